"""The GPU check: what a first run on one CUDA GPU must prove, in one command that fits in 6 minutes on an H200.

    python -m benchmarks.gpu_check [--out DIR] [--export DIR2]      # every part, cold start included
    python -m benchmarks.gpu_check --only kernels,bench             # a rerun of some parts
    python -m benchmarks.gpu_check --dry-run --out /tmp/gc          # no GPU: every part's logic on the CPU, tiny

From the repository's root (no install needed). This module is the driver; the parts live beside it: parts.py
(warm, hf, syncs, dispatch, kernels), runs.py (train, memory, resume), bench.py (bench), budget.py (the time
budgets and the subprocesses they bound).

On a machine without DeepSpeed, install the carried wheels first (benchmarks/device/prepare_wheels.sh makes them;
docs/benchmarks.md, "GPU check", has the whole device command).

Parts, in this order, each with a time budget in seconds (--budget PART=S; `kernels` gets what is left of --total,
timed from the start of the process):
  warm      compile the Triton kernels training uses (attention with document masks, scan, permutation) for the
            train part's shapes, at Mixtral width and in fp32, one process per model in parallel: later parts start warm
  hf        a tiny Mixtral-style and a tiny Jamba-style model of ours, exported to Hugging Face format, against
            transformers' own forward of the export, fp32, our kernels on CUDA: the one check independent of our code
  syncs     one forward + backward of configs/debug.json under torch.cuda.set_sync_debug_mode: the syncs the GPU
            makes, against the count tests/train/test_host_syncs.py's counter gives for the same step on the CPU
  dispatch  the local, all-to-all (plain and chunked) and deduplicating dispatchers on an NCCL world of one: outputs
            and gradients equal the local dispatcher's; syncs per layer against the CPU count
  train     launch/train.py, bf16, activation checkpointing, document masking, our Triton kernels: the loss falls
  memory    Mixtral width (2 layers, seq 4096, bf16, full recompute), one GPU, DeepSpeed: the peak against the
            memory plan and the device's capacity (torch.cuda.mem_get_info); tokens/s and MFU
  resume    launch/train.py with train.async_save: N steps saving at N/2, then a run resumed from that checkpoint
            repeats the uninterrupted run's losses
  bench     each Triton kernel against SDPA / its PyTorch path in bf16 (interleaved rounds): the speed ratios
  kernels   the kernel test suites (tests/kernels) on the GPU, one process per file, with the time that remains
A part that runs out of its budget is reported as "not run" (with what it finished), never as a failure: a
failure is a defect found. The summary table ends the output and goes to OUT/summary.{txt,md,json} (the JSON with
each part's figures and the versions found); OUT/logs holds every subprocess's log. --export copies the three
summaries and logs.tar.gz to another folder (a device machine's $OUT, which brings back a few files only).
--dry-run runs every part on the CPU at tiny sizes, the PyTorch paths standing in for the kernels (the kernel suites
are only collected, under the Triton interpreter) and the budgets 10 times longer: the plumbing and the comparisons,
not the GPU's numbers.
Exit status: 0 nothing failed; 1 a part failed; 2 bad usage, no CUDA device (without --dry-run), or no DeepSpeed for
the parts that train.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.gpu_check.budget import REPO, Budget, BudgetSpent

STARTED = time.monotonic()  # the whole is timed from here: before torch's import, which a cold start pays too

PARTS = ("warm", "hf", "syncs", "dispatch", "train", "memory", "resume", "bench", "kernels")
# Seconds. `kernels` takes what --total leaves, 5 s before its end: 25 s when every other part uses all of its
# budget (330 s together); its figure here is that floor, used only when given with --budget.
BUDGETS = {
    "warm": 60,
    "hf": 40,  # compiles the fp32 variants of the kernels (warm compiles bf16 ones)
    "syncs": 20,
    "dispatch": 25,
    "train": 45,
    "memory": 60,
    "resume": 50,
    "bench": 30,
    "kernels": 25,
}
TOTAL = 360
NOT_RUN = "not run"
# where each part's `part_NAME(args, budget, figures) -> (status, summary)` lives
MODULES = {"bench": "bench", **dict.fromkeys(("train", "memory", "resume"), "runs")}
IN_PROCESS = ("hf", "syncs", "dispatch", "bench")  # stopped by SIGALRM; the others' subprocesses by `finish`
# --dry-run: budgets scale by this. A busy 2-core CPU has run a tiny training step in 15 s, where a GPU takes
# milliseconds: the budgets there only stop a part that hangs.
DRY_RUN_SLOWDOWN = 10


@dataclass
class Result:
    part: str
    status: str  # ok | FAILED | not run (budget spent, or --dry-run without a CPU stand-in) | skipped
    seconds: float
    summary: str
    budget: float = 0.0
    figures: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- driver


def run_part(part: str, args, seconds: float) -> Result:
    import importlib

    print(f"\n=== {part} (budget {seconds:.0f} s)", flush=True)
    budget = Budget(part, seconds)
    figures: dict = {}
    fn = getattr(importlib.import_module(f"{__name__}.{MODULES.get(part, 'parts')}"), f"part_{part}")
    try:
        if part in IN_PROCESS:
            with budget.interrupting():
                status, summary = fn(args, budget, figures)
        else:
            status, summary = fn(args, budget, figures)
    except BudgetSpent as stop:
        status, summary = NOT_RUN, str(stop)
    except Exception as err:  # a part's failure is reported, and the other parts still run
        status, summary = "FAILED", f"{type(err).__name__}: {err}"
    import torch

    if torch.cuda.is_initialized():  # what an in-process part cached is free for the next part's processes
        torch.cuda.empty_cache()
    print(f"--- {part}: {status}: {summary}", flush=True)
    return Result(part, status, time.monotonic() - budget.start, summary, seconds, figures)


def summary_table(results: list[Result]) -> str:
    lines = [f"{'part':<9} {'status':<8} {'seconds':>7} {'budget':>6}  result"]
    for r in results:
        first, *rest = r.summary.splitlines() or [""]
        lines.append(f"{r.part:<9} {r.status:<8} {r.seconds:7.0f} {r.budget:6.0f}  {first}")
        lines += [f"{'':<34}{line}" for line in rest[-10:]]
    return "\n".join(lines)


def markdown(results: list[Result], footer: str) -> str:
    rows = ["| part | status | seconds | budget | result |", "| --- | --- | ---: | ---: | --- |"]
    for r in results:
        text = r.summary.replace("|", "\\|").replace("\n", "<br>")
        rows.append(f"| {r.part} | {r.status} | {r.seconds:.0f} | {r.budget:.0f} | {text} |")
    return "\n".join([*rows, "", footer, ""])


def versions() -> dict:
    """What this machine runs, for the summary (a missing package is None)."""
    import importlib.metadata as md

    import torch

    found = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "deepspeed", "transformers"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    found["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return found


def export(out: Path, to: Path) -> None:
    """The summaries and the logs, as four files (what a device machine's $OUT brings back)."""
    import shutil
    import tarfile

    to.mkdir(parents=True, exist_ok=True)
    for name in ("summary.txt", "summary.md", "summary.json"):
        shutil.copy(out / name, to / name)
    with tarfile.open(to / "logs.tar.gz", "w:gz") as tar:
        if (out / "logs").is_dir():
            tar.add(out / "logs", arcname="logs")


def passed(results: list[Result]) -> bool:
    return not any(r.status == "FAILED" for r in results)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts, from {','.join(PARTS)}")
    p.add_argument(
        "--budget",
        nargs="+",
        default=[],
        metavar="PART=SECONDS",
        help="time budgets, default " + " ".join(f"{k}={v}" for k, v in BUDGETS.items()),
    )
    p.add_argument("--total", type=float, default=TOTAL, help="seconds for the whole; kernels get what is left")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check", help="summary, run directories, logs")
    p.add_argument("--export", type=Path, default=None, help="also copy the summaries and a logs.tar.gz here")
    p.add_argument("--steps", type=int, default=None, help="train: steps (default 30; --dry-run 6)")
    p.add_argument(
        "--resume-steps", type=int, default=None, help="resume: steps of the whole run (default 6; --dry-run 4)"
    )
    p.add_argument(
        "--resume-rtol",
        type=float,
        default=1e-5,
        help="resume: largest relative loss difference (GPU atomics may reorder fp32 sums)",
    )
    p.add_argument("--dry-run", action="store_true", help="no GPU: every part's logic on the CPU, at tiny sizes")
    args = p.parse_args(argv)
    args.parts = [s for s in args.only.split(",") if s]
    if bad := [s for s in args.parts if s not in PARTS]:
        p.error(f"--only: unknown {', '.join(bad)} (choose from {', '.join(PARTS)})")
    budgets = dict(BUDGETS)
    for item in args.budget:
        part, _, seconds = item.partition("=")
        if part not in PARTS or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--budget: expected PART=SECONDS with PART in {', '.join(PARTS)}, got {item!r}")
        budgets[part] = float(seconds)
    args.budgets, args.budget_given = budgets, {item.partition("=")[0] for item in args.budget}
    args.steps = args.steps or (6 if args.dry_run else 30)
    args.resume_steps = args.resume_steps or (4 if args.dry_run else 6)
    return args


def main(argv=None, started: float | None = None) -> int:
    """`started`: the monotonic time the whole is timed from (the process's start, under `python -m`)."""
    args = parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: torch sees no CUDA device; run this on a GPU machine (or --dry-run to check the script "
            "on the CPU)",
            file=sys.stderr,
        )
        return 2
    if os.environ.get("TRITON_INTERPRET"):
        print("gpu_check: unset TRITON_INTERPRET: it would run the kernels in the CPU interpreter", file=sys.stderr)
        return 2
    found = versions()
    if found["deepspeed"] is None and {"train", "memory", "resume"} & set(args.parts):
        print(
            "gpu_check: DeepSpeed is not installed (the train, memory and resume parts need it); on a machine without "
            "network, install the wheels of benchmarks/device/prepare_wheels.sh (docs/benchmarks.md, GPU check)",
            file=sys.stderr,
        )
        return 2
    print("gpu_check: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    # The repository on the path of every process a part starts (a GPU machine has no install): launch/train.py
    # runs as a script, whose own folder is first on its path, not the repository's root.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    start_s = time.monotonic() if started is None else started
    scale = DRY_RUN_SLOWDOWN if args.dry_run else 1
    results = []
    for part in args.parts:
        seconds = args.budgets[part] * (1 if part in args.budget_given else scale)
        if part == "kernels" and part not in args.budget_given:  # the suites take the time that remains
            seconds = max(0.0, args.total * scale - (time.monotonic() - start_s) - 5)
        results.append(run_part(part, args, seconds))
    table = summary_table(results)
    verdict = "passed" if passed(results) else "FAILED"
    where = " (dry run, CPU)" if args.dry_run else f" on {torch.cuda.get_device_name()}"
    footer = f"gpu_check: {verdict} in {time.monotonic() - start_s:.0f} s{where}"
    print(f"\n{table}\n{footer}")
    (args.out / "summary.txt").write_text(f"{table}\n{footer}\n")
    (args.out / "summary.md").write_text(markdown(results, footer))
    (args.out / "summary.json").write_text(
        json.dumps(
            {"verdict": verdict, "dry_run": args.dry_run, "versions": found, "parts": [asdict(r) for r in results]},
            indent=1,
        )
    )
    if args.export:
        export(args.out, args.export)
    return 0 if verdict == "passed" else 1
