"""Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet layers ("linear_attention") and gated full attention
("full_attention") as `layer_types` lists (default: attention at every `full_attention_interval`-th layer), each
followed by an FFN: a MoE with a sigmoid-gated shared expert (`mlp.shared_expert(_gate)`), or in Qwen3-Next a dense
SwiGLU of `intermediate_size` at `mlp_only_layers` and off the `decoder_sparse_step` (as Qwen2/3-MoE).
Attention: the query projection also gives a sigmoid output gate (rows per head [q | gate]); RMSNorm over each
head's q and k; RoPE on the first `partial_rotary_factor` of each head's dims. Every RMSNorm except the Gated
DeltaNet's gated one is zero-centred (scale 1 + weight).
    Qwen3-Next (`Qwen3NextForCausalLM`): the Gated DeltaNet's fused projections (in_proj_qkvz, in_proj_ba) are ours.
    Qwen3.5-MoE text (`Qwen3_5MoeForCausalLM`): every layer MoE; the projections come in parts (in_proj_qkv,
              in_proj_z, in_proj_b, in_proj_a), joined into ours head by head. Its multimodal RoPE (mrope_section)
              is plain RoPE for text, whose three position streams are equal.
    Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration`, the Hub checkpoints): the text model under
              `model.language_model.`, read; the vision tower (`model.visual.`) dropped with one warning line.
              Import only: our model holds no vision tower, so its export is the text model's checkpoint.
Qwen3.5's experts are read per expert (what transformers' save_pretrained writes) or fused (`mlp.experts.gate_up_proj`
(E, 2F, D) and `down_proj` (E, D, F), transformers 5's own layout); export writes them per expert.
Multi-token-prediction tensors (`mtp.*`) are dropped with one warning line."""

from __future__ import annotations

import torch

from moe_dist.config import AttentionConfig, GDNConfig, ModelConfig, MoEConfig
from moe_dist.hf.common import (
    Family,
    HFConfigError,
    attention_names,
    check_silu,
    get,
    reasons,
    refuse,
    rope_theta,
    router_unfit,
    validated,
)

EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXERS = {"linear_attention": "gdn", "full_attention": "attention"}
_GDN_PARAMS = (
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "norm.weight",
    "out_proj.weight",
)
# Qwen3.5's parts of our fused Gated DeltaNet projections, in the order `_join` takes them.
_PARTS = {
    "in_proj_qkvz.weight": ("in_proj_qkv.weight", "in_proj_z.weight"),
    "in_proj_ba.weight": ("in_proj_b.weight", "in_proj_a.weight"),
}
_MTP = ("mtp.", "multi-token-prediction")
_VISION_KEYS = ("text_config", "vision_config", "image_token_id", "video_token_id")
_VISION_KEYS += ("vision_start_token_id", "vision_end_token_id")


def _partial_rotary(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 0.25)


def from_hf(hf: dict, qwen35: bool) -> ModelConfig:
    check_silu(hf)
    refuse(hf, "attention_bias", (False,), "q/k/v/o biases have no counterpart here")
    refuse(hf, "attn_output_gate", (True,), "transformers' Qwen3-Next/3.5 attention is always gated")
    n_layers, d_model = hf["num_hidden_layers"], hf["hidden_size"]
    interval = get(hf, "full_attention_interval", 4)
    types = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)
    ]
    if len(types) != n_layers:
        raise HFConfigError(f"layer_types: {len(types)} entries for num_hidden_layers={n_layers}")
    for i, t in enumerate(types):
        if t not in _MIXERS:
            raise HFConfigError(f"layer_types[{i}]: {t!r} is not supported (only {sorted(_MIXERS)})")
    num_experts = get(hf, "num_experts", 256 if qwen35 else 512)
    if qwen35:
        ffns = ["moe"] * n_layers
    else:
        step, dense_only = get(hf, "decoder_sparse_step", 1), set(get(hf, "mlp_only_layers", []))
        moe_at = [i not in dense_only and num_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)]
        ffns = ["moe" if m else "mlp" for m in moe_at]
    shared = get(hf, "shared_expert_intermediate_size", 512)
    if shared <= 0 and "moe" in ffns:
        raise HFConfigError(f"shared_expert_intermediate_size: {shared}; the family's shared expert needs a width")
    moe = MoEConfig(
        num_experts=max(num_experts, 1),
        top_k=min(get(hf, "num_experts_per_tok", 8 if qwen35 else 10), max(num_experts, 1)),
        d_ff=get(hf, "moe_intermediate_size", 512),
        capacity_factor=None,
        renormalize=True if qwen35 else bool(get(hf, "norm_topk_prob", True)),
        n_shared_experts=1,
        shared_d_ff=shared,
        shared_gate=True,
    )
    n_heads = get(hf, "num_attention_heads", 16)
    attention = AttentionConfig(
        n_heads=n_heads,
        n_kv_heads=get(hf, "num_key_value_heads", 2),
        head_dim=get(hf, "head_dim", 256),
        rope=True,
        rope_theta=rope_theta(hf, 10000.0),
        qk_norm="head",
        output_gate=True,
        rope_fraction=_partial_rotary(hf),
    )
    gdn = GDNConfig(
        n_k_heads=get(hf, "linear_num_key_heads", 16),
        n_v_heads=get(hf, "linear_num_value_heads", 32),
        head_k_dim=get(hf, "linear_key_head_dim", 128),
        head_v_dim=get(hf, "linear_value_head_dim", 128),
        conv_size=get(hf, "linear_conv_kernel_dim", 4),
    )
    return validated(
        ModelConfig(
            vocab_size=get(hf, "vocab_size", 248320 if qwen35 else 151936),
            d_model=d_model,
            n_layers=n_layers,
            d_ff=moe.d_ff if qwen35 else get(hf, "intermediate_size", 5632),
            layers=[f"{_MIXERS[t]}+{f}" for t, f in zip(types, ffns)],
            norm_eps=float(get(hf, "rms_norm_eps", 1e-6)),
            norm_zero_centered=True,
            tie_embeddings=bool(get(hf, "tie_word_embeddings", False)),
            init_std=float(get(hf, "initializer_range", 0.02)),
            attention=attention,
            gdn=gdn,
            moe=moe,
        )
    )


