"""Triton MoE token permutation against `permute_tokens_ref` / `unpermute_tokens_ref` in fp64: outputs and the
gradients of x, y and the router weights, with top-k replication and capacity drops, awkward sizes, three dtypes;
then against the MoE layer's own dispatcher on real router output.

Runs under TRITON_INTERPRET=1 or MOE_DIST_KERNEL_DEVICE=cuda (see conftest.py). Shape suffixes as in
moe_dist/layers/moe.py: T tokens, D d_model, K top_k, A = K·T assignments (slot-major), R kept rows, E experts.
"""

import math
import os

import pytest
import torch
from moe_dist.kernels.permute import permute_tokens, unpermute_tokens
from moe_dist.kernels.reference import permute_tokens_ref, unpermute_tokens_ref

from moe_dist.config import MoEConfig
from moe_dist.layers.moe import LocalDispatcher
from moe_dist.layers.permutation import Permutation
from moe_dist.layers.router import Router

ON_CUDA = os.environ.get("MOE_DIST_KERNEL_DEVICE") == "cuda"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

# (T, D, K, E, capacity factor or None = dropless): 1 token; 7 tokens with drops; D above one 256-wide tile;
# a factor so low that some tokens lose every assignment.
CASES = [(1, 16, 1, 2, None), (7, 100, 2, 4, 1.0), (100, 48, 2, 8, 1.25), (100, 300, 3, 5, 0.4)]
if ON_CUDA:
    CASES += [(4096, 1024, 2, 8, 1.25)]


def routing(T, K, E, capacity_factor, device, seed=0):
    """rows_R as the router builds them: slot-major assignments grouped by expert in position order, cut at
    capacity; plus fp32 weights for every assignment."""
    g = torch.Generator().manual_seed(seed)
    expert_A = torch.randint(0, E, (K * T,), generator=g)
    order_A = torch.argsort(expert_A, stable=True)
    counts_E = torch.bincount(expert_A, minlength=E)
    rows_R = order_A
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * T * K / E)
        position_A = torch.arange(K * T) - (torch.cumsum(counts_E, 0) - counts_E)[expert_A[order_A]]
        rows_R = order_A[position_A < cap]
    weight_A = torch.rand(K * T, generator=g)
    return rows_R.to(device), weight_A.to(device)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, dtype, device, within_torch_error):
    T, D, K, E, cf = case
    rows_R, weight_A = routing(T, K, E, cf, device)
    g = torch.Generator().manual_seed(1)
    x_TD, y_RD = (torch.randn(n, D, generator=g).to(device=device, dtype=dtype) for n in (T, rows_R.shape[0]))
    grad_RD, grad_TD = (torch.randn(n, D, generator=g).to(device=device, dtype=dtype) for n in (rows_R.shape[0], T))

    def run(permute, unpermute, x_TD, y_RD, weight_A, grad_RD, grad_TD):
        x, y, w = leaves(x_TD, y_RD, weight_A)
        rows = rows_R.to(x.device)  # the fp64 reference runs on the CPU
        x_RD = permute(x, rows, K)
        out_TD = unpermute(y, rows, w, T)
        x_RD.backward(grad_RD)
        out_TD.backward(grad_TD)
        return x_RD.detach(), out_TD.detach(), x.grad, y.grad, w.grad

    got = run(permute_tokens, unpermute_tokens, x_TD, y_RD, weight_A, grad_RD, grad_TD)
    base = run(permute_tokens_ref, unpermute_tokens_ref, x_TD, y_RD, weight_A, grad_RD, grad_TD)
    ref = run(
        permute_tokens_ref, unpermute_tokens_ref, *(t.double().cpu() for t in (x_TD, y_RD, weight_A, grad_RD, grad_TD))
    )
    assert torch.equal(got[0], base[0])  # a gather is exact
    for name, a, b, r in zip(("x_RD", "out_TD", "dx", "dy", "dweight"), got, base, ref):
        assert a.device == x_TD.device and a.dtype == b.dtype, name
        within_torch_error(f"{name} {case} {dtype}", a, b, r)


def test_dropped_assignments_contribute_nothing(device):
    """Token 1 loses both assignments, token 0 one of two: its row is 0 and dropped weights get gradient 0."""
    T, K = 3, 2
    rows_R = torch.tensor([0, 2, 5], device=device)  # kept: (k=0, t=0), (k=0, t=2), (k=1, t=2)
    y_RD = torch.randn(3, 16, device=device)
    w = torch.rand(K * T, device=device, requires_grad=True)
    out_TD = unpermute_tokens(y_RD, rows_R, w, T)
    assert torch.equal(out_TD[1], torch.zeros(16, device=device))
    torch.testing.assert_close(out_TD[0], w[0].detach() * y_RD[0])
    torch.testing.assert_close(out_TD[2], w[2].detach() * y_RD[1] + w[5].detach() * y_RD[2])
    out_TD.sum().backward()
    dropped = torch.tensor([1, 3, 4], device=device)
    assert torch.equal(w.grad[dropped], torch.zeros(3, device=device))
    assert (w.grad[rows_R] != 0).all()


def test_nothing_kept(device):
    x_TD = torch.randn(4, 16, device=device, requires_grad=True)
    y_RD = torch.randn(0, 16, device=device, requires_grad=True)
    w = torch.rand(8, device=device, requires_grad=True)
    rows_R = torch.zeros(0, dtype=torch.int64, device=device)
    x_RD = permute_tokens(x_TD, rows_R, 2)
    out_TD = unpermute_tokens(y_RD, rows_R, w, 4)
    assert x_RD.shape == (0, 16) and torch.equal(out_TD, torch.zeros(4, 16, device=device))
    (x_RD.sum() + out_TD.sum()).backward()
    assert torch.equal(x_TD.grad, torch.zeros_like(x_TD)) and torch.equal(w.grad, torch.zeros_like(w))


def test_unsupported_inputs_raise(device):
    x_TD = torch.zeros(4, 16, device=device)
    with pytest.raises(ValueError, match="int64"):
        permute_tokens(x_TD, torch.zeros(2, dtype=torch.int32, device=device), 1)
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        permute_tokens(x_TD.double(), torch.zeros(2, dtype=torch.int64, device=device), 1)
    with pytest.raises(ValueError, match="rows"):
        unpermute_tokens(x_TD, torch.zeros(3, dtype=torch.int64, device=device), torch.zeros(4, device=device), 4)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_same_as_the_moe_dispatcher(capacity_factor, device):
    """On real router output, the kernels reproduce LocalDispatcher.dispatch rows and its combine."""
    cfg = MoEConfig(num_experts=4, top_k=2, capacity_factor=capacity_factor)
    router = Router(32, cfg, init_std=0.5).to(device)
    torch.manual_seed(0)
    router.init_weights()
    x_TD = torch.randn(50, 32, device=device)
    routing, _ = router(x_TD)
    dispatcher = LocalDispatcher(Permutation.for_device("torch", device))
    x_RD, rows_per_expert_E, state = dispatcher.dispatch(x_TD, routing)
    assert torch.equal(permute_tokens(x_TD, routing.rows_R, cfg.top_k), x_RD)
    y_RD = torch.randn_like(x_RD)
    torch.testing.assert_close(
        unpermute_tokens(y_RD, routing.rows_R, routing.weight_A, routing.num_tokens),
        dispatcher.combine(y_RD, state),
        rtol=1e-6,
        atol=1e-6,
    )
