"""Layout-independent, atomic checkpoints: RUN_DIR/checkpoints/step_N/.

Contents: `rankNNNNN.safetensors` files holding every parameter exactly once under its global name, experts
split out by global index (`blocks.0.ffn.experts.w1.5`), each with its AdamW moments (`exp_avg.<name>`,
`exp_avg_sq.<name>`), all fp32; `meta.json` (step, Adam step count, learning rate, layout it was written
at, sha256 of every file) and `config.json`. Nothing is pickled, so loading runs no code.

Because names are global, a checkpoint written at one (dp, ep) layout loads at any other. Ranks write into
`.step_N.tmp/`; rank 0 publishes it by renaming once every rank has finished, so a run killed mid-save never
leaves a directory that `latest_checkpoint` would pick.

DeepSpeed's own checkpoints are not used: they pickle, and their expert files are tied to the EP size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from moe_dist.config import JobConfig, config_to_dict
from moe_dist.layers.moe import Experts
from moe_dist.parallel.comm import barrier
from moe_dist.parallel.mesh import Mesh

FORMAT_VERSION = 1
MOMENTS = ("exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not match the model; the message names the file."""


@dataclass
class _Stored:
    param: nn.Parameter
    names: list[str]  # global tensor names: one, or one per local expert of a stacked expert parameter
    stacked: bool
    writer: bool  # whether this rank writes it (every stored tensor has exactly one writer)


def _stored(model: nn.Module, mesh: Mesh) -> list[_Stored]:
    """This rank's parameters with their global names, in the same order on every rank."""
    experts = {id(p): m for m in model.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)}
    out = []
    for name, p in model.named_parameters():
        module = experts.get(id(p))
        if module is None:
            out.append(_Stored(p, [name], False, mesh.rank == 0))
        else:  # one copy of each expert is written: by the first expert-data-parallel replica
            names = [f"{name}.{module.expert_offset + j}" for j in range(p.shape[0])]
            out.append(_Stored(p, names, True, mesh.edp_rank == 0))
    return out


def _inner_optimizer(engine):
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _link_optimizer_state(engine) -> None:
    """(Re)build DeepSpeed's per-parameter views of the partitioned Adam state.

    ZeRO 1/2 links them once, right after the first parameter group's first step, when later groups have no
    state yet, and never again: their moments would then be unreachable. Linking once all state exists fixes it.
    """
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()


def _full_state(engine, p: nn.Parameter) -> dict[str, torch.Tensor]:
    """fp32 value and Adam moments of one local parameter. Collective under ZeRO (over the parameter's group)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if hasattr(p, "_hp_mapping"):  # ZeRO 1/2: fp32 master weights and moments are partitioned
        return {"param": safe_get_full_fp32_param(p), **{k: safe_get_full_optimizer_state(p, k) for k in MOMENTS}}
    state = _inner_optimizer(engine).state[p]
    return {"param": p.detach().float(), **{k: state[k] for k in MOMENTS}}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(engine, model: nn.Module, scheduler, ckpt_root: Path, step: int, cfg: JobConfig,
                    mesh: Mesh) -> Path:
    """Collective: every rank calls it at the same step."""
    final, tmp = ckpt_root / f"step_{step}", ckpt_root / f".step_{step}.tmp"
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    _link_optimizer_state(engine)
    tensors: dict[str, torch.Tensor] = {}
    for st in _stored(model, mesh):
        full = _full_state(engine, st.param)  # collective under ZeRO: every rank gathers, one writes
        if not st.writer:
            continue
        for key, value in full.items():
            parts = value.unbind(0) if st.stacked else [value]
            for name, v in zip(st.names, parts):
                tensors[name if key == "param" else f"{key}.{name}"] = v.detach().float().cpu().contiguous()
    if tensors:
        save_file(tensors, str(tmp / f"rank{mesh.rank:05d}.safetensors"))
    barrier()
    if mesh.rank == 0:
        files = {f.name: _sha256(f) for f in sorted(tmp.glob("*.safetensors"))}
        adam_step = _adam_step(engine)
        meta = {"format": FORMAT_VERSION, "step": step, "adam_step": adam_step, "lr": scheduler.get_last_lr()[0],
                "layout": {"dp": mesh.dp, "ep": mesh.ep, "tp": cfg.parallel.tp}, "files": files}
        (tmp / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    barrier()
    return final


def _adam_step(engine) -> int:
    steps = [int(s["step"]) for s in _inner_optimizer(engine).state.values() if "step" in s]
    return max(steps, default=0)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint directory (one with meta.json, published by rename), or None."""
    found = [(json.loads(m.read_text())["step"], m.parent) for m in ckpt_root.glob("step_*/meta.json")]
    return max(found, key=lambda t: t[0])[1] if found else None


