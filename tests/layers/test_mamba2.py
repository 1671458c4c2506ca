"""Mamba-2 mixer: equal to transformers' own mixers (Mamba2, NemotronH, GraniteMoeHybrid) with the same weights and
to an explicit recomputation on the step-by-step reference; parameter names, bf16, config errors. What every
mixer kind shares (causality, meta build + init, seeds, backward, documents, cache): test_mixers.py."""

import pytest
import torch
import torch.nn.functional as F
from moe_dist.kernels.reference import ssd_scan_ref
from transformers import GraniteMoeHybridConfig, NemotronHConfig
from transformers import Mamba2Config as HFMamba2Config
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from moe_dist.config import ConfigError, Mamba2Config
from moe_dist.layers.mamba2 import Mamba2

D_MODEL, EPS = 16, 1e-5
SHAPE = {"d_state": 5, "d_conv": 4, "expand": 2, "head_dim": 4, "chunk_size": 8}  # 8 heads of 4


def build(seed=0, dtype=torch.float64, **overrides):
    """Build on meta, materialize on CPU and init from a seeded RNG, as the trainer does; fp64 for tight checks."""
    cfg = Mamba2Config(**{"n_groups": 2, **SHAPE, **overrides})
    with torch.device("meta"):
        layer = Mamba2(D_MODEL, cfg, norm_eps=EPS, init_std=0.02)
    layer.to_empty(device="cpu")
    torch.manual_seed(seed)
    layer.init_weights()
    return layer.to(dtype)


