"""Gated DeltaNet mixer: transformers' own Qwen3NextGatedDeltaNet with the same weights, wiring against an explicit
recomputation, cached decoding against transformers, parameter names, bf16, config rules. What every mixer kind
shares (causality, meta build + init, seeds, backward, documents, cache): test_mixers.py."""

import pytest
import torch
import torch.nn.functional as F
from moe_dist.kernels.reference import gated_delta_rule_ref

from moe_dist.config import ConfigError, GDNConfig, load_config
from moe_dist.layers.gdn import GatedDeltaNet, delta_rule_kernel

D_MODEL, EPS = 16, 1e-6
SHAPES = {"n_k_heads": 2, "n_v_heads": 4, "head_k_dim": 4, "head_v_dim": 3, "conv_size": 3, "chunk_size": 4}


def build(seed=0, dtype=torch.float64, **overrides):
    """Build on meta, materialize on CPU and init from a seeded RNG, as the trainer does; fp64 for tight checks."""
    cfg = GDNConfig(**{**SHAPES, **overrides})
    with torch.device("meta"):
        layer = GatedDeltaNet(D_MODEL, cfg, norm_eps=EPS, init_std=0.02)
    layer.to_empty(device="cpu")
    torch.manual_seed(seed)
    layer.init_weights()
    return layer.to(dtype)


def randomize(layer, seed=1):
    """Give every parameter (the norm weight too) a random offset so no wiring mistake hides behind 0 or 1; the
    projections are scaled up so that q, k, v and the gates are O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.add_((0.3 if "proj" in name else 0.1) * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer


def recompute(layer, x, reset=None):
    """The mixer written out with per-head slices of the packed projections against the sequential reference."""
    p = dict(layer.named_parameters())
    (batch, seqlen, _), hk, hv = x.shape, layer.n_k_heads, layer.n_v_heads
    dk, dv, r = layer.head_k_dim, layer.head_v_dim, hv // hk
    qkvz = (x @ p["in_proj_qkvz.weight"].T).view(batch, seqlen, hk, -1)
    ba = (x @ p["in_proj_ba.weight"].T).view(batch, seqlen, hk, -1)
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]  # (B, L, Hk, dk)
    v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(batch, seqlen, hv, dv)
    z = qkvz[..., 2 * dk + r * dv :].reshape(batch, seqlen, hv, dv)
    b, a = ba[..., :r].reshape(batch, seqlen, hv), ba[..., r:].reshape(batch, seqlen, hv)
    mixed = torch.cat([t.reshape(batch, seqlen, -1) for t in (q, k, v)], -1).transpose(1, 2)
    w = p["conv1d.weight"]
    mixed = F.silu(F.conv1d(F.pad(mixed, (w.shape[-1] - 1, 0)), w, groups=mixed.shape[1]))  # left pad: causal
    q, k, v = mixed.transpose(1, 2).split([hk * dk, hk * dk, hv * dv], -1)
    q, k = (t.reshape(batch, seqlen, hk, dk) for t in (q, k))
    q, k = (t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))  # Qwen3-Next's l2norm
    q, k = q.repeat_interleave(r, 2), k.repeat_interleave(r, 2)  # key head h serves value heads h·r … h·r + r − 1
    g = -torch.exp(p["A_log"]) * F.softplus(a + p["dt_bias"])
    o, _ = gated_delta_rule_ref(q, k, v.reshape(batch, seqlen, hv, dv), g, torch.sigmoid(b), reset=reset)
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + EPS) * p["norm.weight"] * F.silu(z)
    return o.reshape(batch, seqlen, -1) @ p["out_proj.weight"].T


@pytest.mark.parametrize("n_k_heads, seqlen", [(2, 11), (4, 9), (1, 1)])
def test_forward_matches_explicit_recomputation(n_k_heads, seqlen):
    layer = randomize(build(n_k_heads=n_k_heads))
    x = torch.randn(2, seqlen, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(layer(x), recompute(layer, x), rtol=1e-10, atol=1e-12)


def qwen3_next_pair():
    """transformers' own layer (its PyTorch paths: the fla and causal-conv1d packages are not installed) and ours,
    in fp32, with our weights copied by name: the names and the packing of the fused projections are Qwen3-Next's."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    hf_cfg = Qwen3NextConfig(
        hidden_size=D_MODEL,
        linear_num_key_heads=SHAPES["n_k_heads"],
        linear_num_value_heads=SHAPES["n_v_heads"],
        linear_key_head_dim=SHAPES["head_k_dim"],
        linear_value_head_dim=SHAPES["head_v_dim"],
        linear_conv_kernel_dim=SHAPES["conv_size"],
        rms_norm_eps=EPS,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    theirs = qwen3_next.Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=0).float()
    ours = randomize(build(dtype=torch.float32))
    with torch.no_grad():  # outputs O(1): both sides' fp32 rounding (~1e-6 of the output's size) stays under 1e-5
        ours.out_proj.weight.mul_(0.2)
    theirs.load_state_dict(ours.state_dict(), strict=True)  # same names, same shapes
    return ours, theirs, hf_cfg


def test_matches_transformers_qwen3_next():
    ours, theirs, _ = qwen3_next_pair()
    x = torch.randn(2, 70, D_MODEL)  # 70: several of transformers' chunks of 64, and several of ours
    with torch.no_grad():
        want = theirs(x)
        diff = (ours(x) - want).abs().max().item()
    assert diff <= 1e-5 and want.abs().max() > 0.5, (diff, want.abs().max())


def test_cached_decoding_matches_transformers():
    """A prompt then one position per call, through our cache and through transformers' DynamicCache."""
    from transformers import DynamicCache

    ours, theirs, hf_cfg = qwen3_next_pair()
    x = torch.randn(2, 12, D_MODEL)
    cache, state = DynamicCache(config=hf_cfg), ours.new_state(2, x.device, x.dtype)
    with torch.no_grad():
        want = [theirs(x[:, :5], cache=cache)] + [theirs(x[:, t : t + 1], cache=cache) for t in range(5, 12)]
        got = [ours(x[:, :5], state)] + [ours(x[:, t : t + 1], state) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(state.recurrent, cache.get_recurrent_state(0), rtol=0, atol=1e-5)


def test_parameter_names():
    expected = {
        "in_proj_qkvz.weight",
        "in_proj_ba.weight",
        "conv1d.weight",
        "dt_bias",
        "A_log",
        "norm.weight",
        "out_proj.weight",
    }
    assert {name for name, _ in build().named_parameters()} == expected


def test_bf16_activations():
    layer = randomize(build(dtype=torch.float32))
    x = torch.randn(2, 20, D_MODEL)
    want = layer(x)
    got = layer.to(torch.bfloat16)(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2 * want.abs().max().item())


def test_delta_rule_kernel_auto_is_the_torch_path_off_cuda():
    """The kernel function itself (the layer's choice: test_mixers.py)."""
    assert delta_rule_kernel("auto", "cpu").name == "torch"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.gdn.n_k_heads=3", "model.gdn.n_k_heads: must divide n_v_heads=4, got 3"),
        ("model.gdn.chunk_size=48", "model.gdn.chunk_size: must be a power of two, got 48"),
        ("model.gdn.head_k_dim=0", "model.gdn.head_k_dim: must be positive, got 0"),
    ],
)
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == message
