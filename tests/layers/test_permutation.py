"""The PyTorch combine's weighted sum (moe_dist/layers/permutation.py) is one product then fused multiply-adds in
slot order, in the compute dtype, whichever way it runs: one embedding_bag for fp32/fp64 rows, blocks of tokens for
bf16/fp16 rows. Checked bitwise against that chain written out step by step; the whole PyTorch path (gather,
weighted sum and their backwards) against `(un)permute_tokens_ref` in tolerance."""

import pytest
import torch

from moe_dist.layers.permutation import _BLOCK, _slots, _sum_slots, permute_rows, unpermute_rows

F64 = torch.float64


def _chain(rows_RD, row_KT, scale_KT, dtype):
    """out = rows[row_0] · s_0, then out = addcmul(out, rows[row_k], s_k) for k = 1 … K-1, over whole tensors."""
    compute = torch.promote_types(rows_RD.dtype, torch.float32)
    rows, scale = rows_RD.to(compute), scale_KT.to(compute).unsqueeze(-1)
    out = rows[row_KT[0]] * scale[0]
    for k in range(1, row_KT.shape[0]):
        out = torch.addcmul(out, rows[row_KT[k]], scale[k])
    return out.to(dtype)


# T above one block; every assignment kept, some dropped, a single slot
@pytest.mark.parametrize("T, K, kept", [(_BLOCK + 77, 3, 1.0), (_BLOCK * 2 + 5, 4, 0.6), (9, 1, 0.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_weighted_sum_is_the_slot_order_multiply_add_chain(T, K, kept, dtype):
    g = torch.Generator().manual_seed(T + K)
    A, D = K * T, 40
    rows_R = torch.randperm(A, generator=g)[: int(A * kept)]
    row_KT, kept_KT = _slots(rows_R, T, K)
    rows_RD = (torch.randn(rows_R.shape[0], D, generator=g) * 3).to(dtype)
    for scale_KT in (torch.rand(K, T, generator=g) * kept_KT, kept_KT):  # the combine's weights; its backward's 0/1
        got = _sum_slots(rows_RD, row_KT, scale_KT, dtype)
        assert got.dtype == dtype and torch.equal(got, _chain(rows_RD, row_KT, scale_KT, dtype))


# ------------------------------------------------------------------ PyTorch permutation path vs reference


# (1100, 4): more tokens than one block of the combine (512) and more rows than one block of its weight gradient
@pytest.mark.parametrize(
    "T, K, keep", [(7, 2, "some"), (13, 3, "all"), (5, 1, "none"), (1, 4, "some"), (1100, 4, "some")]
)
@pytest.mark.parametrize("dtype, tol", [(F64, 1e-12), (torch.bfloat16, 2e-2)])
def test_permute_rows_match_reference(T, K, keep, dtype, tol):
    """The gather-only PyTorch path equals `(un)permute_tokens_ref`: outputs, and the gradients of x, y and the
    weights (dropped assignments included: zero weight gradient, no contribution)."""
    from moe_dist.kernels.reference import permute_tokens_ref, unpermute_tokens_ref

    g = torch.Generator().manual_seed(T * 10 + K)
    D, A = 6, K * T
    order = torch.randperm(A, generator=g)
    n_keep = {"all": A, "none": 0, "some": A * 2 // 3}[keep]
    rows_R = order[:n_keep]
    x = torch.randn(T, D, generator=g, dtype=F64).to(dtype)
    w = torch.rand(A, generator=g, dtype=torch.float32)
    gy_TD = torch.randn(T, D, generator=g, dtype=F64).to(dtype)
    results = []
    for perm, unperm in ((permute_rows, unpermute_rows), (permute_tokens_ref, unpermute_tokens_ref)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        x_RD = perm(xi, rows_R, K)
        y_RD = x_RD * 1.5  # stands in for the experts
        out = unperm(y_RD, rows_R, wi, T)
        out.backward(gy_TD)
        results.append((x_RD.detach(), out.detach(), xi.grad, wi.grad))
    for got, want in zip(*results):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)
    dropped = torch.ones(A, dtype=torch.bool)
    dropped[rows_R] = False
    assert torch.equal(results[0][3][dropped], torch.zeros(int(dropped.sum())))
