"""Mamba mixer: wiring against an explicit recomputation, parameter names, the default dt rank.
What every mixer kind shares (causality, meta build + init, seeds, backward, documents, cache): test_mixers.py."""

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


def test_default_dt_rank():
    layer = build()
    assert layer.dt_rank == math.ceil(D_MODEL / 16)
    assert layer.x_proj.weight.shape == (layer.dt_rank + 2 * layer.d_state, 2 * D_MODEL)
