"""`--dry-run` after `fits: NO` says what would fit: the smallest larger world the layout divides, and ZeRO 2 where
the config uses less and that fits (real `launch/train.py --dry-run` processes; the plan: docs/memory.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _dry_run(*args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "train.py"), "--dry-run", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_a_layout_that_does_not_fit_is_told_what_would():
    lines = _dry_run("--config", "configs/jamba_v0.1.json")  # the shipped layout at 8 GPUs, ZeRO 1: 152.7 GB
    assert any(line.startswith("fits: NO: total 152.73 GB") for line in lines)
    assert (
        "would fit: world 16 (102.75 GB per rank); or --set deepspeed.zero_stage=2 at world 8 (129.78 GB per rank)"
        in lines
    )


def test_a_layout_that_fits_gets_no_advice():
    lines = _dry_run("--config", "configs/mixtral_8x7b.json", "--world-size", "16")
    assert any(line.startswith("fits: yes") for line in lines)
    assert not [line for line in lines if line.startswith("would fit")]
