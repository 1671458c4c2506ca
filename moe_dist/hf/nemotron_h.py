"""Nemotron-H / Nemotron 3 (`NemotronHForCausalLM`): a list of single-sublayer layers, each one pre-norm residual
unit: Mamba-2 (`linear_attention`, pattern letter M), GQA attention without RoPE (`full_attention`, *), a dense
squared-ReLU MLP (`mlp`, -) or an MoE (`moe`, E): sigmoid routing with a correction bias (`e_score_correction_bias`,
our loss-free balancing bias), expert groups, renormalized and scaled top-k weights, squared-ReLU experts and one
squared-ReLU shared expert. Tensors live under `backbone.` (the published checkpoints' and transformers' own
`save_pretrained` prefix), one norm per layer (`layers.i.norm`), every sublayer named `mixer`.

Published config.json files name the layers by `hybrid_override_pattern` and some Mamba fields `mamba_*`;
transformers writes `layers_block_type` and the plain names: both are read. Multi-token-prediction layers
(`num_nextn_predict_layers`, tensors `mtp.*`) are dropped with one warning, as transformers does; the latent MoE
(`moe_latent_size`) is refused.
"""

from __future__ import annotations

import math

from moe_dist.config import AttentionConfig, Mamba2Config, ModelConfig, MoEConfig
from moe_dist.hf.common import Family, HFConfigError, get, reasons, refuse, validated
from moe_dist.models.decoder import layer_kinds

# transformers' layer type and the pattern letter of published configs → our layer-list entry
_KINDS = {"linear_attention": "mamba2", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
_LETTERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_MAMBA_PARAMS = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D")
_MAMBA_PARAMS += ("norm.weight", "out_proj.weight", "out_proj.bias")
# The loss-free balancing rate an imported model trains with (a training choice the format does not hold:
# DeepSeek-V3's value; `--set model.moe.bias_update_rate=...` changes it, 0 freezes the imported bias).
BIAS_UPDATE_RATE = 1e-3


def number(value) -> float:
    """A float from config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def layer_types(hf: dict) -> list[str]:
    """transformers' layer types: `layers_block_type` / `layer_types`, or the published `hybrid_override_pattern`."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types is None:
        pattern = hf.get("hybrid_override_pattern")
        if pattern is None:
            return ["linear_attention", "moe", "full_attention", "mlp"]  # transformers' default
        bad = sorted(set(pattern) - set(_LETTERS))
        if bad:
            raise HFConfigError(f"hybrid_override_pattern: letters {bad} are not M, *, - or E")
        types = [_LETTERS[c] for c in pattern]
    bad = sorted(set(types) - set(_KINDS))
    if bad:
        raise HFConfigError(f"layers_block_type: {bad} are not {sorted(_KINDS)}")
    return list(types)


def _first(hf: dict, keys: tuple[str, ...], default):
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    return default


def from_hf(hf: dict) -> ModelConfig:
    refuse(hf, "mlp_hidden_act", ("relu2",), "only squared-ReLU ('relu2') FFNs are mapped")
    refuse(hf, "mamba_hidden_act", ("silu",), "Mamba-2's conv activation is SiLU here")
    refuse(hf, "moe_latent_size", (None,), "the latent MoE (experts in a projected space) is not supported")
    for key, why in (
        ("attention_bias", "attention projection biases have no counterpart here"),
        ("mlp_bias", "FFN biases have no counterpart here"),
        ("use_bias", "Mamba projection biases with use_bias are not mapped"),
    ):
        refuse(hf, key, (False,), why)
    refuse(hf, "sliding_window", (None,), "sliding-window attention is not mapped for this family")
    kinds = [_KINDS[t] for t in layer_types(hf)]
    d_model = hf["hidden_size"]
    n_heads = get(hf, "num_attention_heads", 32)
    chunk = int(_first(hf, ("chunk_size", "mamba_chunk_size"), 128))
    low = number(_first(hf, ("time_step_min", "mamba_dt_min"), 0.001))
    # transformers' mixer clamps dt to [time_step_min, inf) (its prefill path; the mamba_ssm kernels do the same)
    mamba2 = Mamba2Config(
        d_state=get(hf, "ssm_state_size", 128),
        d_conv=_first(hf, ("conv_kernel", "mamba_d_conv"), 4),
        expand=_first(hf, ("expand", "mamba_expand"), 2),
        n_heads=get(hf, "mamba_num_heads", 128),
        head_dim=get(hf, "mamba_head_dim", 64),
        n_groups=_first(hf, ("n_groups", "mamba_n_groups"), 8),
        chunk_size=chunk if chunk > 0 and chunk & (chunk - 1) == 0 else 64,  # numerics only: any power of two
        dt_min=low,
        dt_max=number(_first(hf, ("time_step_max", "mamba_dt_max"), 0.1)),
        dt_init_floor=number(_first(hf, ("time_step_floor", "mamba_dt_init_floor"), 1e-4)),
        dt_limit=[low, math.inf],
        conv_bias=bool(_first(hf, ("use_conv_bias", "mamba_conv_bias"), True)),
        proj_bias=False,
    )
    num_experts = _first(hf, ("n_routed_experts", "num_local_experts"), 8)
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=min(get(hf, "num_experts_per_tok", 2), num_experts),
        d_ff=get(hf, "moe_intermediate_size", 7688),
        capacity_factor=None,
        renormalize=bool(get(hf, "norm_topk_prob", True)),
        score="sigmoid",
        route_scale=float(get(hf, "routed_scaling_factor", 1.0)),
        bias_update_rate=BIAS_UPDATE_RATE,
        choice_bias=True,  # the correction bias stays (frozen) where `--set model.moe.bias_update_rate=0`
        n_groups=get(hf, "n_group", 1),
        topk_groups=get(hf, "topk_group", 1),
        # transformers builds the shared expert whatever n_shared_experts says: its width is the whole of it
        n_shared_experts=max(get(hf, "n_shared_experts", 1), 1),
        shared_d_ff=get(hf, "moe_shared_expert_intermediate_size", 7688),
    )
    attention = AttentionConfig(
        n_heads=n_heads,
        n_kv_heads=get(hf, "num_key_value_heads", 8),
        head_dim=get(hf, "head_dim", 128),
        rope=False,
    )
    return validated(
        ModelConfig(
            vocab_size=get(hf, "vocab_size", 131072),
            d_model=d_model,
            n_layers=len(kinds),
            d_ff=get(hf, "intermediate_size", 21504),
            layers=kinds,
            norm_eps=float(get(hf, "layer_norm_epsilon", 1e-5)),
            tie_embeddings=bool(get(hf, "tie_word_embeddings", False)),
            init_std=float(get(hf, "initializer_range", 0.02)),
            ffn_activation="relu2",
            attention=attention,
            mamba2=mamba2,
            moe=moe,
        )
    )


