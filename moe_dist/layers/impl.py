"""The one place that turns a kernel choice, "auto" | "torch" | "triton" (| "cpu"), into a function (DESIGN.md §4.6).

- "torch": the PyTorch path the layer names (SDPA, the chunked scan, index ops).
- "triton": the Triton kernel from `moe_dist.kernels`; a one-line ValueError naming the config key where it
  cannot run (triton not installed, or no CUDA device and no TRITON_INTERPRET=1), and again at call time for
  tensors on a device it cannot use.
- "cpu", for the keys that offer it (model.mamba.impl, model.moe.impl): the compiled CPU kernel (`CpuKernel`;
  the selective scan, the MoE permutation, the router's top-k and expert sort, the experts' gated SiLU and, on
  AMX CPUs, their grouped GEMM), with
  the same one-line errors where it cannot be built (no C++ compiler) or cannot take the tensors.
- A part of a layer that has no kernel of the chosen family (the gated SiLU under "triton") runs its PyTorch
  path.
- "auto": the Triton kernel for CUDA tensors it supports, the CPU kernel (if the layer has one and it builds)
  for CPU tensors it supports, the PyTorch path for everything else. On a machine without CUDA (or without
  triton) and without a CPU kernel that is the PyTorch function itself, so CPU runs never import triton.

Triton kernel modules are imported here, lazily, and nowhere else in the layers: Triton reads TRITON_INTERPRET
when a kernel is decorated, i.e. when its module is first imported. Each pairs its public function `name` with
`name_unsupported(...)` (same arguments, returns why not or None), which "auto" uses to fall back.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch


IMPLS = ("auto", "torch", "triton")
IMPLS_WITH_CPU = IMPLS + ("cpu",)  # for the keys whose layers have compiled CPU kernels


@dataclass(frozen=True)
class CpuKernel:
    """A layer's compiled CPU kernel: `fn` has the PyTorch path's signature; `unsupported(*args, **kwargs)` says
    why it cannot take a call's arguments (or None); `unavailable()` why it cannot be built here (or None; the first
    call builds it)."""

    fn: Callable
    unsupported: Callable[..., Optional[str]]
    unavailable: Callable[[], Optional[str]]


def triton_interpreting() -> bool:
    """TRITON_INTERPRET as Triton parses it: Triton kernels then run on CPU tensors, in numpy."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")


def _why_no_triton() -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if not triton_interpreting() and not torch.cuda.is_available():
        return "no CUDA device (TRITON_INTERPRET=1 runs the kernels in Triton's CPU interpreter, slowly)"
    return None


def _load(kernel: str) -> tuple[Callable, Callable]:
    """"module.function" under moe_dist.kernels → (the function, its `function_unsupported` check)."""
    module_name, fn_name = kernel.split(".")
    module = importlib.import_module(f"moe_dist.kernels.{module_name}")
    return getattr(module, fn_name), getattr(module, f"{fn_name}_unsupported")


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    return next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))


def _cpu_only(cpu: CpuKernel, key: str, what: str) -> Callable:
    why_not = cpu.unavailable()
    if why_not is not None:
        raise ValueError(f"{key}='cpu': the compiled CPU {what} is not available here: {why_not}")

    @functools.wraps(cpu.fn)
    def cpu_only(*args, **kwargs):
        reason = cpu.unsupported(*args, **kwargs)
        if reason is not None:
            raise ValueError(f"{key}='cpu': {reason}")
        return cpu.fn(*args, **kwargs)

    return cpu_only


def resolve(impl: str, key: str, what: str, torch_fn: Callable, kernel: Optional[str],
            cpu: Optional[CpuKernel] = None, choices: tuple = IMPLS) -> Callable:
    """The function for config value `impl` of config key `key`, one of `choices`.

    `what` names the kernel in messages ("selective scan"); `torch_fn` is the PyTorch path; `kernel` is
    "module.function" in moe_dist.kernels, with the same signature as `torch_fn`, or None where this part has no
    Triton kernel; `cpu` its compiled CPU kernel, if it has one. The device of a call is the device of its first
    tensor argument.
    """
    if impl not in choices:
        quoted = [repr(c) for c in choices]
        raise ValueError(f"{key}: expected {', '.join(quoted[:-1])} or {quoted[-1]}, got {impl!r}")
    if impl == "torch" or (impl == "cpu" and cpu is None) or (impl == "triton" and kernel is None):
        return torch_fn
    if impl == "cpu":
        return _cpu_only(cpu, key, what)
    why_not = _why_no_triton()
    if impl == "triton":
        if why_not is not None:
            raise ValueError(f"{key}='triton': the Triton {what} is not available here: {why_not}")
        triton_fn, _ = _load(kernel)

        @functools.wraps(triton_fn)
        def triton_only(*args, **kwargs):
            device = _first_tensor(args, kwargs).device
            if device.type != "cuda" and not (device.type == "cpu" and triton_interpreting()):
                raise ValueError(f"{key}='triton': the Triton {what} got {device} tensors; it runs on CUDA tensors "
                                 "(or on CPU under TRITON_INTERPRET=1)")
            return triton_fn(*args, **kwargs)

        return triton_only
    if cpu is not None and cpu.unavailable() is not None:
        warnings.warn(f"{key}='auto': the compiled CPU {what} is not available ({cpu.unavailable()}); "
                      "CPU tensors take the PyTorch path")
        cpu = None
    triton_fn = triton_unsupported = None
    if kernel is not None and why_not is None and torch.cuda.is_available():  # else no tensor can take Triton
        triton_fn, triton_unsupported = _load(kernel)
    if triton_fn is None and cpu is None:
        return torch_fn

    @functools.wraps(torch_fn)
    def auto(*args, **kwargs):
        device = _first_tensor(args, kwargs).device
        if triton_fn is not None and device.type == "cuda" and triton_unsupported(*args, **kwargs) is None:
            return triton_fn(*args, **kwargs)
        if cpu is not None and device.type == "cpu" and cpu.unsupported(*args, **kwargs) is None:
            return cpu.fn(*args, **kwargs)
        return torch_fn(*args, **kwargs)

    return auto
