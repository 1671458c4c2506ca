"""The compiled CPU token permutation (moe_dist.kernels.permute_cpu) against `(un)permute_tokens_ref`: outputs and
the gradients of the tokens, the expert rows and the combine weights, with dropped assignments (none, some, all),
widths that end in a partial vector, fp32 and bf16; its refusals; the "auto" choice of model.moe.impl."""

import pytest
import torch

from moe_dist.kernels import permute_cpu
from moe_dist.kernels.reference import permute_tokens_ref, unpermute_tokens_ref
from moe_dist.layers.moe import Permutation, permute_rows, unpermute_rows


def test_kernels_build_here():
    assert permute_cpu.unavailable() is None  # the dev and CI machines have a C++ compiler


def run(perm, unperm, x, rows_R, w, gy, K):
    """Gather, a stand-in for the experts, combine; forward values and the gradients of x and w."""
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    x_RD = perm(xi, rows_R, K)
    y_RD = x_RD * 1.5 + 0.25
    out = unperm(y_RD, rows_R, wi, x.shape[0])
    out.backward(gy)
    return {"x_RD": x_RD.detach(), "out": out.detach(), "grad_x": xi.grad, "grad_w": wi.grad}


@pytest.mark.parametrize("T, K, D, keep", [(7, 2, 6, "some"), (13, 3, 17, "all"), (5, 1, 33, "none"),
                                           (1, 4, 16, "some"), (300, 6, 40, "some")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(T, K, D, keep, dtype):
    g = torch.Generator().manual_seed(T * 10 + K)
    A = K * T
    n_keep = {"all": A, "none": 0, "some": A * 2 // 3}[keep]
    rows_R = torch.randperm(A, generator=g)[:n_keep]
    x = torch.randn(T, D, generator=g).to(dtype)
    w = torch.rand(A, generator=g)
    gy = torch.randn(T, D, generator=g).to(dtype)
    want = run(permute_tokens_ref, unpermute_tokens_ref, x.double(), rows_R, w.double(), gy.double(), K)
    torch_path = run(permute_rows, unpermute_rows, x, rows_R, w, gy, K)
    got = run(permute_cpu.permute_tokens, permute_cpu.unpermute_tokens, x, rows_R, w, gy, K)
    for name, ref in want.items():
        assert got[name].dtype == torch_path[name].dtype and got[name].shape == ref.shape, name
        err = (got[name].double() - ref).abs().max().item() if ref.numel() else 0.0
        torch_err = (torch_path[name].double() - ref).abs().max().item() if ref.numel() else 0.0
        assert err <= 2 * torch_err + (1e-5 if dtype == torch.float32 else 1e-2), (name, err, torch_err)
    dropped = torch.ones(A, dtype=torch.bool)
    dropped[rows_R] = False
    assert torch.equal(got["grad_w"][dropped], torch.zeros(int(dropped.sum())))
    if keep != "none":
        assert got["grad_w"].abs().sum() > 0 and got["grad_x"].abs().sum() > 0


def test_non_contiguous_rows():
    T, K, D = 9, 2, 20
    rows_R = torch.randperm(K * T)[:15]
    y = torch.randn(D, 15).t()  # (15, D), strided
    w = torch.rand(K * T)
    torch.testing.assert_close(permute_cpu.unpermute_tokens(y, rows_R, w, T),
                               unpermute_tokens_ref(y, rows_R, w, T), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("x, message", [
    (torch.zeros(3, 4, dtype=torch.float64), "takes fp32 or bf16 rows, got torch.float64"),
    (torch.zeros(3, 4, device="meta"), "takes CPU tensors, got meta"),
])
def test_refuses_what_it_cannot_compute(x, message):
    with pytest.raises(ValueError, match=f"^permute_cpu: the compiled permutation {message}$"):
        permute_cpu.permute_tokens(x, torch.arange(3), 1)


def test_auto_takes_the_kernels_for_bf16_and_torch_for_fp64():
    perm = Permutation.from_impl("auto")
    T, K, D = 11, 2, 24
    rows_R = torch.randperm(K * T)[:18]
    w = torch.rand(K * T)
    y = torch.randn(18, D)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(perm.unpermute(y.to(dtype), rows_R, w, T),
                           permute_cpu.unpermute_tokens(y.to(dtype), rows_R, w, T))
    assert torch.equal(perm.unpermute(y.double(), rows_R, w.double(), T),
                       unpermute_rows(y.double(), rows_R, w.double(), T))
    torch_perm = Permutation.from_impl("torch")
    assert torch_perm.permute is permute_rows and torch_perm.unpermute is unpermute_rows
