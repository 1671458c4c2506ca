"""Llama and Qwen3 (dense): attention with RoPE and a dense SwiGLU in every layer, `mlp.{gate,up,down}_proj`; Qwen3
adds an RMSNorm over each head's q and k. The sources `launch/convert.py upcycle` turns into MoE models."""

from __future__ import annotations

from moe_dist.config import AttentionConfig, ModelConfig
from moe_dist.hf.common import (
    Family,
    attention_model,
    attention_names,
    check_silu,
    get,
    reasons,
    refuse,
    rope_theta,
)
from moe_dist.hf.qwen_moe import EXPERTS
from moe_dist.models.decoder import layer_kinds


def _from_hf(hf: dict, qwen3: bool) -> ModelConfig:
    check_silu(hf)
    refuse(hf, "attention_bias", (False,), "attention biases have no counterpart here")
    refuse(hf, "mlp_bias", (False,), "FFN biases have no counterpart here")
    refuse(hf, "use_sliding_window", (False,), "sliding-window layers are not mapped")
    d_model = hf["hidden_size"]
    n_heads = get(hf, "num_attention_heads", 32)
    attention = AttentionConfig(
        n_heads=n_heads,
        n_kv_heads=get(hf, "num_key_value_heads", n_heads),
        head_dim=hf.get("head_dim") or d_model // n_heads,
        rope=True,
        rope_theta=rope_theta(hf, 10000.0),
        qk_norm="head" if qwen3 else "none",
    )
    return attention_model(
        hf, vocab=151936 if qwen3 else 32000, d_ff=11008, eps=1e-6, ffn_pattern="D", attention=attention
    )


def _unfit(cfg: ModelConfig, qwen3: bool) -> list[str]:
    a = cfg.attention
    kinds = layer_kinds(cfg)
    return reasons(
        [
            (any(m != "attention" for m, _ in kinds), "every mixer must be attention"),
            (any(f != "mlp" for _, f in kinds), "every FFN must be dense"),
            (not a.rope or a.sliding_window is not None, "attention.rope must be true, sliding_window null"),
            (a.qk_norm != ("head" if qwen3 else "none"), f"attention.qk_norm must be {'head' if qwen3 else 'none'!r}"),
            (a.qkv_bias, "attention.qkv_bias must be false"),
        ]
    )


def _to_hf(cfg: ModelConfig, out: dict) -> None:
    a = cfg.attention
    out.update(
        intermediate_size=cfg.d_ff,
        head_dim=a.head_dim or cfg.d_model // a.n_heads,
        rope_theta=a.rope_theta,
        attention_bias=False,
    )
    out.pop("num_experts_per_tok", None)  # written for every family; a dense one has no experts
    out.setdefault("max_position_embeddings", 8192)


def names(name: str, num_experts: int) -> list[str]:
    return attention_names(name, num_experts, moe="mlp", router="gate", experts=EXPERTS)


LLAMA = Family(
    "llama", "LlamaForCausalLM", lambda hf: _from_hf(hf, False), lambda cfg: _unfit(cfg, False), _to_hf, names
)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", lambda hf: _from_hf(hf, True), lambda cfg: _unfit(cfg, True), _to_hf, names)
