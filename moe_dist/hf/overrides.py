"""`--set model.…` on a conversion (`convert.py import` / `upcycle`): the model section comes from the source, so a
model key may change only what leaves the converted weights meaning what they meant in the source. Every key of
ARCHITECTURE_KEYS is refused with a ConfigError naming it, before anything is read or written; every other model
key (loss coefficients, capacity, drop policy, balancing recipes, kernels, telemetry) is applied.
tests/hf/test_convert_overrides.py checks that every model key is either listed here or applied.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import typing
from typing import Any, Iterable

import torch

from moe_dist.config import ConfigError, ModelConfig
from moe_dist.models.decoder import Decoder, build_model


def _both(why: str) -> dict[str, str]:
    return {"import": why, "upcycle": why}


def _imported(why: str) -> dict[str, str]:
    return {"import": why}


# Model keys a conversion takes from its source: key → {conversion that refuses it: why}.
# Import refuses every key that changes a parameter's shape or what the imported weights compute (top_k too: the
# same weights with another k are another function than the Hugging Face model). Upcycle builds new MoE layers with
# a fresh router, so their routing and shared experts are its choice (from --config/--set); their expert count, k
# and width come from --experts, --top-k and the dense FFN the experts copy.
ARCHITECTURE_KEYS: dict[str, dict[str, str]] = {
    "model.vocab_size": _both("the embedding and head rows"),
    "model.d_model": _both("the residual width of every weight"),
    "model.n_layers": _both("the number of blocks"),
    "model.d_ff": _both("the dense FFN width"),
    "model.mixer_pattern": _both("which layers are attention or Mamba"),
    "model.ffn_pattern": _both("which layers are dense or MoE"),
    "model.layers": _both("which sublayers each layer holds"),
    "model.norm_eps": _both("what the RMSNorms compute"),
    "model.norm_zero_centered": _both("what the RMSNorm weights mean"),
    "model.tie_embeddings": _both("whether the head has weights of its own"),
    "model.ffn_activation": _both("what the FFN weights compute (and whether they have a gate)"),
    "model.embedding_multiplier": _both("what the imported weights compute"),
    "model.residual_multiplier": _both("what the imported weights compute"),
    "model.logits_scaling": _both("what the imported weights compute"),
    "model.attention.n_heads": _both("the attention projection shapes"),
    "model.attention.n_kv_heads": _both("the attention projection shapes"),
    "model.attention.head_dim": _both("the attention projection shapes"),
    "model.attention.rope": _both("the positions the attention weights were trained with"),
    "model.attention.rope_theta": _both("the positions the attention weights were trained with"),
    "model.attention.sliding_window": _both("which positions the attention sees"),
    "model.attention.qk_norm": _both("the q/k norm weights"),
    "model.attention.qkv_bias": _both("the q/k/v biases"),
    "model.attention.softmax_scale": _both("what the attention weights were trained with"),
    "model.attention.output_gate": _both("the query projection's shape (its gate rows)"),
    "model.attention.rope_fraction": _both("the positions the attention weights were trained with"),
    "model.mla.n_heads": _both("the MLA projection shapes"),
    "model.mla.q_lora_rank": _both("the MLA query projections (one, or a bottleneck with its norm)"),
    "model.mla.kv_lora_rank": _both("the MLA projection shapes"),
    "model.mla.qk_nope_head_dim": _both("the MLA projection shapes"),
    "model.mla.qk_rope_head_dim": _both("the MLA projection shapes"),
    "model.mla.v_head_dim": _both("the MLA projection shapes"),
    "model.mla.rope": _both("the positions the MLA weights were trained with"),
    "model.mla.rope_theta": _both("the positions the MLA weights were trained with"),
    "model.mla.rope_interleave": _both("how the MLA weights' RoPE rows are ordered"),
    "model.mla.softmax_scale": _both("what the MLA weights were trained with"),
    "model.mla.norm_eps": _both("what the MLA latent norms compute"),
    "model.mla.rope_scaling.type": _both("the positions the MLA weights were trained with"),
    "model.mla.rope_scaling.factor": _both("the positions the MLA weights were trained with"),
    "model.mla.rope_scaling.original_max_position_embeddings": _both("the positions the MLA weights were trained with"),
    "model.mla.rope_scaling.beta_fast": _both("the positions the MLA weights were trained with"),
    "model.mla.rope_scaling.beta_slow": _both("the positions the MLA weights were trained with"),
    "model.mla.rope_scaling.mscale": _both("the positions the MLA weights were trained with"),
    "model.mla.rope_scaling.mscale_all_dim": _both("the positions the MLA weights were trained with"),
    "model.mla.rope_scaling.attention_factor": _both("the positions the MLA weights were trained with"),
    "model.mla.rope_scaling.truncate": _both("the positions the MLA weights were trained with"),
    "model.mamba.d_state": _both("the Mamba weight shapes"),
    "model.mamba.d_conv": _both("the Mamba weight shapes"),
    "model.mamba.expand": _both("the Mamba weight shapes"),
    "model.mamba.dt_rank": _both("the Mamba weight shapes"),
    "model.mamba.conv_bias": _both("the Mamba biases"),
    "model.mamba.proj_bias": _both("the Mamba biases"),
    "model.mamba.inner_norms": _both("the Mamba norm weights"),
    "model.mamba2.d_state": _both("the Mamba-2 weight shapes"),
    "model.mamba2.d_conv": _both("the Mamba-2 weight shapes"),
    "model.mamba2.expand": _both("the Mamba-2 weight shapes"),
    "model.mamba2.n_heads": _both("the Mamba-2 weight shapes"),
    "model.mamba2.head_dim": _both("the Mamba-2 weight shapes"),
    "model.mamba2.n_groups": _both("the Mamba-2 weight shapes and its norm's groups"),
    "model.mamba2.dt_limit": _both("what the imported Mamba-2 layers compute"),
    "model.mamba2.conv_bias": _both("the Mamba-2 biases"),
    "model.mamba2.proj_bias": _both("the Mamba-2 biases"),
    "model.moe.num_experts": {"import": "the experts per MoE layer", "upcycle": "--experts sets it"},
    "model.moe.top_k": {"import": "another k makes the same weights another function", "upcycle": "--top-k sets it"},
    "model.moe.d_ff": {"import": "the expert width", "upcycle": "the experts copy the dense FFN"},
    "model.moe.renormalize": _imported("what the imported router computes"),
    "model.moe.score": _imported("what the imported router computes"),
    "model.moe.route_scale": _imported("what the imported router computes"),
    "model.moe.n_groups": _imported("what the imported router computes"),
    "model.moe.topk_groups": _imported("what the imported router computes"),
    "model.moe.n_shared_experts": _imported("the shared-expert weights"),
    "model.moe.shared_d_ff": _imported("the shared-expert weights"),
    "model.moe.shared_gate": _imported("the shared-expert weights"),
    "model.moe.choice_bias": _imported("the imported router's correction bias, which decides expert choices"),
    "model.gdn.n_k_heads": _both("the Gated DeltaNet weight shapes"),
    "model.gdn.n_v_heads": _both("the Gated DeltaNet weight shapes"),
    "model.gdn.head_k_dim": _both("the Gated DeltaNet weight shapes"),
    "model.gdn.head_v_dim": _both("the Gated DeltaNet weight shapes"),
    "model.gdn.conv_size": _both("the Gated DeltaNet weight shapes"),
}


def is_model_override(text: str) -> bool:
    key = text.split("=", 1)[0].strip()
    return key == "model" or key.startswith("model.")


def _field_type(cls: type, name: str, prefix: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (valid keys: {', '.join(names)})"
        raise ConfigError(f"{prefix}{name}: unknown config key{hint}")
    return typing.get_type_hints(cls)[name]


def _leaves(tp: Any, key: str, value: Any, out: dict[str, Any]) -> None:
    """`value` set at the dotted model `key` (of type `tp`) as {leaf key: value}: an object given for a section
    sets the keys it names."""
    if not (dataclasses.is_dataclass(tp) and isinstance(value, dict)):
        out[key] = value
        return
    for name, v in value.items():
        _leaves(_field_type(tp, name, f"{key}."), f"{key}.{name}", v, out)


def model_settings(overrides: Iterable[str], conversion: str) -> dict[str, Any]:
    """{dotted model key: value} of `overrides` (KEY=VALUE texts, values parsed as JSON where they parse, as
    load_config reads --set); a ConfigError names the first unknown key or the first key `conversion` ("import"
    or "upcycle") takes from its source (ARCHITECTURE_KEYS)."""
    out: dict[str, Any] = {}
    for text in overrides:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not is_model_override(key):
            raise ConfigError(f"override {text!r}: expected model.KEY=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        tp, parts = ModelConfig, key.split(".")
        for depth, part in enumerate(parts[1:], start=1):
            if not dataclasses.is_dataclass(tp):
                raise ConfigError(f"{key}: '{'.'.join(parts[:depth])}' is not a section")
            tp = _field_type(tp, part, ".".join(parts[:depth]) + ".")
        if key == "model" and not isinstance(value, dict):
            raise ConfigError(f"model: expected an object, got {type(value).__name__} {value!r}")
        _leaves(tp, key, value, out)
    for key in out:
        why = ARCHITECTURE_KEYS.get(key, {}).get(conversion)
        if why is not None:
            raise ConfigError(
                f"{key}: cannot be set on {conversion} ({why}); only model settings that keep the source's "
                "architecture can (docs/moe_recipes.md)"
            )
    return out


def with_settings(model: dict, settings: dict[str, Any]) -> dict:
    """The model section `model` (a config dict) with `settings` (from model_settings) written into it; the caller
    validates it (config_from_dict)."""
    model = copy.deepcopy(model)
    for key, value in settings.items():
        node, parts = model, key.split(".")[1:]
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = value
    return model


@torch.no_grad()
def rebuilt(model: Decoder, cfg: ModelConfig) -> Decoder:
    """`model`'s tensors (shared, not copied) in a Decoder of `cfg`, which differs from model.cfg only in keys
    outside ARCHITECTURE_KEYS. Buffers only `cfg` has (the loss-free balancing bias, the global-batch load) take
    their initial values, as a fresh model's would."""
    fresh = build_model(cfg)  # on the meta device: nothing allocated
    old = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    kept = dict(fresh.named_buffers())
    for name, t in old.items():  # Nemotron-H's correction bias is our balancing bias: it decides expert choices
        if name.endswith(".router.bias_E") and name not in kept and bool(t.any()):
            raise ConfigError(
                "model.moe.bias_update_rate: 0 would drop the imported router's expert-choice bias; keep it > 0"
            )
    state = {}
    for name, t in [*fresh.named_parameters(), *fresh.named_buffers()]:
        if name in old:
            assert old[name].shape == t.shape, f"{name}: a shape-changing key is missing from ARCHITECTURE_KEYS"
            state[name] = old[name].detach()
            continue
        owner, _, leaf = name.rpartition(".")
        assert leaf in dict(fresh.get_submodule(owner).named_buffers(recurse=False)), f"{name}: a new parameter"
        init = copy.deepcopy(fresh.get_submodule(owner)).to_empty(device="cpu")
        init.init_weights()  # the owner (the router) initializes its optional buffers there
        state[name] = getattr(init, leaf)
    fresh.load_state_dict(state, assign=True)
    return fresh
