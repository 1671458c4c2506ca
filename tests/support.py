"""Plain helpers the test modules import (`pythonpath = ["tests"]` in pyproject.toml); fixtures live in conftest."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A free TCP port on localhost for a launcher's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def console_script(name: str) -> str:
    """The launcher (deepspeed, torchrun, accelerate) installed beside this Python, else the one on PATH."""
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else shutil.which(name)


def torchrun(nproc: int, port: int | None = None) -> list[str]:
    """The start of a `torchrun` command line for `nproc` local processes, on `port` (a free one by default)."""
    return [console_script("torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(port or free_port())]


# A gloo rank very rarely aborts with this libstdc++ message and no Python frame on its main thread (faulthandler's
# dump), i.e. in C++ teardown after the worker's Python has run: seen about once in 100 two-rank runs on a loaded
# 2-core machine, with no traceback of ours. Such a run is retried once on a fresh port; a second failure fails.
TEARDOWN_ABORT = "terminate called without an active exception"


def worker_env() -> dict[str, str]:
    """The environment of a spawned test worker: tests/ on its PYTHONPATH (the workers import `workers`, as test
    modules do under pytest's `pythonpath`), and faulthandler on, so an abort prints every thread's Python stack
    into the failure."""
    tests = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1"}


def run_torchrun_worker(worker: Path, out: Path, nproc: int = 2, timeout: float = 240, forks=None) -> None:
    """`torchrun --nproc_per_node N WORKER OUT` on its own free port (`worker_env`), or the same world forked from
    the session's server `forks` (tests/forklaunch.py); a failure or a hang fails the test."""
    env = worker_env()
    for _ in range(2):
        if forks is None:
            proc = subprocess.run(
                [*torchrun(nproc), str(worker), str(out)], capture_output=True, text=True, timeout=timeout, env=env
            )
        else:
            proc = forks.run(nproc, [str(out)], env, free_port(), timeout, script=worker, cwd=Path.cwd())
        if proc.returncode == 0 or TEARDOWN_ABORT not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-4000:]


def worker_results(worker: Path, out: Path, nproc: int = 2, forks=None) -> list[dict]:
    """`run_torchrun_worker` with the folder `out` (forked from `forks` where given), where rank r of the worker
    writes rank{r}.json: every rank's result, in rank order."""
    run_torchrun_worker(worker, out, nproc, forks=forks)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def shm_buffers(port: int) -> list[str]:
    """DeepSpeed shm all-reduce buffers of the job that used this rendezvous port, still in /dev/shm."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def train_records(records: list[dict]) -> list[dict]:
    """The per-step training records of a metrics.jsonl (evaluation-only records, e.g. step 0, left out)."""
    return [r for r in records if "loss" in r]


def load_script(path: Path):
    """A script of launch/ imported as a module, with its own folder on sys.path while it loads, as when it runs as
    `python launch/x.py` (its sibling modules resolve the same way). benchmarks/ is a package: import it."""
    import importlib.util

    name = f"script_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


# fla-core installed apart (`pip install --no-deps --target .fla fla-core==0.6.0`, the README's test command): only
# the fresh process that runs kernels/test_fla_ops.py gets it on its path. Installed into the environment,
# transformers' Qwen3-Next would run fla's Triton kernels on CPU tensors in every other test that builds one.
FLA_SITE = Path(__file__).resolve().parents[1] / ".fla"
DEBUG_CONFIG = "configs/debug.json"  # the small job most end-to-end tests train (6 steps, 2 MoE layers)
# One torch thread per process: at these sizes a second thread only adds hand-offs (a single process on 2 busy
# cores ran 6 debug steps 5x slower with the default, cores / local processes = 2). Multi-process runs on 2
# cores get 1 anyway, so the layouts compared with one process keep the same arithmetic.
ONE_THREAD = "train.threads=1"

# The parallel end-to-end runs (tests/parallel/test_ep_e2e.py, test_tp_e2e.py): every layout trains these steps
# and is compared step by step with one process of the same mode, which the two modules share.
E2E_CONFIG = DEBUG_CONFIG  # attention, Mamba, dense and MoE layers; 4 experts, top-2
E2E_STEPS, E2E_SAVE = 6, 3  # resume tests restart from the step-3 checkpoint: past warmup, Adam moments built up
E2E_BASE = [
    f"train.steps={E2E_STEPS}",
    f"train.save_every={E2E_SAVE}",
    "train.eval_every=0",
    "train.eval_batches=4",
    ONE_THREAD,
    "train.peak_tflops=0.1",  # no start-up matmul (half a second of every rank) for an MFU these tests never read
]


def e2e_args(run_dir, *overrides: str, flags: tuple[str, ...] = ()) -> list[str]:
    """launch/train.py's arguments of an end-to-end run: E2E_CONFIG in `run_dir` with E2E_BASE, then `overrides`
    (later keys win); `flags` (e.g. --resume) go before --set."""
    return ["--config", E2E_CONFIG, "--run-dir", str(run_dir), *flags, "--set", *E2E_BASE, *overrides]


# A layer list (`model.layers`) replaces debug.json's patterns; the Mamba-2 and Gated DeltaNet sizes of the hybrid
# tests (heads of 16 channels, chunks of 16 positions).
LAYER_LIST = ["model.mixer_pattern=A", "model.ffn_pattern=E"]
SMALL_RECURRENT = [
    "model.mamba2.head_dim=16",
    "model.mamba2.d_state=16",
    "model.mamba2.chunk_size=16",
    "model.gdn.head_k_dim=16",
    "model.gdn.head_v_dim=16",
    "model.gdn.chunk_size=16",
]

E2E_MODES = {
    "capacity": [],
    "kv4": ["model.attention.n_kv_heads=4"],  # capacity, with kv heads that tp = 4 divides
    "dropless": ["model.moe.capacity_factor=null"],
    # today's MoE recipes at once: sigmoid scores, loss-free balancing with the aux loss over the global batch
    # (this step's f, from the routing pre-pass), one group per EP rank, a gated shared expert (test_ep_e2e.py runs
    # it at dp = ep = 2, test_tp_e2e.py at tp = 2; both compare the aux loss of every step too)
    "recipes": [
        "model.moe.top_k=1",
        "model.moe.score=sigmoid",
        "model.moe.route_scale=2.0",
        "model.moe.bias_update_rate=0.01",
        "model.moe.aux_loss_scope=global_batch",
        "model.moe.n_groups=2",
        "model.moe.group_by=ep_rank",
        "model.moe.n_shared_experts=1",
        "model.moe.shared_gate=true",
    ],
    # a hybrid of every new mixer kind (layer list), capacity MoE: Mamba-2 with one B/C group (8 heads of 16
    # channels: under tp = 2 the group spans both ranks) and Gated DeltaNet (2 key heads of 4 value heads)
    "hybrid": [*LAYER_LIST, 'model.layers=["attention+mlp","mamba2+moe","gdn+moe","mamba2+mlp"]', *SMALL_RECURRENT],
}

# support.E2E_MODES["hybrid"] with Mamba-1 too, and two Mamba-2 groups (CP × TP needs n_groups >= tp): the context
# parallelism tests' model (tests/parallel/test_cp_e2e.py, tests/benchmarks/test_bench_common.py)
CP_HYBRID = [
    *LAYER_LIST,
    'model.layers=["attention+moe","mamba1+mlp","mamba2+moe","gdn+mlp"]',
    *SMALL_RECURRENT,
    "model.mamba2.n_groups=2",
]
