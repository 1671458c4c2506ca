"""The selective scan's fused CPU kernel (`selective_scan_cpu.cpp`): load, autograd Function, public function.

The kernel is built on first use and cached (`cpu_build`). `selective_scan_time_major` is what
`moe_dist.layers.scan.selective_scan(..., native=True)` calls in place of the chunked PyTorch scan; `unavailable()`
says why it cannot be built here (None when it can).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from moe_dist.kernels import cpu_build

LANES = 16  # the kernel's channels per vector (W in cpu_vec.h): its dB/dC accumulators are lane-wise
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = (("scan_fwd", (_I64,) * 4 + (_PTR,) * 8 + (ctypes.c_int,)),
               ("scan_bwd", (_I64,) * 4 + (_PTR,) * 15 + (ctypes.c_int,)))


def _library() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    return cpu_build.library("selective_scan_cpu", _SIGNATURES)


def unavailable() -> Optional[str]:
    """Why the kernel cannot run in this process (no compiler, a failed build), or None; builds it on first call."""
    return _library()[1]


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class _NativeScan(torch.autograd.Function):
    """y = (scan(u, Δ, A, B, C) + D u) · silu(z) on time-major fp32 inputs; the backward runs the kernel's adjoint."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z):
        lib, why = _library()
        assert lib is not None, why
        (batch, length, dim), state = u.shape, A.shape[1]
        A_t = A.t().contiguous()  # (N, D): the kernel loads A's row n for 16 channels at once
        y = torch.empty_like(u)
        lib.scan_fwd(batch, length, dim, state, *map(_ptr, (u, delta, A_t, B, C, D, z, y)), torch.get_num_threads())
        ctx.save_for_backward(u, delta, A_t, B, C, D, z)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        lib, _ = _library()
        u, delta, A_t, B, C, D, z = ctx.saved_tensors
        (batch, length, dim), state, threads = u.shape, A_t.shape[0], torch.get_num_threads()
        dy = dy.contiguous()
        d_u, d_delta = torch.empty_like(u), torch.empty_like(delta)
        dz = None if z is None else torch.empty_like(z)
        dA_part, dD_part = u.new_empty(batch, state, dim), u.new_empty(batch, dim)
        dB_part, dC_part = (u.new_zeros(threads, batch, length, state, LANES) for _ in range(2))
        assert dB_part.data_ptr() % 64 == 0 and dC_part.data_ptr() % 64 == 0  # the kernel adds whole vectors
        lib.scan_bwd(batch, length, dim, state, *map(_ptr, (u, delta, A_t, B, C, D, z, dy, d_u, d_delta, dz, dA_part,
                                                           dD_part, dB_part, dC_part)), threads)
        dD = None if D is None else dD_part.sum(0)
        return d_u, d_delta, dA_part.sum(0).t(), dB_part.sum((0, 4)), dC_part.sum((0, 4)), dD, dz


def selective_scan_time_major(u, delta, A, B, C, D=None, z=None) -> torch.Tensor:
    """The fused scan, y_t = (<h_t, C_t> + D u_t) · silu(z_t), differentiable in every argument.

    Shapes: u, delta, z (batch, len, dim); A (dim, state); B, C (batch, len, state); D (dim,). D and z may be None.
    All fp32 CPU tensors, contiguous (Δ already biased and softplus-ed). Returns y (batch, len, dim), fp32.
    """
    for name, t in zip("u delta A B C D z".split(), (u, delta, A, B, C, D, z)):
        if t is not None and (t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"selective_scan_time_major: {name} must be a contiguous fp32 CPU tensor, "
                             f"got {t.dtype} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}")
    why_not = unavailable()
    if why_not is not None:
        raise ValueError(f"selective_scan_time_major: the compiled kernel is not available: {why_not}")
    return _NativeScan.apply(u, delta, A, B, C, D, z)
