"""MoE token permutation in Triton: gather token rows into expert-sorted order and the weighted sum back.

Shape legend (suffixes on tensor names, as in moe_dist/layers/moe.py):
    T tokens    D d_model    K top_k    A = K·T assignments, slot-major (a = k·T + t)
    R routed rows: kept assignments sorted by expert (R ≤ A; capacity drops are simply absent)

Both directions are written as gathers, never atomics, so results are deterministic: the forward of
`permute_tokens` reads row r from token rows_R[r] % T; its backward and the forward of `unpermute_tokens` sum,
for each token, over its K slots through the inverse map row_A (the row of assignment a, or -1 if dropped).
Sums accumulate in fp32. The plain-PyTorch specifications are `permute_tokens_ref` / `unpermute_tokens_ref` in
`moe_dist.kernels.reference`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(X, ROWS, OUT, num_tokens, num_rows, dmodel, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[r] = X[ROWS[r] % T]: (R, D) ← (T, D)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r_ok = offs_r < num_rows
    mask = r_ok[:, None] & (offs_d[None, :] < dmodel)
    token = tl.load(ROWS + offs_r, mask=r_ok, other=0) % num_tokens  # int64
    x = tl.load(X + token[:, None] * dmodel + offs_d[None, :], mask=mask, other=0.0)
    tl.store(OUT + offs_r.to(tl.int64)[:, None] * dmodel + offs_d[None, :], x, mask=mask)


@triton.jit
def _sum_slots_kernel(
    Y,
    ROW_A,
    WEIGHT_A,
    OUT,
    num_tokens,
    dmodel,
    top_k,
    WEIGHTED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """OUT[t] = Σ_k w[k·T + t] · Y[ROW_A[k·T + t]] over kept slots (row ≥ 0), fp32 sum: (T, D) ← (R, D)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = offs_t < num_tokens
    d_ok = offs_d[None, :] < dmodel
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in range(0, top_k):
        a = k * num_tokens + offs_t.to(tl.int64)
        row = tl.load(ROW_A + a, mask=t_ok, other=-1)
        kept = row >= 0
        y = tl.load(Y + row[:, None] * dmodel + offs_d[None, :], mask=kept[:, None] & d_ok, other=0.0)
        if WEIGHTED:
            w = tl.load(WEIGHT_A + a, mask=kept, other=0.0).to(tl.float32)
            acc += y.to(tl.float32) * w[:, None]
        else:
            acc += y.to(tl.float32)
    tl.store(
        OUT + offs_t.to(tl.int64)[:, None] * dmodel + offs_d[None, :],
        acc.to(OUT.dtype.element_ty),
        mask=t_ok[:, None] & d_ok,
    )


