"""`--dry-run` after `fits: NO` says what would fit: the smallest larger world the layout divides, and ZeRO 2 where
the config uses less and that fits (real `launch/train.py --dry-run` processes; the plan: docs/memory.md)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _dry_run(forks, *args: str) -> list[str]:
    """`python launch/train.py --dry-run ARGS` (forked from the session's server, tests/forklaunch.py): its stdout."""
    proc = forks.script(REPO / "launch" / "train.py", ["--dry-run", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_a_layout_that_does_not_fit_is_told_what_would(forks):
    lines = _dry_run(forks, "--config", "configs/jamba_v0.1.json")  # the shipped layout at 8 GPUs, ZeRO 1: 152.7 GB
    assert any(line.startswith("fits: NO: total 152.73 GB") for line in lines)
    assert (
        "would fit: world 16 (102.75 GB per rank); or --set deepspeed.zero_stage=2 at world 8 (129.78 GB per rank)"
        in lines
    )


def test_a_layout_that_fits_gets_no_advice(forks):
    lines = _dry_run(forks, "--config", "configs/mixtral_8x7b.json", "--world-size", "16")
    assert any(line.startswith("fits: yes") for line in lines)
    assert not [line for line in lines if line.startswith("would fit")]
