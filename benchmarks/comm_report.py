"""Communication per layer of one micro-batch's forward and backward, measured, under a parallel layout.

    torchrun --nproc_per_node 2 benchmarks/comm_report.py --config configs/mixtral_small.json --set parallel.tp=2
    torchrun --nproc_per_node 4 benchmarks/comm_report.py --config ... --set parallel.tp=2 parallel.ep=2

Builds this rank's shard exactly as training does (`parallelize`), runs one micro-batch forward, the loss and
backward (no optimizer: DeepSpeed's gradient reduction over the data-parallel group comes on top, once per step),
and wraps the torch.distributed collectives that our layers issue to count, per layer, each collective's kind,
group size, calls and payload bytes (the tensor each rank contributes). Backward collectives are attributed to
the layer whose backward was running (module backward pre-hooks). Rank 0 prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import sys
import warnings

import torch
import torch.distributed as dist

from moe_dist.config import load_config
from moe_dist.models.decoder import build_model, lm_loss
from moe_dist.parallel.mesh import init_distributed
from moe_dist.parallel.parallelize import parallelize
from moe_dist.parallel.tensor_parallel import vocab_parallel_lm_loss

# torch.distributed function → (keyword, position) of the tensor this rank contributes
WRAPPED = {"all_reduce": ("tensor", 0), "all_to_all_single": ("input", 1), "all_gather": ("tensor", 1),
           "all_gather_single": ("input_tensor", 1), "reduce_scatter_single": ("input", 1),
           "all_gather_into_tensor": ("input_tensor", 1), "reduce_scatter_tensor": ("input", 1)}


def _payload(name: str, args: tuple, kwargs: dict) -> int:
    keyword, position = WRAPPED[name]
    t = kwargs.get(keyword, args[position] if len(args) > position else None)
    return t.numel() * t.element_size()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", nargs="+", default=[])
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    mesh = init_distributed(cfg)
    model = parallelize(build_model(cfg.model), mesh, cfg)

    where = ["other", "forward"]  # [layer, phase]
    table: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])  # key → [calls, bytes]
    renamed = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}
    originals = {name: getattr(dist, name) for name in WRAPPED
                 if hasattr(dist, name) and not hasattr(dist, renamed.get(name, ""))}  # the name comm.py calls

    def wrap(name):
        def counted(*a, **k):
            group = k.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            row = table[(where[0], where[1], name, size)]
            row[0] += 1
            row[1] += _payload(name, a, k)
            return originals[name](*a, **k)
        return counted

    def label(name):
        def fwd(module, inputs):
            where[:] = [name, "forward"]

        def bwd(module, grad_out):
            where[:] = [name, "backward"]
        return fwd, bwd

    layers = [("embed", model.embed)] + [(f"blocks.{i}.{part}", getattr(b, part)) for i, b in enumerate(model.blocks)
                                         for part in ("mixer", "ffn")]
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # the embedding's input is token ids
    for name, module in layers:
        fwd, bwd = label(name)
        module.register_forward_pre_hook(fwd, prepend=True)  # before the TP region's own entry hook
        module.register_full_backward_pre_hook(bwd, prepend=True)
    for name in originals:
        setattr(dist, name, wrap(name))

    t = cfg.train
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    out = model(tokens[:, :-1])
    where[:] = ["loss (vocab-parallel cross-entropy)", "forward"]
    lm = lm_loss(out.logits, tokens[:, 1:]) if mesh.tp == 1 else vocab_parallel_lm_loss(out.logits, tokens[:, 1:], mesh)
    where[:] = ["head", "backward"]
    (lm + cfg.model.moe.aux_loss_coef * out.aux_loss).backward()
    for name, fn in originals.items():
        setattr(dist, name, fn)

    if mesh.rank == 0:
        kinds = [type(b.mixer).__name__ + "/" + type(b.ffn).__name__ for b in model.blocks]
        sp = " sequence_parallel" if cfg.parallel.sequence_parallel else ""
        print(f"layout dp={mesh.dp} ep={mesh.ep} tp={mesh.tp}{sp}; micro-batch {t.micro_batch_size}x{t.seq_len} tokens, "
              f"d_model {cfg.model.d_model}, {cfg.train.dtype}; blocks: {', '.join(kinds)}")
        print("| layer | phase | collective | group size | calls | bytes per rank |")
        print("|---|---|---|---|---|---|")
        order = {name: i for i, (name, _) in enumerate(layers)}
        for (layer, phase, name, size), (calls, nbytes) in sorted(
                table.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][1] != "forward", kv[0][2])):
            print(f"| {layer} | {phase} | {name} | {size} | {calls} | {nbytes:,} |")
        total = sum(v[1] for v in table.values())
        print(f"total bytes per rank for one micro-batch: {total:,}")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