@triton.jit
def _unpermute_bwd_kernel(
    DOUT, Y, ROWS, WEIGHT_A, DY, DWEIGHT_A, num_tokens, num_rows, dmodel, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    """For each row r of assignment a = ROWS[r], token t = a % T: DY[r] = w[a] · dOUT[t], dW[a] = <dOUT[t], Y[r]>."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < num_rows
    a = tl.load(ROWS + offs_r, mask=r_ok, other=0)
    token = a % num_tokens
    w = tl.load(WEIGHT_A + a, mask=r_ok, other=0.0).to(tl.float32)
    row64 = offs_r.to(tl.int64)
    dw = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start_d in range(0, dmodel, BLOCK_D):
        offs_d = start_d + tl.arange(0, BLOCK_D)
        mask = r_ok[:, None] & (offs_d[None, :] < dmodel)
        g = tl.load(DOUT + token[:, None] * dmodel + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + row64[:, None] * dmodel + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DY + row64[:, None] * dmodel + offs_d[None, :], (g * w[:, None]).to(DY.dtype.element_ty), mask=mask)
        dw += tl.sum(g * y, 1)
    tl.store(DWEIGHT_A + a, dw, mask=r_ok)


# ------------------------------------------------------------------------------------------------ launchers

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK_ROWS, _BLOCK_D = 16, 256


def _check_rows(fn: str, x: torch.Tensor, rows_R: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"{fn}: expected a 2-d fp16/bf16/fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    if rows_R.dim() != 1 or rows_R.dtype != torch.int64 or rows_R.device != x.device:
        raise ValueError(
            f"{fn}: rows_R must be a 1-d int64 tensor on {x.device}, "
            f"got {tuple(rows_R.shape)} {rows_R.dtype} on {rows_R.device}"
        )


def _check_unpermute(y_RD: torch.Tensor, rows_R: torch.Tensor, weight_A: torch.Tensor, num_tokens: int) -> None:
    _check_rows("unpermute_tokens", y_RD, rows_R)
    if y_RD.shape[0] != rows_R.shape[0]:
        raise ValueError(f"unpermute_tokens: y_RD has {y_RD.shape[0]} rows but rows_R has {rows_R.shape[0]}")
    if (
        weight_A.dim() != 1
        or weight_A.numel() % max(num_tokens, 1) != 0
        or not weight_A.is_floating_point()
        or weight_A.device != y_RD.device
    ):
        raise ValueError(
            f"unpermute_tokens: weight_A must be a 1-d float tensor of K·T entries (T={num_tokens}) "
            f"on {y_RD.device}, got {tuple(weight_A.shape)} {weight_A.dtype} on {weight_A.device}"
        )


def _row_of_assignment(rows_R: torch.Tensor, num_assignments: int) -> torch.Tensor:
    """Inverse of rows_R: (A,) int64, the routed row of each assignment or -1 where it was dropped."""
    row_A = torch.full((num_assignments,), -1, dtype=torch.int64, device=rows_R.device)
    row_A[rows_R] = torch.arange(rows_R.shape[0], device=rows_R.device)
    return row_A


def _gather_rows(x_TD: torch.Tensor, rows_R: torch.Tensor) -> torch.Tensor:
    num_tokens, dmodel = x_TD.shape
    out_RD = x_TD.new_empty(rows_R.shape[0], dmodel)
    if out_RD.numel():
        grid = (triton.cdiv(rows_R.shape[0], _BLOCK_ROWS), triton.cdiv(dmodel, _BLOCK_D))
        _gather_rows_kernel[grid](
            x_TD, rows_R, out_RD, num_tokens, rows_R.shape[0], dmodel, BLOCK_R=_BLOCK_ROWS, BLOCK_D=_BLOCK_D
        )
    return out_RD


def _sum_slots(
    y_RD: torch.Tensor, row_A: torch.Tensor, weight_A: Optional[torch.Tensor], num_tokens: int, out_dtype: torch.dtype
) -> torch.Tensor:
    dmodel = y_RD.shape[1]
    top_k = row_A.shape[0] // max(num_tokens, 1)
    out_TD = y_RD.new_empty(num_tokens, dmodel, dtype=out_dtype)
    if out_TD.numel():
        grid = (triton.cdiv(num_tokens, _BLOCK_ROWS), triton.cdiv(dmodel, _BLOCK_D))
        _sum_slots_kernel[grid](
            y_RD,
            row_A,
            row_A if weight_A is None else weight_A,
            out_TD,
            num_tokens,
            dmodel,
            top_k,
            WEIGHTED=weight_A is not None,
            BLOCK_T=_BLOCK_ROWS,
            BLOCK_D=_BLOCK_D,
        )
    return out_TD


def _unpermute_bwd(dout_TD, y_RD, rows_R, weight_A):
    num_rows, dmodel = y_RD.shape
    dy_RD = torch.empty_like(y_RD)
    dweight_A = torch.zeros(weight_A.shape, dtype=torch.float32, device=weight_A.device)  # dropped slots: 0
    if num_rows:
        _unpermute_bwd_kernel[(triton.cdiv(num_rows, _BLOCK_ROWS),)](
            dout_TD,
            y_RD,
            rows_R,
            weight_A,
            dy_RD,
            dweight_A,
            dout_TD.shape[0],
            num_rows,
            dmodel,
            BLOCK_R=_BLOCK_ROWS,
            BLOCK_D=_BLOCK_D,
        )
    return dy_RD, dweight_A.to(weight_A.dtype)


# ------------------------------------------------------------------------------------------------ autograd


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, rows_R, top_k: int):
        ctx.save_for_backward(rows_R)
        ctx.top_k, ctx.num_tokens, ctx.x_dtype = top_k, x_TD.shape[0], x_TD.dtype
        return _gather_rows(x_TD, rows_R)

    @staticmethod
    def backward(ctx, dout_RD):
        (rows_R,) = ctx.saved_tensors
        row_A = _row_of_assignment(rows_R, ctx.top_k * ctx.num_tokens)
        dx_TD = _sum_slots(dout_RD.contiguous(), row_A, None, ctx.num_tokens, ctx.x_dtype)
        return dx_TD, None, None


class _UnpermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RD, rows_R, weight_A, num_tokens: int):
        row_A = _row_of_assignment(rows_R, weight_A.shape[0])
        ctx.save_for_backward(y_RD, rows_R, weight_A)
        return _sum_slots(y_RD, row_A, weight_A, num_tokens, y_RD.dtype)

    @staticmethod
    def backward(ctx, dout_TD):
        y_RD, rows_R, weight_A = ctx.saved_tensors
        dy_RD, dweight_A = _unpermute_bwd(dout_TD.contiguous(), y_RD, rows_R, weight_A)
        return dy_RD, None, dweight_A, None


# ------------------------------------------------------------------------------------------------ public


def permute_tokens(x_TD: torch.Tensor, rows_R: torch.Tensor, top_k: int) -> torch.Tensor:
    """Gather token rows into expert-sorted order (top-k replication, capacity drops); differentiable in x.

    Shapes: x_TD (T, D) fp16/bf16/fp32; rows_R (R,) int64 assignment indices a = k·T + t (slot-major, each at
    most once, a < top_k·T), sorted by expert with dropped assignments left out. Returns x_RD (R, D), x's dtype:
    row r is token rows_R[r] % T. The gradient sums each token's rows in fp32.
    Tensors must be CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
    """
    _check_rows("permute_tokens", x_TD, rows_R)
    return _PermuteTokens.apply(x_TD.contiguous(), rows_R.contiguous(), int(top_k))


def unpermute_tokens(y_RD: torch.Tensor, rows_R: torch.Tensor, weight_A: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Weighted sum of expert rows back per token; differentiable in y and in the weights.

    Shapes: y_RD (R, D) fp16/bf16/fp32, rows in the order of rows_R (R,) int64 (as for `permute_tokens`);
    weight_A (K·T,) combine weight of every assignment (any float dtype, usually fp32); num_tokens T.
    Returns out_TD (T, D) in y's dtype: out[t] = Σ over t's kept assignments a of weight_A[a] · y[row of a],
    summed in fp32; a token whose assignments were all dropped gets 0. Dropped assignments get weight grad 0.
    Tensors must be CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
    """
    _check_unpermute(y_RD, rows_R, weight_A, num_tokens)
    return _UnpermuteTokens.apply(y_RD.contiguous(), rows_R.contiguous(), weight_A.contiguous(), int(num_tokens))
