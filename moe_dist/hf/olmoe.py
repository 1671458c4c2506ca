"""OLMoE: attention with RoPE and an RMSNorm over the whole q and k projections (`self_attn.{q,k}_norm`, all heads
at once), a softmax top-k MoE in every layer (renormalized when `norm_topk_prob`), experts of `intermediate_size`
under `mlp.experts.e.{gate,up,down}_proj`, router `mlp.gate`."""

from __future__ import annotations

from moe_dist.config import AttentionConfig, ModelConfig, MoEConfig
from moe_dist.hf.common import (
    Family,
    attention_model,
    attention_names,
    check_silu,
    get,
    reasons,
    refuse,
    rope_theta,
    router_unfit,
)
from moe_dist.hf.qwen_moe import EXPERTS
from moe_dist.models.decoder import layer_kinds


def from_hf(hf: dict) -> ModelConfig:
    check_silu(hf)
    refuse(hf, "clip_qkv", (None,), "clamping q, k and v has no counterpart here")
    refuse(hf, "attention_bias", (False,), "attention biases have no counterpart here")
    n_heads = get(hf, "num_attention_heads", 16)
    num_experts = get(hf, "num_experts", get(hf, "num_local_experts", 64))  # 5.x saves the latter
    attention = AttentionConfig(
        n_heads=n_heads,
        n_kv_heads=get(hf, "num_key_value_heads", n_heads),
        rope=True,
        rope_theta=rope_theta(hf, 10000.0),
        qk_norm="full",
    )
    return attention_model(
        hf,
        vocab=50304,
        d_ff=1024,
        eps=1e-5,
        ffn_pattern="E",
        attention=attention,
        moe=MoEConfig(
            num_experts=num_experts,
            top_k=min(get(hf, "num_experts_per_tok", 8), num_experts),
            capacity_factor=None,
            renormalize=bool(get(hf, "norm_topk_prob", False)),
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
            (a.sliding_window is not None, "attention.sliding_window must be null"),
            (a.qk_norm != "full", "attention.qk_norm must be 'full'"),
            (a.qkv_bias, "attention.qkv_bias must be false"),
            (a.head_dim not in (None, cfg.d_model // a.n_heads), "attention.head_dim must be d_model // n_heads"),
            ((moe.d_ff or cfg.d_ff) != cfg.d_ff, "moe.d_ff must equal d_ff"),
            (moe.n_shared_experts > 0, "moe.n_shared_experts must be 0"),
        ]
    )


def to_hf(cfg: ModelConfig, out: dict) -> None:
    moe = cfg.moe
    out.pop("num_local_experts", None)  # transformers 5.x's name for num_experts: one key, ours
    out.update(
        intermediate_size=moe.d_ff or cfg.d_ff,
        num_experts=moe.num_experts,
        norm_topk_prob=moe.renormalize,
        rope_theta=cfg.attention.rope_theta,
        clip_qkv=None,
        attention_bias=False,
    )
    out.setdefault("max_position_embeddings", 4096)


def names(name: str, num_experts: int) -> list[str]:
    return attention_names(name, num_experts, moe="mlp", router="gate", experts=EXPERTS)


FAMILY = Family("olmoe", "OlmoeForCausalLM", from_hf, unfit, to_hf, names)
