"""What every Hugging Face family module shares: the error type, config helpers, and the `Family` record that
format.py dispatches on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moe_dist.config import ConfigError, ModelConfig, config_from_dict
from moe_dist.layers.rope import RopeScaling


class HFConfigError(ValueError):
    """A Hugging Face config or checkpoint our model cannot represent; the message names the field or file."""


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture: its config mapping both ways and its tensor names."""

    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures"[0]
    from_hf: Callable[[dict], ModelConfig]  # config.json → our model config (HFConfigError naming the field)
    unfit: Callable[[ModelConfig], list[str]]  # why `cfg` is not expressible in this family ([] = it is)
    to_hf: Callable[[ModelConfig, dict], None]  # write this family's keys into a config.json dict
    names: Callable[[str, int], list[str]]  # our parameter name → its Hugging Face name(s) (one per expert)
    supports: frozenset = frozenset()  # of FEATURES, what this family expresses beyond the common form
    # Tensors the format does not store one-to-one under `names` (fused, stacked or split there; the one home of
    # that concept): load_tensor(our name, get(hf name), has(hf name), cfg) → our tensor, save_tensor(our name,
    # tensor, stored(our name), cfg) → {hf name: tensor}; no hook, or None from it, = the rule of `names`.
    load_tensor: Optional[Callable[..., Optional[torch.Tensor]]] = None
    save_tensor: Optional[Callable[..., Optional[dict]]] = None
    # (tensor-name prefix, what they are) of checkpoint tensors import drops with one warning line per prefix
    # (multi-token-prediction heads, a vision tower): parts of the checkpoint our model has no place for.
    dropped: tuple[tuple[str, str], ...] = ()
    export_as: Optional[str] = None  # an import-only layout (a vision-language wrapper): the family its export takes


# Options only some families express: each family's `supports` names those it does; the others refuse them.
FEATURES = {
    "relu2": lambda cfg: cfg.ffn_activation != "swiglu",
    "multipliers": lambda cfg: (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) != (1, 1, 1),
    "softmax_scale": lambda cfg: cfg.attention.softmax_scale is not None,
    "output_gate": lambda cfg: cfg.attention.output_gate,
    "partial_rope": lambda cfg: cfg.attention.rope_fraction != 1.0,
    "zero_centered_norm": lambda cfg: cfg.norm_zero_centered,
}
_FEATURE_KEYS = {
    "relu2": "ffn_activation must be 'swiglu'",
    "multipliers": "embedding_multiplier, residual_multiplier and logits_scaling must be 1",
    "softmax_scale": "attention.softmax_scale must be null",
    "output_gate": "attention.output_gate must be false",
    "partial_rope": "attention.rope_fraction must be 1",
    "zero_centered_norm": "norm_zero_centered must be false",
}


def feature_unfit(cfg: ModelConfig, family: Family) -> list[str]:
    """Why `cfg` uses an option of FEATURES that `family` does not express."""
    return [_FEATURE_KEYS[f] for f, used in FEATURES.items() if f not in family.supports and used(cfg)]


def get(hf: dict, key: str, default):
    value = hf.get(key)
    return default if value is None else value


def tile(letters: list[str]) -> str:
    """The shortest pattern that tiles `letters` (what ModelConfig's *_pattern fields hold)."""
    n = len(letters)
    for p in range(1, n + 1):
        if n % p == 0 and all(letters[i] == letters[i % p] for i in range(n)):
            return "".join(letters[:p])
    raise AssertionError("unreachable: the full list tiles itself")


def rope_theta(hf: dict, default: float = 1e6) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise HFConfigError(f"rope_parameters.rope_type: {kind!r} RoPE scaling is not supported (only 'default')")
    return float(params.get("rope_theta") or hf.get("rope_theta") or default)


def rope_parameters(hf: dict, default_theta: float) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) of a config that may use YaRN: transformers 5.x's `rope_parameters` (or the older
    `rope_scaling`) of type "default" or "yarn"; other scalings are refused by name. YaRN's factor, when absent, is
    max_position_embeddings / original_max_position_embeddings, and beta_fast / beta_slow default to 32 / 1, as
    transformers reads them."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or default_theta)
    if kind == "default":
        return theta, RopeScaling()
    if kind != "yarn":
        raise HFConfigError(f"rope_parameters.rope_type: {kind!r} RoPE scaling is not supported (only default, yarn)")
    if "original_max_position_embeddings" not in params:
        raise HFConfigError("rope_parameters.original_max_position_embeddings: YaRN needs it")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or get(hf, "max_position_embeddings", original) / original
    scaling = RopeScaling(
        type="yarn",
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=None if params.get("mscale") is None else float(params["mscale"]),
        mscale_all_dim=None if params.get("mscale_all_dim") is None else float(params["mscale_all_dim"]),
        attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
        truncate=bool(params.get("truncate", True)),
    )
    return theta, scaling


def rope_parameters_to_hf(theta: float, scaling: RopeScaling) -> dict:
    """transformers 5.x's `rope_parameters` for (theta, scaling): the inverse of `rope_parameters`."""
    if scaling.type == "none":
        return {"rope_type": "default", "rope_theta": theta}
    out = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "truncate": scaling.truncate,
    }
    optional = {"mscale": scaling.mscale, "mscale_all_dim": scaling.mscale_all_dim}
    optional["attention_factor"] = scaling.attention_factor
    return out | {k: v for k, v in optional.items() if v is not None}


