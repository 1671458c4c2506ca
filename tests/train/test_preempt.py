"""A stop signal that reaches one rank stops every rank after the same step, with that step's checkpoint
(moe_dist/train/preempt.py). Under Slurm every rank gets it, and the requeued job resumes to the uninterrupted
run's losses: tests/launch/test_slurm.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import DEBUG_CONFIG, ONE_THREAD, torchrun, train_records

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _workers(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the training processes torchrun started."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next((int(v.split(b"=")[1]) for v in env if v.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[rank] = pid
    return ranks


def test_usr1_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, debug_run, metrics):
    ref = train_records(metrics(debug_run("torchrun")))
    run = tmp_path / "run"
    cmd = [*torchrun(2), TRAIN, "--config", DEBUG_CONFIG, "--run-dir", str(run), "--set", ONE_THREAD]
    log = tmp_path / "log"
    with log.open("w") as out:
        # The launcher ignores the signal, as launch/slurm/node.sh starts it; its workers install their handler.
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN),
        )
    try:
        deadline = time.monotonic() + 600
        while not ((run / "metrics.jsonl").exists() and '"step": 1,' in (run / "metrics.jsonl").read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        os.kill(_workers(proc.pid)[1], signal.SIGUSR1)  # rank 1 only
        proc.wait(timeout=300)
    finally:
        proc.kill()
    text = log.read_text()
    stopped = re.findall(r"^step (\d+): stopped on request", text, re.MULTILINE)
    assert len(stopped) == 1 and 1 <= int(stopped[0]) < ref[-1]["step"], text[-4000:]
    step = int(stopped[0])
    # Rank 0, which never got the signal, stopped too and said so; its status is 3 unless torchrun ended it first
    # (it stops the others once one worker exits non-zero; torchrun itself then exits 1).
    assert proc.returncode == 1 and "exitcode  : 3" in text, text[-4000:]
    got = train_records(metrics(run))
    assert [r["step"] for r in got] == list(range(1, step + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref[:step]], rel=1e-6)
    saved = sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))
    assert saved[-1] == step and (run / "checkpoints" / f"step_{step}" / "meta.json").exists()  # published
