"""Mixtral: attention and a softmax top-k MoE (renormalized) in every layer; experts `block_sparse_moe.experts.e.
{w1, w3, w2}`, router `block_sparse_moe.gate`."""

from __future__ import annotations

from moe_dist.config import AttentionConfig, ModelConfig, MoEConfig
from moe_dist.hf.common import (
    Family,
    attention_model,
    attention_names,
    check_silu,
    get,
    reasons,
    rope_theta,
    router_unfit,
)
from moe_dist.models.decoder import layer_kinds


def from_hf(hf: dict) -> ModelConfig:
    check_silu(hf)
    n_heads = get(hf, "num_attention_heads", 32)
    num_experts = get(hf, "num_local_experts", 8)
    attention = AttentionConfig(
        n_heads=n_heads,
        n_kv_heads=get(hf, "num_key_value_heads", n_heads),
        head_dim=hf.get("head_dim"),
        rope=True,
        rope_theta=rope_theta(hf),
        sliding_window=hf.get("sliding_window"),
    )
    return attention_model(
        hf,
        vocab=32000,
        d_ff=14336,
        eps=1e-5,
        ffn_pattern="E",
        attention=attention,
        moe=MoEConfig(
            num_experts=num_experts,
            top_k=min(get(hf, "num_experts_per_tok", 2), num_experts),
            capacity_factor=None,
            renormalize=True,
        ),
    )


def unfit(cfg: ModelConfig) -> list[str]:
    kinds = layer_kinds(cfg)
    a, moe = cfg.attention, cfg.moe
    return router_unfit(cfg) + reasons(
        [
            (any(m != "attention" for m, _ in kinds), "every mixer must be attention"),
            (any(f != "moe" for _, f in kinds), "every FFN must be MoE"),
            (not a.rope, "attention.rope must be true"),
            (a.qk_norm != "none", "attention.qk_norm must be 'none'"),
            (a.qkv_bias, "attention.qkv_bias must be false"),
            (not moe.renormalize, "moe.renormalize must be true"),
            (moe.n_shared_experts > 0, "moe.n_shared_experts must be 0"),
        ]
    )


def to_hf(cfg: ModelConfig, out: dict) -> None:
    a, moe = cfg.attention, cfg.moe
    out.update(
        intermediate_size=moe.d_ff or cfg.d_ff,
        num_local_experts=moe.num_experts,
        head_dim=a.head_dim,
        rope_theta=a.rope_theta,
        sliding_window=a.sliding_window,
    )
    out.setdefault("max_position_embeddings", 131072)


def names(name: str, num_experts: int) -> list[str]:
    return attention_names(
        name, num_experts, moe="block_sparse_moe", router="gate", experts={"w1": "w1", "w3": "w3", "w2": "w2"}
    )


FAMILY = Family("mixtral", "MixtralForCausalLM", from_hf, unfit, to_hf, names)
