"""The gated SiLU's compiled CPU kernel (`gated_silu_cpu.cpp`): load, autograd Function, public function.

Same semantics as `moe_dist.layers.mlp.gated_silu` (the PyTorch path): silu(a) · b over the halves of [a | b].
The kernel is built on first use and cached (`cpu_build`); `unavailable()` says why it cannot be built here.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from moe_dist.kernels import cpu_build

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = (("gated_silu_fwd", (_I64, _I64, ctypes.c_int, _PTR, _PTR, ctypes.c_int)),
               ("gated_silu_bwd", (_I64, _I64, ctypes.c_int, _PTR, _PTR, _PTR, ctypes.c_int)))
DTYPES = (torch.float32, torch.bfloat16)


def _library() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    return cpu_build.library("gated_silu_cpu", _SIGNATURES)


def unavailable() -> Optional[str]:
    """Why the kernel cannot run in this process (no compiler, a failed build), or None; builds it on first call."""
    return _library()[1]


class _GatedSiLU(torch.autograd.Function):
    """Saves only the input: the backward recomputes σ(a), cheaper than reading a saved silu(a)."""

    @staticmethod
    def forward(ctx, ab: torch.Tensor) -> torch.Tensor:
        lib, why = _library()
        assert lib is not None, why
        half = ab.shape[-1] // 2
        h = ab.new_empty(*ab.shape[:-1], half)
        lib.gated_silu_fwd(ab.numel() // max(1, 2 * half), half, ab.dtype == torch.bfloat16, ab.data_ptr(),
                           h.data_ptr(), torch.get_num_threads())
        ctx.save_for_backward(ab)
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, dh: torch.Tensor) -> torch.Tensor:
        (ab,) = ctx.saved_tensors
        return gated_silu_backward(ab, dh)


def gated_silu_backward(ab: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """d[a | b] of h = silu(a) · b from the forward's input ab (contiguous, as it was saved) and dh: the backward
    kernel alone, for an autograd Function that computed h itself (the AMX GEMM's gated mode)."""
    lib, why = _library()
    assert lib is not None, why
    half = ab.shape[-1] // 2
    dh = dh.to(ab.dtype).contiguous()
    dab = torch.empty_like(ab)
    lib.gated_silu_bwd(ab.numel() // max(1, 2 * half), half, ab.dtype == torch.bfloat16, ab.data_ptr(),
                       dh.data_ptr(), dab.data_ptr(), torch.get_num_threads())
    return dab


def gated_silu_unsupported(ab: torch.Tensor) -> Optional[str]:
    """Why `gated_silu` cannot take this input, or None."""
    if ab.device.type != "cpu":
        return f"the compiled gated SiLU takes CPU tensors, got {ab.device}"
    if ab.dtype not in DTYPES:
        return f"the compiled gated SiLU takes fp32 or bf16, got {ab.dtype}"
    if ab.shape[-1] % 2:
        return f"gated SiLU needs an even last dim [gate | up], got {ab.shape[-1]}"
    return None


def gated_silu(ab: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of a fused (..., 2F) projection [gate | up] → (..., F), in ab's dtype (fp32 or bf16, CPU);
    math in fp32, one rounding per output."""
    reason = gated_silu_unsupported(ab) or unavailable()
    if reason is not None:
        raise ValueError(f"gated_silu: {reason}")
    return _GatedSiLU.apply(ab.contiguous())
