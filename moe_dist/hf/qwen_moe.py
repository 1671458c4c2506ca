"""Qwen2-MoE and Qwen3-MoE: attention with RoPE, MoE layers at `decoder_sparse_step` except `mlp_only_layers`
(dense SwiGLUs of `intermediate_size`), experts of `moe_intermediate_size` under `mlp.experts.e.{gate,up,down}_proj`,
router `mlp.gate`, softmax top-k renormalized when `norm_topk_prob`.
    Qwen2-MoE adds q/k/v biases and one shared expert (`mlp.shared_expert`, width `shared_expert_intermediate_size`)
              scaled by sigmoid(`mlp.shared_expert_gate` · x);
    Qwen3-MoE adds an RMSNorm over each head's q and k (`self_attn.{q,k}_norm`) before RoPE."""

from __future__ import annotations

from moe_dist.config import AttentionConfig, ModelConfig, MoEConfig
from moe_dist.hf.common import (
    Family,
    HFConfigError,
    attention_model,
    attention_names,
    check_silu,
    get,
    reasons,
    refuse,
    rope_theta,
    router_unfit,
    tile,
)
from moe_dist.models.decoder import layer_kinds

EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _from_hf(hf: dict, qwen2: bool) -> ModelConfig:
    check_silu(hf)
    refuse(hf, "use_sliding_window", (False,), "sliding-window layers are not mapped")
    refuse(hf, "attention_bias", (False,), "an o_proj bias has no counterpart here")
    n_layers, d_model = hf["num_hidden_layers"], hf["hidden_size"]
    n_heads = get(hf, "num_attention_heads", 16 if qwen2 else 32)
    num_experts = get(hf, "num_experts", get(hf, "num_local_experts", 60 if qwen2 else 128))  # 5.x saves the latter
    step, dense_only = get(hf, "decoder_sparse_step", 1), set(get(hf, "mlp_only_layers", []))
    ffns = ["E" if i not in dense_only and num_experts > 0 and (i + 1) % step == 0 else "D" for i in range(n_layers)]
    moe = MoEConfig(
        num_experts=max(num_experts, 1),
        top_k=min(get(hf, "num_experts_per_tok", 4 if qwen2 else 8), max(num_experts, 1)),
        d_ff=get(hf, "moe_intermediate_size", 1408 if qwen2 else 768),
        capacity_factor=None,
        renormalize=bool(get(hf, "norm_topk_prob", False)),
    )
    if qwen2:
        width = get(hf, "shared_expert_intermediate_size", 5632)
        if width <= 0:
            raise HFConfigError(f"shared_expert_intermediate_size: {width}; Qwen2-MoE's shared expert needs a width")
        moe.n_shared_experts, moe.shared_d_ff, moe.shared_gate = 1, width, True
    attention = AttentionConfig(
        n_heads=n_heads,
        n_kv_heads=get(hf, "num_key_value_heads", n_heads if qwen2 else 4),
        head_dim=hf.get("head_dim") or d_model // n_heads,
        rope=True,
        rope_theta=rope_theta(hf, 1e6 if qwen2 else 10000.0),
        qk_norm="none" if qwen2 else "head",
        qkv_bias=bool(get(hf, "qkv_bias", True)) if qwen2 else False,
    )
    return attention_model(
        hf, vocab=151936, d_ff=5632 if qwen2 else 6144, eps=1e-6, ffn_pattern=tile(ffns), attention=attention, moe=moe
    )


def _unfit(cfg: ModelConfig, qwen2: bool) -> list[str]:
    a, moe = cfg.attention, cfg.moe
    return router_unfit(cfg) + reasons(
        [
            (any(m != "attention" for m, _ in layer_kinds(cfg)), "every mixer must be attention"),
            (not a.rope, "attention.rope must be true"),
            (a.sliding_window is not None, "attention.sliding_window must be null"),
            (qwen2 and a.qk_norm != "none", "attention.qk_norm must be 'none'"),
            (not qwen2 and a.qk_norm != "head", "attention.qk_norm must be 'head'"),
            (a.qkv_bias != qwen2, f"attention.qkv_bias must be {str(qwen2).lower()}"),
            (qwen2 and not (moe.n_shared_experts and moe.shared_gate), "needs a gated shared expert"),
            (not qwen2 and moe.n_shared_experts > 0, "moe.n_shared_experts must be 0"),
        ]
    )


def _to_hf(cfg: ModelConfig, out: dict, qwen2: bool) -> None:
    a, moe = cfg.attention, cfg.moe
    out.pop("num_local_experts", None)  # transformers 5.x's name for num_experts: one key, ours
    out.update(
        intermediate_size=cfg.d_ff,
        moe_intermediate_size=moe.d_ff or cfg.d_ff,
        num_experts=moe.num_experts,
        norm_topk_prob=moe.renormalize,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, (_, f) in enumerate(layer_kinds(cfg)) if f == "mlp"],
        head_dim=a.head_dim or cfg.d_model // a.n_heads,
        rope_theta=a.rope_theta,
        use_sliding_window=False,
        sliding_window=None,
        attention_bias=False,
    )
    if qwen2:
        out.update(shared_expert_intermediate_size=cfg.moe.shared_hidden(cfg.d_ff), qkv_bias=True)
    out.setdefault("max_position_embeddings", 32768)


def names(name: str, num_experts: int) -> list[str]:
    return attention_names(name, num_experts, moe="mlp", router="gate", experts=EXPERTS)


QWEN2 = Family(
    "qwen2_moe",
    "Qwen2MoeForCausalLM",
    lambda hf: _from_hf(hf, True),
    lambda cfg: _unfit(cfg, True),
    lambda cfg, out: _to_hf(cfg, out, True),
    names,
)
QWEN3 = Family(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    lambda hf: _from_hf(hf, False),
    lambda cfg: _unfit(cfg, False),
    lambda cfg, out: _to_hf(cfg, out, False),
    names,
)
