"""Pipeline parallelism end to end under DeepSpeed (launch/train.py with parallel.pp): every layout equals one process
with gradient accumulation step by step (losses, clipped-gradient norms, tokens and drops per expert, the LM, aux
and z losses, the loss-free balancing bias, the validation loss) and at the end (parameters and Adam moments):

- pp = 2 under 1F1B;
- pp = 2 interleaved with 2 virtual stages (the aux loss over the global batch from the previous step's load,
  loss-free balancing on);
- pp = 2 × ep = 2 at ZeRO 2;
- pp = 2 with tied embeddings at ZeRO 2 (the lookup on the first stage, the head on the last: gradients summed);
- pp = 2 × tp = 2 with sequence parallelism (the hidden states between stages split over the sequence, the logits
  over the vocabulary), and with ep = 2 over whole experts (etp = 1) too;
- pp = 4 on a hybrid whose stages are attention + MoE, Mamba-2 + MLP (no MoE layer), an MoE FFN alone (only MoE
  layers) and Gated DeltaNet + MLP;
- pp = 2 with full activation checkpointing, under an explicit cut (`parallel.pp_cut`: 1 layer, then 3).
- Checkpoints: the pp = 2 run's step-3 checkpoint resumes exactly at pp = 2, on one process and at pp = 4.
"""

from __future__ import annotations

import json
import shutil

import pytest
from support import E2E_SAVE, E2E_STEPS, LAYER_LIST, SMALL_RECURRENT, e2e_args, train_records

ATOL_OF_SCALE = 3e-4  # as test_ep_e2e.py: summation order differs between layouts
MODES = {
    "capacity": [],  # configs/debug.json: attention / Mamba-1, MoE with capacity drops and dense FFNs
    "balancing": [
        "model.moe.aux_loss_scope=global_batch",
        "model.moe.global_batch_load=previous_step",
        "model.moe.bias_update_rate=0.01",
    ],
    "tied": ["model.tie_embeddings=true"],
    "hybrid": [*LAYER_LIST, 'model.layers=["attention+moe","mamba2+mlp","moe","gdn+mlp"]', *SMALL_RECURRENT],
}
LAYOUTS = {  # name: (world, mode, overrides)
    "pp2": (2, "capacity", ["parallel.pp=2"]),
    "pp2-v2": (2, "balancing", ["parallel.pp=2", "parallel.pp_virtual=2"]),
    "pp2-ep2-zero2": (4, "capacity", ["parallel.pp=2", "parallel.ep=2", "deepspeed.zero_stage=2"]),
    "pp2-tied-zero2": (2, "tied", ["parallel.pp=2", "deepspeed.zero_stage=2"]),
    "pp2-tp2-sp": (4, "capacity", ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    # the shipped Qwen3-235B layout's shape: TP with SP, experts whole (etp 1) and EP over dp × tp of each stage
    "pp2-tp2-sp-ep2-etp1": (
        4,
        "capacity",
        ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=1"],
    ),
    "pp4-hybrid": (4, "hybrid", ["parallel.pp=4"]),
    # an explicit cut: one layer on the first stage, three on the second
    "pp2-recompute-cut": (
        2,
        "capacity",
        ["parallel.pp=2", "train.activation_checkpointing=full", "parallel.pp_cut=[1]"],
    ),
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _args(run_dir, mode: str, *overrides: str, flags: tuple[str, ...] = ()) -> list[str]:
    return e2e_args(run_dir, *MODES[mode], "train.eval_every=3", *overrides, flags=flags)


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory, run_train):
    """One process per mode, then every layout once; the tests below compare them."""
    root, out = tmp_path_factory.mktemp("pp"), {}
    for mode in MODES:
        out[mode] = d = root / f"ref_{mode}"
        run_train("fork", 1, _args(d, mode))
    for name, (world, mode, overrides) in LAYOUTS.items():
        out[name] = d = root / name
        run_train("fork", world, _args(d, mode, *overrides))
    return out


def _same_losses(got: list[dict], ref: list[dict], first_step: int = 1) -> None:
    """The LM, aux and z losses, drops per expert and router entropy every step; the validation loss where both
    computed it."""
    got, ref = train_records(got), [r for r in train_records(ref) if r["step"] >= first_step]
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        for key in ("lm_loss", "aux_loss", "z_loss", "eval_loss"):
            if key in r:
                assert g[key] == pytest.approx(r[key], rel=1e-5), (g["step"], key)
        for lg, lr in zip(g["moe"], r["moe"], strict=True):
            assert lg["dropped_per_expert"] == lr["dropped_per_expert"], g["step"]
            assert lg["router_entropy"] == pytest.approx(lr["router_entropy"], rel=1e-5), g["step"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_run_equals_one_process(pp_runs, metrics, same_trajectory, same_final_state, layout):
    world, mode, overrides = LAYOUTS[layout]
    got, ref = metrics(pp_runs[layout]), metrics(pp_runs[mode])
    same_trajectory(got, ref)
    _same_losses(got, ref)
    assert "eval_loss" in train_records(got)[-1]
    if mode == "capacity":
        assert any(sum(layer["dropped_per_expert"]) > 0 for r in train_records(ref) for layer in r["moe"])
    if mode == "balancing":  # the bias of every stage's layers moved and reached rank 0's record
        assert all(any(layer["bias"]) for r in train_records(got) for layer in r["moe"])
    same_final_state(pp_runs[layout], pp_runs[mode], ATOL_OF_SCALE)
    meta = json.loads((pp_runs[layout] / f"checkpoints/step_{E2E_STEPS}/meta.json").read_text())
    assert meta["layout"]["pp"] == int(overrides[0].split("=")[1])


@pytest.mark.parametrize("world, pp", [(2, 2), (1, 1), (4, 4)], ids=["same-layout", "on-one-process", "at-pp4"])
def test_pp2_checkpoint_resumes(tmp_path, pp_runs, run_train, metrics, same_trajectory, same_final_state, world, pp):
    """The pp = 2 run's step-3 checkpoint resumed at pp = 2, by one process and at pp = 4: steps 4-6 and the final
    state equal the uninterrupted runs' (checkpoints hold each tensor once under its name, whatever the stages)."""
    d = tmp_path / "run"
    shutil.copytree(pp_runs["pp2"], d)
    shutil.rmtree(d / f"checkpoints/step_{E2E_STEPS}")
    launcher = "fork"
    proc = run_train(launcher, world, _args(d, "capacity", f"parallel.pp={pp}", flags=("--resume",)))
    assert f"(step {E2E_SAVE})" in proc.stderr
    got = [r for r in metrics(d) if r.get("step", 0) > E2E_SAVE]
    same_trajectory(got, metrics(pp_runs["capacity"]), first_step=E2E_SAVE + 1)
    _same_losses(got, metrics(pp_runs["capacity"]), first_step=E2E_SAVE + 1)
    same_final_state(d, pp_runs["capacity"], ATOL_OF_SCALE)
