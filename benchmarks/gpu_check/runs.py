"""The GPU check's training runs (train, memory, resume: see benchmarks/gpu_check/__init__.py) and the memory part's
worker (`python -m benchmarks.gpu_check.runs memory ...`): each runs our training loop in a process of its own."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.gpu_check.parts import (
    DEBUG,
    MIXTRAL,
    MIXTRAL_PROBE,
    MIXTRAL_TINY,
    TINY,
    TRAINING,
    WIDE,
    kernels,
    run_script,
)

# ----------------------------------------------------------------------------------------------- training runs


def train_records(run_dir: Path) -> list[dict]:
    """The per-step training records of a run's metrics.jsonl (evaluation-only records left out)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "loss" in r]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(f"cannot compare {len(a)} losses with {len(b)}")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def tokens_per_s(records: list[dict], warmup: int = 1) -> float:
    """Median tokens/s after the first `warmup` steps (compiles, allocator growth, the engine's first step)."""
    return statistics.median(r["tokens_per_s"] for r in (records[warmup:] or records))


def loss_falls(losses: list[float], ratio: float = 0.85) -> bool:
    """Finite throughout, and the mean of the last three steps at most `ratio` times the first step's loss."""
    last = losses[-3:]
    return all(math.isfinite(x) for x in losses) and sum(last) / len(last) <= ratio * losses[0]


def train(args, budget, name: str, overrides: list[str], resume_from: Path | None = None) -> list[dict]:
    """launch/train.py in one process (it picks a free port itself) into OUT/name; its training records."""
    run_dir = args.out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    if resume_from is not None:  # a fresh run directory holding only this checkpoint
        shutil.copytree(resume_from, run_dir / "checkpoints" / resume_from.name)
    cmd = [sys.executable, "launch/train.py", "--config", DEBUG, "--run-dir", str(run_dir)]
    cmd += [*(["--resume"] if resume_from is not None else []), "--set", *overrides]
    run_script(args, budget, name, cmd)
    return train_records(run_dir)


def part_train(args, budget, figures):
    base = [*(TINY if args.dry_run else WIDE), *TRAINING, *kernels(args), f"train.steps={args.steps}"]
    records = train(args, budget, "train", base)
    losses = [r["loss"] for r in records]
    figures.update({"losses": losses, "tokens_per_s": tokens_per_s(records)})
    status = "ok" if len(losses) == args.steps and loss_falls(losses) else "FAILED"
    return status, (
        f"{len(losses)} steps bf16, full recompute, document masking, {kernels(args)[0].split('=')[1]} kernels: "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (must fall by 15%); {figures['tokens_per_s']:.0f} tokens/s"
    )


def part_resume(args, budget, figures):
    steps = max(2, args.resume_steps)
    half = steps // 2
    base = [*(TINY if args.dry_run else WIDE), f"train.steps={steps}", f"train.save_every={half}"]
    base.append("train.async_save=true")
    full = train(args, budget, "resume_full", base)
    resumed = train(
        args, budget, f"resume_from_{half}", base, resume_from=args.out / "resume_full" / "checkpoints" / f"step_{half}"
    )
    want = [r for r in full if r["step"] > half]
    if [r["step"] for r in resumed] != [r["step"] for r in want]:
        return "FAILED", (f"resumed steps {[r['step'] for r in resumed]}, expected {[r['step'] for r in want]}")
    got_loss, want_loss = [r["loss"] for r in resumed], [r["loss"] for r in want]
    diff = max_rel_diff(got_loss, want_loss)
    figures["max_rel_loss_diff"] = diff
    return ("ok" if diff <= args.resume_rtol else "FAILED"), (
        f"async save; steps {half + 1}-{steps} resumed from step {half}: "
        f"{'bitwise equal' if got_loss == want_loss else f'max relative difference {diff:.1e}'} "
        f"(tolerance {args.resume_rtol:g})"
    )


# ----------------------------------------------------------------------------------------------- memory


# The plan may be short of the measured peak by this much before it counts as wrong: the allocator rounds
# blocks up and keeps freed ones cached, which the plan does not model block by block.
PLAN_SLACK = 0.10


