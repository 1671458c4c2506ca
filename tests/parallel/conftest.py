"""Helpers shared by the parallel end-to-end tests: the single-process reference runs (made once per session, for
test_ep_e2e.py and test_tp_e2e.py alike) and comparisons of a run with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support import E2E_MODES, E2E_STEPS, e2e_args, train_records


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
        assert len(g["moe"]) == len(r["moe"]) == 2, g["step"]  # configs/debug.json's two MoE layers
        for lg, lr in zip(g["moe"], r["moe"]):
            assert lg["tokens_per_expert"] == lr["tokens_per_expert"]  # global expert load, not rank 0's
            assert lg.get("bias") == lr.get("bias")  # loss-free balancing bias: from the same global counts


def _same_aux(got: list[dict], ref: list[dict], first_step: int = 1) -> None:
    """Per-step aux losses agree (rel 1e-5): with `aux_loss_scope` global_batch every micro-batch's f is the whole
    step's (`global_batch_load` this_step, the default), whatever the layout cuts the global batch into. At step 1
    it is not uniform: the previous step's f (uniform before any step) would give exactly Σ_i P_i = 1."""
    got, ref = train_records(got), [r for r in train_records(ref) if r["step"] >= first_step]
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        assert g["aux_loss"] == pytest.approx(r["aux_loss"], rel=1e-5), g["step"]
    if first_step == 1:
        assert abs(got[0]["aux_loss"] - 1.0) > 1e-4, got[0]["aux_loss"]


def _same_final_state(got_dir: Path, ref_dir: Path, atol_of_scale: float) -> dict[str, torch.Tensor]:
    """The last checkpoints hold the same tensors (parameters and Adam moments, each once under its global name),
    equal in fp32 up to `atol_of_scale` of each tensor's largest magnitude (summation order differs between
    layouts); returns the run's tensors.

    Adam divides by the root of the second moment: where an element's gradient is of the order of rounding
    (rarely routed experts), the summation order of another layout or another CPU's kernels moves that element by
    up to about lr per step. So at most one element in a thousand of a tensor (at least one) may miss the
    tolerance, and none by more than two runs' worth of Adam steps (2 · steps · lr). A layout bug (a lost,
    doubled or misrouted gradient) moves whole rows and breaks the first bound."""
    got = _checkpoint_tensors(got_dir / f"checkpoints/step_{E2E_STEPS}")
    ref = _checkpoint_tensors(ref_dir / f"checkpoints/step_{E2E_STEPS}")
    assert got.keys() == ref.keys()
    lr = json.loads((ref_dir / "config.json").read_text())["train"]["lr"]
    for name in ref:
        assert got[name].shape == ref[name].shape and got[name].dtype == ref[name].dtype, name
        scale = ref[name].abs().max().item()
        diff = (got[name] - ref[name]).abs()
        misses = diff > 1e-5 * ref[name].abs() + atol_of_scale * scale
        allowed = max(1, ref[name].numel() // 1000)
        assert int(misses.sum()) <= allowed, (name, int(misses.sum()), diff.max().item() / scale)
        assert diff.max().item() <= 2 * E2E_STEPS * lr, (name, diff.max().item())
    return got


def _same_dispatch(got: list[dict], ref: list[dict]) -> None:
    """Every step's all-to-all bytes and expert load per MoE layer are equal (and bytes were sent): a chunked
    dispatch cuts the same rows into pieces, routed over the whole micro-batch either way."""
    got, ref = train_records(got), train_records(ref)
    assert len(got) == len(ref) > 0
    for g, r in zip(got, ref):
        for lg, lr in zip(g["moe"], r["moe"], strict=True):
            assert lg["a2a_bytes_per_rank"] == lr["a2a_bytes_per_rank"] > 0, g["step"]
            assert lg["tokens_per_expert"] == lr["tokens_per_expert"], g["step"]


@pytest.fixture(scope="session")
def same_aux():
    return _same_aux


@pytest.fixture(scope="session")
def same_dispatch():
    return _same_dispatch


@pytest.fixture(scope="session")
def reference(tmp_path_factory, run_train):
    """`reference(mode)`: the run directory of the single-process run of configs/debug.json with E2E_BASE in MoE
    mode "capacity" or "dropless", trained on first use."""
    root, done = tmp_path_factory.mktemp("reference"), {}

    def get(mode: str) -> Path:
        if mode not in done:
            run_train("fork", 1, e2e_args(root / mode, *E2E_MODES[mode]))
            done[mode] = root / mode
        return done[mode]

    return get


@pytest.fixture(scope="session")
def checkpoint_tensors():
    return _checkpoint_tensors


@pytest.fixture(scope="session")
def same_trajectory():
    return _same_trajectory


@pytest.fixture(scope="session")
def same_final_state():
    return _same_final_state
