"""Layout-independent, atomic, verified checkpoints: RUN_DIR/checkpoints/step_N/.

Contents: `rankNNNNN.safetensors` files holding every parameter exactly once under its global name, experts
split out by global index (`blocks.0.ffn.experts.w13.5`), each with its AdamW moments (`exp_avg.<name>`,
`exp_avg_sq.<name>`), all fp32; `meta.json` (step, Adam step count, learning rate, layout it was written
at, skipped-step count, the data identity, sha256 of every file) and `config.json`. Nothing is pickled:
tensors are read with safetensors (a JSON header and raw bytes), metadata with `json`, so loading runs no
code whatever the files contain.

Because names are global and tensors whole (tensor-parallel shards are gathered on save and sliced on load
along each parameter's `tp_dim`), a checkpoint written at one (dp, ep, tp) layout loads at any other.
Ranks write into
`.step_N.tmp/` and fsync; rank 0 writes meta.json last and publishes the directory by renaming it once every
rank has finished, so a run killed mid-save never leaves a `step_N/` that resume would pick. On load every file
is checked against its sha256 before a single tensor is read (`verify_checkpoint`); resume.py falls back to
the previous checkpoint when that fails.

DeepSpeed's own checkpoints are not used: they pickle, and their expert files are tied to the EP size.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from moe_dist.config import JobConfig, config_to_dict
from moe_dist.layers.moe import Experts
from moe_dist.parallel import private_api
from moe_dist.parallel.comm import barrier
from moe_dist.parallel.mesh import Mesh
from moe_dist.parallel.tensor_parallel import gather_shards, shard

FORMAT_VERSION = 1
MOMENTS = ("exp_avg", "exp_avg_sq")
STEP_DIR = re.compile(r"step_(\d+)")
TENSOR_FILE = re.compile(r"rank\d{5}\.safetensors")  # the only files a checkpoint may ask us to open


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or unreadable; the message names the file."""


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint that does not fit this run (model shape, data order): an input error, not a fault
    to fall back from (every older checkpoint of the run would not fit either)."""


@dataclass
class _Stored:
    param: nn.Parameter
    names: list[str]  # global tensor names: one, or one per local expert of a stacked expert parameter
    stacked: bool
    writer: bool  # whether this rank writes it (every stored tensor has exactly one writer)
    tp_dim: int | None = None  # the parameter's dim split over tensor-parallel ranks (apply_tp), if any
    tp_parts: int = 1  # blocks of that dim split separately (Mamba in_proj's x and z halves)

    def whole(self, local: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """Collective over the TP group for a TP-sharded parameter: the full tensor from this rank's slice."""
        return local if self.tp_dim is None else gather_shards(local, mesh.tp_group, self.tp_dim, self.tp_parts)

    def local(self, full: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """This rank's slice of a full tensor."""
        return full if self.tp_dim is None else shard(full, self.tp_dim, mesh.tp_rank, mesh.tp, self.tp_parts)

    def full_shape(self, mesh: Mesh) -> tuple:
        """Shape of each stored tensor (one expert's, for a stacked parameter), whatever the TP layout."""
        shape = list(self.param.shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] *= mesh.tp
        return tuple(shape[1:] if self.stacked else shape)


def _stored(model: nn.Module, mesh: Mesh) -> list[_Stored]:
    """This rank's parameters with their global names, in the same order on every rank."""
    experts = {id(p): m for m in model.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)}
    out = []
    for name, p in model.named_parameters():
        module = experts.get(id(p))
        tp = {"tp_dim": getattr(p, "tp_dim", None), "tp_parts": getattr(p, "tp_parts", 1)}
        if module is None:
            out.append(_Stored(p, [name], False, mesh.rank == 0, **tp))
        else:  # one copy of each expert is written: by the first expert-data-parallel replica (tp_rank 0)
            names = [f"{name}.{module.expert_offset + j}" for j in range(p.shape[0])]
            out.append(_Stored(p, names, True, mesh.edp_rank == 0 and mesh.tp_rank == 0, **tp))
    return out


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by global name (the routers' balancing state): replicated and identical on every rank,
    so rank 0 writes them and every rank reads them; no optimizer moments."""
    params = {name for name, _ in model.named_parameters()}
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if name not in params}


def _inner_optimizer(engine):
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _link_optimizer_state(engine) -> None:
    """(Re)build DeepSpeed's per-parameter views of the partitioned Adam state.

    ZeRO 1/2 links them once, right after the first parameter group's first step, when later groups have no
    state yet, and never again: their moments would then be unreachable. Linking once all state exists fixes it.
    """
    private_api.relink_zero_optimizer_state(engine.optimizer)


def _full_state(engine, p: nn.Parameter) -> dict[str, torch.Tensor]:
    """fp32 value and Adam moments of one local parameter. Collective under ZeRO (over the parameter's group)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if private_api.has_partitioned_fp32_state(p):  # ZeRO 1/2: fp32 master weights and moments are partitioned
        return {"param": safe_get_full_fp32_param(p), **{k: safe_get_full_optimizer_state(p, k) for k in MOMENTS}}
    state = _inner_optimizer(engine).state[p]
    return {"param": p.detach().float(), **{k: state[k] for k in MOMENTS}}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file or directory to stable storage, so a published checkpoint survives a machine crash too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path))
    _fsync(path)


