"""The one place that turns a kernel choice, "auto" | "torch" | "triton", into a function.

Invariants: the choice is made once, when a layer is built for its device, never per call; "auto" is the PyTorch
path on every device but CUDA (`AUTO_ON_CUDA` there) and never falls back behind the user's back: a kernel that
cannot take its inputs raises a one-line ValueError; a Triton kernel module is imported only when "triton" is
chosen and can run (Triton reads TRITON_INTERPRET at import), so CPU runs never import triton. Rules in full:
docs/kernels.md, section "Choosing an implementation"; tested in tests/kernels/test_kernel_choice.py.
"""

from __future__ import annotations

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
    "model.mamba2.impl": "torch",  # no GPU kernel for Mamba-2's SSD yet
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


def resolve(
    impl: str,
    key: str,
    device: torch.device | str,
    torch_fn: Callable,
    kernel: Optional[Callable[[], Callable]],
    what: str,
) -> Kernel:
    """The implementation of config value `impl` (of config key `key`) for a layer built for `device`.

    `torch_fn` is the PyTorch path; `kernel` loads the Triton function with the same signature (a zero-argument
    function that imports it from moe_dist.kernels, called only when it is chosen), or is None while the operation
    has no GPU kernel ("triton" is then refused); `what` names it in messages ("selective scan").
    """
    if impl not in IMPLS:
        quoted = [repr(c) for c in IMPLS]
        raise ValueError(f"{key}: expected {', '.join(quoted[:-1])} or {quoted[-1]}, got {impl!r}")
    device = torch.device(device)
    if impl == "auto":  # a CUDA machine without the triton package gets the PyTorch paths
        impl = AUTO_ON_CUDA[key] if device.type == "cuda" and _why_no_triton(device) is None else "torch"
    if impl == "torch":
        return Kernel("torch", torch_fn)
    if kernel is None:
        raise ValueError(f"{key}='triton': there is no Triton {what} kernel yet; use 'torch' or 'auto'")
    why_not = _why_no_triton(device)
    if why_not is not None:
        raise ValueError(f"{key}='triton': the Triton {what} is not available: {why_not}")
    return Kernel("triton", kernel())
