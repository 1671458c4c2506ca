"""Shared test helpers: launching real training jobs (python, deepspeed, torchrun) and reading their outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import console_script, free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "launch" / "train.py")


class Runner:
    """Runs launch/train.py under a real launcher and returns the completed process (timeout = test failure)."""

    def __init__(self, timeout: float = 300.0):
        self.timeout = timeout

    def command(self, launcher: str, nproc: int, args: list[str]) -> list[str]:
        if launcher == "python":
            assert nproc == 1
            return [sys.executable, TRAIN, *args]
        if launcher == "deepspeed":
            return [console_script("deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), TRAIN, *args]
        if launcher == "torchrun":
            return [console_script("torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
                    TRAIN, *args]
        raise ValueError(launcher)

    def __call__(self, launcher: str, nproc: int, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(self.command(launcher, nproc, args), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=self.timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{launcher} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return proc


@pytest.fixture(scope="session")
def run_train() -> Runner:
    return Runner(timeout=600)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="session")
def metrics():
    return read_metrics


@pytest.fixture
def port() -> int:
    """A free TCP port on localhost for a launcher's rendezvous."""
    return free_port()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: a single thread, as thread-pool hand-offs cost more than these ops (and much more on a
    loaded 2-core machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
