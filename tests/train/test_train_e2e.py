"""End-to-end training runs under real launchers: python (1 process), deepspeed and torchrun (2 CPU processes).

The runs of configs/debug.json as it is come from the session's `debug_run` (shared with launch/test_launchers.py and
test_bad_input.py); only the other ZeRO stages and the resume are launched here."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from support import DEBUG_CONFIG, ONE_THREAD, train_records
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moe_dist.config import load_config
from moe_dist.train.throughput import model_flops_per_token, profile_trace_path

CONFIG = DEBUG_CONFIG  # zero_stage 1, 6 steps, eval and checkpoint every 3
STEPS = 6
REQUIRED = {"step", "loss", "lm_loss", "aux_loss", "z_loss", "lr", "grad_norm", "tokens_per_s", "moe", "mfu"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _losses(records):
    return [r["loss"] for r in train_records(records)]


def test_single_process_matches_two_processes_for_every_zero_stage(tmp_path, debug_run, run_train, metrics):
    """ZeRO 1 (the config's) under the deepspeed launcher; 0 and 2 forked from the suite's server
    (tests/forklaunch.py; launchers are equal: test_torchrun_matches_deepspeed_launcher)."""
    ref_losses = _losses(metrics(debug_run("python")))
    assert len(ref_losses) == STEPS
    assert ref_losses[-1] < ref_losses[0] - 0.5, f"loss did not fall: {ref_losses}"
    for stage in (0, 1, 2):
        if stage == 1:
            run_dir = debug_run("deepspeed")
        else:
            run_dir = tmp_path / f"zero{stage}"
            extra = ["train.profile_steps=[2]", "train.profile_ranks=[0,1]"] if stage == 0 else []
            run_train(
                "fork",
                2,
                ["--config", CONFIG, "--run-dir", str(run_dir), "--set", ONE_THREAD, f"deepspeed.zero_stage={stage}"]
                + extra,
            )
        assert json.loads((run_dir / "config.json").read_text())["deepspeed"]["zero_stage"] == stage
        got = metrics(run_dir)
        assert _losses(got) == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), f"zero stage {stage}"
        if stage == 0:  # profiling one step changes no number; each chosen rank wrote its trace of step 2 only
            traces = sorted(p.name for p in (run_dir / "profile").iterdir())
            assert traces == [profile_trace_path(run_dir, 2, r).name for r in (0, 1)]
            events = json.loads(profile_trace_path(run_dir, 2, 1).read_text())["traceEvents"]
            assert any(e.get("name", "").startswith("aten::") for e in events)
        # Expert load is the global count: every assignment of the global batch is counted once.
        for r in train_records(got):
            assert len(r["moe"]) == 2
            for layer in r["moe"]:
                assert sum(layer["tokens_per_expert"]) == 8 * 32 * 2  # global batch × seq_len × top_k


def test_deepspeed_two_process_outputs(debug_run, metrics):
    run_dir = debug_run("deepspeed")
    records = metrics(run_dir)
    train = train_records(records)
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert REQUIRED <= r.keys(), REQUIRED - r.keys()
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0
        # model FLOPs of the global tokens per second, shared by the 2 processes; MFU against the start-up peak
        per_token = r["tflops_per_device"] * 1e12 * 2 / r["tokens_per_s"]
        assert per_token == pytest.approx(model_flops_per_token(load_config(CONFIG)), rel=1e-9)
        assert 0 < r["mfu"] < 1 and r["mfu"] / r["tflops_per_device"] == pytest.approx(
            train[0]["mfu"] / train[0]["tflops_per_device"], rel=1e-9
        )  # one peak for the whole run
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3, 6] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == STEPS
    assert {p.name for p in (run_dir / "checkpoints").glob("step_*")} == {"step_3", "step_6"}

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars, hists = set(acc.Tags()["scalars"]), set(acc.Tags()["histograms"])
    for tag in (
        "train/loss",
        "train/lm_loss",
        "train/aux_loss",
        "train/z_loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/mfu",
        "train/tflops_per_device",
        "eval/eval_loss",
        "moe/layer0/drop_fraction",
        "moe/layer0/max_over_mean_load",
        "moe/layer0/router_entropy",
        "moe/layer0/expert0_token_share",
        "moe/layer1/expert3_token_share",
    ):
        assert tag in scalars, tag
    assert "moe/layer0/tokens_per_expert" in hists
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert acc.Scalars("train/loss")[0].value == pytest.approx(train[0]["loss"], rel=1e-6)


def test_resume_reproduces_uninterrupted_losses(tmp_path, debug_run, run_train, metrics):
    """A crash after the step-3 checkpoint (the step-6 one never completed): --resume recomputes steps 4-6 exactly.
    (Refusing to reuse a run directory without --resume: test_bad_input.py.)"""
    full = _losses(metrics(debug_run("deepspeed")))
    run_dir = tmp_path / "run"
    shutil.copytree(debug_run("deepspeed"), run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_6")
    proc = run_train("fork", 2, ["--config", CONFIG, "--run-dir", str(run_dir), "--resume", "--set", ONE_THREAD])
    assert f"resuming from {run_dir / 'checkpoints' / 'step_3'} (step 3)" in proc.stdout + proc.stderr
    resumed = metrics(run_dir)
    assert [r["step"] for r in train_records(resumed)] == list(range(1, STEPS + 1))
    assert _losses(resumed) == full  # exact: same data, same state, same order of operations
    meta = json.loads((run_dir / "checkpoints" / "step_3" / "meta.json").read_text())
    n_moe, num_experts = (
        len(train_records(resumed)[0]["moe"]),
        len(train_records(resumed)[0]["moe"][0]["tokens_per_expert"]),
    )
    assert np.shape(meta["dead_expert_last_seen"]) == (n_moe, num_experts)  # the telemetry's history resumes too


def test_torchrun_matches_deepspeed_launcher(debug_run, metrics):
    got, ref = _losses(metrics(debug_run("torchrun"))), _losses(metrics(debug_run("deepspeed")))
    assert len(got) == STEPS and got == ref


def test_readme_main_command_runs_on_1_2_and_4_processes(tmp_path, run_train, metrics):
    """`deepspeed [--num_gpus N] launch/train.py --config configs/mixtral_small.json` with the config's own batch,
    layout and eval settings (only the step count cut to 2): every world size starts, trains the same steps
    (one global batch cut into the same micro-batches) and evaluates. The 2-process run is the deepspeed launcher's;
    1 and 4 fork from the suite's server (tests/forklaunch.py: the launchers are equal, test_launchers.py). (8
    processes: config/test_config.py's layout test.)"""
    losses = {}
    for world in (1, 2, 4):
        run_dir = tmp_path / f"w{world}"
        args = ["--config", "configs/mixtral_small.json", "--run-dir", str(run_dir), "--set", "train.steps=2"]
        run_train("deepspeed" if world == 2 else "fork", world, args)
        records = metrics(run_dir)
        train = train_records(records)
        assert [r["step"] for r in train] == [1, 2] and "eval_loss" in records[-1]
        for r in train:  # global expert load: 16 sequences × 128 tokens × top-2 per MoE layer
            assert [sum(layer["tokens_per_expert"]) for layer in r["moe"]] == [16 * 128 * 2] * 6
        losses[world] = [r["loss"] for r in train]
    assert losses[2] == pytest.approx(losses[1], rel=1e-5) and losses[4] == pytest.approx(losses[1], rel=1e-5)
