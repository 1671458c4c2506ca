"""The one place that turns a kernel choice, "auto" | "torch" | "triton", into a function (DESIGN.md §4.6).

- "torch": the PyTorch path the layer names (SDPA, the chunked scan, index ops).
- "triton": the Triton kernel from `moe_dist.kernels`; a one-line ValueError naming the config key where it
  cannot run (triton not installed, or no CUDA device and no TRITON_INTERPRET=1), and again at call time for
  tensors on a device it cannot use.
- "auto": the Triton kernel for CUDA tensors it supports, the PyTorch path for everything else. On a machine
  without CUDA (or without triton) that is the PyTorch function itself, so CPU runs never import triton.

Kernel modules are imported here, lazily, and nowhere else in the layers: Triton reads TRITON_INTERPRET when
a kernel is decorated, i.e. when its module is first imported. Each kernel module pairs its public function
`name` with `name_unsupported(...)` (same arguments, returns why not or None), which "auto" uses to fall back.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from typing import Callable, Optional

import torch


IMPLS = ("auto", "torch", "triton")


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


def resolve(impl: str, key: str, what: str, torch_fn: Callable, kernel: str) -> Callable:
    """The function for config value `impl` of config key `key`.

    `what` names the kernel in messages ("selective scan"); `torch_fn` is the PyTorch path; `kernel` is
    "module.function" in moe_dist.kernels, with the same signature as `torch_fn`. The device of a call is the
    device of its first tensor argument.
    """
    if impl not in IMPLS:
        raise ValueError(f"{key}: expected 'auto', 'torch' or 'triton', got {impl!r}")
    if impl == "torch":
        return torch_fn
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
    if why_not is not None or not torch.cuda.is_available():
        return torch_fn  # "auto" without CUDA: no tensor can ever take the Triton path
    triton_fn, unsupported = _load(kernel)

    @functools.wraps(triton_fn)
    def auto(*args, **kwargs):
        if _first_tensor(args, kwargs).is_cuda and unsupported(*args, **kwargs) is None:
            return triton_fn(*args, **kwargs)
        return torch_fn(*args, **kwargs)

    return auto
