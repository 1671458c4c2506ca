"""The PyTorch combine's weighted sum (moe_dist/layers/permutation.py) is one product then fused multiply-adds in
slot order, in the compute dtype, whichever way it runs: one embedding_bag for fp32/fp64 rows, blocks of tokens for
bf16/fp16 rows. Checked bitwise against that chain written out step by step (tests/layers/test_moe.py compares the
path with the reference in tolerance)."""

import pytest
import torch

from moe_dist.layers.permutation import _BLOCK, _slots, _sum_slots


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
