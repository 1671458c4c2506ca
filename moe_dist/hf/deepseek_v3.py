"""DeepSeek-V3 (`DeepseekV3ForCausalLM`; also Kimi K2's text model and Moonlight): MLA in every layer
(`self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`, `kv_a_proj_with_mqa` = [latent | RoPE key],
`kv_a_layernorm`, `kv_b_proj` = per head [k nope | v], `o_proj`; the RoPE slice interleaved where `rope_interleave`,
YaRN through `rope_parameters`), dense SwiGLUs of `intermediate_size` in the first `first_k_dense_replace` layers and
MoE layers after them: sigmoid scores with the correction bias `mlp.gate.e_score_correction_bias` (for choosing
only: our loss-free balancing bias), `n_group` expert groups of which a token takes `topk_group` (ranked by the sum
of their two best biased scores), the top-k weights renormalised (`norm_topk_prob`) and multiplied by
`routed_scaling_factor`, experts `mlp.experts.e.{gate,up,down}_proj` of `moe_intermediate_size` and one shared
SwiGLU `mlp.shared_experts` of `n_shared_experts` × that width.

The latent norms' epsilon is transformers' fixed 1e-6 (not `rms_norm_eps`). Published fp8 weights (`weight_scale_inv`)
are dequantized by format.py's reader. Multi-token-prediction layers
(`model.layers.<num_hidden_layers>.*`) are not read yet: a checkpoint carrying them is refused by the unused-tensor
check, and export writes `num_nextn_predict_layers: 0`.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_dist.config import ModelConfig, MoEConfig
from moe_dist.hf.common import (
    Family,
    HFConfigError,
    check_silu,
    get,
    reasons,
    refuse,
    rope_parameters,
    rope_parameters_to_hf,
    validated,
)
from moe_dist.hf.nemotron_h import BIAS_UPDATE_RATE
from moe_dist.layers.mla import MLAConfig
from moe_dist.models.decoder import layer_kinds

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which q_a_layernorm and kv_a_layernorm keep
_ATTENTION = {
    "wq": "q_proj",
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
}
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def from_hf(hf: dict) -> ModelConfig:
    check_silu(hf)
    refuse(hf, "attention_bias", (False,), "MLA projection biases have no counterpart here")
    n_layers, n_heads = hf["num_hidden_layers"], get(hf, "num_attention_heads", 128)
    refuse(hf, "num_key_value_heads", (None, n_heads), "MLA up-projects keys and values for every head")
    first_dense = min(get(hf, "first_k_dense_replace", 3), n_layers)
    num_experts = get(hf, "n_routed_experts", 256)
    n_shared = get(hf, "n_shared_experts", 1)
    if n_shared < 1:
        raise HFConfigError(f"n_shared_experts: {n_shared}; transformers' DeepSeek-V3 MoE always has a shared SwiGLU")
    theta, scaling = rope_parameters(hf, 10000.0)
    mla = MLAConfig(
        n_heads=n_heads,
        q_lora_rank=hf.get("q_lora_rank", 1536),
        kv_lora_rank=get(hf, "kv_lora_rank", 512),
        qk_nope_head_dim=get(hf, "qk_nope_head_dim", 128),
        qk_rope_head_dim=get(hf, "qk_rope_head_dim", 64),
        v_head_dim=get(hf, "v_head_dim", 128),
        rope=True,
        rope_theta=theta,
        rope_interleave=bool(get(hf, "rope_interleave", True)),
        rope_scaling=scaling,
        norm_eps=LATENT_NORM_EPS,
    )
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=min(get(hf, "num_experts_per_tok", 8), num_experts),
        d_ff=get(hf, "moe_intermediate_size", 2048),
        capacity_factor=None,
        renormalize=bool(get(hf, "norm_topk_prob", True)),
        score="sigmoid",
        route_scale=float(get(hf, "routed_scaling_factor", 2.5)),
        bias_update_rate=BIAS_UPDATE_RATE,  # loss-free balancing goes on from the imported bias (0: it stays frozen)
        choice_bias=True,
        n_groups=get(hf, "n_group", 8),
        topk_groups=get(hf, "topk_group", 4),
        n_shared_experts=n_shared,
    )
    return validated(
        ModelConfig(
            vocab_size=get(hf, "vocab_size", 129280),
            d_model=hf["hidden_size"],
            n_layers=n_layers,
            d_ff=get(hf, "intermediate_size", 18432),
            layers=["mla+mlp"] * first_dense + ["mla+moe"] * (n_layers - first_dense),
            norm_eps=float(get(hf, "rms_norm_eps", 1e-6)),
            tie_embeddings=bool(get(hf, "tie_word_embeddings", False)),
            init_std=float(get(hf, "initializer_range", 0.02)),
            mla=mla,
            moe=moe,
        )
    )


def unfit(cfg: ModelConfig) -> list[str]:
    kinds = layer_kinds(cfg)
    ffns = [f for _, f in kinds]
    first_dense = ffns.count("mlp")
    m, moe = cfg.mla, cfg.moe
    has_moe = "moe" in ffns
    return reasons(
        [
            (any(k != "mla" for k, _ in kinds), "every mixer must be mla"),
            (ffns != ["mlp"] * first_dense + ["moe"] * (len(ffns) - first_dense), "FFNs must be mlp layers, then moe"),
            (not m.rope, "mla.rope must be true"),
            (m.softmax_scale is not None, "mla.softmax_scale must be null"),
            (m.norm_eps != LATENT_NORM_EPS, f"mla.norm_eps must be {LATENT_NORM_EPS}"),
            (has_moe and moe.score != "sigmoid", "moe.score must be 'sigmoid'"),
            (has_moe and moe.n_shared_experts < 1, "moe.n_shared_experts must be >= 1"),
            (has_moe and moe.shared_gate, "moe.shared_gate must be false"),
            (
                has_moe and moe.shared_hidden(cfg.d_ff) != moe.n_shared_experts * (moe.d_ff or cfg.d_ff),
                "moe.shared_d_ff must be null (n_shared_experts × the expert width)",
            ),
        ]
    )


def to_hf(cfg: ModelConfig, out: dict) -> None:
    m, moe = cfg.mla, cfg.moe
    for stale in ("num_local_experts", "qk_head_dim", "head_dim", "num_mtp_layers"):
        out.pop(stale, None)
    out.update(
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_heads,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_interleave=m.rope_interleave,
        rope_parameters=rope_parameters_to_hf(m.rope_theta, m.rope_scaling),
        intermediate_size=cfg.d_ff,
        first_k_dense_replace=[f for _, f in layer_kinds(cfg)].count("mlp"),
        moe_intermediate_size=moe.d_ff or cfg.d_ff,
        n_routed_experts=moe.num_experts,
        n_shared_experts=moe.n_shared_experts,
        norm_topk_prob=moe.renormalize,
        routed_scaling_factor=moe.route_scale,
        n_group=moe.n_groups,
        topk_group=moe.topk_groups,
        num_nextn_predict_layers=0,  # no multi-token-prediction layer is written (yet)
        attention_bias=False,
    )
    s = m.rope_scaling  # YaRN's extended length where the template has none (transformers checks the ratio)
    out.setdefault(
        "max_position_embeddings", 4096 if s.type == "none" else int(s.factor * s.original_max_position_embeddings)
    )


def names(name: str, num_experts: int) -> list[str]:
    top = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
    }
    if name in top:
        return [top[name]]
    _, layer, rest = name.split(".", 2)  # blocks.<i>.<rest>
    prefix = f"model.layers.{layer}."
    simple = {
        "mixer_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn.router.weight": "mlp.gate.weight",
        "ffn.router.bias_E": "mlp.gate.e_score_correction_bias",
        **{f"mixer.{ours}.weight": f"self_attn.{theirs}.weight" for ours, theirs in _ATTENTION.items()},
        **{f"ffn.{ours}.weight": f"mlp.{theirs}.weight" for ours, theirs in _PROJ.items()},
        **{f"ffn.shared.{ours}.weight": f"mlp.shared_experts.{theirs}.weight" for ours, theirs in _PROJ.items()},
    }
    if rest in simple:
        return [prefix + simple[rest]]
    if rest.startswith("ffn.experts."):
        which = {"w13": ["gate_proj", "up_proj"], "w2": ["down_proj"]}[rest.rsplit(".", 1)[1]]
        return [f"{prefix}mlp.experts.{e}.{w}.weight" for w in which for e in range(num_experts)]
    raise HFConfigError(f"{name}: no Hugging Face deepseek_v3 counterpart")


def load_tensor(name: str, get_hf, has, cfg: ModelConfig) -> Optional[torch.Tensor]:
    """A checkpoint without a correction bias (one exported from a model trained without loss-free balancing, which
    then has none) routes with zeros, as transformers initialises it."""
    if name.endswith(".ffn.router.bias_E") and not has(names(name, cfg.moe.num_experts)[0]):
        return torch.zeros(cfg.moe.num_experts)
    return None


FAMILY = Family(
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    from_hf,
    unfit,
    to_hf,
    names,
    load_tensor=load_tensor,
)
