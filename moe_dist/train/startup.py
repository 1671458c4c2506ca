"""What start-up prints (rank 0, once, before the first step): one line of versions, one line of the kernels the
model chose for its device (`Decoder.implementations`), and a warning line for each slow path this run will take
on CUDA: each layer kind's own (`LayerKind.slow_paths`: attention with a mask no fast kernel takes, experts whose
GEMMs torch's grouped GEMM cannot take), and every kernel "auto" could not take. Then what the run is (`run_line`:
directory, parameters, layout, steps, evaluation and checkpoint schedule) and how many CPU threads it took and why
(`choose_threads`); at the end one `done:` line (`summary_line`). Tested in tests/train/test_startup_report.py and
tests/train/test_console.py."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path

import torch
from torch import nn

from moe_dist.config import JobConfig
from moe_dist.layers.kernel_choice import Kernel
from moe_dist.layers.registry import kind_of
from moe_dist.models.decoder import held_blocks, param_counts


def _version(package: str) -> str:
    try:  # the installed distribution's version, without importing it (CPU runs never import triton)
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions_line(device: torch.device) -> str:
    """`versions: python 3.12.3, torch 2.11.0, triton 3.6.0, deepspeed 0.19.8, CUDA 13.0 (NVIDIA H200)` (or `cpu`)."""
    if device.type == "cuda":
        where = f"CUDA {torch.version.cuda} ({torch.cuda.get_device_name(device)})"
    else:
        where = device.type
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    parts += [f"{name} {_version(name)}" for name in ("triton", "deepspeed")]
    return "versions: " + ", ".join([*parts, where])


def kernels_line(implementations: dict[str, str]) -> str:
    """`kernels: attention sdpa, attention_documents triton, permutation triton, experts grouped_mm, scan triton`
    (in the order the layers first name them)."""
    return "kernels: " + ", ".join(f"{op} {name}" for op, name in implementations.items())


def slow_paths(cfg: JobConfig, model: nn.Module, device: torch.device) -> list[str]:
    """One warning line per slow path the run `cfg` takes with `model` (built for `device`); none off CUDA."""
    if device.type != "cuda":
        return []
    blocks = held_blocks(model)
    reasons = [
        r for b in blocks for s in (b.mixer, b.ffn) if s is not None for r in kind_of(s).slow_paths(cfg, s, device)
    ]
    lines = [f"warning: slow path: {w}" for w in dict.fromkeys(reasons)]
    # Kernels "auto" could not take (Kernel.slow: e.g. fla-core not installed for the Mamba-2 / GDN layers).
    kernels = dict.fromkeys(k.slow for m in model.modules() for k in vars(m).values() if isinstance(k, Kernel))
    lines += [f"warning: slow path: {w}" for w in kernels if w]
    return lines


def startup_report(cfg: JobConfig, model: nn.Module, device: torch.device) -> list[str]:
    """The lines start-up prints: versions, kernels, then the slow-path warnings."""
    return [versions_line(device), kernels_line(model.implementations()), *slow_paths(cfg, model, device)]


def _cores() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or taskset's limit, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def choose_threads(requested: int, local_processes: int) -> tuple[int, str]:
    """(torch intra-op threads per process, why). `requested` > 0 is taken as it is. 0 takes this process's share of
    the cores less one core left to everything else (the OS, the data, other users), and fewer when the 1-minute
    load average says other work keeps more cores busy (our own processes' start-up counted out); at least one.
    Two threads that wait for each other's time slices collapse when other work holds the cores: on a shared
    2-core machine one thread ran the default job 4-16x faster than two (docs/benchmarks.md, "CPU threads"). A
    load that rises after start-up is not seen, hence the core always left free."""
    if requested > 0:
        return requested, f"train.threads={requested}"
    cores = _cores()
    share = max(1, (cores - 1) // local_processes)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    others = max(0.0, load - local_processes)  # our processes, starting up, are part of the load average
    free_share = max(1, int(cores - others + 0.5) // local_processes)
    n = min(share, free_share)
    why = f"train.threads=0: {cores} cores less 1 left to other work, / {local_processes} local process(es)"
    if n < share:
        why += f"; other work keeps about {min(others, cores):.1f} busy (load average {load:.1f})"
    return n, why + "; set train.threads to pin it"


def _steps_every(every: int, what: str) -> str:
    if not every:
        return f"{what} at the end"
    return f"{what} every {every} steps and at the end" if every > 1 else f"{what} every step"


def run_line(cfg: JobConfig, run_dir: Path, mesh, start: int) -> str:
    """`run: runs/x (fresh); 5.31M parameters, 2.16M active per token; world 1 = dp 1 x tp 1, ep 1, ZeRO 1;
    200 steps of 16 x 128 tokens; eval every 50 steps and at the end (8 batches); checkpoint every 100 steps ...`"""
    counts = param_counts(cfg.model)
    t, pa = cfg.train, cfg.parallel
    sizes = (("pp", mesh.pp), ("dp", mesh.dp), ("cp", mesh.cp), ("tp", mesh.tp))
    dims = [f"{name} {size}" for name, size in sizes if size > 1 or name in ("dp", "tp")]
    sp = " + SP" if pa.sequence_parallel and mesh.tp > 1 else ""
    where = "fresh" if start == 0 else f"resuming at step {start}"
    return (
        f"run: {run_dir} ({where}); {counts['params_total'] / 1e6:.2f}M parameters, "
        f"{counts['params_active'] / 1e6:.2f}M active per token; world {mesh.world_size} = {' x '.join(dims)}{sp}, "
        f"ep {mesh.ep}, ZeRO {cfg.deepspeed.zero_stage}, {t.dtype}; {t.steps} steps of {t.global_batch_size} x "
        f"{t.seq_len} tokens; {_steps_every(t.eval_every, 'eval')} ({t.eval_batches} batches); "
        f"{_steps_every(t.save_every, 'checkpoint')}"
    )


def summary_line(records: list[dict], last_checkpoint: Path | None, seconds: float) -> str:
    """`done: step 200, loss 2.7812, last eval loss 2.9021 (step 200), last checkpoint runs/x/checkpoints/step_200,
    wall time 41 min 3 s`."""
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    parts = [f"step {steps[-1]['step']}, loss {steps[-1]['loss']:.4f}" if steps else "no step run"]
    parts.append(f"last eval loss {evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})" if evals else "no eval")
    parts.append(f"last checkpoint {last_checkpoint}" if last_checkpoint else "no checkpoint")
    minutes, secs = divmod(round(seconds), 60)
    parts.append(f"wall time {minutes} min {secs} s" if minutes else f"wall time {seconds:.1f} s")
    return "done: " + ", ".join(parts)


def shm_op_note() -> str | None:
    """A line announcing DeepSpeed's one-time build of its CPU shared-memory communication op (1-3 minutes, silent
    otherwise) when this machine has no built copy yet; None when it has one or the run is on CUDA. The op is built
    by torch's extension loader into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions/py<version>_cpu/)."""
    name = "deepspeed_shm_comm"
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        root = os.path.join(cache, "torch_extensions", f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    built = Path(root, name, f"{name}.so")
    if built.is_file():
        return None
    return (
        f"note: building DeepSpeed's CPU shared-memory op once for this machine (1-3 minutes, quiet meanwhile; "
        f"cached in {built.parent})"
    )
