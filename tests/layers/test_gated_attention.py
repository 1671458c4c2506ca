"""Qwen3-Next's attention and norms against references written here in fp64: the output gate (wq's rows per head
[q | gate], sigmoid on every output channel), partial RoPE (the first int(Dh × rope_fraction) dims rotated with
their own frequencies, the rest passed through), and the zero-centred RMSNorm (scale 1 + weight)."""

import math

import pytest
import torch
from layers.test_attention import attention_ref, build, rope_ref

from moe_dist.config import ConfigError, load_config
from moe_dist.layers.norm import RMSNorm

F64 = torch.float64
TOL = dict(rtol=2e-5, atol=2e-5)  # RoPE's cos/sin are fp32 whatever the dtype (rope.py)


def gated_partial_ref(layer, x, n_heads, n_kv_heads, head_dim, rotary, theta):
    """Attention with wq's per-head [q | gate] rows, RoPE on the first `rotary` dims of each head, and the
    concatenated heads times sigmoid(gate) before wo."""
    B, S, _ = x.shape
    wq = layer.wq.weight.view(n_heads, 2, head_dim, -1)
    q_w, g_w = wq[:, 0].reshape(n_heads * head_dim, -1), wq[:, 1].reshape(n_heads * head_dim, -1)
    gate = torch.sigmoid(x @ g_w.T)  # (B, S, H·Dh)

    def rope_first(t):
        return torch.cat([rope_ref(t[..., :rotary], theta), t[..., rotary:]], dim=-1)

    q = rope_first((x @ q_w.T).view(B, S, n_heads, head_dim).transpose(1, 2))
    k = rope_first((x @ layer.wk.weight.T).view(B, S, n_kv_heads, head_dim).transpose(1, 2))
    v = (x @ layer.wv.weight.T).view(B, S, n_kv_heads, head_dim).transpose(1, 2)
    group = n_heads // n_kv_heads
    k = torch.stack([k[:, h // group] for h in range(n_heads)], dim=1)
    v = torch.stack([v[:, h // group] for h in range(n_heads)], dim=1)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    probs = ((q @ k.transpose(-1, -2)) / math.sqrt(head_dim)).masked_fill(mask, float("-inf")).softmax(-1)
    out = (probs @ v).transpose(1, 2).reshape(B, S, n_heads * head_dim)
    return (out * gate) @ layer.wo.weight.T


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_gated_partial_rope_attention_matches_reference(fraction):
    layer = build(n_heads=4, n_kv_heads=2, head_dim=8, output_gate=True, rope_fraction=fraction)
    assert layer.wq.weight.shape == (4 * 2 * 8, 16)
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1), dtype=F64)
    want = gated_partial_ref(layer, x, 4, 2, 8, int(8 * fraction), 10000.0)
    torch.testing.assert_close(layer(x), want, **TOL)


def test_partial_rope_leaves_the_other_dims_unrotated():
    """With rope_fraction 0.5 and no gate: the attention of the reference whose q/k are rotated on half their dims
    only, which differs from full RoPE (so the fraction is not ignored)."""
    layer = build(n_heads=2, n_kv_heads=2, head_dim=8, rope_fraction=0.5)
    x = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(2), dtype=F64)
    w = [getattr(layer, n).weight for n in ("wq", "wk", "wv", "wo")]
    full = attention_ref(x, *w, 2, 2, 8, 10000.0)
    out = layer(x)
    assert (out - full).abs().max() > 1e-3
    ungated = build(n_heads=2, n_kv_heads=2, head_dim=8, output_gate=True, rope_fraction=0.5)
    with torch.no_grad():  # gate rows zero: sigmoid(0) = 1/2 on every channel, the query rows the plain layer's
        ungated.wq.weight.view(2, 2, 8, 16)[:, 0] = layer.wq.weight.view(2, 8, 16)
        ungated.wq.weight.view(2, 2, 8, 16)[:, 1] = 0
        for n in ("wk", "wv", "wo"):
            getattr(ungated, n).weight.copy_(getattr(layer, n).weight)
    torch.testing.assert_close(ungated(x), out / 2, rtol=1e-12, atol=1e-12)


def test_gated_attention_with_cache_and_documents_equals_the_full_forward():
    layer = build(n_heads=4, n_kv_heads=2, head_dim=8, output_gate=True, rope_fraction=0.25, qk_norm="head")
    x = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(3), dtype=F64)
    full = layer(x)
    cache = layer.new_cache(1, 9, x.device, F64)
    steps = torch.cat([layer(x[:, :5], cache), *[layer(x[:, t : t + 1], cache) for t in range(5, 9)]], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-12, atol=1e-12)
    docs = torch.tensor([[0] * 4 + [1] * 5])  # the second document alone equals its own forward
    torch.testing.assert_close(layer(x, document_ids=docs)[:, 4:], layer(x[:, 4:]), rtol=1e-12, atol=1e-12)


def test_zero_centred_rmsnorm_scales_by_one_plus_weight():
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(4), dtype=F64)
    norm = RMSNorm(8, 1e-6, zero_centered=True).double()
    norm.init_weights()
    assert torch.equal(norm.weight.detach(), torch.zeros(8, dtype=F64))  # scale one at init
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8, dtype=F64))
    want = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6) * (1 + torch.linspace(-0.5, 0.5, 8, dtype=F64))
    torch.testing.assert_close(norm(x), want, rtol=1e-12, atol=1e-12)


def test_rope_fraction_must_rotate_an_even_number_of_dims():
    with pytest.raises(ConfigError, match="model.attention.rope_fraction"):
        load_config(None, ["model.attention.head_dim=8", "model.attention.rope_fraction=0.125"])
    with pytest.raises(ConfigError, match="model.attention.rope_fraction"):
        load_config(None, ["model.attention.rope_fraction=0"])
