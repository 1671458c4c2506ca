"""The pipeline bubble measured on CPU processes against the performance model's (pp − 1) / (m · v).

    torchrun --nproc_per_node 2 -m benchmarks.studies.pipeline_bubble --config configs/debug.json \
        --set model.n_layers=8 train.seq_len=128 --micro 2 4 8 --stages-per-rank 1 2

Each rank builds its pipeline part as training does (`parallelize`, parallel.pp = the world size) and runs
optimizer-free steps of m micro-batches through the schedule (parallel/pipeline.py's `build_schedule`: autograd by
the schedule, no DeepSpeed), for every m of --micro and v of --stages-per-rank. Per step and rank it times the stages'
forward and backward chunks (their compute; the schedule's receives wait outside them) and the step's wall time.
The bubble of a rank is 1 − its busy time / the step's time: the share of the step it waits for other stages or
transfers. The model charges (pp − 1) / (m · v) of the step's compute as bubble (planning/perfmodel.py), i.e. a
share (pp − 1) / (m · v + pp − 1) of the step. Rank 0 prints a markdown table: median over --steps steps (after
one warm-up), the busiest rank's bubble (the others wait longer by the stage imbalance).

On 2 CPU cores each rank has a core only for pp = 2; gloo's point-to-point sends are copies through loopback.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moe_dist.config import load_config
from moe_dist.models.decoder import build_model, lm_loss
from moe_dist.parallel.comm import all_reduce_sum
from moe_dist.parallel.mesh import init_distributed
from moe_dist.parallel.parallelize import parallelize
from moe_dist.parallel.pipeline import build_schedule


def _timed(pipes: list, busy: list) -> None:
    """Add every forward and backward chunk's duration to busy[0]."""
    for pipe in pipes:
        for name in ("forward_one_chunk", "backward_one_chunk"):
            inner = getattr(pipe, name)

            def wrapped(*args, _inner=inner, **kwargs):
                tic = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    busy[0] += time.perf_counter() - tic

            setattr(pipe, name, wrapped)


def measure(cfg, micro: int, steps: int) -> tuple[float, float]:
    """(median step seconds, median busy seconds) of this rank over `steps` steps after one warm-up."""
    mesh = init_distributed(cfg)
    part = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)
    t = cfg.train
    schedule = build_schedule(
        part.stages,
        part.stage_indices,
        part.n_stages,
        micro,
        lambda logits, target: lm_loss(logits, target) / micro,
        mesh.pp_group,
        (t.micro_batch_size, t.seq_len),
    )
    pipes = getattr(schedule, "_stages", None) or [schedule._stage]
    busy = [0.0]
    _timed(pipes, busy)
    g = torch.Generator().manual_seed(0)
    rows = micro * t.micro_batch_size
    walls, works = [], []
    for step in range(steps + 1):
        tokens = torch.randint(0, cfg.model.vocab_size, (rows, t.seq_len + 1), generator=g)
        first, last = part.stages[0].first, part.stages[-1].last
        busy[0] = 0.0
        all_reduce_sum(torch.zeros(1))  # start together
        tic = time.perf_counter()
        schedule.step(*((tokens[:, :-1],) if first else ()), target=tokens[:, 1:] if last else None)
        wall = time.perf_counter() - tic
        for p in part.parameters():
            p.grad = None
        if step:
            walls.append(wall)
            works.append(busy[0])
    return statistics.median(walls), statistics.median(works)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/debug.json")
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--stages-per-rank", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    pp = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    rows = []
    for v in args.stages_per_rank:
        for m in args.micro:
            over = [*args.set, f"parallel.pp={pp}", f"parallel.pp_virtual={v}"]
            over.append(f"train.global_batch_size={m * load_config(args.config, args.set).train.micro_batch_size}")
            cfg = load_config(args.config, over)
            wall, work = measure(cfg, m, args.steps)
            shares = torch.zeros(pp, dtype=torch.float64)
            shares[int(os.environ["RANK"])] = 1 - work / wall
            shares = all_reduce_sum(shares)
            model = (pp - 1) / (m * v + pp - 1)
            rows.append((v, m, wall, min(shares.tolist()), max(shares.tolist()), model))
    if int(os.environ["RANK"]) == 0:
        print(f"pp = {pp}; bubble = 1 − busy / step time; model: (pp − 1) / (m · v + pp − 1) of the step")
        print("| v | m | step (s) | bubble, busiest rank | bubble, idlest rank | model |")
        print("|---|---|---|---|---|---|")
        for v, m, wall, low, high, model in rows:
            print(f"| {v} | {m} | {wall:.3f} | {low:.3f} | {high:.3f} | {model:.3f} |")


if __name__ == "__main__":
    main()