def from_hf_vl(hf: dict) -> ModelConfig:
    """The text model of a Qwen3.5-MoE vision-language config.json (its `text_config`)."""
    if not isinstance(hf.get("text_config"), dict):
        raise HFConfigError("text_config: missing (a Qwen3.5-MoE vision-language config.json holds the text model)")
    text = dict(hf["text_config"])
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return from_hf(text, True)


def unfit(cfg: ModelConfig, qwen35: bool) -> list[str]:
    kinds = cfg.layer_kinds()
    a, moe = cfg.attention, cfg.moe
    has_moe = any(f == "moe" for _, f in kinds)
    return (router_unfit(cfg) if has_moe else []) + reasons(
        [
            (
                any(m not in ("gdn", "attention") or f is None for m, f in kinds),
                "every layer must be gdn or attention with an FFN",
            ),
            (qwen35 and any(f != "moe" for _, f in kinds), "every FFN must be moe (Qwen3.5-MoE has no dense layers)"),
            (not cfg.norm_zero_centered, "model.norm_zero_centered must be true"),
            (not a.rope or not a.output_gate, "attention.rope and attention.output_gate must be true"),
            (a.qk_norm != "head" or a.qkv_bias, "attention.qk_norm must be 'head' and qkv_bias false"),
            (a.sliding_window is not None, "attention.sliding_window must be null"),
            (has_moe and not (moe.n_shared_experts == 1 and moe.shared_gate), "needs one gated shared expert"),
            (qwen35 and has_moe and not moe.renormalize, "moe.renormalize must be true"),
        ]
    )


def to_hf(cfg: ModelConfig, out: dict, qwen35: bool) -> None:
    kinds = cfg.layer_kinds()
    a, moe, g = cfg.attention, cfg.moe, cfg.gdn
    for key, value in (out.get("text_config") or {}).items():  # a vision-language template: its text model's keys
        out.setdefault(key, value)
    for key in ("num_local_experts", "full_attention_interval", "partial_rotary_factor", "rope_theta", *_VISION_KEYS):
        out.pop(key, None)  # one key each: ours (layer_types, rope_parameters); no vision tower
    out.update(
        moe_intermediate_size=moe.d_ff or cfg.d_ff,
        shared_expert_intermediate_size=moe.shared_hidden(cfg.d_ff),
        num_experts=moe.num_experts,
        head_dim=a.head_dim or cfg.d_model // a.n_heads,
        layer_types=["full_attention" if m == "attention" else "linear_attention" for m, _ in kinds],
        linear_num_key_heads=g.n_k_heads,
        linear_num_value_heads=g.n_v_heads,
        linear_key_head_dim=g.head_k_dim,
        linear_value_head_dim=g.head_v_dim,
        linear_conv_kernel_dim=g.conv_size,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta, "partial_rotary_factor": a.rope_fraction},
        attention_bias=False,
    )
    if not qwen35:
        out.update(
            intermediate_size=cfg.d_ff,
            norm_topk_prob=moe.renormalize,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, (_, f) in enumerate(kinds) if f == "mlp"],
        )
    out.setdefault("max_position_embeddings", 262144)


