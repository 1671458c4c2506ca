"""The one place that turns a kernel choice, "auto" | "torch" | "triton", into a function (DESIGN.md §4.6).

Every operation has at most two implementations: the PyTorch path, which the layer names (the readable spec
and the CPU path), and one GPU kernel, ours in Triton from `moe_dist.kernels`. The choice is made once, when a
layer is built for the device it will run on, never per call:

- "torch": the PyTorch path, on any device.
- "triton": the Triton kernel; a one-line ValueError naming the config key where it cannot run (triton not
  installed, or the layer is built for a device other than CUDA without TRITON_INTERPRET=1).
- "auto": on CUDA, what `AUTO_ON_CUDA` says for the key (the PyTorch path where triton is not installed); on
  every other device, the PyTorch path (so CPU runs never import triton).

A kernel checks its own preconditions (shapes, dtypes, devices) at its entry and raises a one-line ValueError
naming what it got: "auto" never falls back behind the user's back; `impl="torch"` is the way around a case a
kernel does not take. Triton kernel modules are imported here, lazily, and nowhere else in the layers: Triton
reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is first imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

IMPLS = ("auto", "torch", "triton")

# What "auto" takes on CUDA, per config key. Attention: torch's SDPA (its flash / cuDNN backends); our Triton
# flash attention measured 0.52-0.65x SDPA's speed on an H200 and stays available as "triton".
AUTO_ON_CUDA = {
    "model.attention.impl": "torch",
    "model.mamba.impl": "triton",
    "model.moe.impl": "triton",
    "model.gdn.impl": "torch",  # no GPU kernel for the gated delta rule yet: the chunked PyTorch path
}


@dataclass(frozen=True)
class Kernel:
    """A resolved implementation: calling it runs `fn`; `name` says which one it is ("torch" or "triton")."""

    name: str
    fn: Callable

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def triton_interpreting() -> bool:
    """TRITON_INTERPRET as Triton parses it: Triton kernels then run on CPU tensors, in numpy."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")


def _why_no_triton(device: torch.device) -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if device.type == "cuda" or (device.type == "cpu" and triton_interpreting()):
        return None
    if device.type == "cpu":
        return (
            "the model is built for the CPU (TRITON_INTERPRET=1 runs the kernels in Triton's CPU interpreter, slowly)"
        )
    return f"the model is built for {device}; the Triton kernels run on CUDA"


def resolve(impl: str, key: str, device: torch.device | str, torch_fn: Callable, kernel: str, what: str) -> Kernel:
    """The implementation of config value `impl` (of config key `key`) for a layer built for `device`.

    `torch_fn` is the PyTorch path; `kernel` is "module.function" in moe_dist.kernels with the same signature;
    `what` names it in messages ("selective scan").
    """
    if impl not in IMPLS:
        quoted = [repr(c) for c in IMPLS]
        raise ValueError(f"{key}: expected {', '.join(quoted[:-1])} or {quoted[-1]}, got {impl!r}")
    device = torch.device(device)
    if impl == "auto":  # a CUDA machine without the triton package gets the PyTorch paths
        impl = AUTO_ON_CUDA[key] if device.type == "cuda" and _why_no_triton(device) is None else "torch"
    if impl == "torch":
        return Kernel("torch", torch_fn)
    why_not = _why_no_triton(device)
    if why_not is not None:
        raise ValueError(f"{key}='triton': the Triton {what} is not available: {why_not}")
    module_name, fn_name = kernel.split(".")
    return Kernel("triton", getattr(importlib.import_module(f"moe_dist.kernels.{module_name}"), fn_name))
