"""launch/train.py runs unchanged under every launcher — deepspeed, torchrun, accelerate launch (multi-process,
and through its DeepSpeed plugin) — and each run follows the same trajectory. The deepspeed and torchrun runs are
the session's `debug_run` (shared with train/test_train_e2e.py); the accelerate runs are made here with the same
arguments."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from support import DEBUG_CONFIG, ONE_THREAD, console_script, free_port, shm_buffers, train_records

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _accelerate(deepspeed_plugin: bool, port: int) -> list[str]:
    cmd = [
        console_script("accelerate"),
        "launch",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(port),
    ]
    # --multi_gpu is accelerate's torch.distributed launcher; on a CPU machine it starts CPU processes.
    # The DeepSpeed plugin's settings go to the processes as ACCELERATE_DEEPSPEED_* variables; train.py builds its
    # engine from the job config, so the two are kept equal (zero stage 1 in both).
    return [*cmd, "--use_deepspeed", "--zero_stage", "1"] if deepspeed_plugin else [*cmd, "--multi_gpu"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, debug_run, metrics):
    root = tmp_path_factory.mktemp("launchers")
    # No accelerate config from the user's home may change what `accelerate launch` does.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HOME": str(root / "hf_home")}
    out = {launcher: train_records(metrics(debug_run(launcher))) for launcher in ("deepspeed", "torchrun")}
    shm = {launcher: debug_run.shm[launcher] for launcher in ("deepspeed", "torchrun")}
    for launcher, plugin in (("accelerate", False), ("accelerate-deepspeed", True)):
        run_dir, port = root / launcher, free_port()
        cmd = [
            *_accelerate(plugin, port),
            TRAIN,
            "--config",
            DEBUG_CONFIG,
            "--run-dir",
            str(run_dir),
            "--set",
            ONE_THREAD,
        ]
        tic = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        print(f"{launcher}: {time.perf_counter() - tic:.1f} s end to end")
        assert proc.returncode == 0, f"{launcher} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        out[launcher] = train_records(metrics(run_dir))
        shm[launcher] = shm_buffers(port)
    return out, shm


def test_no_shared_memory_buffer_outlives_a_run(runs):
    """DeepSpeed's CPU shm all-reduce leaves a 69 MB /dev/shm buffer per rank behind (the deepspeed launcher's runs
    make them); init_distributed removes their names once every rank has mapped them. (That the name looked for
    is the one DeepSpeed creates: parallel/test_private_api.py.)"""
    _, shm = runs
    assert set(shm) == {"deepspeed", "torchrun", "accelerate", "accelerate-deepspeed"}
    assert not {k: v for k, v in shm.items() if v}


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate", "accelerate-deepspeed"])
def test_launcher_matches_deepspeed(runs, launcher):
    records, _ = runs
    ref, got = records["deepspeed"], records[launcher]
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-6)  # same init, data, layout
    assert [r["moe"][0]["tokens_per_expert"] for r in got] == [r["moe"][0]["tokens_per_expert"] for r in ref]


def test_pipeline_runs_under_deepspeed_and_accelerate(tmp_path, runs, run_train, metrics):
    """parallel.pp = 2 through the deepspeed launcher and accelerate launch: the same trajectory as the data-parallel
    runs above (torchrun's pipeline runs are tests/parallel/test_pp_e2e.py's)."""
    records, _ = runs
    ref = records["deepspeed"]
    args = ["--config", DEBUG_CONFIG, "--set", ONE_THREAD, "parallel.pp=2"]
    run_train("deepspeed", 2, [*args[:2], "--run-dir", str(tmp_path / "deepspeed"), *args[2:]])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HOME": str(tmp_path / "hf_home")}
    cmd = [*_accelerate(False, free_port()), TRAIN, *args[:2], "--run-dir", str(tmp_path / "accelerate"), *args[2:]]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    for launcher in ("deepspeed", "accelerate"):
        got = train_records(metrics(tmp_path / launcher))
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5), launcher
        assert [r["moe"][1]["tokens_per_expert"] for r in got] == [r["moe"][1]["tokens_per_expert"] for r in ref]
