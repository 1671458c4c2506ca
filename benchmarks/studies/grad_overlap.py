"""Exposed gradient reduction per optimizer step at ZeRO 1 (bf16 weights, fp32 accumulation), with and without
overlapping it with the last micro-batch's backward (train.grad_reduce_overlap), in one run.

    torchrun --nproc_per_node 2 -m benchmarks.studies.grad_overlap --config configs/debug.json --steps 15 \
        --set train.dtype=bf16 train.global_batch_size=8 train.grad_reduce_bucket_mb=0.25

Two engines are built as training builds them (`initialize_engine`), the same model and tokens, one with the
overlap off and one with it on; each step runs both (which goes first alternates), all ranks aligned by a barrier
before every timed backward. At ZeRO 1 only the step's last backward (the accumulation boundary) reduces, so

    exposed reduction = wall time of the boundary micro-batch's `engine.backward`
                        - median wall time of the same step's other micro-batches' `engine.backward`

(the same autograd and fp32 accumulation in both; what remains is the reduction the caller waited for: after the
backward without the overlap, the unfinished tail of the started reduces with it). Rank 0 prints the per-mode
medians over the steps (the first, warm-up, step left out) and their ratio; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moe_dist.config import load_config
from moe_dist.models.decoder import build_model, lm_loss
from moe_dist.parallel import comm
from moe_dist.parallel.mesh import init_distributed
from moe_dist.parallel.parallelize import parallelize
from moe_dist.train.optim import build_optimizer, initialize_engine


def build(args, mesh, overlap: bool):
    cfg = load_config(
        args.config, [*args.set, "deepspeed.zero_stage=1", f"train.grad_reduce_overlap={str(overlap).lower()}"]
    )
    torch.manual_seed(0)
    model = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)
    optimizer, scheduler = build_optimizer(model, cfg)
    return cfg, initialize_engine(model, optimizer, scheduler, cfg, mesh.dp, mesh.mpu, mesh.cp)


def one_step(cfg, engine, batches, mesh) -> tuple[float, float]:
    """(boundary backward seconds, median of the other backwards' seconds) of one optimizer step."""
    seconds = []
    for tokens in batches:
        out = engine(tokens[:, :-1].to(mesh.device))
        loss = lm_loss(out.logits, tokens[:, 1:].to(mesh.device)) + cfg.model.moe.aux_loss_coef * out.aux_loss
        comm.barrier()
        start = time.perf_counter()
        engine.backward(loss)
        seconds.append(time.perf_counter() - start)
        engine.step()
    return seconds[-1], statistics.median(seconds[:-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--steps", type=int, default=15, help="timed steps per mode (after one warm-up step)")
    p.add_argument("--json", help="rank 0 writes the medians here")
    args = p.parse_args(argv)
    mesh = init_distributed(load_config(args.config, args.set))
    built = {overlap: build(args, mesh, overlap) for overlap in (False, True)}
    cfg = built[False][0]
    torch.set_num_threads(cfg.train.threads or 1)
    micro = cfg.train.grad_accum_steps(mesh.dp)
    assert micro >= 2, "needs at least 2 micro-batches per step (train.global_batch_size)"
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    exposed = {False: [], True: []}
    boundary = {False: [], True: []}
    for step in range(args.steps + 1):
        t = cfg.train
        batches = [torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=gen)]
        batches += [torch.randint_like(batches[0], cfg.model.vocab_size, generator=gen) for _ in range(micro - 1)]
        for overlap in (False, True) if step % 2 else (True, False):
            last, others = one_step(built[overlap][0], built[overlap][1], batches, mesh)
            if step > 0:
                exposed[overlap].append(last - others)
                boundary[overlap].append(last)
    med = {k: statistics.median(v) * 1e3 for k, v in exposed.items()}
    result = {
        "layout": f"dp={mesh.dp} ep={mesh.ep}",
        "micro_batches": micro,
        "steps": args.steps,
        "exposed_ms": {"off": med[False], "on": med[True]},
        "boundary_backward_ms": {
            k: statistics.median(v) * 1e3 for k, v in (("off", boundary[False]), ("on", boundary[True]))
        },
        "ratio_on_off": med[True] / med[False] if med[False] > 0 else float("nan"),
    }
    if mesh.rank == 0:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
