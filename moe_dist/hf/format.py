"""Hugging Face checkpoint directories ↔ our Decoder, for every family in FAMILIES (one module each).

A Hugging Face checkpoint directory is `config.json` plus safetensors files (one `model.safetensors`, or shards
listed by `model.safetensors.index.json`), with the tensor names of the Hub checkpoints, which every
transformers version loads (its own `save_pretrained` writes them too). Our experts are stacked (E, D, 2F) /
(E, F, D): the transposes of Hugging Face's per-expert Linear weights, with the gate and up projections side by
side in one w13 = [w1 | w3]. Imported models are dropless (`capacity_factor: null`), as Hugging Face's MoE
blocks are, so logits match. Nothing here imports transformers: reading and writing the format only needs
safetensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_dist.config import ModelConfig
from moe_dist.hf import deepseek_v3, dense, granite_hybrid, jamba, mixtral, nemotron_h, olmoe, qwen3_next, qwen_moe
from moe_dist.hf.common import Family, HFConfigError, feature_unfit
from moe_dist.models.decoder import Decoder, build_model

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        mixtral.FAMILY,
        jamba.FAMILY,
        qwen_moe.QWEN2,
        qwen_moe.QWEN3,
        olmoe.FAMILY,
        dense.LLAMA,
        dense.QWEN3,
        nemotron_h.FAMILY,
        granite_hybrid.FAMILY,
        qwen3_next.QWEN3_NEXT,
        qwen3_next.QWEN3_5_MOE_TEXT,
        qwen3_next.QWEN3_5_MOE,
        deepseek_v3.FAMILY,
    )
}
_SHARD_BYTES = 5 * 2**30  # safetensors shard size of exported checkpoints (Hugging Face's default)


def config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig for a Hugging Face config.json (as a dict) of one of FAMILIES. Absent keys take the
    transformers defaults of that architecture."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        raise HFConfigError(f"model_type: {kind!r} is not supported (expected one of {sorted(FAMILIES)})")
    return FAMILIES[kind].from_hf(hf)


def family_of(cfg: ModelConfig, prefer: Optional[str] = None) -> Family:
    """The Hugging Face family that expresses `cfg` exactly (`prefer` first, e.g. the one it was imported from),
    or HFConfigError naming the nearest family (the fewest rules broken; on a tie `prefer`, then FAMILIES' order)
    and its first broken rule: one short line, where listing every family's rules made one of some 1,500 characters."""
    prefer = FAMILIES[prefer].export_as or prefer if prefer in FAMILIES else prefer
    order = sorted(FAMILIES.values(), key=lambda f: f.model_type != prefer)
    why = {}
    for family in order:
        why[family.model_type] = feature_unfit(cfg, family) + family.unfit(cfg)
        if not why[family.model_type]:
            return family
    exportable = [f for f in order if not f.export_as]  # not the import-only forms; `prefer` wins a tie
    nearest = min(exportable, key=lambda f: len(why[f.model_type]))
    rules = why[nearest.model_type]
    more = f" (and {len(rules) - 1} more rule{'s' if len(rules) > 2 else ''})" if len(rules) > 1 else ""
    raise HFConfigError(
        f"model: not expressible as a Hugging Face checkpoint; nearest family {nearest.model_type} "
        f"({nearest.architecture}): {rules[0]}{more}"
    )


def config_to_hf(cfg: ModelConfig, template: Optional[dict] = None) -> dict:
    """The Hugging Face config.json dict for `cfg`. Keys of `template` (e.g. the config.json a model was
    imported from: token ids, max_position_embeddings) are kept where our config does not define them."""
    family = family_of(cfg, (template or {}).get("model_type"))
    a, moe = cfg.attention, cfg.moe
    out = dict(template or {})
    for stale in (
        "rope_parameters",
        "rope_scaling",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "quantization_config",
    ):
        out.pop(stale, None)
    out.update(
        architectures=[family.architecture],
        model_type=family.model_type,
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
    family.to_hf(cfg, out)
    return out


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """An fp8 weight (out, in) stored with one fp32 multiplier per block of block[0] × block[1] entries (DeepSeek-V3's
    and Kimi K2's `weight_scale_inv`, (ceil(out / b0), ceil(in / b1)); edge blocks partial) → fp32 w · scale."""
    rows, cols = w.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise HFConfigError(
            f"{name}_scale_inv: shape {tuple(scale_inv.shape)}, expected {expected} for {name} {tuple(w.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return w.float() * scale


def is_experts(name: str) -> bool:
    return ".ffn.experts." in name


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


def assign_tensors(model: Decoder, read, source: str, dtype: Optional[torch.dtype]) -> Decoder:
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

    def read_stored(hf_name: str) -> torch.Tensor:
        if hf_name not in index:
            raise HFConfigError(f"{path}: tensor {hf_name!r} missing (the checkpoint does not match its config.json)")
        f = index[hf_name]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        used.add(hf_name)
        return handles[f].get_tensor(hf_name)

    block = tuple((hf.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    dequantized = []

    def get(hf_name: str) -> torch.Tensor:
        t = read_stored(hf_name)
        if t.dtype not in FP8:
            return t
        scale = f"{hf_name}_scale_inv"
        if scale not in index:
            raise HFConfigError(f"{path}: fp8 tensor {hf_name!r} has no {scale!r} (its block scales)")
        dequantized.append(hf_name)
        return dequantize_blocks(t, read_stored(scale), block, hf_name)

    family = FAMILIES[hf["model_type"]]

    def read(name: str) -> torch.Tensor:
        special = None if family.load_tensor is None else family.load_tensor(name, get, index.__contains__, cfg)
        if special is not None:
            return special
        names = family.names(name, cfg.moe.num_experts)
        if not is_experts(name):
            return get(names[0])
        E = cfg.moe.num_experts
        parts = [torch.stack([get(n).t() for n in names[i : i + E]]) for i in range(0, len(names), E)]
        return torch.cat(parts, dim=2)  # w13: [gate | up]

    model = assign_tensors(build_model(cfg), read, str(path), dtype)
    if dequantized:  # one line on stderr: the model holds the dequantized values, not the fp8 checkpoint's bytes
        print(
            f"note: {path}: dequantized {len(dequantized)} fp8 tensors ({block[0]}x{block[1]} block scales) to "
            f"{str(dtype or torch.float32).removeprefix('torch.')}",
            file=sys.stderr,
        )
    unused = sorted(set(index) - used - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
    for prefix, what in family.dropped:
        dropped = [n for n in unused if n.startswith(prefix)]
        if dropped:
            # One line on stderr (a warnings.warn would add its source line): the import goes on without them.
            print(
                f"warning: {path}: dropped {len(dropped)} {what} tensors ({prefix}*): our model has no place for them",
                file=sys.stderr,
            )
            unused = [n for n in unused if not n.startswith(prefix)]
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
    family = FAMILIES[hf["model_type"]]
    tensors: dict[str, torch.Tensor] = {}
    # the router's choice bias is the one buffer a format holds (Nemotron-H's e_score_correction_bias)
    ours = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n.endswith(".router.bias_E"))]
    by_name = dict(ours)

    def stored(name: str) -> torch.Tensor:
        p = by_name[name]
        if p.device.type == "meta":
            raise HFConfigError(f"{name}: the model is on the meta device; materialize or load it first")
        return p.detach().to(dtype or p.dtype).cpu()

    for name, _ in ours:
        t = stored(name)
        special = None if family.save_tensor is None else family.save_tensor(name, t, stored, cfg)
        if special is not None:
            tensors.update({n: w.contiguous() for n, w in special.items()})
            continue
        names = family.names(name, cfg.moe.num_experts)
        if is_experts(name):
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