def check_silu(hf: dict) -> None:
    if get(hf, "hidden_act", "silu") != "silu":
        raise HFConfigError(
            f"hidden_act: only 'silu' (SwiGLU experts, Mamba's SiLU) is supported, got {hf['hidden_act']!r}"
        )


def refuse(hf: dict, key: str, allowed, why: str) -> None:
    """HFConfigError naming `key` when the config sets it to something other than the `allowed` values."""
    if key in hf and hf[key] not in allowed:
        raise HFConfigError(f"{key}: {hf[key]!r} is not supported ({why})")


def validated(cfg: ModelConfig) -> ModelConfig:
    """`cfg` after our config's own checks (heads dividing, positive sizes), as a one-line HFConfigError."""
    try:
        return config_from_dict({"model": dataclasses.asdict(cfg)}).model
    except ConfigError as e:
        raise HFConfigError(f"config.json maps to an invalid model config: {e}") from None


def attention_model(
    hf: dict, *, vocab: int, d_ff: int, eps: float, ffn_pattern: str, attention, moe=None
) -> ModelConfig:
    """The validated config of an attention-only decoder (Mixtral, Qwen, OLMoE, Llama): the sizes every such
    config.json names the same way, with the family's defaults (`vocab`, `d_ff`, `eps`) where a key is absent."""
    extra = {} if moe is None else {"moe": moe}
    return validated(
        ModelConfig(
            vocab_size=get(hf, "vocab_size", vocab),
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            d_ff=get(hf, "intermediate_size", d_ff),
            tie_embeddings=bool(get(hf, "tie_word_embeddings", False)),
            init_std=float(get(hf, "initializer_range", 0.02)),
            mixer_pattern="A",
            ffn_pattern=ffn_pattern,
            norm_eps=float(get(hf, "rms_norm_eps", eps)),
            attention=attention,
            **extra,
        )
    )


def period_offset(letters: list[str], letter: str) -> Optional[tuple[int, int]]:
    """(period, offset) with `letter` exactly at the layers i % period == offset, or None if no such pair."""
    n = len(letters)
    where = [c == letter for c in letters]
    for period in range(1, n + 2):
        for offset in range(period):
            if all(where[i] == (i % period == offset) for i in range(n)):
                return period, offset
    return None


def reasons(checks: list[tuple[bool, str]]) -> list[str]:
    return [why for bad, why in checks if bad]


def router_unfit(cfg: ModelConfig) -> list[str]:
    """Routing no Hugging Face family here expresses (each routes by softmax top-k over all experts)."""
    moe = cfg.moe
    return reasons(
        [
            (moe.score != "softmax", "moe.score must be 'softmax'"),
            (moe.route_scale != 1.0, "moe.route_scale must be 1"),
            (moe.n_groups != 1, "moe.n_groups must be 1"),
            (
                moe.bias_update_rate > 0 or moe.choice_bias,
                "moe.bias_update_rate must be 0 and moe.choice_bias false (the format has no expert-choice bias)",
            ),
        ]
    )


def attention_names(
    name: str,
    num_experts: int,
    *,
    moe: str,
    router: str,
    experts: dict[str, str],
    dense: str = "mlp",
) -> list[str]:
    """Tensor names of the attention-only families (Mixtral, Qwen2/3-MoE, OLMoE): `moe` is the MoE block's prefix
    in a layer, `router` its gate's name, `experts` our w1/w3/w2 → their per-expert projection names; dense FFN
    layers are `dense`.{gate,up,down}_proj, shared experts `moe`.shared_expert(_gate). For the fused w13: all
    gate names, then all up names (the halves of its last dim)."""
    top = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
    }
    if name in top:
        return [top[name]]
    _, layer, rest = name.split(".", 2)  # blocks.<i>.<rest>
    prefix = f"model.layers.{layer}."
    proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    simple = {
        "mixer_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn.router.weight": f"{moe}.{router}.weight",
        "mixer.q_norm.weight": "self_attn.q_norm.weight",
        "mixer.k_norm.weight": "self_attn.k_norm.weight",
        "ffn.shared.gate.weight": f"{moe}.shared_expert_gate.weight",
        **{f"mixer.w{x}.{p}": f"self_attn.{x}_proj.{p}" for x in "qkvo" for p in ("weight", "bias")},
        **{f"ffn.{ours}.weight": f"{dense}.{theirs}.weight" for ours, theirs in proj.items()},
        **{f"ffn.shared.{ours}.weight": f"{moe}.shared_expert.{theirs}.weight" for ours, theirs in proj.items()},
    }
    if rest in simple:
        return [prefix + simple[rest]]
    if rest.startswith("ffn.experts."):
        which = {"w13": [experts["w1"], experts["w3"]], "w2": [experts["w2"]]}[rest.rsplit(".", 1)[1]]
        return [f"{prefix}{moe}.experts.{e}.{w}.weight" for w in which for e in range(num_experts)]
    raise HFConfigError(f"{name}: no Hugging Face counterpart")
