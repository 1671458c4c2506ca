"""launch/slurm/slurm_env.py without a cluster: Slurm's variables as a job sees them, mapped to the launchers' flags
and checked against the layout. The same under a real Slurm: tests/launch/test_slurm.py (root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import DEBUG_CONFIG, load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "slurm" / "slurm_env.py"
# What sbatch --nodes 2 --ntasks-per-node 1 --gpus-per-node 8 sets in the batch shell (node 0).
JOB = {
    "SLURM_JOB_ID": "4711",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_GPUS_PER_NODE": "8",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_JOB_NODELIST": "gpu[01-02]",
}


@pytest.fixture(scope="module")
def slurm_env():
    return load_script(SCRIPT)


def test_tasks_per_node_reads_slurms_compressed_form(slurm_env):
    assert slurm_env.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm_env.tasks_per_node("1") == [1]


@pytest.mark.parametrize(
    "change, expected",
    [
        ({}, (2, 8)),
        ({"NPROC_PER_NODE": "3"}, (2, 3)),  # CPU processes, or fewer than the GPUs
        ({"SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "h100:4"}, (2, 4)),
        ({"SLURM_NNODES": "4", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "1(x4)"}, (4, 8)),
    ],
)
def test_allocation(slurm_env, change, expected):
    assert slurm_env.allocation({**JOB, **change}) == expected


@pytest.mark.parametrize(
    "change, names",
    [
        ({"SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)"}, "4 tasks on 2 nodes (SLURM_TASKS_PER_NODE=2(x2))"),
        ({"SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "2,1"}, "3 tasks on 2 nodes"),
        ({"SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "0"}, "the allocation has no GPUs (SLURM_GPUS_PER_NODE=0)"),
        ({"SLURM_JOB_ID": None}, "not inside a Slurm allocation"),
    ],
)
def test_an_allocation_these_scripts_cannot_run_is_named(slurm_env, change, names):
    env = {k: v for k, v in {**JOB, **change}.items() if v is not None}
    with pytest.raises(slurm_env.AllocationError) as e:
        slurm_env.allocation(env)
    assert names in str(e.value)


def test_a_world_the_layout_does_not_take_is_one_line_and_exit_2():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(JOB, SLURM_GPUS_ON_NODE="1", SLURM_GPUS_PER_NODE="1")  # 2 nodes x 1 GPU: world 2
    cmd = [sys.executable, str(SCRIPT), "--config", DEBUG_CONFIG, "--set", "parallel.ep=4"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "error: slurm allocation: 2 nodes x 1 processes = world size 2 does not fit the job: parallel.ep: 4 must "
        "divide the data-parallel degree 2 (world 2 / tp 1; parallel.etp=1 lets it divide dp × tp)"
    ], proc.stderr