def _write_manifest(tmp: Path, meta: dict, cfg: JobConfig) -> None:
    """config.json, then meta.json: the manifest is written last, after every file it lists."""
    for name, text in (
        ("config.json", json.dumps(config_to_dict(cfg), indent=2)),
        ("meta.json", json.dumps(meta, indent=2)),
    ):
        (tmp / name).write_text(text + "\n")
        _fsync(tmp / name)


def _publish(tmp: Path, final: Path) -> None:
    """Make the finished checkpoint visible under its final name in one rename."""
    if final.exists():  # left by an earlier trajectory of this run (resumed from an older checkpoint)
        doomed = final.with_name(f".{final.name}.deleting")  # unpublished first: never a half-deleted step_N/
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(final, doomed)
        shutil.rmtree(doomed)
    os.replace(tmp, final)
    _fsync(final.parent)


def save_checkpoint(
    engine,
    model: nn.Module,
    scheduler,
    ckpt_root: Path,
    step: int,
    cfg: JobConfig,
    mesh: Mesh,
    extra_meta: dict | None = None,
) -> Path:
    """Collective: every rank calls it at the same step. `extra_meta` goes into meta.json (JSON values)."""
    final, tmp = ckpt_root / f"step_{step}", ckpt_root / f".step_{step}.tmp"
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    if not any(_inner_optimizer(engine).state.values()):  # no update applied yet (every step skipped so far)
        _ensure_optimizer_state(engine, 0)  # what Adam's lazy init would create: zero moments, step 0
    _link_optimizer_state(engine)
    tensors: dict[str, torch.Tensor] = {}
    for st in _stored(model, mesh):
        # collective under ZeRO (over the parameter's data-parallel group) and TP: every rank gathers, one writes
        full = {key: st.whole(value, mesh) for key, value in _full_state(engine, st.param).items()}
        if not st.writer:
            continue
        for key, value in full.items():
            parts = value.unbind(0) if st.stacked else [value]
            for name, v in zip(st.names, parts):
                tensors[name if key == "param" else f"{key}.{name}"] = v.detach().float().cpu().contiguous()
    if mesh.rank == 0:
        tensors.update({name: b.detach().float().cpu().contiguous() for name, b in _buffers(model).items()})
    if tensors:
        _write_tensors(tensors, tmp / f"rank{mesh.rank:05d}.safetensors")
    barrier()
    if mesh.rank == 0:
        files = {f.name: _sha256(f) for f in sorted(tmp.glob("*.safetensors"))}
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            "adam_step": _adam_step(engine),
            "lr": scheduler.get_last_lr()[0],
            "layout": {"dp": mesh.dp, "ep": mesh.ep, "tp": mesh.tp},
            **(extra_meta or {}),
            "files": files,
        }
        _write_manifest(tmp, meta, cfg)
        _publish(tmp, final)
    barrier()
    return final


