"""MoE token permutation: the gather of token rows into expert order and the weighted sum back.

Shape legend (as in moe.py): T tokens, D d_model, K top_k, A = K·T assignments (slot-major, a = k·T + t),
R routed rows (kept assignments sorted by expert).

The PyTorch path here has the semantics and signatures of `moe_dist.kernels.reference.(un)permute_tokens_ref`
(their specification and test oracle), with backwards written as gathers: the reference's autograd would
scatter-add with repeated indices, which runs serially on CPU. The GPU kernel is `moe_dist.kernels.permute`;
`Permutation.for_device` chooses between the two once (moe_dist.layers.kernel_choice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_dist.layers.kernel_choice import Kernel, resolve


def _slots(rows_R: torch.Tensor, num_tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where every assignment's row is: row_KT[k, t] indexes rows_R's order (0 where the assignment was dropped),
    kept_KT is 1.0 for a kept assignment and 0.0 for a dropped one. (K, T) int64 and (K, T) fp32."""
    R, dev = rows_R.shape[0], rows_R.device
    row_A = torch.zeros(top_k * num_tokens, dtype=torch.long, device=dev).index_put_(
        (rows_R,), torch.arange(R, device=dev)
    )
    kept_A = torch.zeros(top_k * num_tokens, dtype=torch.float32, device=dev).index_fill_(0, rows_R, 1.0)
    return row_A.view(top_k, num_tokens), kept_A.view(top_k, num_tokens)


_BLOCK = 512  # token rows per block: one block's fp32 temporaries stay in cache (the arithmetic is unchanged)