def part_memory(args, budget, figures):
    """Mixtral width, two layers, one GPU, through launch/train.py's own training loop (DeepSpeed, ZeRO 2):
    the allocator's peak against the plan without its runtime term (CUDA context, NCCL: outside the allocator)."""
    sets = MIXTRAL_TINY if args.dry_run else MIXTRAL_PROBE
    out = args.out / "memory.json"
    shutil.rmtree(args.out / "memory_run", ignore_errors=True)  # the worker's run directory (a rerun starts fresh)
    run_script(args, budget, "memory", [sys.executable, "-m", __name__, "memory", "--out", str(out), "--set", *sets])
    got = json.loads(out.read_text())
    figures.update(got)
    plan = got["plan_gb"]
    allocator_plan = plan["total"] - plan["runtime"]
    peak = got["peak_reserved_gb"]
    if args.dry_run:  # the tiny model's plan is far below the process's own resident memory: nothing to judge
        ok, summary = True, f"CPU stand-in: resident peak {peak:.2f} GB, plan {plan['total']:.2f} GB (not judged)"
    else:
        ok = peak <= allocator_plan * (1 + PLAN_SLACK)
        summary = (
            f"peak {peak:.1f} GB reserved ({got['peak_allocated_gb']:.1f} allocated) vs plan {allocator_plan:.1f} GB "
            f"without runtime ({plan['total']:.1f} with); "
            f"capacity {got['capacity_mib']:,.0f} MiB = {got['capacity_gb']:.1f} GB"
        )
    summary += f"; {got['tokens_per_s']:.0f} tokens/s"
    if got.get("mfu") is not None:
        summary += f", MFU {got['mfu']:.1%} of {got['peak_tflops']:.0f} TFLOP/s"
    return ("ok" if ok else "FAILED"), summary


def memory_worker(argv: list[str]) -> None:
    """Train the config in this process; write the peaks, the capacity and the plan as JSON to --out."""
    import argparse
    import gc

    from benchmarks.studies.memory_check import reset_peak, rss_bytes
    from moe_dist.config import load_config
    from moe_dist.planning.collectives import H200_BF16_DENSE_PEAK
    from moe_dist.planning.memory import memory_plan
    from moe_dist.planning.workload import model_cost
    from moe_dist.train.loop import train as train_loop

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--set", nargs="*", default=[])
    a = p.parse_args(argv)
    cfg = load_config(MIXTRAL, a.set)
    cuda = torch.cuda.is_available()
    GB = 1e9
    import deepspeed  # noqa: F401  (before the baseline: its import is not the run's memory)

    if cuda:
        from moe_dist.planning.capacity import device_capacity_bytes  # the plan's own reading of the device

        capacity = device_capacity_bytes()
        torch.cuda.reset_peak_memory_stats()
    else:
        gc.collect()
        reset_peak()
        base, capacity = rss_bytes(), float("nan")
    records = train_loop(cfg, a.out.parent / "memory_run")
    if cuda:
        reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    else:
        reserved = allocated = rss_bytes("VmHWM") - base
    plan = memory_plan(cfg, world_size=1, device="cuda" if cuda else "cpu")
    tps = tokens_per_s(records)
    flops = 3 * model_cost(cfg).fwd_flops_per_token * tps  # model FLOPs: forward + backward, recompute not counted
    result = {
        "capacity_gb": capacity / GB,
        "capacity_mib": capacity / 2**20,
        "plan_capacity": plan.get("capacity"),  # the plan's fit against the device, where the plan states it
        "peak_reserved_gb": reserved / GB,
        "peak_allocated_gb": allocated / GB,
        "plan_gb": plan["memory_per_rank_gb"],
        "tokens_per_s": tps,
        "mfu": flops / H200_BF16_DENSE_PEAK if cuda else None,
        "peak_tflops": H200_BF16_DENSE_PEAK / 1e12,
    }
    a.out.write_text(json.dumps(result))


if __name__ == "__main__":
    {"memory": memory_worker}[sys.argv[1]](sys.argv[2:])
