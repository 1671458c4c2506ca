"""The MoE token permutation's compiled CPU kernels (`permute_cpu.cpp`): load, autograd Functions, public functions.

`permute_tokens` and `unpermute_tokens` have the semantics and signatures of `permute_tokens_ref` and
`unpermute_tokens_ref` (moe_dist.kernels.reference). The gather itself stays torch's index_select (one pass
already); the kernels do the weighted combine and both backward passes. Built on first use and cached (`cpu_build`).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from moe_dist.kernels import cpu_build

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = (("permute_combine", (_I64, _I64, _I64, ctypes.c_int) + (_PTR,) * 4 + (ctypes.c_int,)),
               ("permute_combine_bwd", (_I64, _I64, _I64, ctypes.c_int) + (_PTR,) * 6 + (ctypes.c_int,)))
DTYPES = (torch.float32, torch.bfloat16)


def _library() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    return cpu_build.library("permute_cpu", _SIGNATURES)


def unavailable() -> Optional[str]:
    """Why the kernels cannot run in this process (no compiler, a failed build), or None; builds them on first call."""
    return _library()[1]


def _row_of(rows_R: torch.Tensor, assignments: int) -> torch.Tensor:
    """(K·T,) int64: the routed row of each assignment, -1 where it was dropped."""
    row_of_A = torch.full((assignments,), -1, dtype=torch.long)
    return row_of_A.index_put_((rows_R,), torch.arange(rows_R.shape[0]))


def _combine(rows_RD: torch.Tensor, row_of_A: torch.Tensor, scale_A: Optional[torch.Tensor], tokens: int):
    out_TD = rows_RD.new_empty(tokens, rows_RD.shape[1])
    _library()[0].permute_combine(tokens, row_of_A.shape[0] // max(tokens, 1), rows_RD.shape[1],
                                  rows_RD.dtype == torch.bfloat16, rows_RD.data_ptr(), row_of_A.data_ptr(),
                                  None if scale_A is None else scale_A.data_ptr(), out_TD.data_ptr(),
                                  torch.get_num_threads())
    return out_TD


def gather_forward(ctx, x_TD: torch.Tensor, rows_R: torch.Tensor, top_k: int) -> torch.Tensor:
    """x_RD = x_TD[rows_R % T], saving what a backward that sums each token's slots needs: the forward of both
    this gather and the PyTorch one (`moe_dist.layers.moe._PermuteRows`)."""
    T = x_TD.shape[0]
    ctx.save_for_backward(rows_R)
    ctx.top_k, ctx.num_tokens = top_k, T
    return x_TD.index_select(0, rows_R % T) if T else x_TD.new_zeros(0, x_TD.shape[1])


class _Permute(torch.autograd.Function):
    forward = staticmethod(gather_forward)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_RD: torch.Tensor):
        (rows_R,) = ctx.saved_tensors
        row_of_A = _row_of(rows_R, ctx.top_k * ctx.num_tokens)
        return _combine(grad_RD.contiguous(), row_of_A, None, ctx.num_tokens), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RD: torch.Tensor, rows_R: torch.Tensor, weight_A: torch.Tensor, num_tokens: int):
        row_of_A = _row_of(rows_R, weight_A.shape[0])
        weight32_A = weight_A.detach().float().contiguous()
        ctx.save_for_backward(y_RD, row_of_A, weight32_A)
        ctx.num_tokens, ctx.weight_dtype = num_tokens, weight_A.dtype
        return _combine(y_RD, row_of_A, weight32_A, num_tokens)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_TD: torch.Tensor):
        y_RD, row_of_A, weight32_A = ctx.saved_tensors
        T = ctx.num_tokens
        grad_TD = grad_TD.to(y_RD.dtype).contiguous()
        grad_y, grad_w = torch.empty_like(y_RD), torch.empty_like(weight32_A)
        _library()[0].permute_combine_bwd(T, row_of_A.shape[0] // max(T, 1), y_RD.shape[1],
                                          y_RD.dtype == torch.bfloat16, y_RD.data_ptr(), grad_TD.data_ptr(),
                                          row_of_A.data_ptr(), weight32_A.data_ptr(), grad_y.data_ptr(),
                                          grad_w.data_ptr(), torch.get_num_threads())
        return grad_y, None, grad_w.to(ctx.weight_dtype), None


def permute_tokens_unsupported(x_TD: torch.Tensor, *args, **kwargs) -> Optional[str]:
    """Why the kernels cannot take these tensors (the first one's device and dtype decide), or None."""
    if x_TD.device.type != "cpu":
        return f"the compiled permutation takes CPU tensors, got {x_TD.device}"
    if x_TD.dtype not in DTYPES:
        return f"the compiled permutation takes fp32 or bf16 rows, got {x_TD.dtype}"
    return None


unpermute_tokens_unsupported = permute_tokens_unsupported


def _check(t: torch.Tensor) -> torch.Tensor:
    reason = permute_tokens_unsupported(t) or unavailable()
    if reason is not None:
        raise ValueError(f"permute_cpu: {reason}")
    return t.contiguous()


def permute_tokens(x_TD: torch.Tensor, rows_R: torch.Tensor, top_k: int) -> torch.Tensor:
    """x_TD (T, D) fp32/bf16 CPU, rows_R (R,) int64 assignments a = k·T + t sorted by expert → (R, D) = x[a % T]."""
    return _Permute.apply(_check(x_TD), rows_R, top_k)


def unpermute_tokens(y_RD: torch.Tensor, rows_R: torch.Tensor, weight_A: torch.Tensor, num_tokens: int):
    """y_RD (R, D) fp32/bf16 CPU in rows_R's order, weight_A (K·T,) → (T, D): out[t] = Σ_kept weight[a] · y[row(a)],
    accumulated in fp32, in y's dtype."""
    return _Unpermute.apply(_check(y_RD), rows_R, weight_A, num_tokens)