def unfit(cfg: ModelConfig) -> list[str]:
    kinds = layer_kinds(cfg)
    a, moe, mb = cfg.attention, cfg.moe, cfg.mamba2
    has_moe = cfg.has_kind("moe")
    return reasons(
        [
            (any(m is not None and f is not None for m, f in kinds), "every layer must hold one sublayer"),
            (cfg.has_kind("mamba1") or cfg.has_kind("gdn"), "mixers must be mamba2 or attention"),
            (cfg.ffn_activation != "relu2", "ffn_activation must be 'relu2'"),
            (a.rope, "attention.rope must be false"),
            (a.sliding_window is not None, "attention.sliding_window must be null"),
            (a.qk_norm != "none" or a.qkv_bias, "attention.qk_norm must be 'none' and qkv_bias false"),
            (a.softmax_scale is not None, "attention.softmax_scale must be null"),
            (cfg.has_kind("mamba2") and mb.proj_bias, "mamba2.proj_bias must be false"),
            (
                cfg.has_kind("mamba2") and (mb.dt_limit is None or mb.dt_limit[1] != math.inf),
                "mamba2.dt_limit must be [time_step_min, Infinity]",
            ),
            (has_moe and moe.score != "sigmoid", "moe.score must be 'sigmoid'"),
            (has_moe and moe.n_shared_experts < 1, "moe.n_shared_experts must be >= 1"),
            (has_moe and moe.shared_gate, "moe.shared_gate must be false"),
        ]
    )