def read_meta(path: Path) -> dict:
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path}: missing; {path} is not a complete checkpoint")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: checkpoint format {meta.get('format')}, expected {FORMAT_VERSION}")
    return meta


def _open_tensors(path: Path, meta: dict) -> dict[str, tuple[Path, str]]:
    """Verify every file's sha256 and index which file holds each tensor name."""
    index = {}
    for fname, digest in meta["files"].items():
        f = path / fname
        if not f.is_file():
            raise CheckpointError(f"{f}: listed in meta.json but missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"{f}: sha256 mismatch (corrupted or truncated)")
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                index[key] = (f, key)
    return index


def _ensure_optimizer_state(engine, adam_step: int) -> None:
    """Create Adam state where none exists yet (a fresh engine has none before its first step)."""
    inner = _inner_optimizer(engine)
    flats = getattr(engine.optimizer, "single_partition_of_fp32_groups", None)
    params = flats if flats is not None else [p for g in inner.param_groups for p in g["params"]]
    for p in params:
        state = inner.state[p]
        for k in MOMENTS:
            state.setdefault(k, torch.zeros_like(p, memory_format=torch.preserve_format))
        state["step"] = torch.tensor(float(adam_step))
    _link_optimizer_state(engine)


def load_checkpoint(engine, model: nn.Module, scheduler, path: Path, mesh: Mesh) -> int:
    """Restore parameters, Adam moments and LR schedule into this rank's shard; returns the step."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    meta = read_meta(path)
    index = _open_tensors(path, meta)
    _ensure_optimizer_state(engine, meta["adam_step"])
    handles: dict[Path, object] = {}

    def read(name: str) -> torch.Tensor:
        if name not in index:
            raise CheckpointError(f"{path}: no tensor named {name!r} (the checkpoint does not match this model)")
        f, key = index[name]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f].get_tensor(key)

    for st in _stored(model, mesh):
        p, values = st.param, {}
        for key in ("param", *MOMENTS):
            names = [n if key == "param" else f"{key}.{n}" for n in st.names]
            v = torch.stack([read(n) for n in names]) if st.stacked else read(names[0])
            if v.shape != p.shape:
                raise CheckpointError(f"{path}: {names[0]} has shape {tuple(v.shape)}, model expects {tuple(p.shape)}")
            values[key] = v.to(p.device)
        with torch.no_grad():
            p.copy_(values["param"].to(p.dtype))
        if hasattr(p, "_hp_mapping"):
            safe_set_full_fp32_param(p, values["param"])
            for k in MOMENTS:
                safe_set_full_optimizer_state(p, values[k], k)
        else:
            state = _inner_optimizer(engine).state[p]
            for k in MOMENTS:
                state[k].copy_(values[k])
    # The schedule is a function of the step alone; its state is not loaded because the number of parameter
    # groups depends on the layout (expert groups exist only with EP).
    step = int(meta["step"])
    scheduler.last_epoch = step
    for group, base, factor in zip(_inner_optimizer(engine).param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(step)
    barrier()
    return step
