"""Mamba mixer: wiring against an explicit recomputation, causality, meta build + init, parameter names."""

import math

import pytest
import torch
import torch.nn.functional as F
from moe_dist.kernels.reference import selective_scan_ref

from moe_dist.config import MambaConfig
from moe_dist.layers.mamba import Mamba

D_MODEL, EPS = 16, 1e-5


def build(seed=0, **overrides):
    """Build on meta, materialize on CPU and init from a seeded RNG, as the trainer does; fp64 for tight checks."""
    cfg = MambaConfig(d_state=4, d_conv=3, expand=2, chunk_size=4, **overrides)
    with torch.device("meta"):
        layer = Mamba(D_MODEL, cfg, norm_eps=EPS, init_std=0.02)
    layer.to_empty(device="cpu")
    torch.manual_seed(seed)
    layer.init_weights()
    return layer.double()


def randomize(layer, seed=1):
    """Give every parameter (norm weights and biases too) a random value so no wiring mistake hides behind 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def recompute(layer, x):
    """The Mamba block written out step by step against the sequential reference scan."""
    p = dict(layer.named_parameters())
    seqlen, d_inner, rank, state = x.shape[1], layer.d_inner, layer.dt_rank, layer.d_state
    xz = x @ p["in_proj.weight"].T + p.get("in_proj.bias", 0)
    u, z = xz[..., :d_inner], xz[..., d_inner:]  # (B, L, Di)
    conv_in = F.pad(u.transpose(1, 2), (p["conv1d.weight"].shape[-1] - 1, 0))  # left pad only: causal
    u = F.silu(F.conv1d(conv_in, p["conv1d.weight"], p.get("conv1d.bias"), groups=d_inner))  # (B, Di, L)
    x_dbl = u.transpose(1, 2) @ p["x_proj.weight"].T
    dt, B, C = x_dbl[..., :rank], x_dbl[..., rank : rank + state], x_dbl[..., rank + state :]
    if layer.inner_norms:
        dt, B, C = rms_norm(dt, p["dt_norm.weight"]), rms_norm(B, p["b_norm.weight"]), rms_norm(C, p["c_norm.weight"])
    delta = F.softplus(dt @ p["dt_proj.weight"].T + p["dt_proj.bias"])  # (B, L, Di)
    y = selective_scan_ref(
        u,
        delta.transpose(1, 2),
        -torch.exp(p["A_log"]),
        B.transpose(1, 2),
        C.transpose(1, 2),
        D=p["D"],
        z=z.transpose(1, 2),
    )
    assert y.shape[-1] == seqlen
    return y.transpose(1, 2) @ p["out_proj.weight"].T + p.get("out_proj.bias", 0)


@pytest.mark.parametrize("inner_norms", [False, True])
@pytest.mark.parametrize("proj_bias, conv_bias", [(False, True), (True, False)])
def test_forward_matches_explicit_recomputation(inner_norms, proj_bias, conv_bias):
    layer = randomize(build(inner_norms=inner_norms, proj_bias=proj_bias, conv_bias=conv_bias))
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)  # 11: several scan chunks of 4 plus a tail
    out = layer(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, recompute(layer, x), rtol=1e-10, atol=1e-12)


def test_causal():
    layer = randomize(build(inner_norms=True))
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    t = 6
    x2 = x.clone()
    x2[:, t] += torch.randn(2, D_MODEL, dtype=torch.float64)
    out, out2 = layer(x), layer(x2)
    torch.testing.assert_close(out2[:, :t], out[:, :t], rtol=0, atol=1e-14)
    assert (out2[:, t:] - out[:, t:]).abs().amax(dim=-1).min() > 1e-8  # the change reaches every later token


@pytest.mark.parametrize("inner_norms", [False, True])
def test_parameter_names(inner_norms):
    layer = build(inner_norms=inner_norms)
    expected = {
        "in_proj.weight",
        "conv1d.weight",
        "conv1d.bias",
        "x_proj.weight",
        "dt_proj.weight",
        "dt_proj.bias",
        "A_log",
        "D",
        "out_proj.weight",
    }
    if inner_norms:
        expected |= {"dt_norm.weight", "b_norm.weight", "c_norm.weight"}
    assert {name for name, _ in layer.named_parameters()} == expected

    biased = {name for name, _ in build(inner_norms=inner_norms, proj_bias=True, conv_bias=False).named_parameters()}
    assert biased == expected - {"conv1d.bias"} | {"in_proj.bias", "out_proj.bias"}


def test_meta_build_and_init():
    cfg = MambaConfig(d_state=8, dt_rank=3, inner_norms=True)
    with torch.device("meta"):
        layer = Mamba(D_MODEL, cfg, norm_eps=EPS, init_std=0.02)
    assert all(p.is_meta for p in layer.parameters())
    layer.to_empty(device="cpu")
    torch.manual_seed(0)
    layer.init_weights()
    d_inner = cfg.expand * D_MODEL

    A = -torch.exp(layer.A_log)
    torch.testing.assert_close(A, -torch.arange(1.0, 9.0).expand(d_inner, -1))
    torch.testing.assert_close(layer.D, torch.ones(d_inner))
    dt = F.softplus(layer.dt_proj.bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert dt.std() > 0  # sampled per channel, not a constant
    assert layer.dt_proj.weight.abs().max() <= 3**-0.5
    assert 0.01 < layer.in_proj.weight.std() < 0.03  # init_std = 0.02
    for norm in (layer.dt_norm, layer.b_norm, layer.c_norm):
        torch.testing.assert_close(norm.weight, torch.ones_like(norm.weight))
    assert torch.count_nonzero(layer.conv1d.bias) == 0

    out = layer(torch.randn(2, 9, D_MODEL))
    assert out.shape == (2, 9, D_MODEL) and torch.isfinite(out).all()


def test_init_is_deterministic_in_the_seed():
    """Every rank materializes its own copy: the same seed must give the same weights, another seed others."""
    a, b, c = build(seed=0), build(seed=0), build(seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    assert not torch.equal(a.in_proj.weight, c.in_proj.weight)
    assert not torch.equal(a.dt_proj.bias, c.dt_proj.bias)


def test_backward_reaches_every_parameter():
    layer = build(inner_norms=True, proj_bias=True)
    layer(torch.randn(2, 7, D_MODEL, dtype=torch.float64)).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_impl_choice():
    build(impl="auto")
    build(impl="torch")
    with pytest.raises(ValueError, match="Triton selective scan is not available"):
        Mamba(D_MODEL, MambaConfig(impl="triton"), norm_eps=EPS, init_std=0.02)


def test_default_dt_rank():
    layer = build()
    assert layer.dt_rank == math.ceil(D_MODEL / 16)
    assert layer.x_proj.weight.shape == (layer.dt_rank + 2 * layer.d_state, 2 * D_MODEL)