def write_whole_checkpoint(
    ckpt_root: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict, cfg: JobConfig
) -> Path:
    """One process holding every tensor (imported weights): the files, manifest and atomic publish of
    `save_checkpoint`, in one tensor file. `meta` holds the fields besides "format" and "files"."""
    final, tmp = ckpt_root / f"step_{step}", ckpt_root / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_tensors(tensors, tmp / "rank00000.safetensors")
    files = {"rank00000.safetensors": _sha256(tmp / "rank00000.safetensors")}
    _write_manifest(tmp, {"format": FORMAT_VERSION, "step": step, **meta, "files": files}, cfg)
    _publish(tmp, final)
    return final


def _adam_step(engine) -> int:
    steps = [int(s["step"]) for s in _inner_optimizer(engine).state.values() if "step" in s]
    return max(steps, default=0)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest published checkpoint directory (`step_N` holding meta.json), unverified; None if there is none.
    Training resumes through resume.select_checkpoint, which verifies and falls back."""
    found = [
        (int(m.group(1)), d)
        for d in ckpt_root.glob("step_*")
        if (m := STEP_DIR.fullmatch(d.name)) and (d / "meta.json").is_file()
    ]
    return max(found, key=lambda t: t[0])[1] if found else None


def read_meta(path: Path) -> dict:
    """meta.json of checkpoint `path`, parsed as JSON and checked for the fields this module relies on."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path}: missing; {path} is not a complete checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: not valid JSON ({e}); corrupted manifest") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{meta_path}: checkpoint format {found}, expected {FORMAT_VERSION}")
    files = meta.get("files")
    if not (
        isinstance(meta.get("step"), int)
        and isinstance(meta.get("adam_step"), int)
        and isinstance(files, dict)
        and all(isinstance(v, str) for v in files.values())
    ):
        raise CheckpointError(
            f"{meta_path}: needs integer 'step' and 'adam_step' and a 'files' object of sha256 strings"
        )
    for name in files:
        if not TENSOR_FILE.fullmatch(name):
            raise CheckpointError(
                f"{meta_path}: lists {name!r}, which is not a checkpoint tensor file "
                f"(rankNNNNN.safetensors); refusing to open it"
            )
    return meta


def verify_checkpoint(path: Path, rank: int = 0, world_size: int = 1) -> tuple[dict, dict[str, tuple[Path, tuple]]]:
    """Check checkpoint `path` and index it: (meta, {tensor name: (file, shape)}).

    Every file listed in meta.json must exist and parse as safetensors; this rank hashes its share of them
    (file i when i % world_size == rank), so the ranks together check each file's sha256 once. Raises
    CheckpointError naming the first bad file."""
    meta = read_meta(path)
    named = STEP_DIR.fullmatch(path.name)
    if named and meta["step"] != int(named.group(1)):
        raise CheckpointError(f"{path / 'meta.json'}: says step {meta['step']}, the directory name another")
    index: dict[str, tuple[Path, tuple]] = {}
    for i, (fname, digest) in enumerate(sorted(meta["files"].items())):
        f = path / fname
        if not f.is_file():
            raise CheckpointError(f"{f}: listed in meta.json but missing")
        if i % world_size == rank and _sha256(f) != digest:
            raise CheckpointError(f"{f}: sha256 mismatch (corrupted or truncated)")
        try:  # parses the JSON header only; a file that is not safetensors (e.g. a pickle) fails here
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    index[key] = (f, tuple(sf.get_slice(key).get_shape()))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({' '.join(str(e).split())})") from None
    return meta, index


def _expected(model: nn.Module, mesh: Mesh) -> tuple[dict[str, tuple], set[str]]:
    """({tensor name this rank reads on load: shape}, every tensor name of the whole model, all ranks')."""
    local, every = {}, set()
    for st in _stored(model, mesh):
        shape = st.full_shape(mesh)
        for name in st.names:
            local[name] = shape
        if st.stacked:  # st.names are this rank's experts; the model has ep times as many
            base = st.names[0].rsplit(".", 1)[0]
            every.update(f"{base}.{e}" for e in range(len(st.names) * mesh.ep))
        else:
            every.update(st.names)
    local.update({f"{k}.{n}": shape for n, shape in list(local.items()) for k in MOMENTS})
    buffers = {name: tuple(b.shape) for name, b in _buffers(model).items()}
    return local | buffers, every | {f"{k}.{n}" for n in every for k in MOMENTS} | set(buffers)


