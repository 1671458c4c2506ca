"""Multi-head Latent Attention: the layer against an explicit per-head recomputation (interleaved RoPE written as
complex rotations, an independent form), the latent cache against the full forward and in greedy decoding, RoPE off,
YaRN's frequencies and factors against transformers', config rules. What every mixer kind shares (causality, meta
build + init, backward, documents): test_mixers.py."""

import math

import pytest
import torch

from moe_dist.config import ConfigError, config_from_dict, load_config
from moe_dist.layers.mla import MLA, MLACache, MLAConfig
from moe_dist.layers.rope import RopeScaling, rope_cos_sin
from moe_dist.layers.sequence_shard import SeqShard
from moe_dist.models.decoder import build_model, generate, materialize_whole

F64 = torch.float64
D_MODEL = 24
SHAPES = dict(n_heads=3, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
YARN = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=6, mscale=0.707, mscale_all_dim=1.0)
TOL = dict(rtol=2e-5, atol=2e-5)  # RoPE runs in fp32 inside the fp64 layer (apply_rope)


def build(seed=0, **overrides):
    """fp64, O(1) random weights everywhere (norm weights too), so that no wiring hides behind 0 or 1."""
    layer = MLA(D_MODEL, MLAConfig(**{**SHAPES, **overrides}), init_std=0.02, n_layers=2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.5)
    return layer.double()


