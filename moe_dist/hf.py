"""Hugging Face interop: Mixtral and Jamba checkpoint directories ↔ our Decoder, and ↔ our training checkpoints.

A Hugging Face checkpoint directory is `config.json` plus safetensors files (one `model.safetensors`, or shards
listed by `model.safetensors.index.json`), with the tensor names of the Hub checkpoints, which every
transformers version loads (its own `save_pretrained` writes them too):

    Mixtral  model.layers.i.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
             block_sparse_moe.gate, block_sparse_moe.experts.e.{w1,w3,w2}}, model.norm
    Jamba    model.layers.i.{input_layernorm, self_attn.* | mamba.*, pre_ff_layernorm,
             feed_forward.{gate,up,down}_proj | feed_forward.router, feed_forward.experts.e.{gate,up,down}_proj},
             model.final_layernorm

Our experts are stacked (E, D, 2F) / (E, F, D): the transposes of Hugging Face's per-expert Linear weights, with
the gate and up projections side by side in one w13 = [w1 | w3].
Imported models are dropless (`capacity_factor: null`), as Hugging Face's MoE blocks are, so logits match.
Nothing here imports transformers: reading and writing the format only needs safetensors.

What our config cannot express is refused with a one-line error naming the field (RoPE scaling, activations
other than SiLU, Jamba layouts that are not one period/offset); training hyper-parameters of the Hugging Face
config (router_aux_loss_coef, jitter noise) are not mapped: ours stay at their defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_dist.config import (
    AttentionConfig,
    ConfigError,
    JobConfig,
    MambaConfig,
    ModelConfig,
    MoEConfig,
    config_from_dict,
    config_to_dict,
)
from moe_dist.models.decoder import Decoder, build_model, layer_kinds
from moe_dist.train.checkpoint import MOMENTS, latest_checkpoint, verify_checkpoint, write_whole_checkpoint
from moe_dist.train.optim import lr_lambda

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "jamba": "JambaForCausalLM"}
# Files of a Hugging Face directory that are not weights or config but travel with a converted model.
COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)
_MAMBA_PARAMS = (
    "in_proj.weight",
    "in_proj.bias",
    "conv1d.weight",
    "conv1d.bias",
    "x_proj.weight",
    "dt_proj.weight",
    "dt_proj.bias",
    "A_log",
    "D",
    "out_proj.weight",
    "out_proj.bias",
)
_SHARD_BYTES = 5 * 2**30  # safetensors shard size of exported checkpoints (Hugging Face's default)


class HFConfigError(ValueError):
    """A Hugging Face config or checkpoint our model cannot represent; the message names the field or file."""


# ----------------------------------------------------------------------------------------------- configs


def _get(hf: dict, key: str, default):
    value = hf.get(key)
    return default if value is None else value


def _tile(letters: list[str]) -> str:
    """The shortest pattern that tiles `letters` (what ModelConfig's *_pattern fields hold)."""
    n = len(letters)
    for p in range(1, n + 1):
        if n % p == 0 and all(letters[i] == letters[i % p] for i in range(n)):
            return "".join(letters[:p])
    raise AssertionError("unreachable: the full list tiles itself")


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise HFConfigError(f"rope_parameters.rope_type: {kind!r} RoPE scaling is not supported (only 'default')")
    return float(params.get("rope_theta") or hf.get("rope_theta") or 1e6)


def config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig for a Hugging Face Mixtral or Jamba config.json (as a dict). Absent keys take the
    transformers defaults of that architecture."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise HFConfigError(f"model_type: {kind!r} is not supported (expected one of {sorted(ARCHITECTURES)})")
    if _get(hf, "hidden_act", "silu") != "silu":
        raise HFConfigError(
            f"hidden_act: only 'silu' (SwiGLU experts, Mamba's SiLU) is supported, got {hf['hidden_act']!r}"
        )
    n_layers, d_model = hf["num_hidden_layers"], hf["hidden_size"]
    n_heads = _get(hf, "num_attention_heads", 32)
    common = dict(
        vocab_size=_get(hf, "vocab_size", 32000 if kind == "mixtral" else 65536),
        d_model=d_model,
        n_layers=n_layers,
        d_ff=_get(hf, "intermediate_size", 14336),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        init_std=float(_get(hf, "initializer_range", 0.02)),
    )
    num_experts = _get(hf, "num_local_experts" if kind == "mixtral" else "num_experts", 8 if kind == "mixtral" else 16)
    # Jamba with num_experts 1 has no MoE layer; top_k is clipped so that the (unused) MoE section validates.
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=min(_get(hf, "num_experts_per_tok", 2), num_experts),
        capacity_factor=None,
        renormalize=kind == "mixtral",
    )
    if kind == "mixtral":
        attention = AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=_get(hf, "num_key_value_heads", n_heads),
            head_dim=hf.get("head_dim"),
            rope=True,
            rope_theta=_rope_theta(hf),
            sliding_window=hf.get("sliding_window"),
        )
        return _validated(
            ModelConfig(
                **common,
                mixer_pattern="A",
                ffn_pattern="E",
                norm_eps=float(_get(hf, "rms_norm_eps", 1e-5)),
                attention=attention,
                moe=moe,
            )
        )
    attn_period, attn_offset = _get(hf, "attn_layer_period", 8), _get(hf, "attn_layer_offset", 4)
    exp_period, exp_offset = _get(hf, "expert_layer_period", 2), _get(hf, "expert_layer_offset", 1)
    dt_rank = _get(hf, "mamba_dt_rank", "auto")
    mamba = MambaConfig(
        d_state=_get(hf, "mamba_d_state", 16),
        d_conv=_get(hf, "mamba_d_conv", 4),
        expand=_get(hf, "mamba_expand", 2),
        dt_rank=math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank),
        conv_bias=bool(_get(hf, "mamba_conv_bias", True)),
        proj_bias=bool(_get(hf, "mamba_proj_bias", False)),
        inner_norms=True,
    )
    mixers = ["A" if i % attn_period == attn_offset else "M" for i in range(n_layers)]
    ffns = ["E" if i % exp_period == exp_offset and moe.num_experts > 1 else "D" for i in range(n_layers)]
    attention = AttentionConfig(
        n_heads=n_heads, n_kv_heads=_get(hf, "num_key_value_heads", 8), head_dim=hf.get("head_dim"), rope=False
    )
    return _validated(
        ModelConfig(
            **common,
            mixer_pattern=_tile(mixers),
            ffn_pattern=_tile(ffns),
            norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
            attention=attention,
            mamba=mamba,
            moe=moe,
        )
    )


