"""What start-up prints (rank 0, once, before the first step): one line of versions, one line of the kernels the
model chose for its device (`Decoder.implementations`), and a warning line for each slow path this run will take
on CUDA: each layer kind's own (`LayerKind.slow_paths`: attention with a mask no fast kernel takes, experts whose
GEMMs torch's grouped GEMM cannot take), and every kernel "auto" could not take. Tested in
tests/train/test_startup_report.py."""

from __future__ import annotations

import platform
from importlib import metadata

import torch
from torch import nn

from moe_dist.config import JobConfig
from moe_dist.layers.kernel_choice import Kernel
from moe_dist.layers.registry import kind_of
from moe_dist.models.decoder import held_blocks


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
