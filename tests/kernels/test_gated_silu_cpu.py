"""The compiled CPU gated SiLU (moe_dist.kernels.gated_silu_cpu) against fp64 autograd of silu(a) · b: outputs and
gradients, fp32 and bf16, widths that end in a partial vector; its refusals; the "auto" choice of model.moe.impl.

Tolerance: at most twice the error of the PyTorch gated SiLU (moe_dist.layers.mlp) in the same dtype, plus a small
atol (DESIGN.md §6).
"""

import pytest
import torch
import torch.nn.functional as F

from moe_dist.kernels import gated_silu_cpu
from moe_dist.layers.mlp import gated_silu, select_gated_silu


def reference(ab, grad_h):
    ab = ab.double().requires_grad_()
    a, b = ab.chunk(2, dim=-1)
    h = F.silu(a) * b
    return h, torch.autograd.grad(h, ab, grad_h.double())[0]


def run(fn, ab, grad_h):
    ab = ab.clone().requires_grad_()
    h = fn(ab)
    return h, torch.autograd.grad(h, ab, grad_h)[0]


def test_kernel_builds_here():
    assert gated_silu_cpu.unavailable() is None  # the dev and CI machines have a C++ compiler


# (rows, 2F): one pair; half = 17 (a vector and a tail of 1); wide rows; a 3-D input; no rows
@pytest.mark.parametrize("shape", [(1, 2), (7, 34), (100, 512), (2, 5, 40), (0, 8)])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_matches_autograd_of_silu_times_up(shape, dtype, atol):
    g = torch.Generator().manual_seed(0)
    ab = (torch.randn(*shape, generator=g) * 3).to(dtype)  # gates far into both tails of the sigmoid
    grad_h = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype)
    want = reference(ab, grad_h)
    torch_path = run(gated_silu, ab, grad_h)
    got = run(gated_silu_cpu.gated_silu, ab, grad_h)
    for name, x, t, ref in zip(("h", "grad"), got, torch_path, want):
        assert x.dtype == dtype and x.shape == ref.shape, name
        if ref.numel():
            assert ref.abs().sum() > 0, name
            err, torch_err = ((v.double() - ref).abs().max().item() for v in (x, t))
            assert err <= 2 * torch_err + atol, (name, err, torch_err)


def test_non_contiguous_input():
    ab = torch.randn(40, 6).t()  # (6, 40), strided
    grad_h = torch.randn(6, 20)
    for got, want in zip(run(gated_silu_cpu.gated_silu, ab, grad_h), reference(ab, grad_h)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_nan_stays_nan_in_bf16():
    ab = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    h = gated_silu_cpu.gated_silu(ab)
    assert torch.isnan(h[0, 0]) and torch.isfinite(h[0, 1])


@pytest.mark.parametrize("ab, message", [
    (torch.zeros(2, 3), "gated SiLU needs an even last dim [gate | up], got 3"),
    (torch.zeros(2, 4, dtype=torch.float64), "takes fp32 or bf16, got torch.float64"),
    (torch.zeros(2, 4, device="meta"), "takes CPU tensors, got meta"),
])
def test_refuses_what_it_cannot_compute(ab, message):
    with pytest.raises(ValueError, match=r"^gated_silu: .*" + message.replace("[", r"\[").replace("|", r"\|")
                       .replace("]", r"\]")):
        gated_silu_cpu.gated_silu(ab)


def test_auto_takes_the_kernel_for_bf16_and_fp32_and_torch_for_fp64():
    auto = select_gated_silu("auto")
    ab = torch.randn(9, 30)
    for x in (ab, ab.bfloat16()):
        assert torch.equal(auto(x), gated_silu_cpu.gated_silu(x))
    assert torch.equal(auto(ab.double()), gated_silu(ab.double()))
    assert select_gated_silu("torch") is gated_silu
