"""Attention and RoPE against an explicit masked-softmax reference written here.

The reference repeats k/v heads explicitly for grouped-query attention, masks with a Python-built causal mask
and rotates with its own half-split RoPE from math.cos/math.sin, all in fp64. What every mixer kind shares
(causality, meta build + init, backward, documents): test_mixers.py.
"""

import math

import pytest
import torch

from moe_dist.config import AttentionConfig
from moe_dist.layers.attention import Attention, attention_kernel
from moe_dist.layers.rope import apply_rope, rope_cos_sin

F64 = torch.float64
D_MODEL = 16


def rope_ref(x, theta):
    """x (B, H, S, Dh): pair dimension i with i + Dh/2 and rotate the pair at position s by s * theta^(-2i/Dh)."""
    B, H, S, Dh = x.shape
    half = Dh // 2
    cos = torch.empty(S, half, dtype=F64)
    sin = torch.empty(S, half, dtype=F64)
    for s in range(S):
        for i in range(half):
            angle = s * theta ** (-2.0 * i / Dh)
            cos[s, i], sin[s, i] = math.cos(angle), math.sin(angle)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def attention_ref(x, wq, wk, wv, wo, n_heads, n_kv_heads, head_dim, theta, rope=True):
    """x (B, S, D) → (B, S, D); weights in nn.Linear layout (out, in)."""
    B, S, _ = x.shape
    q = (x @ wq.T).view(B, S, n_heads, head_dim).transpose(1, 2)
    k = (x @ wk.T).view(B, S, n_kv_heads, head_dim).transpose(1, 2)
    v = (x @ wv.T).view(B, S, n_kv_heads, head_dim).transpose(1, 2)
    if rope:
        q, k = rope_ref(q, theta), rope_ref(k, theta)
    group = n_heads // n_kv_heads
    k = torch.stack([k[:, h // group] for h in range(n_heads)], dim=1)  # query head h reads kv head h // group
    v = torch.stack([v[:, h // group] for h in range(n_heads)], dim=1)
    mask = torch.tensor([[j > i for j in range(S)] for i in range(S)])
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    out = (probs @ v).transpose(1, 2).reshape(B, S, n_heads * head_dim)
    return out @ wo.T


def build(n_heads=4, n_kv_heads=4, head_dim=None, theta=10000.0, seed=0, **cfg_kw):
    cfg = AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, rope_theta=theta, **cfg_kw)
    layer = Attention(D_MODEL, cfg, init_std=0.02, n_layers=2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # O(1) weights so the softmax is far from uniform and every term matters
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.5)
    return layer.double()


# RoPE runs in fp32 inside the layer (apply_rope docstring), so fp64 layers agree with the fp64 reference to ~1e-6.
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("seq_len", [1, 7, 33])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_matches_explicit_reference(n_kv_heads, seq_len):
    check_against_reference(build(n_heads=4, n_kv_heads=n_kv_heads), seq_len)


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim, theta", [(4, 2, 6, 100.0), (2, 1, 8, 10.0)])
def test_matches_reference_with_explicit_head_dim_and_theta(n_heads, n_kv_heads, head_dim, theta):
    check_against_reference(build(n_heads, n_kv_heads, head_dim=head_dim, theta=theta), 9)


def test_rope_off_matches_reference_without_rotation():
    """`rope: false` (Jamba's attention): no rotation at all, so no position information inside attention."""
    layer = build(n_heads=4, n_kv_heads=2, rope=False)
    check_against_reference(layer, 7, rope=False)
    with_rope = build(n_heads=4, n_kv_heads=2)
    x = torch.randn(1, 7, D_MODEL, dtype=F64)
    assert (layer(x) - with_rope(x)).abs().max() > 1e-2  # same weights (same seed): only the rotation differs


def check_against_reference(layer, seq_len, rope=True):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, seq_len, D_MODEL, generator=g, dtype=F64)
    up = torch.randn(2, seq_len, D_MODEL, generator=g, dtype=F64)
    ws = [lin.weight.detach().clone().requires_grad_(True) for lin in (layer.wq, layer.wk, layer.wv, layer.wo)]
    xl, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)

    out = layer(xl)
    ref = attention_ref(xr, *ws, layer.n_heads, layer.n_kv_heads, layer.head_dim, layer.rope_theta, rope=rope)
    assert out.shape == x.shape and out.dtype == F64
    torch.testing.assert_close(out, ref, **TOL)

    (out * up).sum().backward()
    (ref * up).sum().backward()
    torch.testing.assert_close(xl.grad, xr.grad, **TOL)
    for lin, w in zip((layer.wq, layer.wk, layer.wv, layer.wo), ws):
        torch.testing.assert_close(lin.weight.grad, w.grad, **TOL)


def test_reference_is_not_trivially_satisfied():
    """Different kv grouping or no RoPE must change the reference output (so the comparison above has teeth)."""
    layer = build(n_heads=4, n_kv_heads=2)
    x = torch.randn(1, 7, D_MODEL, dtype=F64)
    ws = [lin.weight.detach() for lin in (layer.wq, layer.wk, layer.wv, layer.wo)]
    ref = attention_ref(x, *ws, 4, 2, 4, 10000.0)
    no_rope = attention_ref(x, *ws, 4, 2, 4, 1e30)  # theta → ∞: all angles but the first pair's vanish
    assert (ref - no_rope).abs().max() > 1e-2
    # kv heads interleaved the other way round (h % n_kv instead of h // group) must differ too
    wk_swapped = ws[1].view(2, 4, D_MODEL).flip(0).reshape(8, D_MODEL)
    wv_swapped = ws[2].view(2, 4, D_MODEL).flip(0).reshape(8, D_MODEL)
    assert (ref - attention_ref(x, ws[0], wk_swapped, wv_swapped, ws[3], 4, 2, 4, 10000.0)).abs().max() > 1e-2


def test_batch_rows_are_independent():
    layer = build(n_heads=4, n_kv_heads=1)
    x = torch.randn(3, 5, D_MODEL, dtype=F64)
    out = layer(x)
    for b in range(3):
        torch.testing.assert_close(layer(x[b : b + 1]), out[b : b + 1], rtol=1e-12, atol=1e-12)


def test_attention_kernel_choice():
    """The kernel function itself (the layer's choice: test_mixers.py): "auto" is SDPA on the CPU and on CUDA."""
    assert attention_kernel("auto") == attention_kernel("torch") == attention_kernel("auto", "cuda")
    with pytest.raises(ValueError, match=r"model\.attention\.impl"):
        attention_kernel("triton")


# ------------------------------------------------------------------------------------------------- RoPE


def test_rope_cos_sin_values():
    cos, sin = rope_cos_sin(5, 6, 100.0, torch.device("cpu"))
    assert cos.shape == sin.shape == (5, 6) and cos.dtype == torch.float32
    for s in range(5):
        for d in range(6):
            angle = s * 100.0 ** (-2.0 * (d % 3) / 6)  # half-split: dims d and d + 3 share a frequency
            assert cos[s, d].item() == pytest.approx(math.cos(angle), abs=1e-6)
            assert sin[s, d].item() == pytest.approx(math.sin(angle), abs=1e-6)


@pytest.mark.parametrize("head_dim, theta", [(4, 10000.0), (8, 10.0), (6, 500.0)])
def test_apply_rope_matches_reference(head_dim, theta):
    x = torch.randn(2, 3, 11, head_dim, dtype=F64)
    cos, sin = rope_cos_sin(11, head_dim, theta, x.device)
    out = apply_rope(x, cos, sin)
    assert out.dtype == F64
    torch.testing.assert_close(out, rope_ref(x, theta), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16])
def test_rope_preserves_norms_and_position_zero_is_identity(dtype):
    x = torch.randn(2, 3, 17, 8).to(dtype)
    cos, sin = rope_cos_sin(17, 8, 10000.0, x.device)
    out = apply_rope(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double().norm(dim=-1), x.double().norm(dim=-1), rtol=tol, atol=tol)
    assert torch.equal(out[:, :, 0], x[:, :, 0])
    assert (out[:, :, 1:].double() - x[:, :, 1:].double()).abs().amax() > 1e-2  # later positions do rotate


def test_rope_scores_depend_only_on_relative_position():
    q = torch.randn(8, dtype=F64)
    k = torch.randn(8, dtype=F64)
    S = 12
    cos, sin = rope_cos_sin(S, 8, 10000.0, q.device)
    qs = apply_rope(q.expand(1, 1, S, 8), cos, sin)[0, 0]  # q placed at every position
    ks = apply_rope(k.expand(1, 1, S, 8), cos, sin)[0, 0]
    scores = qs @ ks.T  # scores[m, n] = <R_m q, R_n k>
    for offset in range(-3, 4):
        diag = torch.diagonal(scores, offset)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-5, atol=1e-5)
    assert (scores[0, 0] - scores[0, 3]).abs() > 1e-3
