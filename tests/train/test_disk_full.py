"""The disk-full drill on a real file system: a 12 MB tmpfs as the run directory of configs/debug.json (a checkpoint
is about 4.4 MB), each run a real `python launch/train.py` process.

1. Saving every step, the third save meets ENOSPC: exit 1, one `error:` line naming the file and what to free, the
   partial `.step_3.tmp/` removed, step_1 and step_2 intact, metrics.jsonl holding steps 1-3.
2. `--resume` with 3.6 MB free: refused (exit 1, one line) before anything changes: metrics.jsonl keeps its three
   records, no file of the run directory changes.
3. After freeing space (step_1 deleted) `--resume` removes a partial save a killed run left, finishes the run, and
   metrics.jsonl holds steps 1-4.

Needs root (mount); skipped with the reason where the mount fails. Single process: in the quick subset.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = ["--config", str(REPO / "configs" / "debug.json"), "--set", "train.steps=4", "train.save_every=1"]
RUN += ["train.eval_every=0", "train.threads=1"]


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "fs"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 12 MB tmpfs here (needs root): {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _train(forks, run: Path, *extra: str) -> subprocess.CompletedProcess:
    """One training process (forked from the session's server, tests/forklaunch.py) in `run`'s parent folder."""
    return forks.script(REPO / "launch" / "train.py", ["--run-dir", run, *RUN, *extra], cwd=run.parent, timeout=600)


def _one_error(proc: subprocess.CompletedProcess) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return errors[0]


def _files(root: Path) -> dict[str, tuple]:
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_disk_full_during_a_save_and_on_resume(small_fs, forks):
    run = small_fs / "run"
    ckpts = run / "checkpoints"

    line = _one_error(_train(forks, run))
    assert "checkpoint save of step 3 failed (nothing published; earlier checkpoints intact)" in line
    assert f"no space left on device writing {ckpts / '.step_3.tmp' / 'rank00000.safetensors'}" in line
    assert f"free space on the file system of {run}" in line and "rerun with --resume" in line
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_2"]  # the partial save is gone
    assert _steps(run) == [1, 2, 3]
    free_after_failure = shutil.disk_usage(small_fs).free

    before = _files(run)
    line = _one_error(_train(forks, run, "--resume"))
    assert f"error: {run}: " in line and "the next checkpoint needs about" in line and "free space" in line
    assert _files(run) == before  # metrics.jsonl not cut back, config.json and the TensorBoard events untouched
    assert _steps(run) == [1, 2, 3]
    assert shutil.disk_usage(small_fs).free == free_after_failure

    shutil.rmtree(ckpts / "step_1")  # what the error line says to do
    (ckpts / ".step_3.tmp").mkdir()  # and what a save killed mid-write leaves: removed before the space check
    (ckpts / ".step_3.tmp" / "rank00000.safetensors").write_bytes(b"\0" * (1 << 20))
    proc = _train(forks, run, "--resume", "--set", "train.keep_last=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"removed {ckpts / '.step_3.tmp'}, the partial checkpoint of a save that did not finish" in proc.stderr
    assert "resuming from" in proc.stderr and "step 2" in proc.stderr
    assert _steps(run) == [1, 2, 3, 4]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_4"]