def to_hf(cfg: ModelConfig, out: dict) -> None:
    a, mb, moe = cfg.attention, cfg.mamba2, cfg.moe
    types = {v: k for k, v in _KINDS.items()}
    low = mb.dt_limit[0] if mb.dt_limit is not None else mb.dt_min
    for stale in ("hybrid_override_pattern", "layer_types", "num_local_experts", "rms_norm_eps", "hidden_act"):
        out.pop(stale, None)
    for stale in ("mamba_d_conv", "mamba_expand", "mamba_n_groups", "mamba_chunk_size", "mamba_conv_bias"):
        out.pop(stale, None)
    for stale in ("mamba_dt_min", "mamba_dt_max", "mamba_dt_limit", "mamba_dt_init_floor"):
        out.pop(stale, None)
    out.update(
        layers_block_type=[types[m or f] for m, f in layer_kinds(cfg)],
        head_dim=a.head_dim or cfg.d_model // a.n_heads,
        intermediate_size=cfg.d_ff,
        mlp_hidden_act="relu2",
        mamba_hidden_act="silu",
        layer_norm_epsilon=cfg.norm_eps,
        ssm_state_size=mb.d_state,
        conv_kernel=mb.d_conv,
        expand=mb.expand,
        mamba_num_heads=mb.heads(cfg.d_model),
        mamba_head_dim=mb.head_dim,
        n_groups=mb.n_groups,
        chunk_size=mb.chunk_size,
        time_step_min=low,
        time_step_max=mb.dt_max,
        time_step_floor=mb.dt_init_floor,
        use_conv_bias=mb.conv_bias,
        n_routed_experts=moe.num_experts,
        moe_intermediate_size=moe.d_ff or cfg.d_ff,
        n_shared_experts=moe.n_shared_experts,
        moe_shared_expert_intermediate_size=moe.shared_hidden(cfg.d_ff),
        moe_latent_size=None,
        norm_topk_prob=moe.renormalize,
        routed_scaling_factor=moe.route_scale,
        n_group=moe.n_groups,
        topk_group=moe.topk_groups,
        num_nextn_predict_layers=0,
        attention_bias=False,
        mlp_bias=False,
        use_bias=False,
        sliding_window=None,
    )
    out.setdefault("max_position_embeddings", 4096)


def names(name: str, num_experts: int) -> list[str]:
    top = {
        "embed.weight": "backbone.embeddings.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "backbone.norm_f.weight",
    }
    if name in top:
        return [top[name]]
    _, layer, rest = name.split(".", 2)  # blocks.<i>.<rest>
    prefix = f"backbone.layers.{layer}."
    simple = {
        "mixer_norm.weight": "norm.weight",  # one norm per layer: the layer's one sublayer has it
        "ffn_norm.weight": "norm.weight",
        "ffn.router.weight": "mixer.gate.weight",
        "ffn.router.bias_E": "mixer.gate.e_score_correction_bias",
        "ffn.w1.weight": "mixer.up_proj.weight",
        "ffn.w2.weight": "mixer.down_proj.weight",
        "ffn.shared.w1.weight": "mixer.shared_experts.up_proj.weight",
        "ffn.shared.w2.weight": "mixer.shared_experts.down_proj.weight",
        **{f"mixer.w{x}.weight": f"mixer.{x}_proj.weight" for x in "qkvo"},
        **{f"mixer.{p}": f"mixer.{p}" for p in _MAMBA_PARAMS},
    }
    if rest in simple:
        return [prefix + simple[rest]]
    if rest in ("ffn.experts.w1", "ffn.experts.w2"):
        which = {"w1": "up_proj", "w2": "down_proj"}[rest.rsplit(".", 1)[1]]
        return [f"{prefix}mixer.experts.{e}.{which}.weight" for e in range(num_experts)]
    raise HFConfigError(f"{name}: no Hugging Face nemotron_h counterpart")


FAMILY = Family(
    "nemotron_h",
    "NemotronHForCausalLM",
    from_hf,
    unfit,
    to_hf,
    names,
    supports=frozenset({"relu2"}),
    dropped=(("mtp.", "multi-token-prediction"),),
)
