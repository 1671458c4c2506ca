"""Helpers shared by the parallel end-to-end tests: compare a run with the single-process reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support import train_records


def _checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint; asserts that no tensor is stored twice."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(step_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                assert key not in out, f"{key} stored twice"
                out[key] = sf.get_tensor(key)
    return out


def _same_trajectory(got: list[dict], ref: list[dict], first_step: int = 1) -> None:
    """Per-step losses (rel 1e-5), clipped-gradient norms (rel 1e-4) and global expert load (exact) agree."""
    got, ref = train_records(got), [r for r in train_records(ref) if r["step"] >= first_step]
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5), g["step"]
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), g["step"]  # clipping at 1.0 is active
        for lg, lr in zip(g["moe"], r["moe"]):
            assert lg["tokens_per_expert"] == lr["tokens_per_expert"]  # global expert load, not rank 0's


@pytest.fixture(scope="session")
def checkpoint_tensors():
    return _checkpoint_tensors


@pytest.fixture(scope="session")
def same_trajectory():
    return _same_trajectory
