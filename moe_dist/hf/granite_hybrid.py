"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`, model_type "granitemoehybrid"): layers of a Mamba-2 or attention
mixer (`layer_types` "mamba" / "attention", transformers 5 also writes "linear_attention" / "full_attention"), then
a softmax top-k MoE (renormalized over the top k) beside a shared SwiGLU MLP: our "mamba2+moe" / "attention+moe"
with one shared expert of `shared_intermediate_size` (without experts, `num_local_experts` 0, the shared MLP alone:
"…+mlp"). Granite's multipliers map to ours: `embedding_multiplier`, `residual_multiplier`, `logits_scaling` (a
divisor) and `attention_multiplier` (attention.softmax_scale, in place of 1/sqrt(head_dim)); attention without
RoPE unless `position_embedding_type` is "rope" (Granite 4.0-H's published configs say "nope").

Tensors under `model.layers.i.`: `mamba.*` / `self_attn.{q,k,v,o}_proj`, `input_layernorm`,
`post_attention_layernorm`, the router `block_sparse_moe.router.layer`, the experts stacked as
`block_sparse_moe.input_linear` (E, 2F, D) = [gate; up] and `output_linear` (E, D, F) — the transposes of our w13
and w2 — and the shared MLP `shared_mlp.input_linear` (2S, D) = [gate; up], `shared_mlp.output_linear`.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from moe_dist.config import AttentionConfig, Mamba2Config, ModelConfig, MoEConfig
from moe_dist.hf.common import (
    Family,
    HFConfigError,
    check_silu,
    get,
    reasons,
    refuse,
    rope_theta,
    router_unfit,
    validated,
)
from moe_dist.hf.nemotron_h import number
from moe_dist.models.decoder import layer_kinds

_MIXERS = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention", "full_attention": "attention"}
_MAMBA_PARAMS = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D")
_MAMBA_PARAMS += ("norm.weight", "out_proj.weight", "out_proj.bias")


def _dt_limit(hf: dict) -> Optional[list[float]]:
    limit = hf.get("time_step_limit")
    if limit is None:
        return None
    low, high = number(limit[0]), number(limit[1])
    return None if (low, high) == (0.0, math.inf) else [low, high]  # (0, inf) clamps nothing: softplus >= 0


def from_hf(hf: dict) -> ModelConfig:
    check_silu(hf)
    refuse(hf, "attention_bias", (False,), "attention projection biases have no counterpart here")
    refuse(hf, "position_embedding_type", (None, "nope", "rope"), "only 'rope' or none ('nope') are mapped")
    n_layers, d_model = hf["num_hidden_layers"], hf["hidden_size"]
    types = get(hf, "layer_types", ["mamba"] * n_layers)
    bad = sorted(set(types) - set(_MIXERS))
    if bad:
        raise HFConfigError(f"layer_types: {bad} are not mamba or attention")
    if len(types) != n_layers:
        raise HFConfigError(f"layer_types: {len(types)} entries for num_hidden_layers={n_layers}")
    num_experts = get(hf, "num_local_experts", 8)
    shared = get(hf, "shared_intermediate_size", 1024)
    if shared <= 0:
        raise HFConfigError(f"shared_intermediate_size: {shared}; Granite's shared MLP needs a width")
    ffn = "moe" if num_experts > 0 else "mlp"
    n_heads = get(hf, "num_attention_heads", 32)
    expand = get(hf, "mamba_expand", 2)
    mamba_heads = get(hf, "mamba_n_heads", 128)
    head = get(hf, "mamba_d_head", "auto")
    chunk = int(get(hf, "mamba_chunk_size", 256))
    mamba2 = Mamba2Config(
        d_state=get(hf, "mamba_d_state", 256),
        d_conv=get(hf, "mamba_d_conv", 4),
        expand=expand,
        n_heads=mamba_heads,
        head_dim=expand * d_model // mamba_heads if head == "auto" else int(head),
        n_groups=get(hf, "mamba_n_groups", 1),
        chunk_size=chunk if chunk > 0 and chunk & (chunk - 1) == 0 else 64,  # numerics only: any power of two
        dt_limit=_dt_limit(hf),
        conv_bias=bool(get(hf, "mamba_conv_bias", True)),
        proj_bias=bool(get(hf, "mamba_proj_bias", False)),
    )
    if mamba2.n_heads * mamba2.head_dim != expand * d_model:
        raise HFConfigError("mamba_d_head: mamba_n_heads × mamba_d_head must be mamba_expand × hidden_size")
    moe = MoEConfig(
        num_experts=max(num_experts, 1),
        top_k=min(get(hf, "num_experts_per_tok", 2), max(num_experts, 1)),
        capacity_factor=None,
        renormalize=True,  # softmax over the k best logits = the full softmax renormalized over the top k
        n_shared_experts=1,
        shared_d_ff=shared,
    )
    rope = hf.get("position_embedding_type") == "rope"
    attention = AttentionConfig(
        n_heads=n_heads,
        n_kv_heads=get(hf, "num_key_value_heads", n_heads),
        head_dim=d_model // n_heads,
        rope=rope,
        rope_theta=rope_theta(hf, 10000.0) if rope else 10000.0,
        softmax_scale=float(get(hf, "attention_multiplier", 1.0)),
    )
    return validated(
        ModelConfig(
            vocab_size=get(hf, "vocab_size", 32000),
            d_model=d_model,
            n_layers=n_layers,
            d_ff=get(hf, "intermediate_size", 11008) if ffn == "moe" else shared,
            layers=[f"{_MIXERS[t]}+{ffn}" for t in types],
            norm_eps=float(get(hf, "rms_norm_eps", 1e-6)),
            tie_embeddings=bool(get(hf, "tie_word_embeddings", False)),
            init_std=float(get(hf, "initializer_range", 0.02)),
            embedding_multiplier=float(get(hf, "embedding_multiplier", 1.0)),
            residual_multiplier=float(get(hf, "residual_multiplier", 1.0)),
            logits_scaling=float(get(hf, "logits_scaling", 1.0)),
            attention=attention,
            mamba2=mamba2,
            moe=moe,
        )
    )


def unfit(cfg: ModelConfig) -> list[str]:
    kinds = layer_kinds(cfg)
    a, mb, moe = cfg.attention, cfg.mamba2, cfg.moe
    ffns = {f for _, f in kinds}
    return (router_unfit(cfg) if "moe" in ffns else []) + reasons(
        [
            (any(m not in ("mamba2", "attention") for m, _ in kinds), "every layer needs a mamba2 or attention mixer"),
            (len(ffns) != 1 or None in ffns, "every layer needs the same FFN kind (moe, or mlp alone)"),
            ("moe" in ffns and not moe.renormalize, "moe.renormalize must be true"),
            ("moe" in ffns and (moe.n_shared_experts < 1 or moe.shared_gate), "needs an ungated shared expert"),
            (a.sliding_window is not None, "attention.sliding_window must be null"),
            (a.qk_norm != "none" or a.qkv_bias, "attention.qk_norm must be 'none' and qkv_bias false"),
            (a.head_dim not in (None, cfg.d_model // a.n_heads), "attention.head_dim must be d_model // n_heads"),
            (
                cfg.has_kind("mamba2") and mb.d_inner(cfg.d_model) != mb.expand * cfg.d_model,
                "mamba2.n_heads × head_dim must be expand × d_model",
            ),
        ]
    )


def to_hf(cfg: ModelConfig, out: dict) -> None:
    a, mb, moe = cfg.attention, cfg.mamba2, cfg.moe
    kinds = layer_kinds(cfg)
    has_moe = cfg.has_kind("moe")
    out.pop("layers_block_type", None)
    out.update(
        layer_types=["mamba" if m == "mamba2" else "attention" for m, _ in kinds],
        intermediate_size=(moe.d_ff or cfg.d_ff) if has_moe else cfg.d_ff,
        num_local_experts=moe.num_experts if has_moe else 0,
        shared_intermediate_size=moe.shared_hidden(cfg.d_ff) if has_moe else cfg.d_ff,
        embedding_multiplier=cfg.embedding_multiplier,
        residual_multiplier=cfg.residual_multiplier,
        logits_scaling=cfg.logits_scaling,
        attention_multiplier=a.softmax_scale or 1.0 / math.sqrt(a.head_dim or cfg.d_model // a.n_heads),
        position_embedding_type="rope" if a.rope else "nope",
        rope_theta=a.rope_theta,
        attention_bias=False,
        mamba_n_heads=mb.heads(cfg.d_model),
        mamba_d_head=mb.head_dim,
        mamba_n_groups=mb.n_groups,
        mamba_d_state=mb.d_state,
        mamba_d_conv=mb.d_conv,
        mamba_expand=mb.expand,
        mamba_chunk_size=mb.chunk_size,
        mamba_conv_bias=mb.conv_bias,
        mamba_proj_bias=mb.proj_bias,
        time_step_limit=list(mb.dt_limit) if mb.dt_limit is not None else [0.0, math.inf],
    )
    out.setdefault("max_position_embeddings", 131072)


def _fused(rest: str) -> Optional[tuple[str, str, int]]:
    """(their name, what, part) for tensors stored fused: what "stacked" (experts, transposed per expert) or
    "halves" (our w1 / w3 = their [gate; up] rows), part 0/1 for the halves."""
    stacked = {
        "ffn.experts.w13": "block_sparse_moe.input_linear.weight",
        "ffn.experts.w2": "block_sparse_moe.output_linear.weight",
    }
    if rest in stacked:
        return stacked[rest], "stacked", 0
    for ours in ("ffn.shared", "ffn"):
        for part, w in enumerate(("w1", "w3")):
            if rest == f"{ours}.{w}.weight":
                return "shared_mlp.input_linear.weight", "halves", part
    return None


def _split(name: str) -> tuple[str, str]:
    _, layer, rest = name.split(".", 2)  # blocks.<i>.<rest>
    return f"model.layers.{layer}.", rest


def load_tensor(name: str, get_hf: Callable[[str], torch.Tensor], *_) -> Optional[torch.Tensor]:
    if not name.startswith("blocks."):
        return None
    prefix, rest = _split(name)
    fused = _fused(rest)
    if fused is None:
        return None
    theirs, what, part = fused
    t = get_hf(prefix + theirs)
    return t.transpose(1, 2) if what == "stacked" else t.chunk(2, dim=0)[part]


def save_tensor(name: str, t: torch.Tensor, stored: Callable[[str], torch.Tensor], *_) -> Optional[dict]:
    if not name.startswith("blocks."):
        return None
    prefix, rest = _split(name)
    fused = _fused(rest)
    if fused is None:
        return None
    theirs, what, part = fused
    if what == "stacked":
        return {prefix + theirs: t.transpose(1, 2)}
    if part == 1:
        return {}  # written with w1
    return {prefix + theirs: torch.cat([t, stored(name.replace(".w1.weight", ".w3.weight"))], dim=0)}


def names(name: str, num_experts: int) -> list[str]:
    top = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
    }
    if name in top:
        return [top[name]]
    prefix, rest = _split(name)
    simple = {
        "mixer_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn.router.weight": "block_sparse_moe.router.layer.weight",
        "ffn.w2.weight": "shared_mlp.output_linear.weight",
        "ffn.shared.w2.weight": "shared_mlp.output_linear.weight",
        **{f"mixer.w{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkvo"},
        **{f"mixer.{p}": f"mamba.{p}" for p in _MAMBA_PARAMS},
    }
    if rest in simple:
        return [prefix + simple[rest]]
    raise HFConfigError(f"{name}: no Hugging Face granitemoehybrid counterpart")


FAMILY = Family(
    "granitemoehybrid",
    "GraniteMoeHybridForCausalLM",
    from_hf,
    unfit,
    to_hf,
    names,
    supports=frozenset({"multipliers", "softmax_scale"}),
    load_tensor=load_tensor,
    save_tensor=save_tensor,
)
