"""benchmarks/gpu_check/ without a GPU: its command line, the budgets that stop a part (reported as not run, not
as a failure), the summaries it writes, the comparisons it judges by, and its --dry-run, which runs the parts'
logic on the CPU (a few in-process parts here; every part in the slow test)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

import benchmarks.gpu_check as gpu_check
from benchmarks.gpu_check import budget as common
from benchmarks.gpu_check import runs

REPO = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_every_part():
    proc = run("--help")
    assert proc.returncode == 0, proc.stderr
    for part in gpu_check.PARTS:
        assert f"\n  {part} " in proc.stdout
    assert "--dry-run" in proc.stdout and "--only" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_says_so_and_exits_2():
    proc = run()
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr


def test_budgets_and_parts_from_the_command_line():
    args = gpu_check.parse_args(["--only", "train,resume", "--budget", "train=30", "resume=12.5"])
    assert args.parts == ["train", "resume"]
    assert args.budgets == {**gpu_check.BUDGETS, "train": 30.0, "resume": 12.5}
    assert args.budget_given == {"train", "resume"}
    # every part at its full budget leaves the kernel suites their 25 s and a 5 s margin: the whole in 6 minutes
    assert sum(gpu_check.BUDGETS.values()) + 5 <= gpu_check.TOTAL <= 6 * 60
    assert (gpu_check.parse_args([]).steps, gpu_check.parse_args([]).resume_steps) == (30, 6)
    assert (gpu_check.parse_args(["--dry-run"]).steps, gpu_check.parse_args(["--dry-run"]).resume_steps) == (6, 4)
    for bad in (["--only", "train,nope"], ["--budget", "train"], ["--budget", "nope=3"], ["--budget", "train=-1"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)


def test_a_spent_budget_ends_processes_and_interrupts_work(tmp_path):
    budget = common.Budget("train", 0.5)
    proc = common.start([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "sleep.log")
    tic = time.monotonic()
    with pytest.raises(common.BudgetSpent, match="budget of 0 s spent while sleeper was running"):
        common.finish({"sleeper": proc}, budget)
    assert time.monotonic() - tic < 10 and proc.poll() is not None
    with pytest.raises(common.BudgetSpent, match="before the next benchmark"):
        budget.check("the next benchmark")
    quick = common.start([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "quick.log")
    assert common.finish({"quick": quick}, common.Budget("tests", 60)) == {"quick": 3}
    tic = time.monotonic()
    with pytest.raises(common.BudgetSpent), common.Budget("hf", 0.3).interrupting():
        time.sleep(30)  # in-process work: the alarm interrupts it
    assert time.monotonic() - tic < 5


def test_the_budget_alarm_waits_for_an_import_to_finish(tmp_path, monkeypatch):
    """An alarm inside an import would leave a half-initialized module behind for every later part (it did, with
    sympy, which autograd imports lazily): the alarm waits for the import, then interrupts."""
    (tmp_path / "slow_module_for_budget.py").write_text("import time\ntime.sleep(0.6)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(common.BudgetSpent), common.Budget("syncs", 0.1).interrupting():
        import slow_module_for_budget  # noqa: F401

        time.sleep(30)
    assert sys.modules["slow_module_for_budget"].DONE


def test_the_kernel_suites_get_what_the_total_leaves(tmp_path):
    # --total 0.1 (x10 on --dry-run) is spent before the suites start: they are not run, and that is no failure
    assert gpu_check.main(["--dry-run", "--only", "kernels", "--total", "0.1", "--out", str(tmp_path)]) == 0
    (part,) = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert (part["status"], part["budget"]) == ("not run", 0.0)
    assert "spent while tests/kernels/test_flash_attention.py" in part["summary"]


def test_judgements():
    assert runs.max_rel_diff([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="cannot compare 1 losses with 2"):
        runs.max_rel_diff([1.0], [1.0, 2.0])
    records = [{"tokens_per_s": 10.0}, {"tokens_per_s": 1000.0}, {"tokens_per_s": 2000.0}, {"tokens_per_s": 4000.0}]
    assert runs.tokens_per_s(records) == 2000.0  # the first step (compiles, warm-up) left out
    assert runs.loss_falls([5.5, 5.0, 4.6, 4.5, 4.6])  # last three average 4.57 <= 0.85 * 5.5
    assert not runs.loss_falls([5.5, 5.4, 5.0, 4.9, 4.8])  # 4.9 > 4.675
    assert not runs.loss_falls([5.5, float("nan"), 3.0, 3.0, 3.0])


def test_summaries_and_verdict(tmp_path):
    R = gpu_check.Result
    results = [
        R("warm", "ok", 40, "compiled", 60),
        R("bench", "not run", 35, "budget of 35 s spent\nline 2", 35),
        R("kernels", "FAILED", 80, "flash_attention: 1 failed", 120),
    ]
    table = gpu_check.summary_table(results)
    assert table.splitlines()[0].split() == ["part", "status", "seconds", "budget", "result"]
    assert "bench     not run       35     35  budget of 35 s spent" in table and "line 2" in table
    assert "| kernels | FAILED | 80 | 120 | flash_attention: 1 failed |" in gpu_check.markdown(results, "footer")
    assert gpu_check.passed(results[:2])  # a part out of time was not run: not a failure
    assert not gpu_check.passed(results)


def test_dry_run_in_process_parts_and_a_budget_stop(tmp_path):
    """dispatch and bench run their real logic on the CPU; syncs gets too little time and is reported as not run;
    the summaries and the export come out."""
    code = gpu_check.main(
        ["--dry-run", "--only", "syncs,dispatch,bench", "--budget", "syncs=0", "--out", str(tmp_path / "o")]
        + ["--export", str(tmp_path / "x")]
    )
    assert code == 0
    summary = json.loads((tmp_path / "x" / "summary.json").read_text())
    parts = {p["part"]: p for p in summary["parts"]}
    assert {k: p["status"] for k, p in parts.items()} == {"syncs": "not run", "dispatch": "ok", "bench": "ok"}
    assert summary["versions"]["torch"] == torch.__version__ and summary["dry_run"]
    dispatch = parts["dispatch"]["figures"]
    assert set(dispatch) == {
        f"{k} cf={cf}" for k in ("local", "all-to-all", "all-to-all chunks=3", "dedup") for cf in (None, 1.0)
    }
    # the all-to-all and dedup dispatchers move their counts to the host once per layer (the CPU test's pin)
    assert [v["syncs"] for v in dispatch.values()] == [0, 1, 1, 1, 1, 1, 1, 1]
    assert all(v["max_abs_diff"] <= 1e-6 for v in dispatch.values())
    assert len(parts["bench"]["figures"]["ratios"]) == 14  # attention 4, scan 2, ssd 2, gdn 2, permutation 4
    assert (tmp_path / "x" / "summary.md").read_text().startswith("| part | status |")
    with tarfile.open(tmp_path / "x" / "logs.tar.gz") as tar:
        assert tar.getnames() == []  # in-process parts only: no subprocess logs


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_dry_run_runs_every_part(tmp_path):
    proc = run("--dry-run", "--out", str(tmp_path), timeout=1400)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    parts = {p["part"]: p for p in json.loads((tmp_path / "summary.json").read_text())["parts"]}
    assert {k: p["status"] for k, p in parts.items()} == dict.fromkeys(gpu_check.PARTS, "ok")
    assert all(d < 2e-5 for k, d in parts["hf"]["figures"].items())  # our export, transformers' forward
    losses = parts["train"]["figures"]["losses"]
    assert len(losses) == 6 and runs.loss_falls(losses)
    assert "bitwise equal" in parts["resume"]["summary"]
    assert parts["syncs"]["figures"] == {"cpu_syncs_per_microbatch": 2, "gpu_syncs_per_microbatch": 2}
    assert parts["memory"]["figures"]["plan_gb"]["total"] > 0
    assert "31 tests collected" in parts["kernels"]["summary"] or "collected" in parts["kernels"]["summary"]