def check_fits(path: Path, meta: dict, index: dict, model: nn.Module, mesh: Mesh, data_identity: dict) -> None:
    """Raise CheckpointMismatch when checkpoint `path` cannot continue this run: a tensor this rank needs is
    missing or has another shape (a different model), or the data order differs (resuming would repeat or
    skip samples). Runs before anything is loaded or written."""
    local, every = _expected(model, mesh)
    extra = sorted(set(index) - every)
    if extra:
        raise CheckpointMismatch(
            f"{path}: holds {len(extra)} tensors this model lacks (e.g. {extra[0]!r}); it was "
            f"written for a different model (compare {path / 'config.json'} with this config)"
        )
    for name, shape in local.items():
        if name not in index:
            raise CheckpointMismatch(
                f"{path}: has no tensor {name!r}; it was written for a different model "
                f"(compare {path / 'config.json'} with this config)"
            )
        if index[name][1] != shape:
            raise CheckpointMismatch(
                f"{path}: {name} has shape {index[name][1]}, this model needs {shape}; it was "
                f"written for a different model shape (compare {path / 'config.json'})"
            )
    saved = meta.get("data")  # absent in checkpoints made outside training (e.g. imported weights)
    if saved is not None:
        for key, value in data_identity.items():
            if saved.get(key) != value:
                raise CheckpointMismatch(
                    f"{path}: written with data {key}={saved.get(key)!r}, this run has "
                    f"{value!r}; resuming would repeat or skip samples"
                )


def _ensure_optimizer_state(engine, adam_step: int) -> None:
    """Create Adam state where none exists yet (a fresh engine has none before its first step)."""
    inner = _inner_optimizer(engine)
    flats = getattr(engine.optimizer, "single_partition_of_fp32_groups", None)
    params = flats if flats is not None else [p for g in inner.param_groups for p in g["params"]]
    on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
    for p in params:
        state = inner.state[p]
        for k in MOMENTS:
            state.setdefault(k, torch.zeros_like(p, memory_format=torch.preserve_format))
        # As torch's Adam creates it: fp32, on the parameter's device when fused/capturable (its kernels read it
        # there; a CPU step beside CUDA parameters fails the first fused step after a resume), else on the CPU.
        state["step"] = torch.tensor(float(adam_step), dtype=torch.float32, device=p.device if on_device else "cpu")
    _link_optimizer_state(engine)


def load_checkpoint(engine, model: nn.Module, scheduler, path: Path, meta: dict, index: dict, mesh: Mesh) -> int:
    """Restore parameters, Adam moments and LR schedule from a verified checkpoint (`verify_checkpoint`'s
    meta and index, `check_fits` passed) into this rank's shard; returns the step."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    _ensure_optimizer_state(engine, meta["adam_step"])
    handles: dict[Path, object] = {}

    def read(name: str) -> torch.Tensor:
        f = index[name][0]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f].get_tensor(name)

    for st in _stored(model, mesh):
        p, values = st.param, {}
        for key in ("param", *MOMENTS):
            names = [n if key == "param" else f"{key}.{n}" for n in st.names]
            v = torch.stack([read(n) for n in names]) if st.stacked else read(names[0])
            values[key] = st.local(v, mesh).contiguous().to(p.device)
        with torch.no_grad():
            p.copy_(values["param"].to(p.dtype))
        if private_api.has_partitioned_fp32_state(p):
            safe_set_full_fp32_param(p, values["param"])
            for k in MOMENTS:
                safe_set_full_optimizer_state(p, values[k], k)
        else:
            state = _inner_optimizer(engine).state[p]
            for k in MOMENTS:
                state[k].copy_(values[k])
    with torch.no_grad():
        for name, b in _buffers(model).items():
            b.copy_(read(name).to(b.dtype))
    # The schedule is a function of the step alone (skipped steps included, see guard.py); its state is not
    # loaded because the number of parameter groups depends on the layout (expert groups exist only with EP).
    step = int(meta["step"])
    scheduler.last_epoch = step
    for group, base, factor in zip(_inner_optimizer(engine).param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(step)
    barrier()
    return step