def _validated(cfg: ModelConfig) -> ModelConfig:
    """`cfg` after our config's own checks (heads dividing, positive sizes), as a one-line HFConfigError."""
    try:
        return config_from_dict({"model": dataclasses.asdict(cfg)}).model
    except ConfigError as e:
        raise HFConfigError(f"config.json maps to an invalid model config: {e}") from None


def _period_offset(letters: list[str], letter: str) -> Optional[tuple[int, int]]:
    """(period, offset) with `letter` exactly at the layers i % period == offset, or None if no such pair."""
    n = len(letters)
    where = [c == letter for c in letters]
    for period in range(1, n + 2):
        for offset in range(period):
            if all(where[i] == (i % period == offset) for i in range(n)):
                return period, offset
    return None


def _architecture(cfg: ModelConfig) -> str:
    """'mixtral' or 'jamba': the Hugging Face architecture that expresses `cfg` exactly, or HFConfigError."""
    kinds = layer_kinds(cfg)
    mixers, ffns = [m for m, _ in kinds], [f for _, f in kinds]
    a, moe = cfg.attention, cfg.moe
    mixtral = [
        why
        for bad, why in [
            (set(mixers) != {"A"}, "every mixer must be attention"),
            (set(ffns) != {"E"}, "every FFN must be MoE"),
            (not a.rope, "attention.rope must be true"),
            (not moe.renormalize, "moe.renormalize must be true"),
        ]
        if bad
    ]
    if not mixtral:
        return "mixtral"
    jamba = [
        why
        for bad, why in [
            (a.rope, "attention.rope must be false"),
            (a.sliding_window is not None, "attention.sliding_window must be null"),
            ("E" in ffns and moe.renormalize, "moe.renormalize must be false"),
            (a.head_dim not in (None, cfg.d_model // a.n_heads), "attention.head_dim must be d_model // n_heads"),
            ("M" in mixers and not cfg.mamba.inner_norms, "mamba.inner_norms must be true"),
            ("E" in ffns and "D" in ffns and (moe.d_ff or cfg.d_ff) != cfg.d_ff, "moe.d_ff must equal d_ff"),
            (_period_offset(mixers, "A") is None, "attention layers must sit at one period/offset"),
            (_period_offset(ffns, "E") is None, "MoE layers must sit at one period/offset"),
        ]
        if bad
    ]
    if not jamba:
        return "jamba"
    raise HFConfigError(
        f"model: not expressible as Hugging Face Mixtral ({'; '.join(mixtral)}) nor Jamba ({'; '.join(jamba)})"
    )


def config_to_hf(cfg: ModelConfig, template: Optional[dict] = None) -> dict:
    """The Hugging Face config.json dict for `cfg`. Keys of `template` (e.g. the config.json a model was
    imported from: token ids, max_position_embeddings) are kept where our config does not define them."""
    kind = _architecture(cfg)
    kinds = layer_kinds(cfg)
    a, moe = cfg.attention, cfg.moe
    out = dict(template or {})
    for stale in ("rope_parameters", "rope_scaling", "torch_dtype", "dtype", "transformers_version"):
        out.pop(stale, None)
    out.update(
        architectures=[ARCHITECTURES[kind]],
        model_type=kind,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        num_experts_per_tok=moe.top_k,
        initializer_range=cfg.init_std,
    )
    if kind == "mixtral":
        out.update(
            intermediate_size=moe.d_ff or cfg.d_ff,
            num_local_experts=moe.num_experts,
            head_dim=a.head_dim,
            rope_theta=a.rope_theta,
            sliding_window=a.sliding_window,
        )
        out.setdefault("max_position_embeddings", 131072)
        return out
    m, has_moe = cfg.mamba, any(f == "E" for _, f in kinds)
    attn_period, attn_offset = _period_offset([k for k, _ in kinds], "A")
    exp_period, exp_offset = _period_offset([f for _, f in kinds], "E")
    out.update(
        intermediate_size=(moe.d_ff or cfg.d_ff) if has_moe else cfg.d_ff,
        num_experts=moe.num_experts if has_moe else 1,
        attn_layer_period=attn_period,
        attn_layer_offset=attn_offset,
        expert_layer_period=exp_period,
        expert_layer_offset=exp_offset,
        mamba_d_state=m.d_state,
        mamba_d_conv=m.d_conv,
        mamba_expand=m.expand,
        mamba_dt_rank=m.dt_rank or math.ceil(cfg.d_model / 16),
        mamba_conv_bias=m.conv_bias,
        mamba_proj_bias=m.proj_bias,
        use_mamba_kernels=False,
    )
    out.setdefault("max_position_embeddings", 262144)
    return out


# ----------------------------------------------------------------------------------------------- tensor names


def _hf_names(kind: str, name: str, num_experts: int) -> list[str]:
    """Hugging Face tensor names of our parameter `name`: one name, or one per expert for stacked experts (for the
    fused w13, all gate names, then all up names: the halves of its last dim)."""
    top = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight" if kind == "mixtral" else "model.final_layernorm.weight",
    }
    if name in top:
        return [top[name]]
    _, layer, rest = name.split(".", 2)  # blocks.<i>.<rest>
    prefix = f"model.layers.{layer}."
    if kind == "mixtral":
        moe, hf_ffn = "block_sparse_moe.gate.weight", {"w1": "w1", "w3": "w3", "w2": "w2"}
        ffn_norm, dense = "post_attention_layernorm.weight", {}
        moe_prefix = "block_sparse_moe.experts"
    else:
        moe, hf_ffn = "feed_forward.router.weight", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        ffn_norm = "pre_ff_layernorm.weight"
        dense = {f"ffn.{ours}.weight": f"feed_forward.{hf}.weight" for ours, hf in hf_ffn.items()}
        moe_prefix = "feed_forward.experts"
    experts = {"w13": [hf_ffn["w1"], hf_ffn["w3"]], "w2": [hf_ffn["w2"]]}
    simple = {
        "mixer_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": ffn_norm,
        "ffn.router.weight": moe,
        **{f"mixer.w{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkvo"},
        **{f"mixer.{p}": f"mamba.{p}" for p in _MAMBA_PARAMS},
        **{f"mixer.{x}_norm.weight": f"mamba.{x}_layernorm.weight" for x in ("dt", "b", "c")},
        **dense,
    }
    if rest in simple:
        return [prefix + simple[rest]]
    if rest.startswith("ffn.experts."):
        return [
            f"{prefix}{moe_prefix}.{e}.{w}.weight" for w in experts[rest.rsplit(".", 1)[1]] for e in range(num_experts)
        ]
    raise HFConfigError(f"{name}: no Hugging Face {kind} counterpart")


def _is_experts(name: str) -> bool:
    return ".ffn.experts." in name


# ----------------------------------------------------------------------------------------------- HF directories


def _hf_index(path: Path) -> dict[str, Path]:
    """Tensor name → safetensors file of a Hugging Face checkpoint directory."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        files = sorted({path / f for f in json.loads(index_file.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFConfigError(f"{path}: no safetensors files (only safetensors checkpoints are read: no pickle)")
    index = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            index.update({k: f for k in sf.keys()})
    return index


def _assign(model: Decoder, read, source: str, dtype: Optional[torch.dtype]) -> Decoder:
    """Fill a meta-built model with the tensors `read(our_name)` returns (no random init, no double allocation)."""
    state = {}
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        t = read(name)
        if tuple(t.shape) != tuple(p.shape):
            raise HFConfigError(f"{source}: {name} has shape {tuple(t.shape)}, the config implies {tuple(p.shape)}")
        state[name] = t.to(dtype or t.dtype).contiguous()
    model.load_state_dict(state, assign=True)
    return model


def load_hf_model(path: str | Path, dtype: Optional[torch.dtype] = torch.float32) -> Decoder:
    """Our Decoder with the weights of the Hugging Face Mixtral/Jamba directory `path` (dtype None = as stored)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise HFConfigError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    hf = json.loads((path / "config.json").read_text())
    cfg = config_from_hf(hf)
    index = _hf_index(path)
    used: set[str] = set()
    handles: dict[Path, object] = {}

    def get(hf_name: str) -> torch.Tensor:
        if hf_name not in index:
            raise HFConfigError(f"{path}: tensor {hf_name!r} missing (the checkpoint does not match its config.json)")
        f = index[hf_name]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        used.add(hf_name)
        return handles[f].get_tensor(hf_name)

    def read(name: str) -> torch.Tensor:
        names = _hf_names(hf["model_type"], name, cfg.moe.num_experts)
        if not _is_experts(name):
            return get(names[0])
        E = cfg.moe.num_experts
        parts = [torch.stack([get(n).t() for n in names[i : i + E]]) for i in range(0, len(names), E)]
        return torch.cat(parts, dim=2)  # w13: [gate | up]

    model = _assign(build_model(cfg), read, str(path), dtype)
    unused = sorted(set(index) - used - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
    if unused:
        raise HFConfigError(
            f"{path}: {len(unused)} tensors not used by the model built from config.json, e.g. {unused[:3]}"
        )
    return model


def save_hf_model(
    model: Decoder,
    path: str | Path,
    dtype: Optional[torch.dtype] = None,
    template: Optional[dict] = None,
    shard_bytes: int = _SHARD_BYTES,
) -> Path:
    """Write `model` as a Hugging Face checkpoint directory (config.json + safetensors, sharded past
    `shard_bytes`) that `transformers.AutoModelForCausalLM.from_pretrained(path)` loads offline."""
    cfg = model.cfg
    hf = config_to_hf(cfg, template)
    kind = hf["model_type"]
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise HFConfigError(f"{name}: the model is on the meta device; materialize or load it first")
        t = p.detach().to(dtype or p.dtype).cpu()
        names = _hf_names(kind, name, cfg.moe.num_experts)
        if _is_experts(name):
            if t.shape[0] != cfg.moe.num_experts:
                raise HFConfigError(
                    f"{name}: holds {t.shape[0]} of {cfg.moe.num_experts} experts (expert-parallel "
                    "slice); export a checkpoint, which holds them all"
                )
            halves = t.chunk(len(names) // t.shape[0], dim=2)  # w13: [gate | up]; w2: itself
            tensors.update({n: w.t().contiguous() for n, w in zip(names, (w for h in halves for w in h.unbind(0)))})
        else:
            tensors[names[0]] = t.contiguous()
    hf["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for n, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return path


# ----------------------------------------------------------------------------------------------- training checkpoints


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from itself (RUN_DIR/checkpoints/step_N) or from a run directory (its newest)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    found = latest_checkpoint(path / "checkpoints") if (path / "checkpoints").is_dir() else None
    if found is None:
        raise HFConfigError(f"{path}: neither a checkpoint (no meta.json) nor a run directory with a complete one")
    return found


def load_checkpoint_model(
    path: str | Path, dtype: Optional[torch.dtype] = None, dropless: bool = False
) -> tuple[Decoder, JobConfig]:
    """The model (parameters only, no optimizer state) and job config of one of our training checkpoints;
    `dropless` builds it with `moe.capacity_factor` null (inference). Files are checked against meta.json."""
    ckpt = resolve_checkpoint(path)
    _, index = verify_checkpoint(ckpt)  # sha256 of every file, safetensors headers only
    cfg = config_from_dict(json.loads((ckpt / "config.json").read_text()))
    model_cfg = cfg.model
    if dropless:
        model_cfg = dataclasses.replace(model_cfg, moe=dataclasses.replace(model_cfg.moe, capacity_factor=None))
    handles: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        if name not in index:
            raise HFConfigError(f"{ckpt}: no tensor named {name!r} (the checkpoint does not match its config.json)")
        f = index[name][0]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f].get_tensor(name)

    def read(name: str) -> torch.Tensor:
        if _is_experts(name):
            return torch.stack([get(f"{name}.{e}") for e in range(cfg.model.moe.num_experts)])
        return get(name)

    return _assign(build_model(model_cfg), read, str(ckpt), dtype), cfg


def write_initial_checkpoint(model: Decoder, cfg: JobConfig, run_dir: str | Path) -> Path:
    """RUN_DIR/checkpoints/step_0 in the training-checkpoint format (zero Adam moments, adam_step 0) and
    RUN_DIR/config.json, so that `launch/train.py --config RUN_DIR/config.json --run-dir RUN_DIR --resume`
    starts training from `model`'s weights. `cfg.model` must describe `model`."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    if root.exists() and any(root.iterdir()):
        raise HFConfigError(f"{root}: already holds checkpoints; choose a new run directory")
    if (run_dir / "metrics.jsonl").exists():
        raise HFConfigError(f"{run_dir}: already holds a run (metrics.jsonl); choose a new run directory")
    tensors: dict[str, torch.Tensor] = {name: b.float().cpu() for name, b in model.named_buffers()}
    for name, p in model.named_parameters():
        t = p.detach().float().cpu()
        parts = {f"{name}.{e}": w for e, w in enumerate(t.unbind(0))} if _is_experts(name) else {name: t}
        for n, w in parts.items():
            tensors[n] = w.contiguous()
            for moment in MOMENTS:
                tensors[f"{moment}.{n}"] = torch.zeros_like(w)
    meta = {"adam_step": 0, "lr": cfg.train.lr * lr_lambda(cfg)(0), "layout": {"dp": 1, "ep": 1, "tp": 1}}
    final = write_whole_checkpoint(root, 0, tensors, meta, cfg)
    (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    return final


def import_hf_to_run(hf_dir: str | Path, run_dir: str | Path, base: Optional[JobConfig] = None) -> Path:
    """Hugging Face directory → a run directory ready for `--resume`: step-0 checkpoint, config.json (the
    model section from Hugging Face, everything else from `base` or the defaults), and RUN_DIR/hf/ holding the
    source config.json and tokenizer files, which `export_run_to_hf` carries back."""
    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    model = load_hf_model(hf_dir)
    cfg = config_from_dict({**config_to_dict(base or JobConfig()), "model": dataclasses.asdict(model.cfg)})
    final = write_initial_checkpoint(model, cfg, run_dir)
    companion = run_dir / "hf"
    companion.mkdir(exist_ok=True)
    for name in ("config.json", *COMPANION_FILES):
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, companion / name)
    return final


def companion_dir(path: str | Path) -> Optional[Path]:
    """RUN_DIR/hf of a run directory or of one of its checkpoints, if the run was imported from Hugging Face."""
    path = Path(path)
    for d in (path, path.parent.parent):
        if (d / "hf" / "config.json").is_file():
            return d / "hf"
    return None


def export_run_to_hf(checkpoint: str | Path, out_dir: str | Path, dtype: Optional[torch.dtype] = None) -> Path:
    """One of our checkpoints (or a run directory's newest) → a Hugging Face directory; a run imported from
    Hugging Face gets its original config.json keys and tokenizer files back."""
    ckpt = resolve_checkpoint(checkpoint)
    model, _ = load_checkpoint_model(ckpt)
    extra = companion_dir(ckpt)
    template = json.loads((extra / "config.json").read_text()) if extra else None
    out = save_hf_model(model, out_dir, dtype=dtype, template=template)
    for name in COMPANION_FILES if extra else ():
        if (extra / name).is_file():
            shutil.copyfile(extra / name, out / name)
    return out


def load_model(path: str | Path, dtype: Optional[torch.dtype] = torch.float32) -> Decoder:
    """A Hugging Face directory, one of our checkpoints or a run directory → our Decoder, dropless for inference."""
    path = Path(path)
    hf_config = path / "config.json"
    if hf_config.is_file() and "model_type" in json.loads(hf_config.read_text()):
        return load_hf_model(path, dtype)
    return load_checkpoint_model(path, dtype, dropless=True)[0]