def names(name: str, num_experts: int, qwen35: bool = False, prefix: str = "model.") -> list[str]:
    """Our name → theirs; `prefix` replaces the text model's "model." (the vision-language checkpoints')."""
    _, layer, rest = name.split(".", 2) if name.startswith("blocks.") else (None, None, "")
    if rest.startswith("mixer.") and rest.removeprefix("mixer.") in _GDN_PARAMS:
        param = rest.removeprefix("mixer.")
        parts = _PARTS.get(param, (param,)) if qwen35 else (param,)
        found = [f"model.layers.{layer}.linear_attn.{p}" for p in parts]
    else:
        found = attention_names(name, num_experts, moe="mlp", router="gate", experts=EXPERTS)
    return [prefix + n.removeprefix("model.") if n.startswith("model.") else n for n in found]


def fused_experts(name: str, prefix: str = "model.") -> str:
    """blocks.i.ffn.experts.w13 / w2 → the fused gate_up_proj / down_proj of layer i (Qwen3.5's Hub checkpoints)."""
    layer, which = name.split(".")[1], name.rsplit(".", 1)[1]
    return f"{prefix}layers.{layer}.mlp.experts.{'gate_up_proj' if which == 'w13' else 'down_proj'}"


def _split_sizes(name: str, cfg: ModelConfig) -> tuple[int, list[int]]:
    """(key heads, per-key-head row counts of our fused projection `name`: [q, k, v, z] or [b, a])."""
    g = cfg.gdn
    r = g.n_v_heads // g.n_k_heads
    if name.endswith("in_proj_qkvz.weight"):
        return g.n_k_heads, [g.head_k_dim, g.head_k_dim, r * g.head_v_dim, r * g.head_v_dim]
    return g.n_k_heads, [r, r]


def join(name: str, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Qwen3.5's [qkv, z] or [b, a] rows (each block head-major over all heads) → ours, packed per key head."""
    hk, sizes = _split_sizes(name, cfg)
    d = parts[0].shape[-1]
    blocks = torch.cat(parts).split([hk * s for s in sizes])  # q, k, v, z (or b, a), all heads each
    return torch.cat([b.view(hk, s, d) for b, s in zip(blocks, sizes)], dim=1).reshape(-1, d)


def split(name: str, ours: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    """The inverse of `join`: [qkv, z] or [b, a]."""
    hk, sizes = _split_sizes(name, cfg)
    d = ours.shape[-1]
    blocks = [b.reshape(-1, d) for b in ours.view(hk, sum(sizes), d).split(sizes, dim=1)]
    if len(blocks) == 4:
        return [torch.cat(blocks[:3]), blocks[3]]
    return blocks


def stored_apart(prefix: str = "model."):
    """Qwen3.5's (load_tensor, save_tensor) hooks (common.Family): its split GDN projections joined into ours and
    split back, and experts read fused (gate_up_proj, down_proj) where the per-expert tensors are absent."""

    def load(name: str, get, has, cfg: ModelConfig):
        theirs = names(name, cfg.moe.num_experts, True, prefix)
        if ".ffn.experts." in name:
            fused = fused_experts(name, prefix)
            if not has(theirs[0]) and has(fused):
                return get(fused).transpose(1, 2)  # (E, 2F, D) → (E, D, 2F) = [gate | up]; (E, D, F) → (E, F, D)
            return None
        return join(name, [get(n) for n in theirs], cfg) if len(theirs) > 1 else None

    def save(name: str, t: torch.Tensor, stored, cfg: ModelConfig):
        theirs = names(name, cfg.moe.num_experts, True, prefix)
        if ".ffn.experts." in name or len(theirs) == 1:
            return None
        return dict(zip(theirs, split(name, t, cfg), strict=True))

    return {"load_tensor": load, "save_tensor": save}


_SUPPORTS = frozenset({"output_gate", "partial_rope", "zero_centered_norm"})
QWEN3_NEXT = Family(
    "qwen3_next",
    "Qwen3NextForCausalLM",
    lambda hf: from_hf(hf, False),
    lambda cfg: unfit(cfg, False),
    lambda cfg, out: to_hf(cfg, out, False),
    names,
    supports=_SUPPORTS,
    dropped=(_MTP,),
)
QWEN3_5_MOE_TEXT = Family(
    "qwen3_5_moe_text",
    "Qwen3_5MoeForCausalLM",
    lambda hf: from_hf(hf, True),
    lambda cfg: unfit(cfg, True),
    lambda cfg, out: to_hf(cfg, out, True),
    lambda name, e: names(name, e, True),
    **stored_apart(),
    supports=_SUPPORTS,
    dropped=(_MTP, ("model.visual.", "vision-tower")),
)
QWEN3_5_MOE = Family(
    "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration",
    from_hf_vl,
    lambda cfg: ["import only (vision-language): its export is the text model, qwen3_5_moe_text"],
    lambda cfg, out: None,
    lambda name, e: names(name, e, True, "model.language_model."),
    **stored_apart("model.language_model."),
    supports=_SUPPORTS,
    dropped=(_MTP, ("model.visual.", "vision-tower")),
    export_as="qwen3_5_moe_text",
)
