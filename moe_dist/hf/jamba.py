"""Jamba: Mamba and attention mixers (no RoPE) at one period/offset each, dense and MoE FFNs likewise; experts
`feed_forward.experts.e.{gate,up,down}_proj`, router `feed_forward.router`, raw (not renormalized) top-k weights."""

from __future__ import annotations

import math

from moe_dist.config import AttentionConfig, MambaConfig, ModelConfig, MoEConfig
from moe_dist.hf.common import (
    Family,
    HFConfigError,
    check_silu,
    get,
    period_offset,
    reasons,
    router_unfit,
    tile,
    validated,
)
from moe_dist.models.decoder import layer_kinds

_MAMBA_PARAMS = (
    "in_proj.weight",
    "in_proj.bias",
    "conv1d.weight",
    "conv1d.bias",
    "x_proj.weight",
    "dt_proj.weight",
    "dt_proj.bias",
    "A_log",
    "D",
    "out_proj.weight",
    "out_proj.bias",
)


def from_hf(hf: dict) -> ModelConfig:
    check_silu(hf)
    n_layers, d_model = hf["num_hidden_layers"], hf["hidden_size"]
    num_experts = get(hf, "num_experts", 16)
    # num_experts 1 has no MoE layer; top_k is clipped so that the (unused) MoE section validates.
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=min(get(hf, "num_experts_per_tok", 2), num_experts),
        capacity_factor=None,
        renormalize=False,
    )
    attn_period, attn_offset = get(hf, "attn_layer_period", 8), get(hf, "attn_layer_offset", 4)
    exp_period, exp_offset = get(hf, "expert_layer_period", 2), get(hf, "expert_layer_offset", 1)
    dt_rank = get(hf, "mamba_dt_rank", "auto")
    mamba = MambaConfig(
        d_state=get(hf, "mamba_d_state", 16),
        d_conv=get(hf, "mamba_d_conv", 4),
        expand=get(hf, "mamba_expand", 2),
        dt_rank=math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank),
        conv_bias=bool(get(hf, "mamba_conv_bias", True)),
        proj_bias=bool(get(hf, "mamba_proj_bias", False)),
        inner_norms=True,
    )
    mixers = ["A" if i % attn_period == attn_offset else "M" for i in range(n_layers)]
    ffns = ["E" if i % exp_period == exp_offset and moe.num_experts > 1 else "D" for i in range(n_layers)]
    n_heads = get(hf, "num_attention_heads", 32)
    attention = AttentionConfig(
        n_heads=n_heads, n_kv_heads=get(hf, "num_key_value_heads", 8), head_dim=hf.get("head_dim"), rope=False
    )
    return validated(
        ModelConfig(
            vocab_size=get(hf, "vocab_size", 65536),
            d_model=d_model,
            n_layers=n_layers,
            d_ff=get(hf, "intermediate_size", 14336),
            tie_embeddings=bool(get(hf, "tie_word_embeddings", False)),
            init_std=float(get(hf, "initializer_range", 0.02)),
            mixer_pattern=tile(mixers),
            ffn_pattern=tile(ffns),
            norm_eps=float(get(hf, "rms_norm_eps", 1e-6)),
            attention=attention,
            mamba=mamba,
            moe=moe,
        )
    )


def unfit(cfg: ModelConfig) -> list[str]:
    kinds = layer_kinds(cfg)
    mixers, ffns = [m for m, _ in kinds], [f for _, f in kinds]
    a, moe = cfg.attention, cfg.moe
    return (router_unfit(cfg) if "moe" in ffns else []) + reasons(
        [
            (a.rope, "attention.rope must be false"),
            (a.sliding_window is not None, "attention.sliding_window must be null"),
            (a.qk_norm != "none" or a.qkv_bias, "attention.qk_norm must be 'none' and qkv_bias false"),
            ("moe" in ffns and moe.renormalize, "moe.renormalize must be false"),
            ("moe" in ffns and moe.n_shared_experts > 0, "moe.n_shared_experts must be 0"),
            (a.head_dim not in (None, cfg.d_model // a.n_heads), "attention.head_dim must be d_model // n_heads"),
            ("mamba1" in mixers and not cfg.mamba.inner_norms, "mamba.inner_norms must be true"),
            ("moe" in ffns and "mlp" in ffns and (moe.d_ff or cfg.d_ff) != cfg.d_ff, "moe.d_ff must equal d_ff"),
            (
                any(k not in ("attention", "mamba1") for k in mixers) or None in ffns,
                "every layer must be attention or mamba1 with an FFN (Jamba has no mamba2/gdn layers)",
            ),
            (period_offset(mixers, "attention") is None, "attention layers must sit at one period/offset"),
            (period_offset(ffns, "moe") is None, "MoE layers must sit at one period/offset"),
        ]
    )


def to_hf(cfg: ModelConfig, out: dict) -> None:
    kinds = layer_kinds(cfg)
    m, moe, has_moe = cfg.mamba, cfg.moe, any(f == "moe" for _, f in kinds)
    attn_period, attn_offset = period_offset([k for k, _ in kinds], "attention")
    exp_period, exp_offset = period_offset([f for _, f in kinds], "moe")
    out.update(
        intermediate_size=(moe.d_ff or cfg.d_ff) if has_moe else cfg.d_ff,
        num_experts=moe.num_experts if has_moe else 1,
        attn_layer_period=attn_period,
        attn_layer_offset=attn_offset,
        expert_layer_period=exp_period,
        expert_layer_offset=exp_offset,
        mamba_d_state=m.d_state,
        mamba_d_conv=m.d_conv,
        mamba_expand=m.expand,
        mamba_dt_rank=m.dt_rank or math.ceil(cfg.d_model / 16),
        mamba_conv_bias=m.conv_bias,
        mamba_proj_bias=m.proj_bias,
        use_mamba_kernels=False,
    )
    out.setdefault("max_position_embeddings", 262144)


def names(name: str, num_experts: int) -> list[str]:
    top = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "model.final_layernorm.weight",
    }
    if name in top:
        return [top[name]]
    _, layer, rest = name.split(".", 2)  # blocks.<i>.<rest>
    prefix = f"model.layers.{layer}."
    proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    simple = {
        "mixer_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "pre_ff_layernorm.weight",
        "ffn.router.weight": "feed_forward.router.weight",
        **{f"mixer.w{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkvo"},
        **{f"mixer.{p}": f"mamba.{p}" for p in _MAMBA_PARAMS},
        **{f"mixer.{x}_norm.weight": f"mamba.{x}_layernorm.weight" for x in ("dt", "b", "c")},
        **{f"ffn.{ours}.weight": f"feed_forward.{theirs}.weight" for ours, theirs in proj.items()},
    }
    if rest in simple:
        return [prefix + simple[rest]]
    if rest.startswith("ffn.experts."):
        which = {"w13": [proj["w1"], proj["w3"]], "w2": [proj["w2"]]}[rest.rsplit(".", 1)[1]]
        return [f"{prefix}feed_forward.experts.{e}.{w}.weight" for w in which for e in range(num_experts)]
    raise HFConfigError(f"{name}: no Hugging Face jamba counterpart")


FAMILY = Family("jamba", "JambaForCausalLM", from_hf, unfit, to_hf, names)