def randomize(layer, seed=1):
    """Give every parameter (norm weight and biases too) a random value so no wiring mistake hides behind 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer


def recompute(layer, x, reset=None):
    """The Mamba-2 block written out against the step-by-step reference scan (no document-masked conv: `reset` is
    only used where the conv window cannot cross a document start)."""
    p = dict(layer.named_parameters())
    Di, H, P, G, N = layer.d_inner, layer.n_heads, layer.head_dim, layer.n_groups, layer.d_state
    zxbcdt = x @ p["in_proj.weight"].T + p.get("in_proj.bias", 0)
    z, xBC, dt = zxbcdt[..., :Di], zxbcdt[..., Di:-H], zxbcdt[..., -H:]
    conv_in = F.pad(xBC.transpose(1, 2), (p["conv1d.weight"].shape[-1] - 1, 0))  # left pad only: causal
    xBC = F.silu(F.conv1d(conv_in, p["conv1d.weight"], p.get("conv1d.bias"), groups=layer.conv_dim)).transpose(1, 2)
    u, B, C = xBC[..., :Di], xBC[..., Di : Di + G * N], xBC[..., Di + G * N :]
    dt = F.softplus(dt + p["dt_bias"])
    if layer.dt_limit is not None:
        dt = dt.clamp(*layer.dt_limit)
    b, L = x.shape[:2]
    y, _ = ssd_scan_ref(
        u.view(b, L, H, P), dt, -torch.exp(p["A_log"]), B.view(b, L, G, N), C.view(b, L, G, N), p["D"], reset=reset
    )
    h = (y.reshape(b, L, Di) * F.silu(z)).view(b, L, G, Di // G)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).view(b, L, Di) * p["norm.weight"]
    return h @ p["out_proj.weight"].T + p.get("out_proj.bias", 0)


@pytest.mark.parametrize("n_groups", [1, 2, 8])
@pytest.mark.parametrize("proj_bias, conv_bias, dt_limit", [(False, True, None), (True, False, [0.05, 0.5])])
def test_forward_matches_explicit_recomputation(n_groups, proj_bias, conv_bias, dt_limit):
    layer = randomize(build(n_groups=n_groups, proj_bias=proj_bias, conv_bias=conv_bias, dt_limit=dt_limit))
    x = torch.randn(2, 19, D_MODEL, dtype=torch.float64)  # 19: two chunks of 8 plus a tail
    out = layer(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, recompute(layer, x), rtol=1e-10, atol=1e-12)


def _transformers_mixer(family, n_groups, dt_limit):
    """A tiny transformers Mamba-2 mixer of `family` with our test shape (8 heads of 4, state 5, conv 4)."""
    if family == "mamba2":
        cfg = HFMamba2Config(
            hidden_size=D_MODEL,
            num_heads=8,
            head_dim=4,
            state_size=5,
            n_groups=n_groups,
            conv_kernel=4,
            expand=2,
            chunk_size=8,
            num_hidden_layers=1,
            layer_norm_epsilon=EPS,
            time_step_limit=dt_limit,
        )
        return Mamba2Mixer(cfg, 0)
    if family == "nemotron_h":  # its dt limit is (time_step_min, inf)
        cfg = NemotronHConfig(
            hidden_size=D_MODEL,
            mamba_num_heads=8,
            mamba_head_dim=4,
            ssm_state_size=5,
            n_groups=n_groups,
            conv_kernel=4,
            chunk_size=8,
            layer_norm_epsilon=EPS,
            time_step_min=dt_limit[0],
            layers_block_type=["mamba"],
            num_hidden_layers=1,
        )
        return NemotronHMamba2Mixer(cfg, 0)
    cfg = GraniteMoeHybridConfig(  # no dt limit
        hidden_size=D_MODEL,
        mamba_n_heads=8,
        mamba_d_head=4,
        mamba_d_state=5,
        mamba_n_groups=n_groups,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        mamba_expand=2,
        rms_norm_eps=EPS,
        layer_types=["mamba"],
        num_hidden_layers=1,
    )
    return GraniteMoeHybridMambaLayer(cfg, 0)


@pytest.mark.parametrize(
    "family, n_groups, dt_limit",
    [
        ("mamba2", 1, (0.0, float("inf"))),
        ("mamba2", 2, (0.05, 0.5)),
        ("nemotron_h", 2, (0.3, float("inf"))),  # a lower limit that clamps: without it outputs differ by ~1e-2
        ("granitemoehybrid", 2, (0.0, float("inf"))),
    ],
)
def test_equals_transformers_mixer(family, n_groups, dt_limit):
    """The strongest check that this is the real Mamba-2: transformers' own mixers (their PyTorch path on CPU) with
    our state dict loaded strictly (same names and shapes), fp32 outputs within 1e-5."""
    theirs = _transformers_mixer(family, n_groups, dt_limit).eval()
    limit = None if dt_limit == (0.0, float("inf")) else list(dt_limit)
    ours = randomize(build(n_groups=n_groups, dt_limit=limit, dtype=torch.float32, chunk_size=16))
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 21, D_MODEL)
    with torch.no_grad():
        expected, out = theirs(x), ours(x)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_parameter_names():
    expected = {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight"}
    expected |= {"out_proj.weight"}
    layer = build()
    assert {name for name, _ in layer.named_parameters()} == expected
    assert layer.in_proj.weight.shape == (2 * 32 + 2 * 2 * 5 + 8, D_MODEL)  # z, x, B, C, dt
    biased = {name for name, _ in build(proj_bias=True, conv_bias=False).named_parameters()}
    assert biased == expected - {"conv1d.bias"} | {"in_proj.bias", "out_proj.bias"}


def test_n_heads_sets_the_width():
    layer = build(n_heads=6)  # d_inner = 6 * 4 = 24, not expand * d_model
    assert (layer.n_heads, layer.d_inner) == (6, 24)
    assert layer(torch.randn(1, 5, D_MODEL, dtype=torch.float64)).shape == (1, 5, D_MODEL)


def test_bf16_forward_is_close_to_fp64():
    layer = randomize(build())
    x = torch.randn(2, 19, D_MODEL, dtype=torch.float64)
    exact = layer(x)
    out = layer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), exact, rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"head_dim": 5},
            "model.mamba2.head_dim: must divide d_inner = expand * d_model = 32 when n_heads is null, got 5",
        ),
        ({"n_groups": 3}, "model.mamba2.n_groups: must divide the 8 heads (d_inner / head_dim), got 3"),
        ({"chunk_size": 6}, "model.mamba2.chunk_size: must be a power of two, got 6"),
    ],
)
def test_bad_shapes_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        Mamba2(D_MODEL, Mamba2Config(**{**SHAPE, **overrides}), norm_eps=EPS, init_std=0.02)
    assert str(e.value) == message
