"""The experts' building blocks: the grouped GEMM (torch's, or one matmul per expert where it cannot take the
tensors), the expert backends (`model.moe.backend`) and the gated SiLU between the two GEMMs. The whole layer
against a per-token loop is in test_moe.py."""

import pytest
import torch
import torch.nn.functional as F

import moe_dist.layers.experts as experts_mod
from moe_dist.config import MoEConfig
from moe_dist.layers.moe import MoE

F64 = torch.float64


# ------------------------------------------------------------------------------------------ grouped GEMM


@pytest.mark.parametrize("d_in, d_out, dtype, uses_gmm", [(7, 5, F64, False), (16, 8, torch.float32, True)])
def test_grouped_mm_function_with_empty_groups(path_spy, d_in, d_out, dtype, uses_gmm):
    """Rows sorted by expert, experts 0 and 2 empty; `.sum()` gives a broadcast (stride-0) output gradient."""
    counts = torch.tensor([0, 3, 0, 4])
    x = torch.randn(7, d_in, dtype=dtype, requires_grad=True)
    w = torch.randn(4, d_in, d_out, dtype=dtype, requires_grad=True)
    y = experts_mod.grouped_mm(x, w, counts)
    ref = torch.cat(
        [x.detach()[:3].double() @ w.detach()[1].double(), x.detach()[3:].double() @ w.detach()[3].double()]
    )
    torch.testing.assert_close(y.detach().double(), ref, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    torch.testing.assert_close(x.grad[:3], w[1].detach().sum(-1).expand(3, d_in), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad[3:], w[3].detach().sum(-1).expand(4, d_in), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad[1], x.detach()[:3].sum(0)[:, None].expand(d_in, d_out), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad[3], x.detach()[3:].sum(0)[:, None].expand(d_in, d_out), rtol=1e-5, atol=1e-5)
    assert torch.equal(w.grad[0], torch.zeros(d_in, d_out, dtype=dtype))
    assert torch.equal(w.grad[2], torch.zeros(d_in, d_out, dtype=dtype))
    answers, calls = path_spy
    assert answers == [uses_gmm] and len(calls) == int(uses_gmm)


def test_grouped_mm_ok_alignment_rule():
    x32 = torch.zeros(3, 16)
    assert experts_mod._grouped_mm_ok(x32, torch.zeros(2, 16, 32))
    assert not experts_mod._grouped_mm_ok(torch.zeros(3, 7), torch.zeros(2, 7, 32))  # 28-byte rows
    assert not experts_mod._grouped_mm_ok(x32, torch.zeros(2, 16, 5))  # 20-byte weight rows
    assert not experts_mod._grouped_mm_ok(x32, torch.zeros(2, 32, 16).transpose(1, 2))  # non-contiguous weight
    assert not experts_mod._grouped_mm_ok(x32.double(), torch.zeros(2, 16, 32))  # dtype mismatch


# ------------------------------------------------------------------------------- model.moe.backend


def test_unknown_or_unusable_backend_is_a_config_error_naming_the_key():
    from moe_dist.config import ConfigError
    from moe_dist.layers.megablocks_backend import megablocks_unavailable

    with pytest.raises(ConfigError, match=r"^model\.moe\.backend: expected 'native' or 'megablocks', got 'tutel'$"):
        experts_mod.expert_swiglu("tutel")
    why = megablocks_unavailable()
    if why is None:
        pytest.skip("megablocks is usable here: nothing to refuse")
    with pytest.raises(ConfigError, match=r"^model\.moe\.backend='megablocks': not usable here: .*; use 'native'$"):
        MoE(16, 32, MoEConfig(num_experts=4, top_k=2, backend="megablocks"), init_std=0.02, n_layers=2)


def test_train_refuses_an_unusable_megablocks_backend_with_exit_2(tmp_path, forks):
    from pathlib import Path

    from moe_dist.layers.megablocks_backend import megablocks_unavailable

    if megablocks_unavailable() is None:
        pytest.skip("megablocks is usable here: nothing to refuse")
    repo = Path(__file__).resolve().parents[2]
    args = ["--config", repo / "configs" / "debug.json", "--set", "model.moe.backend=megablocks"]
    proc = forks.script(repo / "launch" / "train.py", [*args, "--run-dir", tmp_path / "run"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model.moe.backend='megablocks': not usable here")


def _megablocks_skip_reason():
    from moe_dist.layers.megablocks_backend import megablocks_unavailable

    return megablocks_unavailable() or ""


@pytest.mark.skipif(bool(_megablocks_skip_reason()), reason=f"MegaBlocks backend: {_megablocks_skip_reason()}")
@pytest.mark.parametrize("capacity_factor", [1.0, None])
def test_megablocks_backend_matches_native(capacity_factor):
    """Same weights and input: the MegaBlocks expert GEMMs give our layer's outputs and gradients (bf16, CUDA),
    within twice the bf16 error of the native layer against its fp32 self."""
    torch.manual_seed(0)
    layers = {}
    for name, backend in (("native", "native"), ("megablocks", "megablocks"), ("fp32", "native")):
        cfg = MoEConfig(num_experts=8, top_k=2, capacity_factor=capacity_factor, backend=backend)
        layers[name] = MoE(64, 128, cfg, init_std=0.02, n_layers=2).cuda()
    layers["native"].init_weights()
    for name in ("megablocks", "fp32"):
        layers[name].load_state_dict(layers["native"].state_dict())
    x = torch.randn(4, 37, 64, device="cuda")
    results = {}
    for name, layer in layers.items():
        layer.to(torch.float32 if name == "fp32" else torch.bfloat16)
        xi = x.to(next(layer.parameters()).dtype).requires_grad_()
        out, stats = layer(xi)
        (out.float().square().sum() + stats.aux_loss + stats.z_loss).backward()
        results[name] = [out.float(), xi.grad.float()] + [p.grad.float() for p in layer.parameters()]
    for mb, nat, ref in zip(results["megablocks"], results["native"], results["fp32"]):
        bound = 2 * (nat - ref).abs().max().item() + 1e-3
        assert (mb - ref).abs().max().item() <= bound


# ------------------------------------------------------------------------------------- gated SiLU


@pytest.mark.parametrize(
    "shape, dtype, tol", [((7, 10), F64, 1e-12), ((2, 3, 16), torch.bfloat16, 2e-2), ((0, 8), torch.float32, 0)]
)
def test_gated_silu_matches_autograd_of_silu_times_up(shape, dtype, tol):
    """gated_silu([a | b]) = silu(a) · b, and its hand-written backward equals autograd's through the two halves."""
    from moe_dist.layers.mlp import gated_silu

    g = torch.Generator().manual_seed(3)
    ab = torch.randn(shape, generator=g, dtype=F64).to(dtype)
    grad_h = torch.randn(*shape[:-1], shape[-1] // 2, generator=g, dtype=F64).to(dtype)
    got_in, ref_in = ab.clone().requires_grad_(), ab.clone().requires_grad_()
    got = gated_silu(got_in)
    a, b = ref_in.chunk(2, dim=-1)
    ref = F.silu(a) * b
    got.backward(grad_h)
    ref.backward(grad_h)
    assert got.shape == ref.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), ref.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_in.grad.double(), ref_in.grad.double(), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------ squared ReLU


def test_relu2_moe_matches_a_per_token_loop():
    """`ffn_activation` "relu2" (Nemotron-H): each token's output is Σ_k w_k · relu(x W1_e)² W2_e over its chosen
    experts, plus the shared expert relu(x S1)² S2 (no gate, no w3 anywhere), computed here token by token."""
    from moe_dist.layers.mlp import SwiGLU

    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=2, d_ff=8, capacity_factor=None, n_shared_experts=1, shared_d_ff=6)
    moe = MoE(16, 8, cfg, init_std=0.3, n_layers=2, activation="relu2").float()
    moe.init_weights()
    assert moe.experts.weight_names == ("w1", "w2") and not hasattr(moe.experts, "w13")
    assert moe.shared.w3 is None and moe.experts.w1.shape == (4, 16, 8)
    x = torch.randn(10, 16, dtype=torch.float32)
    out, _ = moe(x)
    logits = x @ moe.router.weight.t()
    weight, idx = logits.softmax(-1).topk(2, dim=-1)
    weight = weight / weight.sum(-1, keepdim=True)
    e = moe.experts
    for t in range(10):
        ref = sum(weight[t, k] * (F.relu(x[t] @ e.w1[idx[t, k]]) ** 2) @ e.w2[idx[t, k]] for k in range(2))
        ref = ref + moe.shared.w2(F.relu(moe.shared.w1(x[t])) ** 2)
        torch.testing.assert_close(out[t], ref, rtol=1e-5, atol=1e-5)
    dense = SwiGLU(16, 8, 0.3, 2, activation="relu2")
    dense.init_weights()
    assert dense.w3 is None
    torch.testing.assert_close(dense(x), dense.w2(F.relu(dense.w1(x)) ** 2), rtol=0, atol=0)


def test_relu2_refuses_megablocks_and_splits_over_tensor_parallelism():
    """MegaBlocks runs SwiGLU experts only: refused by name. Tensor parallelism splits squared-ReLU FFNs as SwiGLU's
    (sharded == unsharded: tests/parallel/test_tp_layers.py), so a relu2 layout is accepted where every hidden size
    divides by parallel.tp, and refused by the key of the one that does not."""
    from moe_dist.config import ConfigError, config_from_dict
    from moe_dist.config.parallel_checks import check_layout

    with pytest.raises(ConfigError, match="model.moe.backend"):
        MoE(16, 8, MoEConfig(backend="megablocks"), init_std=0.02, n_layers=2, activation="relu2")

    def layout(tp: int, **model) -> None:
        model = {"ffn_activation": "relu2", "ffn_pattern": "DE", "n_layers": 2, **model}
        check_layout(config_from_dict({"model": model, "parallel": {"tp": tp}}), tp)

    layout(2, moe={"n_shared_experts": 1, "shared_d_ff": 30})
    for key, model in (
        ("model.d_ff", {"d_ff": 30, "moe": {"d_ff": 32}}),  # the dense FFN's
        ("model.moe.d_ff", {"moe": {"d_ff": 30}}),
        ("model.moe.shared_d_ff", {"moe": {"n_shared_experts": 1, "shared_d_ff": 30}}),
    ):
        with pytest.raises(ConfigError, match=key):
            layout(4, **model)