def recompute(layer: MLA, x: torch.Tensor) -> torch.Tensor:
    """MLA head by head from the weights, with the interleaved RoPE pairs as complex numbers times e^(i·pos·freq)."""
    cfg, p = layer.cfg, dict(layer.named_parameters())
    B, S, _ = x.shape
    H, dn, dr, dv, C = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    def rms(t, w):
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + cfg.norm_eps) * w

    q = (
        x @ p["wq.weight"].T
        if cfg.q_lora_rank is None
        else rms(x @ p["wq_a.weight"].T, p["q_norm.weight"]) @ p["wq_b.weight"].T
    )
    q = q.view(B, S, H, dn + dr)
    kv = x @ p["wkv_a.weight"].T
    latent, k_r = rms(kv[..., :C], p["kv_norm.weight"]), kv[..., C:]  # (B, S, C), (B, S, dr)
    up = (latent @ p["wkv_b.weight"].T).view(B, S, H, dn + dv)
    cos, sin = rope_cos_sin(S, dr, cfg.rope_theta, x.device, cfg.rope_scaling)
    # interleaved pairs (x0, x1), (x2, x3), ... each turned by one frequency (cos[:, j] for pair j)
    turn = torch.complex(cos[:, : dr // 2].double(), sin[:, : dr // 2].double())  # (S, dr/2), |turn| = YaRN factor
    outs = []
    for h in range(H):
        q_r = torch.view_as_complex(q[:, :, h, dn:].reshape(B, S, dr // 2, 2).contiguous()) * turn
        k_rot = torch.view_as_complex(k_r.reshape(B, S, dr // 2, 2).contiguous()) * turn
        rope_scores = (q_r[:, :, None] * k_rot[:, None].conj()).real.sum(-1)  # (B, S, S): Re(q · conj k)
        scores = (q[:, :, h, :dn] @ up[:, :, h, :dn].transpose(1, 2) + rope_scores) * layer.scale
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(scores.softmax(-1) @ up[:, :, h, dn:])  # (B, S, dv)
    return torch.cat(outs, -1) @ p["wo.weight"].T


@pytest.mark.parametrize("q_lora_rank, scaling", [(7, YARN), (None, RopeScaling())])
def test_matches_explicit_recomputation_with_interleaved_rope(q_lora_rank, scaling):
    layer = build(q_lora_rank=q_lora_rank, rope_interleave=True, rope_scaling=scaling)
    x = torch.randn(2, 11, D_MODEL, dtype=F64)
    torch.testing.assert_close(layer(x), recompute(layer, x), **TOL)


def test_half_split_layout_is_the_interleaved_one_with_permuted_weights():
    """rope_interleave only says how the RoPE slice is stored: permuting wq_b's and wkv_a's RoPE rows from
    interleaved to half-split order gives the same layer with rope_interleave false."""
    inter = build(q_lora_rank=7, rope_interleave=True)
    half = build(q_lora_rank=7, rope_interleave=False)
    dq, dn, dr, C = 10, 6, 4, 10
    perm = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])
    with torch.no_grad():
        half.load_state_dict(inter.state_dict())
        wq_b = half.wq_b.weight.view(3, dq, -1)
        wq_b[:, dn:] = wq_b[:, dn:][:, perm].clone()
        half.wkv_a.weight[C:] = half.wkv_a.weight[C:][perm].clone()
    x = torch.randn(2, 9, D_MODEL, dtype=F64)
    torch.testing.assert_close(half(x), inter(x), rtol=1e-12, atol=1e-12)


def test_latent_cache_decoding_equals_full_forward():
    """The cache holds the latent and the RoPE key (C + dr per token), not per-head keys and values; a prompt, then
    one position per call, then a last call of two equal the full forward at those positions."""
    layer = build(q_lora_rank=7, rope_interleave=True, rope_scaling=YARN)
    x = torch.randn(2, 13, D_MODEL, dtype=F64)
    cache = layer.new_cache(2, 13, x.device, x.dtype)
    assert isinstance(cache, MLACache) and cache.latent.shape == (2, 13, 10) and cache.k_rope.shape == (2, 1, 13, 4)
    outs = [layer(x[:, :5], cache)] + [layer(x[:, t : t + 1], cache) for t in range(5, 11)] + [layer(x[:, 11:], cache)]
    torch.testing.assert_close(torch.cat(outs, 1), layer(x), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="exceed the cache's max_len 13"):
        layer(x[:, :1], cache)


def test_greedy_decoding_with_the_cache_equals_recomputation():
    cfg = config_from_dict(
        {
            "model": {
                "d_model": 32,
                "n_layers": 2,
                "mixer_pattern": "L",
                "ffn_pattern": "DE",
                "moe": {"capacity_factor": None, "num_experts": 4, "d_ff": 16},
                "mla": {**SHAPES, "q_lora_rank": 8, "rope_interleave": True},
            }
        }
    ).model
    model = materialize_whole(build_model(cfg), "cpu", seed=0)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(generate(model, prompt, 8, temperature=0), generate(model, prompt, 8, 0, use_cache=False))


def test_without_rope_the_last_query_ignores_the_order_of_earlier_keys():
    """Kimi Linear's MLA (rope false) has no position signal: permuting the positions before the last leaves the
    last output unchanged; with RoPE it moves."""
    x = torch.randn(1, 8, D_MODEL, dtype=F64)
    shuffled = torch.cat([x[:, torch.randperm(7, generator=torch.Generator().manual_seed(1))], x[:, 7:]], 1)
    off, on = build(rope=False), build(rope=True)
    torch.testing.assert_close(off(shuffled)[:, -1], off(x)[:, -1], rtol=1e-10, atol=1e-12)
    assert (on(shuffled)[:, -1] - on(x)[:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "params",
    [
        dict(factor=4.0, original_max_position_embeddings=6, mscale=0.707, mscale_all_dim=1.0),
        dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1),
        dict(factor=8.0, original_max_position_embeddings=100, attention_factor=1.3, truncate=False),
        # Kimi K2's: beta_fast = beta_slow, a step where the ramp would divide by zero
        dict(
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=1.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ],
)
def test_yarn_matches_transformers(params):
    """rope.py's YaRN frequencies and cos/sin factor equal transformers' `rope_parameters` of type yarn, and MLA's
    softmax scale takes DeepSeek's mscale(factor, mscale_all_dim)² as transformers' DeepseekV3Attention does."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.DeepseekV3Config(
        qk_rope_head_dim=64, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **params}
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    scaling = RopeScaling(type="yarn", **params)
    cos, sin = rope_cos_sin(50, 64, 10000.0, "cpu", scaling)
    angles = torch.outer(torch.arange(50, dtype=torch.float32), inv_freq)
    torch.testing.assert_close(cos[:, :32], angles.cos() * factor, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:, 32:], angles.sin() * factor, rtol=1e-6, atol=1e-6)
    mla = MLAConfig(qk_nope_head_dim=128, qk_rope_head_dim=64, rope_scaling=scaling)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    assert math.isclose(mla.scale(), yarn_apply_mscale(hf.rope_parameters, 192**-0.5), rel_tol=1e-12)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model.mla.qk_rope_head_dim=5",
            "model.mla.qk_rope_head_dim: RoPE rotates pairs, must be positive and even, got 5",
        ),
        ("model.mla.q_lora_rank=0", "model.mla.q_lora_rank: must be positive or null, got 0"),
        ("model.mla.kv_lora_rank=0", "model.mla.kv_lora_rank: must be positive, got 0"),
        ("model.mla.rope_scaling.type=yarn", None),
        (
            "model.mla.mask=prefix",
            "model.mla.mask: 'prefix' needs data.document_masking=true (the prompt is found per document)",
        ),
    ],
)
def test_config_errors_name_the_key(override, message):
    if message is None:  # YaRN with its defaults is a valid section; a factor below 1 is not
        load_config(None, [override])
        with pytest.raises(
            ConfigError, match=r"^model\.mla\.rope_scaling\.factor: YaRN's factor must be >= 1, got 0.5$"
        ):
            load_config(None, [override, "model.mla.rope_scaling.factor=0.5"])
        with pytest.raises(
            ConfigError, match=r"^model\.mla\.rope_scaling\.beta_fast: must be >= beta_slow=1.0, got 0.5$"
        ):
            load_config(None, [override, "model.mla.rope_scaling.beta_fast=0.5"])
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == message


def test_tensor_parallel_head_split_is_checked_by_name():
    with pytest.raises(ConfigError, match=r"^model\.mla\.n_heads: MLA heads 3 is not divisible by parallel\.tp=2$"):
        load_config(None, ["model.mixer_pattern=L", "model.mla.n_heads=3", "parallel.tp=2"])
    with pytest.raises(ValueError, match=r"^model\.mla\.impl='triton': there is no Triton MLA attention kernel yet"):
        MLA(D_MODEL, MLAConfig(**SHAPES, impl="triton"), 0.02, 2)


def test_prefix_lm_prompt_tokens_see_each_other_within_their_document():
    """`prefix` with documents: a prompt token sees the later prompt tokens of its document, never a token after
    the prompt nor another document."""
    layer = build(mask="prefix")
    x = torch.randn(1, 10, D_MODEL, dtype=F64)
    ids = torch.tensor([[0] * 6 + [1] * 4])
    prefix = torch.tensor([[True] * 3 + [False] * 3 + [True] * 2 + [False] * 2])
    base = layer(x, document_ids=ids, prefix=prefix)
    for t, moved, still in ((2, [0, 1], []), (4, [], [0, 1, 2, 3]), (7, [6], [0, 1, 2, 3, 4, 5])):
        x2 = x.clone()
        x2[:, t] += 1.0
        out = layer(x2, document_ids=ids, prefix=prefix)
        assert all((out[0, i] - base[0, i]).abs().max() > 1e-6 for i in moved), t
        torch.testing.assert_close(out[0, still], base[0, still], rtol=0, atol=1e-12)


class OneProcessGroup:
    """A CP group simulated in one process: each rank's all-gather returns every rank's tensor as recorded by an
    earlier call of that rank (its own live, so this is a forward-only check: tests/parallel/test_cp_mla.py runs
    real ranks, backward too)."""

    def __init__(self, rank: int, size: int, seen: dict):
        self.rank, self.size, self.seen = rank, size, seen

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self.seen[self.rank] = x.detach()
        return torch.cat(
            [x if r == self.rank else self.seen.get(r, torch.zeros_like(x)) for r in range(self.size)], dim
        )


@pytest.mark.parametrize("cp, masks", [(2, "documents"), (4, "prefix"), (2, None)])
def test_context_parallel_pieces_equal_the_whole_sequence(cp, masks):
    """Under CP each rank holds a head and a tail piece and gathers only the latent and RoPE key (C + dr per
    position): its outputs equal the whole-sequence layer's at its positions, RoPE angles and masks global."""
    layer = build(
        q_lora_rank=7, rope_interleave=True, rope_scaling=YARN, mask="prefix" if masks == "prefix" else "causal"
    )
    S = 16
    x = torch.randn(2, S, D_MODEL, dtype=F64)
    kw = {}
    if masks is not None:  # documents cut inside pieces and at a piece edge
        kw["document_ids"] = torch.tensor([[0] * 5 + [1] * 3 + [2] * 8, [0] * 11 + [1] * 5])
    if masks == "prefix":
        kw["prefix"] = torch.tensor([[1, 1, 0, 0, 0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]] * 2, dtype=torch.bool)
    whole = layer(x, **kw)
    seen: dict = {}
    shards = [SeqShard(cp, r, S, OneProcessGroup(r, cp, seen)) for r in range(cp)]
    for shard in shards:  # records every rank's gathered tensor
        layer(shard.local(x), shard=shard, **kw)
    for shard in shards:
        torch.testing.assert_close(layer(shard.local(x), shard=shard, **kw), shard.local(whole), rtol=1e-10, atol=1e-12)
    assert seen[0].shape == (2, S // cp, 10 + 4)  # C + dr per position: no per-head keys or values
