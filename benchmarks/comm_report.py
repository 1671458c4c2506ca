"""Communication per layer of one micro-batch's forward and backward, measured, under a parallel layout.

    torchrun --nproc_per_node 2 benchmarks/comm_report.py --config configs/mixtral_small.json --set parallel.tp=2
    torchrun --nproc_per_node 4 benchmarks/comm_report.py --config ... --set parallel.tp=2 parallel.ep=2
    torchrun --nproc_per_node 4 benchmarks/comm_report.py --config ... --set parallel.tp=2 parallel.ep=4 parallel.etp=1

Builds this rank's shard exactly as training does (`parallelize`), runs one micro-batch forward, the loss and
backward (no optimizer: DeepSpeed's gradient reduction over the data-parallel group comes on top, once per step),
and traces the torch.distributed collectives that our layers issue (common.CollectiveTracer) to count, per layer,
each collective's kind, group size, calls and payload bytes (the tensor each rank contributes). Backward
collectives are attributed to the layer whose backward was running (module backward pre-hooks). Rank 0 prints a
markdown table.
"""

from __future__ import annotations

import argparse
import collections
import sys
import warnings

import torch
import torch.distributed as dist
from common import CollectiveTracer

from moe_dist.config import load_config
from moe_dist.models.decoder import build_model, lm_loss
from moe_dist.parallel.mesh import init_distributed
from moe_dist.parallel.parallelize import parallelize
from moe_dist.parallel.tensor_parallel import vocab_parallel_lm_loss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", nargs="+", default=[])
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    mesh = init_distributed(cfg)
    model = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)

    where = ["other", "forward"]  # [layer, phase]
    table: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])  # key → [calls, bytes]

    def count(call):
        row = table[(where[0], where[1], call.name, call.group_size)]
        row[0] += 1
        row[1] += call.contributed_bytes

    def label(name):
        def fwd(module, inputs):
            where[:] = [name, "forward"]

        def bwd(module, grad_out):
            where[:] = [name, "backward"]

        return fwd, bwd

    layers = [("embed", model.embed)] + [
        (f"blocks.{i}.{part}", getattr(b, part)) for i, b in enumerate(model.blocks) for part in ("mixer", "ffn")
    ]
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # the embedding's input is token ids
    for name, module in layers:
        fwd, bwd = label(name)
        module.register_forward_pre_hook(fwd, prepend=True)  # before the TP region's own entry hook
        module.register_full_backward_pre_hook(bwd, prepend=True)
    tracer = CollectiveTracer(count).install()

    t = cfg.train
    tokens = torch.randint(
        0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(0)
    ).to(mesh.device)
    out = model(tokens[:, :-1])
    where[:] = ["loss (vocab-parallel cross-entropy)", "forward"]
    lm = lm_loss(out.logits, tokens[:, 1:]) if mesh.tp == 1 else vocab_parallel_lm_loss(out.logits, tokens[:, 1:], mesh)
    where[:] = ["head", "backward"]
    (lm + cfg.model.moe.aux_loss_coef * out.aux_loss).backward()
    tracer.uninstall()

    if mesh.rank == 0:
        kinds = [type(b.mixer).__name__ + "/" + type(b.ffn).__name__ for b in model.blocks]
        sp = " sequence_parallel" if cfg.parallel.sequence_parallel else ""
        sp += f" etp={mesh.etp}" if mesh.tp > 1 else ""
        print(
            f"layout dp={mesh.dp} ep={mesh.ep} tp={mesh.tp}{sp}; micro-batch {t.micro_batch_size}x{t.seq_len} tokens, "
            f"d_model {cfg.model.d_model}, {cfg.train.dtype}; blocks: {', '.join(kinds)}"
        )
        print("| layer | phase | collective | group size | calls | bytes per rank |")
        print("|---|---|---|---|---|---|")
        order = {name: i for i, (name, _) in enumerate(layers)}
        for (layer, phase, name, size), (calls, nbytes) in sorted(
            table.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][1] != "forward", kv[0][2])
        ):
            print(f"| {layer} | {phase} | {name} | {size} | {calls} | {nbytes:,} |")
        total = sum(v[1] for v in table.values())
        print(f"total bytes per rank for one micro-batch: {total:,}")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
