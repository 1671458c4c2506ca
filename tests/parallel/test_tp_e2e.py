"""Tensor parallelism end to end under DeepSpeed: (dp, ep, tp) layouts, with and without sequence parallelism,
equal one process with gradient accumulation step by step (losses, clipped-gradient norms, expert load, final
parameters and Adam moments), and checkpoints reshard tp=2 → tp=1 → tp=2 and across combined layouts on the
same trajectory; the same for expert parallelism folded across TP (parallel.etp = 1), and checkpoints reshard
between etp = 1 and etp = tp; a Mamba-2 / Gated DeltaNet hybrid at tp = 2 and (2, 2, 2) with sequence parallelism,
its checkpoint resharded to one process; an imported Nemotron-H (squared-ReLU dense FFNs, experts and shared expert)
at tp = 2 and (2, 2, 2). (dp, ep, tp) = (4, 4, 1) from scratch is test_ep_e2e.py's; the single-process reference is
the session's, shared with it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support import E2E_BASE, E2E_CONFIG, E2E_MODES, E2E_SAVE, E2E_STEPS, e2e_args, train_records

from moe_dist.config import load_config
from moe_dist.hf import import_hf_to_run

LAYOUTS = {  # dp-ep-tp: world size, overrides
    "dp1-ep1-tp2": (2, ["parallel.tp=2"]),
    "dp2-ep2-tp2": (4, ["parallel.tp=2", "parallel.ep=2"]),
    "dp2-ep1-tp2": (4, ["parallel.tp=2", "deepspeed.zero_stage=2"]),
    "dp1-ep1-tp2-recipes": (2, ["parallel.tp=2", *E2E_MODES["recipes"]]),
    # The chunked, overlapped dispatch (parallel.a2a_chunks) inside each TP rank's token slice: 32 tokens in 3
    # chunks (11, 11, 10), or the sequence-parallel 32 in 2, with ZeRO 2 (sequence parallelism's one layout: its
    # step-3 checkpoint is the one resumed at (4, 4, 1)).
    "dp2-ep2-tp2-chunks3": (4, ["parallel.tp=2", "parallel.ep=2", "parallel.a2a_chunks=3"]),
    "dp2-ep2-tp2-sequence-parallel-chunks2": (
        4,
        [
            "parallel.tp=2",
            "parallel.ep=2",
            "parallel.sequence_parallel=true",
            "parallel.a2a_chunks=2",
            "deepspeed.zero_stage=2",
        ],
    ),
    # Activation checkpointing of every part (models/activation_checkpointing.py) under EP and TP: also compared with
    # the same layout without it, exactly (test_recompute_changes_nothing_under_ep_and_tp).
    "dp2-ep2-tp2-recompute": (4, ["parallel.tp=2", "parallel.ep=2", "train.activation_checkpointing=full"]),
    # Mamba-2 (one B/C group spanning the TP ranks) and Gated DeltaNet layers beside attention, dense and MoE ones
    "dp1-ep1-tp2-hybrid": (2, ["parallel.tp=2", *E2E_MODES["hybrid"]]),
    "dp2-ep2-tp2-sequence-parallel-hybrid": (
        4,
        ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true", *E2E_MODES["hybrid"]],
    ),
}


# Expert parallelism folded across TP (parallel.etp = 1: whole experts, EP groups spanning dp × tp): world, single-
# process reference mode (support.E2E_MODES), overrides: ZeRO 2 and sequence parallelism at (dp, ep, tp) = (2, 2, 2),
# (2, 4, 2) with the chunked dispatch and (1, 4, 4); ZeRO 1 without sequence parallelism where the (2, 2, 2) run's
# checkpoint resumes (test_checkpoint_reshards_between_etp1_and_etp_tp).
_FOLD, _SP_ZERO2 = ["parallel.etp=1"], ["parallel.sequence_parallel=true", "deepspeed.zero_stage=2"]
FOLDED = {
    "dp2-ep2-tp2-etp1-sequence-parallel-zero2": (4, "capacity", ["parallel.tp=2", "parallel.ep=2", *_FOLD, *_SP_ZERO2]),
    "dp2-ep4-tp2-etp1-sequence-parallel-zero2-chunks2": (
        4,
        "capacity",
        ["parallel.tp=2", "parallel.ep=4", *_FOLD, *_SP_ZERO2, "parallel.a2a_chunks=2"],
    ),
    "dp1-ep4-tp4-etp1-sequence-parallel-zero2": (
        4,
        "kv4",
        ["parallel.tp=4", "parallel.ep=4", *_FOLD, *_SP_ZERO2, *E2E_MODES["kv4"]],
    ),
}


def _mode(layout: str) -> str:
    """The single-process reference a layout is compared with (support.E2E_MODES)."""
    for mode in ("recipes", "hybrid"):
        if layout.endswith(f"-{mode}"):
            return mode
    return "capacity"


# fp32, of each tensor's largest magnitude. TP splits sums (heads, channels, expert hidden units) into partial sums,
# so rounding differs; Adam amplifies it where gradients are tiny (a rarely routed expert's w2: worst seen 0.9e-4
# of the scale after these 6 steps, 1.0e-4 after 8, while losses agree to 1e-7).
ATOL_OF_SCALE = 3e-4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _args(run_dir, *overrides: str, resume: bool = False) -> list[str]:
    return e2e_args(run_dir, *overrides, flags=("--resume",) if resume else ())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_train):
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for layout, (world, extra) in LAYOUTS.items():
        out[layout] = root / layout
        run_train("fork", world, _args(out[layout], *extra))
    return out


def _resume(run_train, src, dst, world: int, *overrides: str, from_step: int) -> None:
    """Copy run `src` to `dst` without its checkpoints after `from_step` and resume it there."""
    shutil.copytree(src, dst)
    for step_dir in (dst / "checkpoints").glob("step_*"):
        if int(step_dir.name[5:]) > from_step:
            shutil.rmtree(step_dir)
    proc = run_train("fork", world, _args(dst, *overrides, resume=True))
    assert f"resuming from {dst / 'checkpoints' / f'step_{from_step}'} (step {from_step})" in proc.stderr


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp_run_equals_one_process(runs, reference, metrics, same_trajectory, same_final_state, same_aux, layout):
    same_trajectory(metrics(runs[layout]), metrics(reference(_mode(layout))))
    same_final_state(runs[layout], reference(_mode(layout)), ATOL_OF_SCALE)  # every tensor whole, once, by global name
    if _mode(layout) == "recipes":  # the global batch's f (this step's): TP peers route the same tokens, counted once
        same_aux(metrics(runs[layout]), metrics(reference("recipes")))


def test_recompute_changes_nothing_under_ep_and_tp(runs, metrics, checkpoint_tensors):
    """Recompute repeats no routing and no all-to-all: every per-step figure (losses, gradient norm, tokens and
    drops per expert, all-to-all bytes) and the final parameters and moments equal the run without it, bitwise."""
    got, ref = train_records(metrics(runs["dp2-ep2-tp2-recompute"])), train_records(metrics(runs["dp2-ep2-tp2"]))
    assert len(got) == len(ref) > 0
    for g, r in zip(got, ref):
        for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "moe"):
            assert g[key] == r[key], (g["step"], key)
    final = f"checkpoints/step_{len(ref)}"
    a, b = checkpoint_tensors(runs["dp2-ep2-tp2-recompute"] / final), checkpoint_tensors(runs["dp2-ep2-tp2"] / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_chunked_dispatch_sends_the_same_rows_under_tp(runs, metrics, same_dispatch):
    same_dispatch(metrics(runs["dp2-ep2-tp2-chunks3"]), metrics(runs["dp2-ep2-tp2"]))


def test_checkpoint_reshards_tp2_to_tp1_to_tp2(
    tmp_path, runs, reference, run_train, metrics, same_trajectory, same_final_state
):
    """Resume the tp=2 run's step-3 checkpoint in one process (saving every 2 steps), then that run's step-4
    checkpoint at tp=2 again: every step continues the uninterrupted single-process trajectory."""
    ref = reference("capacity")
    tp1, tp2 = tmp_path / "resume_tp1", tmp_path / "resume_tp2"
    _resume(run_train, runs["dp1-ep1-tp2"], tp1, 1, "train.save_every=2", from_step=E2E_SAVE)
    same_trajectory(
        [r for r in train_records(metrics(tp1)) if r["step"] > E2E_SAVE], metrics(ref), first_step=E2E_SAVE + 1
    )
    same_final_state(tp1, ref, ATOL_OF_SCALE)

    _resume(run_train, tp1, tp2, 2, "parallel.tp=2", from_step=E2E_SAVE + 1)
    same_trajectory(
        [r for r in train_records(metrics(tp2)) if r["step"] > E2E_SAVE + 1], metrics(ref), first_step=E2E_SAVE + 2
    )
    same_final_state(tp2, ref, ATOL_OF_SCALE)


def test_checkpoint_reshards_across_combined_layouts(
    tmp_path, runs, reference, run_train, metrics, same_trajectory, same_final_state
):
    """The (dp, ep, tp) = (2, 2, 2) sequence-parallel run's step-3 checkpoint (ZeRO 2, dispatch in 2 chunks) resumed
    at (4, 4, 1) with ZeRO 1: every dimension changes."""
    d, ref = tmp_path / "resume_222_to_441", reference("capacity")
    _resume(run_train, runs["dp2-ep2-tp2-sequence-parallel-chunks2"], d, 4, "parallel.ep=4", from_step=E2E_SAVE)
    same_trajectory(
        [r for r in train_records(metrics(d)) if r["step"] > E2E_SAVE], metrics(ref), first_step=E2E_SAVE + 1
    )
    same_final_state(d, ref, ATOL_OF_SCALE)


def test_hybrid_checkpoint_reshards_to_one_process(
    tmp_path, runs, reference, run_train, metrics, same_trajectory, same_final_state
):
    """The Mamba-2 / Gated DeltaNet hybrid's (dp, ep, tp) = (2, 2, 2) sequence-parallel step-3 checkpoint resumed in
    one process: every sharded tensor of the new mixers (in_proj's z, x, B, C, dt blocks, the conv's channel
    blocks, per-head vectors) is gathered whole on save, and the run continues the single-process trajectory."""
    d, ref = tmp_path / "resume_hybrid_222_to_111", reference("hybrid")
    src = runs["dp2-ep2-tp2-sequence-parallel-hybrid"]
    _resume(run_train, src, d, 1, *E2E_MODES["hybrid"], from_step=E2E_SAVE)
    same_trajectory(
        [r for r in train_records(metrics(d)) if r["step"] > E2E_SAVE], metrics(ref), first_step=E2E_SAVE + 1
    )
    same_final_state(d, ref, ATOL_OF_SCALE)


@pytest.fixture(scope="module")
def folded_runs(tmp_path_factory, run_train):
    root = tmp_path_factory.mktemp("folded")
    out = {}
    for layout, (world, _, extra) in FOLDED.items():
        out[layout] = root / layout
        run_train("fork", world, _args(out[layout], *extra))
    return out


@pytest.mark.parametrize("layout", list(FOLDED))
def test_folded_run_equals_one_process(folded_runs, reference, metrics, same_trajectory, same_final_state, layout):
    """Whole experts behind an all-to-all across TP ranks: losses, clipped-gradient norms (each expert parameter
    counted once), expert load and the final parameters and moments equal one process."""
    world, mode, _ = FOLDED[layout]
    records = train_records(metrics(folded_runs[layout]))
    same_trajectory(records, metrics(reference(mode)))
    assert all(layer["a2a_bytes_per_rank"] > 0 for r in records for layer in r["moe"])
    got = same_final_state(folded_runs[layout], reference(mode), ATOL_OF_SCALE)
    assert sum(1 for k in got if k.startswith("blocks.0.ffn.experts.w13.")) == 4  # every expert once, whole
    meta = json.loads((folded_runs[layout] / "checkpoints/step_3/meta.json").read_text())
    assert meta["layout"]["etp"] == 1 and meta["layout"]["tp"] * meta["layout"]["dp"] == world


def test_checkpoint_reshards_between_etp1_and_etp_tp(
    tmp_path, folded_runs, reference, run_train, metrics, same_trajectory, same_final_state
):
    """The (2, 2, 2, etp 1) sequence-parallel ZeRO 2 run's step-3 checkpoint resumed with experts split over TP
    (etp = tp = 2, ZeRO 1, saving every 2 steps), then that run's step-4 checkpoint resumed folded again at
    (2, 4, 2, etp 1): every step continues the uninterrupted single-process trajectory."""
    ref = reference("capacity")
    split, folded = tmp_path / "resume_etp2", tmp_path / "resume_etp1"
    src = folded_runs["dp2-ep2-tp2-etp1-sequence-parallel-zero2"]
    _resume(run_train, src, split, 4, "parallel.tp=2", "parallel.ep=2", "train.save_every=2", from_step=E2E_SAVE)
    same_trajectory(
        [r for r in train_records(metrics(split)) if r["step"] > E2E_SAVE], metrics(ref), first_step=E2E_SAVE + 1
    )
    same_final_state(split, ref, ATOL_OF_SCALE)

    _resume(run_train, split, folded, 4, "parallel.tp=2", "parallel.ep=4", "parallel.etp=1", from_step=E2E_SAVE + 1)
    same_trajectory(
        [r for r in train_records(metrics(folded)) if r["step"] > E2E_SAVE + 1], metrics(ref), first_step=E2E_SAVE + 2
    )
    same_final_state(folded, ref, ATOL_OF_SCALE)


# Nemotron-H as `convert.py import` brings it in: transformers' own model (test_hf_hybrids.NEMOTRON: Mamba-2, attention,
# a relu² MLP and two dropless MoE layers of 8 relu² experts, top-3 of sigmoid scores in 2 groups with the correction
# bias, a relu² shared expert), trained from its step-0 checkpoint with E2E_BASE's steps, in one process and under TP.
# Each run loads the unsharded import into its shards (w1/w2 sliced by `tp_dim`) and saves them gathered whole,
# compared with the one-process run's tensors: the relu² shapes reshard both ways.
NEMOTRON_LAYOUTS = {  # dp-ep-tp: world size, overrides
    "dp1-ep1-tp1": (1, []),
    "dp1-ep1-tp2": (2, ["parallel.tp=2"]),
    "dp2-ep2-tp2": (4, ["parallel.tp=2", "parallel.ep=2"]),
}


@pytest.fixture(scope="module")
def nemotron_runs(tmp_path_factory, run_train):
    from hf.test_hf_hybrids import family_dir  # imports transformers: only where this fixture runs

    root = tmp_path_factory.mktemp("nemotron_h")
    family_dir("nemotron_h", root / "hf")
    import_hf_to_run(root / "hf", root / "imported", load_config(E2E_CONFIG, E2E_BASE))
    out = {}
    for layout, (world, extra) in NEMOTRON_LAYOUTS.items():
        out[layout] = root / layout
        shutil.copytree(root / "imported", out[layout])
        args = ["--config", str(out[layout] / "config.json"), "--run-dir", str(out[layout]), "--resume"]
        proc = run_train("fork", world, [*args, *(["--set", *extra] if extra else [])])
        assert f"resuming from {out[layout] / 'checkpoints' / 'step_0'} (step 0)" in proc.stderr  # the import's weights
    return out


@pytest.mark.parametrize("layout", [k for k in NEMOTRON_LAYOUTS if k != "dp1-ep1-tp1"])
def test_imported_nemotron_h_under_tp_equals_one_process(
    nemotron_runs, metrics, same_trajectory, same_final_state, checkpoint_tensors, layout
):
    """Losses, clipped-gradient norms, expert load and correction biases of every step, and the final parameters and
    Adam moments (each relu² w1/w2 whole, once), equal the one-process run with gradient accumulation."""
    ref = nemotron_runs["dp1-ep1-tp1"]
    cfg = json.loads((ref / "config.json").read_text())
    assert cfg["model"]["ffn_activation"] == "relu2" and cfg["model"]["layers"].count("moe") == 2
    same_trajectory(metrics(nemotron_runs[layout]), metrics(ref))
    got = same_final_state(nemotron_runs[layout], ref, ATOL_OF_SCALE)
    # the relu² up projections whole: the experts' by global index, the shared expert's and the MLP's
    relu2 = {f"blocks.1.ffn.experts.w1.{e}" for e in range(8)} | {"blocks.1.ffn.shared.w1.weight"}
    relu2.add("blocks.3.ffn.w1.weight")
    assert relu2 <= got.keys()
    _print_agreement(layout, metrics(nemotron_runs[layout]), metrics(ref), got, checkpoint_tensors(ref / FINAL))


FINAL = f"checkpoints/step_{E2E_STEPS}"


def _print_agreement(layout: str, got: list[dict], ref: list[dict], final: dict, ref_final: dict) -> None:
    """The measured agreement (shown with -s): largest relative differences of the steps' losses and gradient norms,
    and of the final parameters (Adam moments left out) the largest |difference|, absolute and of the tensor's scale."""
    pairs = list(zip(train_records(got), train_records(ref), strict=True))
    rel = {k: max(abs(g[k] - r[k]) / abs(r[k]) for g, r in pairs) for k in ("loss", "grad_norm")}
    params = [k for k in ref_final if not k.startswith("exp_avg")]  # exp_avg.* and exp_avg_sq.*: the moments
    diff = {k: (final[k] - ref_final[k]).abs().max().item() for k in params}
    of_scale = {k: diff[k] / max(ref_final[k].abs().max().item(), 1e-30) for k in params}
    worst = max(params, key=of_scale.get)
    print(
        f"nemotron_h {layout}: max rel diff loss {rel['loss']:.2e} grad_norm {rel['grad_norm']:.2e}; max |param diff| "
        f"{max(diff.values()):.2e}, of its tensor's scale at most {of_scale[worst]:.2e} ({worst})"
    )
