"""One gradient reduction per optimizer step (ZeRO 1 with bf16 weights and fp32 accumulation, train/optim.py):
the bytes a step reduces per group, training that equals one process, exact resume, resharding, the same with the
reduction overlapped with the last micro-batch's backward (train.grad_reduce_overlap), and the options the engine
cannot honour.

The fp32 layouts of test_ep_e2e.py and test_tp_e2e.py at ZeRO 1 run the same reduction (after the last
micro-batch's backward, each bucket slice reduced onto its owner); the bf16 world here adds the fp32 accumulation
buffers and several buckets per step."""

from __future__ import annotations

import json
import os
import runpy
import shutil
from pathlib import Path

import pytest
from support import E2E_CONFIG, E2E_SAVE, E2E_STEPS, e2e_args, free_port, train_records

REPO = Path(__file__).resolve().parents[2]
# bf16 weights, 4 micro-batches per rank at dp 2 (8 in one process), dropless experts; 0.1 MiB buckets: a step's
# gradients span a dozen of them (a DeepSpeed path that reduced them at the wrong time showed only from two on)
BF16 = ["train.dtype=bf16", "train.global_batch_size=16", "model.moe.capacity_factor=null"]
BF16 += ["train.grad_reduce_bucket_mb=0.1"]
# the reduction from the last backward's hooks, and the updated weights' gather behind the next forward
OVERLAP = ["train.grad_reduce_overlap=true", "train.param_gather_overlap=true"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.grad_reduce_bucket_mb=0", "train.grad_reduce_bucket_mb: must be a positive number of MiB, got 0"),
        ("train.grad_reduce_bucket_mb=1e-7", "train.grad_reduce_bucket_mb: 1e-07 MiB holds no whole gradient element"),
        ("train.grad_reduce_overlap=true", "train.grad_reduce_overlap: true is not honoured at deepspeed.zero_stage=0"),
        ('deepspeed.extra={"zero_optimization": {"overlap_comm": true}}', "deepspeed.extra: zero_optimization's"),
        ("train.param_gather_overlap=true", "train.param_gather_overlap: true needs partitioned weights to gather"),
    ],
    ids=["bucket-zero", "bucket-below-an-element", "overlap-at-zero0", "extra-overlap_comm", "gather-at-zero0"],
)
def test_options_the_engine_cannot_honour_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, override, message):
    monkeypatch.setenv("WORLD_SIZE", "1")
    main = runpy.run_path(str(REPO / "launch/train.py"))["main"]
    run = tmp_path / "run"
    at_zero0 = override.endswith("_overlap=true")
    extra = ["deepspeed.zero_stage=0"] if at_zero0 else []  # else stage 1
    assert main(["--config", str(REPO / E2E_CONFIG), "--run-dir", str(run), "--set", override, *extra]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {message}"), errors
    assert not run.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_step_of_4_micro_batches_reduces_one_steps_gradients(tmp_path, forks):
    """dp 4, ep 2 (expert data-parallel groups of 2), 4 micro-batches per rank: ZeRO 1 reduces the dense gradients
    over dp and the expert gradients over edp once, as many bytes as one step's gradients in the dtype that
    travels; ZeRO 2 (the old mode) reduces every micro-batch: four times the bytes. One world, three engines."""
    out = tmp_path / "counts.json"
    sets = ["train.threads=1", "train.eval_batches=4", "parallel.ep=2", "train.global_batch_size=32"]
    sets += ["train.dtype=bf16", "model.moe.capacity_factor=null"]
    variants = [f"deepspeed.zero_stage=1,train.grad_reduce_dtype={d}" for d in ("fp32", "bf16")]
    variants += ["deepspeed.zero_stage=2"]
    # overlapped with the last micro-batch's backward, in 0.1 MiB buckets (a dozen per group and step)
    variants += ["deepspeed.zero_stage=1,train.grad_reduce_overlap=true,train.grad_reduce_bucket_mb=0.1"]
    args = ["--config", E2E_CONFIG, "--json", str(out), "--set", *sets, "--step", *variants]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # `torchrun --nproc_per_node 4 -m benchmarks.comm_report ARGS`
    proc = forks.run(4, args, env, free_port(), 500, module="benchmarks.comm_report", cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fp32, bf16, old, overlapped = json.loads(out.read_text())
    for got, size in ((fp32, 4), (bf16, 2), (overlapped, 4)):
        assert got["micro_batches"] == 4
        for group in ("data-parallel", "expert data-parallel"):
            assert got["grad_bytes"][group] > 0 and got["grad_bytes"][group] % size == 0
            assert got["reduced_bytes"][group] == got["grad_bytes"][group], (size, group, got["rows"])
    assert bf16["grad_bytes"]["data-parallel"] * 2 == fp32["grad_bytes"]["data-parallel"]
    assert old["reduced_bytes"]["expert data-parallel"] == 4 * old["grad_bytes"]["expert data-parallel"]
    assert old["reduced_bytes"]["data-parallel"] >= 4 * old["grad_bytes"]["data-parallel"]
    # the same reduction, dense over dp 4 and experts over edp 2: the same clipped-norm input as without overlap
    assert overlapped["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=1e-6)

    def calls(got):
        return sum(row[3] for row in got["rows"] if row[0] == "backward" and row[1] == "data-parallel")

    assert calls(overlapped) > 2 * calls(fp32)  # the 0.1 MiB buckets did reduce apart (a reduce per owner and bucket)


def _args(run_dir: Path, *extra: str) -> list[str]:
    return e2e_args(run_dir, *BF16, *extra)


def _final_tensors(run_dir: Path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted((run_dir / f"checkpoints/step_{E2E_STEPS}").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bf16_one_reduction_per_step_trains_as_one_process_resumes_exactly_and_reshards(tmp_path, run_train, metrics):
    """bf16, 6 steps, checkpoint at 3: dp 2 · ep 2 at ZeRO 1 against one process (same mode).
    - The same with the reduction overlapped with the last micro-batch's backward (train.grad_reduce_overlap, a
      dozen 0.1 MiB buckets per step) and the updated weights gathered module by module behind the next forward
      (train.param_gather_overlap: broadcasts from their owners instead of DeepSpeed's all-gather): bitwise the
      same run.
    - pp 2 with both against one process (each rank's engine accumulates its stages' gradients over the schedule's
      8 micro-batches and reduces them once, from its last backward's hooks).
    - The step-3 checkpoint resumed at the same layout with the overlap on (bitwise the same steps 4-6 and final
      state) and at one process (the one-process run's losses, the source run's final state).
    (At this layout ZeRO 2 ends within 1e-9 of ZeRO 1: the same fp32 sums in another order.)"""
    one, two = tmp_path / "one", tmp_path / "dp2ep2"
    run_train("fork", 1, _args(one, "deepspeed.zero_stage=1"))
    run_train("fork", 2, _args(two, "deepspeed.zero_stage=1", "parallel.ep=2"))
    overlapped, pipe = tmp_path / "dp2ep2_overlap", tmp_path / "pp2_overlap"
    run_train("fork", 2, _args(overlapped, "deepspeed.zero_stage=1", "parallel.ep=2", *OVERLAP))
    run_train("fork", 2, _args(pipe, "deepspeed.zero_stage=1", "parallel.pp=2", *OVERLAP))
    ref = train_records(metrics(one))
    got = train_records(metrics(two))
    # the same sums of the same fp32 accumulators, reduced from the hooks: bitwise the same run
    assert [(r["loss"], r["grad_norm"]) for r in train_records(metrics(overlapped))] == [
        (r["loss"], r["grad_norm"]) for r in got
    ]
    base = _final_tensors(two)
    assert all(_final_tensors(overlapped)[k].equal(base[k]) for k in base)
    for run in (two, pipe):
        got_run = train_records(metrics(run))
        assert [r["step"] for r in got_run] == list(range(1, E2E_STEPS + 1))
        for g, r in zip(got_run, ref):
            # bf16 weights: a sum in another order can round an updated weight to the neighbouring bf16 value
            assert g["loss"] == pytest.approx(r["loss"], rel=2e-4), (run.name, g["step"])
            assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=2e-3), (run.name, g["step"])

    for name, world, extra in (("same", 2, ["parallel.ep=2", *OVERLAP]), ("one", 1, [])):
        d = tmp_path / f"resumed_{name}"
        shutil.copytree(two, d)
        shutil.rmtree(d / f"checkpoints/step_{E2E_STEPS}")
        run_train("fork", world, [*_args(d, "deepspeed.zero_stage=1", *extra), "--resume"])
        got = [r for r in train_records(metrics(d)) if r["step"] > E2E_SAVE]
        assert [r["step"] for r in got] == list(range(E2E_SAVE + 1, E2E_STEPS + 1))
        tensors = _final_tensors(d)
        if name == "same":  # exact resume, the reduction overlapped
            want = [r for r in train_records(metrics(two)) if r["step"] > E2E_SAVE]
            assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]
            assert tensors.keys() == base.keys()
            assert all(tensors[k].equal(base[k]) for k in base)
        else:  # resharded to one process: steps 4-6 of the uninterrupted runs
            for g, r in zip(got, [r for r in ref if r["step"] > E2E_SAVE]):
                assert g["loss"] == pytest.approx(r["loss"], rel=2e-4), g["step"]
            # Against the source run continued at its own layout (the same state at step 3): only steps 4-6's
            # summation order differs, by bf16 roundings that Adam's moments carry most (measured: 3.5e-4 and
            # 1.2e-2 at most). Against the one-process run both are ~3e-2 / 1e-1 apart: bf16 from step 1 on.
            assert tensors.keys() == base.keys()
            for k in base:
                distance = ((tensors[k] - base[k]).norm() / base[k].norm().clamp_min(1e-12)).item()
                assert distance < (5e-2 if k.startswith("exp_avg") else 3e-3), (k, distance)
