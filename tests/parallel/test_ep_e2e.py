"""Expert parallelism end to end under DeepSpeed: EP runs equal one process with gradient accumulation
(docs/parallelism.md, "The equivalence guarantee"), step by step, for ZeRO 1 and 2, capacity and dropless;
checkpoints reshard across EP sizes.

Every run is compared with the session's single-process `reference` of its mode (shared with test_tp_e2e.py),
losses, clipped-gradient norms and expert load at every step, parameters and Adam moments at the end. A resumed
run is such a comparison too, for the steps after its checkpoint, so (dp, ep, zero) = (2, 2, 1) with capacity
drops is covered by ep1-to-ep2; (2, 2, 2) → (4, 4, 1) resharding with TP is test_tp_e2e.py's. Runs use torchrun
except one (the deepspeed launcher; launchers are equal: launch/test_launchers.py)."""

from __future__ import annotations

import re
import shutil

import pytest
from support import E2E_MODES, E2E_SAVE, E2E_STEPS, e2e_args, train_records

NUM_EXPERTS = 4  # configs/debug.json
# fp32, of each tensor's largest magnitude: summation order differs between layouts, and Adam amplifies it where
# gradients are tiny (with AVX2 kernels one element of the recipes run's w2 of 8,192 moved 1.35e-4 of the scale,
# the rest below 5.2e-5); a layout bug (a lost or misrouted gradient) moves whole tensors by about lr per step.
ATOL_OF_SCALE = 3e-4  # as test_tp_e2e.py
LAYOUTS = {  # (world, ep, mode, zero stage, parallel.a2a_chunks): launcher
    (2, 2, "dropless", 2, 1): "deepspeed",
    (4, 2, "capacity", 2, 1): "fork",
    (4, 4, "dropless", 1, 1): "fork",
    # support.E2E_MODES: sigmoid, bias, global-batch aux, groups = EP ranks, shared
    (2, 2, "recipes", 1, 1): "fork",
    # the Mamba-2 / Gated DeltaNet hybrid of test_tp_e2e.py (tp = 2, (2, 2, 2)) under expert parallelism alone
    (2, 2, "hybrid", 1, 1): "fork",
    # the chunked, overlapped dispatch (parallel.a2a_chunks): 64 tokens per micro-batch in 2 or 3 (22, 21, 21) chunks
    (4, 4, "dropless", 1, 2): "fork",
    (4, 2, "capacity", 2, 3): "fork",
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _args(run_dir, mode: str, ep: int, zero: int, *flags: str, chunks: int = 1) -> list[str]:
    layout = [f"parallel.ep={ep}", f"deepspeed.zero_stage={zero}", f"parallel.a2a_chunks={chunks}"]
    return e2e_args(run_dir, *E2E_MODES[mode], *layout, flags=flags)


def _check_against_reference(run_dir, ref_dir, ep: int, first_step, read, same_trajectory, same_final_state):
    records = [r for r in train_records(read(run_dir)) if r["step"] >= first_step]
    same_trajectory(records, read(ref_dir), first_step=first_step)
    if ep > 1:
        assert all(layer["a2a_bytes_per_rank"] > 0 for r in records for layer in r["moe"])
    got = same_final_state(run_dir, ref_dir, ATOL_OF_SCALE)
    experts = sorted(k for k in got if re.fullmatch(r"blocks\.\d+\.ffn\.experts\.w13\.\d+", k))
    assert len(experts) == 2 * NUM_EXPERTS  # two MoE layers, every expert once under its global index


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_train):
    """Run every layout once; tests below inspect the results."""
    root, out = tmp_path_factory.mktemp("ep"), {}
    for (world, ep, mode, zero, chunks), launcher in LAYOUTS.items():
        out[(world, ep, mode, zero, chunks)] = d = root / f"w{world}_ep{ep}_{mode}_z{zero}_c{chunks}"
        run_train(launcher, world, _args(d, mode, ep, zero, chunks=chunks))
    return out


@pytest.mark.parametrize(
    "layout",
    list(LAYOUTS),
    ids=lambda t: f"dp{t[0]}-ep{t[1]}-{t[2]}-zero{t[3]}" + (f"-chunks{t[4]}" if t[4] > 1 else ""),
)
def test_ep_run_equals_one_process(runs, reference, metrics, same_trajectory, same_final_state, same_aux, layout):
    _check_against_reference(
        runs[layout], reference(layout[2]), layout[1], 1, metrics, same_trajectory, same_final_state
    )
    if layout[2] == "recipes":  # the bias moved, identically in both runs (conftest compares it every step)
        assert all(any(layer["bias"]) for r in train_records(metrics(runs[layout])) for layer in r["moe"])
        same_aux(metrics(runs[layout]), metrics(reference("recipes")))  # the global batch's f: this step's


@pytest.mark.parametrize(
    "source, mode, resume_world, resume_ep",
    [
        ((2, 2, "dropless", 2, 1), "dropless", 1, 1),  # ep=2 -> ep=1 (one process)
        ("ref", "capacity", 2, 2),  # ep=1 -> ep=2
        ((4, 4, "dropless", 1, 1), "dropless", 2, 2),  # ep=4 -> ep=2
        ((2, 2, "recipes", 1, 1), "recipes", 1, 1),  # the balancing bias and global load travel in the checkpoint
    ],
    ids=["ep2-to-ep1", "ep1-to-ep2", "ep4-to-ep2", "ep2-to-ep1-recipes"],
)
def test_checkpoint_reshards_across_ep_sizes(
    tmp_path,
    runs,
    reference,
    run_train,
    metrics,
    same_trajectory,
    same_final_state,
    same_aux,
    source,
    mode,
    resume_world,
    resume_ep,
):
    """The source run's step-3 checkpoint, written at its layout, resumed at another (ZeRO 1): steps 4-6 and the
    final state equal the uninterrupted single-process run's."""
    d = tmp_path / "run"
    shutil.copytree(reference(mode) if source == "ref" else runs[source], d)
    shutil.rmtree(d / f"checkpoints/step_{E2E_STEPS}")
    sizes = [f.stat().st_size for f in (d / f"checkpoints/step_{E2E_SAVE}").glob("*.safetensors")]
    world = 1 if source == "ref" else source[0]  # every rank of the source layout wrote a balanced share
    assert len(sizes) == world and max(sizes) <= 1.25 * sum(sizes) / world, sizes
    launcher = "fork"
    proc = run_train(launcher, resume_world, _args(d, mode, resume_ep, 1, "--resume"))
    assert f"resuming from {d / 'checkpoints' / f'step_{E2E_SAVE}'} (step {E2E_SAVE})" in proc.stderr
    _check_against_reference(d, reference(mode), resume_ep, E2E_SAVE + 1, metrics, same_trajectory, same_final_state)
    if mode == "recipes":  # the resumed step recomputes its global-batch f (this_step), as the uninterrupted run did
        same_aux([r for r in metrics(d) if r["step"] > E2E_SAVE], metrics(reference(mode)), first_step=E2E_SAVE + 1)


def test_chunked_dispatch_sends_the_same_rows(runs, metrics, same_dispatch):
    same_dispatch(metrics(runs[(4, 4, "dropless", 1, 2)]), metrics(runs[(4, 4, "dropless", 1, 1)]))
