"""The gated RMSNorm shared by Mamba-2 (gate, then normalise per group) and Gated DeltaNet (normalise, then gate):
both orders against the formulas written out, the groups, the fp32 inside under bf16, and the statistics hook
that tensor parallelism overrides."""

import pytest
import torch
import torch.nn.functional as F

from moe_dist.layers.norm import GatedRMSNorm

EPS = 1e-5


def norm(dim, gate_first, groups=1, dtype=torch.float64):
    n = GatedRMSNorm(dim, EPS, gate_first=gate_first, groups=groups)
    n.init_weights()
    assert torch.equal(n.weight, torch.ones(dim))
    with torch.no_grad():
        n.weight.copy_(torch.randn(dim))  # a scale that is not one, so a misplaced weight shows
    return n.to(dtype)


def test_gate_first_normalises_x_times_silu_gate_per_group():
    """Mamba-2: h = x · silu(z); each group of dim / G channels divided by its own root mean square; times w."""
    n = norm(12, gate_first=True, groups=3)
    x, z = torch.randn(2, 5, 12, dtype=torch.float64), torch.randn(2, 5, 12, dtype=torch.float64)
    h = (x * z * torch.sigmoid(z)).view(2, 5, 3, 4)
    expected = (h / torch.sqrt((h * h).mean(-1, keepdim=True) + EPS)).view(2, 5, 12) * n.weight
    torch.testing.assert_close(n(x, z), expected, rtol=1e-12, atol=1e-12)


def test_norm_first_normalises_x_then_gates_it():
    """Gated DeltaNet (Qwen3-Next): x divided by its root mean square over the last dim (one head), times w, times
    silu(z)."""
    n = norm(8, gate_first=False)
    x, z = torch.randn(2, 5, 3, 8, dtype=torch.float64), torch.randn(2, 5, 3, 8, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * n.weight * (z * torch.sigmoid(z))
    torch.testing.assert_close(n(x, z), expected, rtol=1e-12, atol=1e-12)


def test_the_two_orders_differ_and_one_group_is_the_whole_dim():
    x, z = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    first, after = norm(8, True), norm(8, False)
    after.weight = first.weight
    assert not torch.allclose(first(x, z), after(x, z))
    torch.testing.assert_close(after(x, z), F.rms_norm(x, (8,), first.weight, EPS) * F.silu(z), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gate_first", [True, False])
def test_bf16_inputs_are_normalised_in_fp32_and_cast_back_once(gate_first):
    n32 = norm(16, gate_first, groups=2, dtype=torch.float32)
    x, z = torch.randn(3, 16).bfloat16(), torch.randn(3, 16).bfloat16()
    out = n32(x, z)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, n32(x.float(), z.float()).bfloat16())


def test_the_statistics_hook_sets_the_mean_square():
    """Tensor parallelism's spanning-group norm overrides `_mean_square` (its groups span ranks): whatever it
    returns is what x is divided by."""

    class Halved(GatedRMSNorm):
        def _mean_square(self, h):
            return super()._mean_square(h) / 4

    n = Halved(8, EPS, gate_first=True, groups=2).double()
    with torch.no_grad():
        n.weight.normal_()
    x, z = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    h = (x * F.silu(z)).view(3, 2, 4)
    expected = (h / torch.sqrt((h * h).mean(-1, keepdim=True) / 4 + EPS)).view(3, 8) * n.weight
    torch.testing.assert_close(n(x, z), expected, rtol=1e-12, atol=1e-12)
