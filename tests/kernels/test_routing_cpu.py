"""The router's compiled CPU selections (moe_dist.kernels.routing_cpu) against torch.topk and torch's stable
argsort: indices and values, gradients through the values, ties, NaN, bad ids; and the Router's choice of them."""

import pytest
import torch

from moe_dist.config import MoEConfig
from moe_dist.kernels import routing_cpu
from moe_dist.layers.moe import Router


def test_kernels_build_here():
    assert routing_cpu.unavailable() is None  # the dev and CI machines have a C++ compiler


@pytest.mark.parametrize("T, E, k", [(1, 1, 1), (7, 3, 2), (300, 8, 2), (4096, 64, 6), (5, 16, 16), (0, 4, 2)])
def test_topk_matches_torch(T, E, k):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T + E)) * 5
    probs = logits.softmax(-1).requires_grad_()
    values, idx = routing_cpu.topk(probs, k)
    want_values, want_idx = probs.topk(k, dim=-1)  # random values: no ties, so one right answer
    assert idx.dtype == torch.long and idx.shape == (T, k)
    assert torch.equal(idx, want_idx) and torch.equal(values, want_values)
    if T:
        g = torch.randn(T, k)
        got_grad, = torch.autograd.grad(values, probs, g)
        want_grad, = torch.autograd.grad(want_values, probs, g)
        assert torch.equal(got_grad, want_grad) and got_grad.abs().sum() > 0


def test_topk_ties_go_to_the_lower_index_and_nan_ranks_first():
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25],
                          [0.1, 0.4, 0.1, 0.4],
                          [0.0, float("nan"), 0.7, 0.3],
                          [float("nan"), 0.0, float("nan"), 1.0]])
    _, idx = routing_cpu.topk(probs, 3)
    assert idx.tolist() == [[0, 1, 2], [1, 3, 0], [1, 2, 3], [0, 2, 3]]


@pytest.mark.parametrize("A, E", [(0, 4), (1, 1), (24576, 64), (1000, 3)])
def test_argsort_by_expert_is_a_stable_argsort(A, E):
    expert = torch.randint(0, E, (A,), generator=torch.Generator().manual_seed(A))  # many equal keys
    assert torch.equal(routing_cpu.argsort_by_expert(expert, E), torch.argsort(expert, stable=True))


@pytest.mark.parametrize("bad", [-1, 4])
def test_argsort_by_expert_refuses_ids_outside_the_range(bad):
    expert = torch.tensor([0, 3, bad, 1])
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\)"):
        routing_cpu.argsort_by_expert(expert, 4)


@pytest.mark.parametrize("tensor, message", [
    (torch.rand(4, 3, dtype=torch.float64), "fp32 CPU"),
    (torch.rand(12), "fp32 CPU"),
])
def test_topk_refuses_what_it_cannot_compute(tensor, message):
    assert message in routing_cpu.topk_unsupported(tensor, 2)
    assert "k <= E" in routing_cpu.topk_unsupported(torch.rand(4, 3), 4)


def test_router_takes_the_kernels_for_auto_and_cpu_and_torch_otherwise(monkeypatch):
    calls = []
    for name in ("topk", "argsort_by_expert"):
        fn = getattr(routing_cpu, name)
        monkeypatch.setattr(routing_cpu, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    x = torch.randn(64, 16)
    results = {}
    for impl in ("auto", "cpu", "torch"):
        calls.clear()
        router = Router(16, MoEConfig(num_experts=8, top_k=2, impl=impl), init_std=0.5)
        torch.manual_seed(0)
        router.init_weights()
        routing, stats = router(x)
        results[impl] = (routing.rows_R, routing.tokens_per_expert_E, routing.weight_A, stats.z_loss)
        assert calls == ([] if impl == "torch" else ["topk", "argsort_by_expert"]), impl
    for impl in ("auto", "cpu"):  # the same routing either way
        assert all(torch.equal(a, b) for a, b in zip(results[impl], results["torch"])), impl
