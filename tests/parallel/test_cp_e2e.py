"""Context parallelism end to end under DeepSpeed: a CP run equals one process step by step (losses, clipped-gradient
norms, tokens and drops per expert, the LM, aux and z losses, router entropy) and at the end (parameters and Adam
moments), on a hybrid of every mixer kind with capacity drops, packed documents on and off: cp = 2 and cp = 4,
cp = 2 × tp = 2, cp = 2 × ep = 2 (dp = 1: EP spans the CP ranks), and a cp = 2 checkpoint resumed by one process.

The hybrid is configs/debug.json's sizes with one layer of each mixer (attention, Mamba-1, Mamba-2, Gated
DeltaNet) and two MoE layers; sequences of 32 positions are pieces of 8 (cp = 2) or 4 (cp = 4). The mixers' layer
tests (test_cp_attention.py, test_cp_recurrent.py) cover the adversarial document layouts (a boundary at a piece
edge, a piece that is one whole document, pieces shorter than d_conv − 1); here the data's own documents."""

from __future__ import annotations

import json
import shutil

import pytest
from support import CP_HYBRID, E2E_SAVE, E2E_STEPS, e2e_args, train_records

ATOL_OF_SCALE = 3e-4  # as test_ep_e2e.py: summation order differs between layouts
MODES = {  # capacity drops (debug.json's capacity_factor 1.25) in both; packed documents in one
    # the global batch's aux-loss fractions (this step's, from the routing pre-pass) and the loss-free balancing bias
    "capacity": ["model.moe.aux_loss_scope=global_batch", "model.moe.bias_update_rate=0.01"],
    "documents": ["data.document_masking=true", "model.moe.aux_loss_scope=sequence"],
}
LAYOUTS = {  # (world, cp, tp, ep, mode): ZeRO stage (the references: 1)
    (2, 2, 1, 1, "documents"): 1,
    (2, 2, 1, 2, "capacity"): 2,  # dp = 1: the expert-parallel group is the CP group
    (4, 4, 1, 1, "capacity"): 1,
    (4, 4, 1, 1, "documents"): 1,
    (4, 2, 2, 1, "documents"): 1,
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _args(run_dir, mode: str, cp: int, tp: int, ep: int, *flags: str, zero: int = 1) -> list[str]:
    layout = [f"parallel.cp={cp}", f"parallel.tp={tp}", f"parallel.ep={ep}", f"deepspeed.zero_stage={zero}"]
    return e2e_args(run_dir, *CP_HYBRID, *MODES[mode], *layout, flags=flags)


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory, run_train):
    """One process per mode, then every layout once; the tests below compare them."""
    root, out = tmp_path_factory.mktemp("cp"), {}
    for mode in MODES:
        out[mode] = d = root / f"ref_{mode}"
        run_train("fork", 1, _args(d, mode, 1, 1, 1))
    for (world, cp, tp, ep, mode), zero in LAYOUTS.items():
        out[(world, cp, tp, ep, mode)] = d = root / f"w{world}_cp{cp}_tp{tp}_ep{ep}_{mode}"
        run_train("fork", world, _args(d, mode, cp, tp, ep, zero=zero))
    return out


def _same_drops(got: list[dict], ref: list[dict], first_step: int = 1) -> None:
    """Drops per expert (the capacity and drop order are the whole micro-batch's), the LM, aux and z losses and the
    router entropy, every step; the validation loss where it was computed."""
    got, ref = train_records(got), [r for r in train_records(ref) if r["step"] >= first_step]
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        assert g["aux_loss"] == pytest.approx(r["aux_loss"], rel=1e-5), g["step"]
        assert g["z_loss"] == pytest.approx(r["z_loss"], rel=1e-5), g["step"]
        assert g["lm_loss"] == pytest.approx(r["lm_loss"], rel=1e-5), g["step"]
        if "eval_loss" in r:  # the last step's validation pass: its micro-batches split over the CP ranks too
            assert g["eval_loss"] == pytest.approx(r["eval_loss"], rel=1e-5), g["step"]
        for lg, lr in zip(g["moe"], r["moe"], strict=True):
            assert lg["dropped_per_expert"] == lr["dropped_per_expert"], g["step"]
            assert lg["router_entropy"] == pytest.approx(lr["router_entropy"], rel=1e-5), g["step"]


@pytest.mark.parametrize(
    "layout", list(LAYOUTS), ids=lambda t: f"w{t[0]}-cp{t[1]}-tp{t[2]}-ep{t[3]}-{t[4]}-zero{LAYOUTS[t]}"
)
def test_cp_run_equals_one_process(cp_runs, metrics, same_trajectory, same_final_state, layout):
    mode = layout[4]
    got, ref = metrics(cp_runs[layout]), metrics(cp_runs[mode])
    same_trajectory(got, ref)
    _same_drops(got, ref)
    assert "eval_loss" in train_records(got)[-1]
    assert any(sum(layer["dropped_per_expert"]) > 0 for r in train_records(ref) for layer in r["moe"])
    same_final_state(cp_runs[layout], cp_runs[mode], ATOL_OF_SCALE)
    meta = json.loads((cp_runs[layout] / f"checkpoints/step_{E2E_STEPS}/meta.json").read_text())
    assert meta["layout"]["cp"] == layout[1] and meta["layout"]["dp"] * layout[1] * layout[2] == layout[0]
    if mode == "capacity":  # the bias moved (conftest compares it every step)
        assert all(any(layer["bias"]) for r in train_records(got) for layer in r["moe"])


def test_cp2_checkpoint_resumes_on_one_process(
    tmp_path, cp_runs, run_train, metrics, same_trajectory, same_final_state
):
    """The cp = 2 run's step-3 checkpoint resumed by one process: steps 4-6 and the final state equal the
    uninterrupted single-process run's (checkpoints do not depend on cp)."""
    d = tmp_path / "run"
    shutil.copytree(cp_runs[(2, 2, 1, 1, "documents")], d)
    shutil.rmtree(d / f"checkpoints/step_{E2E_STEPS}")
    proc = run_train("fork", 1, _args(d, "documents", 1, 1, 1, "--resume"))
    assert f"(step {E2E_SAVE})" in proc.stderr
    got = [r for r in metrics(d) if r.get("step", 0) > E2E_SAVE]
    same_trajectory(got, metrics(cp_runs["documents"]), first_step=E2E_SAVE + 1)
    _same_drops(got, metrics(cp_runs["documents"]), first_step=E2E_SAVE + 1)
    same_final_state(d, cp_runs["documents"], ATOL_OF_SCALE)
