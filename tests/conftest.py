"""Shared test helpers: launching real training jobs (python, deepspeed, torchrun) and reading their outputs.

Multi-process runs are the suite's cost (each launch is seconds of imports and start-up per rank on a 2-core
machine), so runs that several modules compare against are made once per session (`debug_run`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from forklaunch import ForkServer
from support import DEBUG_CONFIG, ONE_THREAD, console_script, free_port, shm_buffers, torchrun

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "launch" / "train.py")


def _import_pypi_kernels() -> None:
    """`python -m pytest` puts the repository root first on sys.path, where our kernels/ folder (installed as
    moe_dist.kernels) shadows the PyPI package `kernels` that transformers imports when it is installed (a
    dependency of transformers since 5.2x): load the real one first, with the root off the path, so that every later
    `import kernels` finds it in sys.modules."""
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != REPO]
    try:
        import kernels  # noqa: F401
    except ImportError:
        pass  # not installed: transformers then does not import it either
    finally:
        sys.path[:] = saved


_import_pypi_kernels()


class Runner:
    """Runs launch/train.py under a real launcher and returns the completed process (timeout = test failure),
    with the rendezvous port it used as `master_port` (None for a single process). "fork" is the suite's own
    launcher for layout comparisons (tests/forklaunch.py: ranks forked from one process that imported everything
    once), given the server `forks`."""

    def __init__(self, timeout: float = 300.0, forks: ForkServer | None = None):
        self.timeout, self.forks = timeout, forks

    def command(self, launcher: str, nproc: int, args: list[str], port: int | None) -> list[str]:
        if launcher == "python":
            assert nproc == 1
            return [sys.executable, TRAIN, *args]
        if launcher == "deepspeed":
            return [console_script("deepspeed"), "--num_gpus", str(nproc), "--master_port", str(port), TRAIN, *args]
        if launcher == "torchrun":
            return [*torchrun(nproc, port), TRAIN, *args]
        raise ValueError(launcher)

    def __call__(self, launcher: str, nproc: int, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        port = None if launcher == "python" or (launcher == "fork" and nproc == 1) else free_port()
        if launcher == "fork":
            proc = self.forks.run(nproc, args, env, port, self.timeout)
        else:
            proc = subprocess.run(
                self.command(launcher, nproc, args, port),
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=self.timeout,
            )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{launcher} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            )
        proc.master_port = port
        return proc


@pytest.fixture(scope="session")
def forks(tmp_path_factory) -> ForkServer:
    """The session's fork server (tests/forklaunch.py), started on first use."""
    server = ForkServer(tmp_path_factory.mktemp("forklaunch"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def run_train(forks) -> Runner:
    return Runner(timeout=600, forks=forks)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="session")
def metrics():
    return read_metrics


class DebugRuns:
    """`debug_run(launcher)`: the run directory of configs/debug.json as it is (6 steps, eval and checkpoint every
    3; one thread per process) under "python" (1 process), "deepspeed" or "torchrun" (2 processes), trained on
    first use and shared by every test that compares against it (train/test_train_e2e.py, launch/test_launchers.py,
    train/test_bad_input.py). Tests copy a run directory before they change anything in it. `shm[launcher]`: the
    DeepSpeed shm buffers the run left behind, looked for right after it ended; `stderr[launcher]`: what it
    printed there (start-up lines, train/test_startup_report.py)."""

    def __init__(self, root: Path, run: Runner):
        self.root, self.run = root, run
        self.dirs: dict[str, Path] = {}
        self.shm: dict[str, list[str]] = {}
        self.stderr: dict[str, str] = {}

    def __call__(self, launcher: str) -> Path:
        if launcher not in self.dirs:
            run_dir = self.root / launcher
            proc = self.run(
                launcher,
                1 if launcher == "python" else 2,
                ["--config", DEBUG_CONFIG, "--run-dir", str(run_dir), "--set", ONE_THREAD],
            )
            if proc.master_port is not None:
                self.shm[launcher] = shm_buffers(proc.master_port)
            self.stderr[launcher] = proc.stderr
            self.dirs[launcher] = run_dir
        return self.dirs[launcher]


@pytest.fixture(scope="session")
def debug_run(tmp_path_factory, run_train) -> DebugRuns:
    return DebugRuns(tmp_path_factory.mktemp("debug_runs"), run_train)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: a single thread, as thread-pool hand-offs cost more than these ops (and much more on a
    loaded 2-core machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
