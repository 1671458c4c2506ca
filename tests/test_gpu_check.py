"""benchmarks/gpu_check.py without a GPU: its command line, the budgets that stop a part, the comparisons and the
summary, and (slow) its --dry-run, which runs the training and resume parts on the CPU."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
gpu_check = load_script(SCRIPT)


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_every_part():
    proc = run("--help")
    assert proc.returncode == 0, proc.stderr
    for part in gpu_check.PARTS:
        assert part in proc.stdout
    assert "MOE_DIST_KERNEL_DEVICE=cuda" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_says_so_and_exits_2():
    proc = run()
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr


def test_budgets_and_parts_from_the_command_line():
    args = gpu_check.parse_args(["--parts", "train,resume", "--budget", "train=30", "resume=12.5"])
    assert args.parts == ["train", "resume"]
    assert args.budgets == {**gpu_check.BUDGETS, "train": 30.0, "resume": 12.5}
    assert sum(gpu_check.BUDGETS.values()) <= 8 * 60  # the whole fits in 8 minutes on one GPU
    assert gpu_check.parse_args([]).steps == 20 and gpu_check.parse_args(["--dry-run"]).steps == 3
    for bad in (["--parts", "tests,nope"], ["--budget", "train"], ["--budget", "nope=3"], ["--budget", "train=-1"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)


def test_a_spent_budget_ends_the_running_process(tmp_path):
    budget = gpu_check.Budget("train", 0.5)
    proc = gpu_check.start([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "sleep.log")
    tic = time.monotonic()
    with pytest.raises(gpu_check.BudgetSpent, match="budget of 0 s spent while sleeper was running"):
        gpu_check.finish({"sleeper": proc}, budget)
    assert time.monotonic() - tic < 10 and proc.poll() is not None
    with pytest.raises(gpu_check.BudgetSpent, match="before the next benchmark"):
        budget.check("the next benchmark")
    quick = gpu_check.start([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "quick.log")
    assert gpu_check.finish({"quick": quick}, gpu_check.Budget("tests", 60)) == {"quick": 3}


def test_comparisons_and_summary():
    assert gpu_check.max_rel_diff([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="cannot compare 1 losses with 2"):
        gpu_check.max_rel_diff([1.0], [1.0, 2.0])
    records = [{"tokens_per_s": 100.0}, {"tokens_per_s": 1000.0}, {"tokens_per_s": 2000.0}, {"tokens_per_s": 4000.0}]
    assert gpu_check.step_ms(records, 1000) == pytest.approx(375.0)  # median of 500 and 250 ms, warm-up left out
    R = gpu_check.Result
    results = [
        R("tests", "ok", 100, "3 files"),
        R("bench", "partial", 60, "budget spent"),
        R("train", "STOPPED", 120, "budget of 120 s spent\nline 2"),
    ]
    table = gpu_check.summary_table(results, gpu_check.BUDGETS)
    assert table.splitlines()[0].split() == ["part", "status", "seconds", "budget", "result"]
    assert "train   STOPPED      120    120  budget of 120 s spent" in table and "line 2" in table
    assert not gpu_check.passed(results)  # a verifying part that ran out of time did not verify
    assert gpu_check.passed(results[:2])  # benchmarks cut short are partial, not failed


def test_dry_run_part_out_of_budget_fails(tmp_path):
    proc = run("--dry-run", "--parts", "resume", "--budget", "resume=1", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "resume  STOPPED" in proc.stdout and "gpu_check: FAILED" in proc.stdout
    assert "STOPPED" in (tmp_path / "summary.txt").read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_trains_compares_and_resumes(tmp_path):
    proc = run("--dry-run", "--out", str(tmp_path), timeout=800)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    rows = {
        line.split()[0]: line.split()[1]
        for line in proc.stdout.splitlines()
        if line.split()[:1] and line.split()[0] in gpu_check.PARTS and len(line.split()) > 1
    }
    assert rows == {"tests": "skipped", "bench": "skipped", "train": "ok", "resume": "ok"}
    assert "max relative loss difference 0.00e+00" in proc.stdout  # both sides on the PyTorch paths here
    assert "steps 4-6 resumed from step 3: bitwise equal" in proc.stdout
    assert (tmp_path / "resume_from_3" / "metrics.jsonl").exists()