def _sum_slots(rows_RD: torch.Tensor, row_KT: torch.Tensor, scale_KT: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = Σ_k scale_KT[k, t] · rows[row_KT[k, t]] summed in the compute dtype (fp32 at least), returned in
    `dtype`. (T, D).

    The sum is one product then fused multiply-adds over the slots in slot order, gathers instead of a scatter-add.
    Rows in the compute dtype take one `embedding_bag` (fbgemm's fused gather and multiply-add, the same arithmetic
    in the same order: tests/layers/test_permutation.py checks it bitwise). Narrower rows (bf16 on CPU) meet their fp32
    scale through a widened temporary copy, so they go in blocks of `_BLOCK` tokens whose temporaries stay in
    cache, each block rounded into the output while it is there; embedding_bag would want the scales in the rows'
    dtype. A dropped slot reads row 0 with scale 0 (so an inf in row 0 would reach it as NaN: such a step is
    non-finite anyway, and the guard skips it)."""
    compute = torch.promote_types(rows_RD.dtype, torch.float32)
    K, T = row_KT.shape
    if rows_RD.shape[0] == 0:  # every assignment dropped: nothing to gather from
        return rows_RD.new_zeros(T, rows_RD.shape[1], dtype=dtype)
    if rows_RD.dtype == compute:
        out_TD = F.embedding_bag(row_KT.t(), rows_RD, mode="sum", per_sample_weights=scale_KT.t().to(compute))
        return out_TD.to(dtype)
    scale_KT1 = scale_KT.to(compute).unsqueeze(-1)
    out_TD = rows_RD.new_empty(T, rows_RD.shape[1], dtype=dtype)
    acc_BD = rows_RD.new_empty(min(T, _BLOCK), rows_RD.shape[1], dtype=compute)
    for lo in range(0, T, _BLOCK):
        blk, acc = slice(lo, lo + _BLOCK), acc_BD[: min(_BLOCK, T - lo)]
        torch.mul(rows_RD.index_select(0, row_KT[0, blk]), scale_KT1[0, blk], out=acc)
        for k in range(1, K):  # K ≤ a handful: a loop over slots, never over tokens or experts
            acc.addcmul_(rows_RD.index_select(0, row_KT[k, blk]), scale_KT1[k, blk])
        out_TD[blk] = acc
    return out_TD


def _row_dots(a_RD: torch.Tensor, b_RD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(R,) Σ_d a·b per row: products in the rows' dtype summed in `dtype`, in blocks of `_BLOCK` rows so that the
    products and the widened copy `sum` makes of them stay in cache (a whole (R, D) product written out and read
    back cost several times the arithmetic, and blocks of megabytes were handed back to the kernel and faulted in
    again on every call)."""
    out_R = a_RD.new_empty(a_RD.shape[0], dtype=dtype)
    for lo in range(0, a_RD.shape[0], _BLOCK):
        blk = slice(lo, lo + _BLOCK)
        torch.sum(torch.mul(a_RD[blk], b_RD[blk]), -1, dtype=dtype, out=out_R[blk])
    return out_R


class _PermuteRows(torch.autograd.Function):
    """x_RD = x_TD[rows_R % T]; backward sums each token's kept slots by gathers."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, rows_R: torch.Tensor, top_k: int) -> torch.Tensor:
        T = x_TD.shape[0]
        ctx.save_for_backward(rows_R)
        ctx.top_k, ctx.num_tokens = top_k, T
        return x_TD.index_select(0, rows_R % T) if T else x_TD.new_zeros(0, x_TD.shape[1])

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        (rows_R,) = ctx.saved_tensors
        row_KT, kept_KT = _slots(rows_R, ctx.num_tokens, ctx.top_k)
        return _sum_slots(grad_RD, row_KT, kept_KT, grad_RD.dtype), None, None


class _UnpermuteRows(torch.autograd.Function):
    """out[t] = Σ_{kept a of t} weight_A[a] · y[row(a)], fp32 accumulation."""

    @staticmethod
    def forward(ctx, y_RD: torch.Tensor, rows_R: torch.Tensor, weight_A: torch.Tensor, num_tokens: int):
        K = weight_A.shape[0] // max(num_tokens, 1)
        row_KT, kept_KT = _slots(rows_R, num_tokens, K)
        ctx.save_for_backward(y_RD, rows_R, weight_A)
        ctx.num_tokens = num_tokens
        return _sum_slots(y_RD, row_KT, weight_A.view(K, num_tokens) * kept_KT, y_RD.dtype)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        y_RD, rows_R, weight_A = ctx.saved_tensors
        compute = torch.promote_types(y_RD.dtype, torch.float32)
        grad_R = grad_TD.index_select(0, rows_R % ctx.num_tokens)  # each row's token gradient (R, D)
        grad_weight_A = None
        if ctx.needs_input_grad[2]:
            # d out[t] / d weight[a] = y[row(a)]: a dot product per kept row, summed in fp32 over products in the
            # rows' dtype (as torch's own autograd of y * w in that dtype; widening both (R, D) operands to fp32
            # first cost more than the rest of the combine's backward); dropped assignments get 0
            grad_weight_A = torch.zeros_like(weight_A)
            dots_R = _row_dots(grad_R, y_RD, compute)
            grad_weight_A.index_copy_(0, rows_R, dots_R.to(weight_A.dtype))
        # times its weight, in the gradient's dtype (the weight rounded to it once)
        grad_y = grad_R.mul_(weight_A.index_select(0, rows_R).to(grad_TD.dtype)[:, None])
        return grad_y, None, grad_weight_A, None


class _ReorderRows(torch.autograd.Function):
    """x[order] for a permutation `order` whose inverse is `inverse`: a gather both ways (indexing's autograd
    would scatter-add with index_put)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def reorder_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Rows of `x` in `order` (a permutation of its rows, `inverse` its inverse), differentiable by gathers."""
    return _ReorderRows.apply(x, order, inverse)


def permute_rows(x_TD: torch.Tensor, rows_R: torch.Tensor, top_k: int) -> torch.Tensor:
    """The PyTorch path of the token gather: `permute_tokens_ref`'s semantics and signature, faster backward."""
    return _PermuteRows.apply(x_TD, rows_R, top_k)


def unpermute_rows(y_RD: torch.Tensor, rows_R: torch.Tensor, weight_A: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The PyTorch path of the weighted sum back: `unpermute_tokens_ref`'s semantics and signature, by gathers."""
    return _UnpermuteRows.apply(y_RD, rows_R, weight_A, num_tokens)


@dataclass(frozen=True)
class Permutation:
    """The gather into expert order and the weighted sum back, as chosen for one device."""

    permute: Kernel  # (x_TD, rows_R, top_k) -> x_RD
    unpermute: Kernel  # (y_RD, rows_R, weight_A, num_tokens) -> out_TD

    @classmethod
    def for_device(cls, impl: str, device: torch.device | str) -> "Permutation":
        """`model.moe.impl` resolved for a layer built for `device`: the Triton kernels or the functions above."""
        key, what = "model.moe.impl", "token permutation"
        return cls(
            resolve(impl, key, device, permute_rows, _triton_permute, what),
            resolve(impl, key, device, unpermute_rows, _triton_unpermute, what),
        )


def _triton_permute():
    from moe_dist.kernels.permute import permute_tokens  # lazy: imports triton (kernel_choice.py)

    return permute_tokens


def _triton_unpermute():
    from moe_dist.kernels.permute import unpermute_tokens  # lazy: imports triton (kernel_choice.py)

    return unpermute_tokens
