"""launch/train.py runs unchanged under every launcher — deepspeed, torchrun, accelerate launch (multi-process,
and through its DeepSpeed plugin) — and each run starts from the same first-step loss."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from support import console_script, free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "launch" / "train.py")
ARGS = ["--config", "configs/debug.json", "--set", "train.steps=2", "train.eval_every=0", "train.save_every=0"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _command(launcher: str, port: int) -> list[str]:
    accelerate = [console_script("accelerate"), "launch", "--num_processes", "2", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)]
    return {
        "deepspeed": [console_script("deepspeed"), "--num_gpus", "2", "--master_port", str(port)],
        "torchrun": [console_script("torchrun"), "--nproc_per_node", "2", "--master_port", str(port)],
        # --multi_gpu is accelerate's torch.distributed launcher; on a CPU machine it starts CPU processes.
        "accelerate": [*accelerate, "--multi_gpu"],
        # The DeepSpeed plugin's settings go to the processes as ACCELERATE_DEEPSPEED_* variables; train.py
        # builds its engine from the job config, so the two are kept equal (zero stage 1 in both).
        "accelerate-deepspeed": [*accelerate, "--use_deepspeed", "--zero_stage", "1"],
    }[launcher]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, metrics):
    root = tmp_path_factory.mktemp("launchers")
    # No accelerate config from the user's home may change what `accelerate launch` does.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HOME": str(root / "hf_home")}
    out = {}
    for launcher in ("deepspeed", "torchrun", "accelerate", "accelerate-deepspeed"):
        run_dir = root / launcher
        port = free_port()
        cmd = [*_command(launcher, port), TRAIN, *ARGS, "--run-dir", str(run_dir)]
        tic = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        print(f"{launcher}: {time.perf_counter() - tic:.1f} s end to end")
        assert proc.returncode == 0, f"{launcher} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        out[launcher] = [r for r in metrics(run_dir) if "loss" in r]
        out[f"{launcher} shm"] = sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    return out


def test_no_shared_memory_buffer_outlives_a_run(runs):
    """DeepSpeed's CPU shm all-reduce leaves a 69 MB /dev/shm buffer per rank behind (the deepspeed launcher's runs
    make them); init_distributed removes their names once every rank has mapped them."""
    leaked = {k: v for k, v in runs.items() if k.endswith(" shm") and v}
    assert not leaked


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate", "accelerate-deepspeed"])
def test_launcher_matches_deepspeed(runs, launcher):
    ref, got = runs["deepspeed"], runs[launcher]
    assert [r["step"] for r in got] == [1, 2]
    assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-6)  # same init, data and layout
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-6)
    assert got[0]["moe"][0]["tokens_per_expert"] == ref[0]["moe"][0]["tokens_per_expert"]
