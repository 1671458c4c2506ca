"""Finding, verifying and loading the checkpoints save.py writes (the package docstring describes the format).

`verify_checkpoint` checks every file a rank will read against its sha256 and its safetensors header before any
tensor is used; `check_fits` refuses a sound checkpoint of another model shape or data order; `load_checkpoint`
restores parameters, Adam moments, buffers and the LR schedule, each rank reading only its slices.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from moe_dist.parallel import private_api
from moe_dist.parallel.comm import barrier
from moe_dist.parallel.mesh import Mesh
from moe_dist.parallel.tensor_parallel import shard_ranges
from moe_dist.train.checkpoint.format import FORMAT_VERSION, STEP_DIR, TENSOR_FILE, CheckpointError, CheckpointMismatch
from moe_dist.train.checkpoint.plan import MOMENTS, STATE_KEYS, stored_name
from moe_dist.train.checkpoint.state import (
    Stored,
    ensure_optimizer_state,
    inner_optimizer,
    pipeline_whole,
    stored_buffers,
    stored_params,
)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


def _header(f: Path) -> dict[str, tuple]:
    """{tensor name: shape} from a safetensors header; a file that is not safetensors (e.g. a pickle) fails here."""
    try:  # parses the JSON header only
        with safe_open(str(f), framework="pt") as sf:
            return {key: tuple(sf.get_slice(key).get_shape()) for key in sf.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{f}: not a readable safetensors file ({' '.join(str(e).split())})") from None


def _manifest_index(path: Path, meta: dict) -> dict[str, tuple[Path, tuple]] | None:
    """The index meta.json carries ("tensors": {name: [file, shape]}, written by Checkpointer), or None."""
    tensors = meta.get("tensors")
    if tensors is None:
        return None
    ok = isinstance(tensors, dict) and all(
        isinstance(v, list) and len(v) == 2 and v[0] in meta["files"] and isinstance(v[1], list)
        and all(isinstance(d, int) for d in v[1])
        for v in tensors.values()
    )  # fmt: skip
    if not ok:
        raise CheckpointError(f"{path / 'meta.json'}: 'tensors' must map names to [a listed file, shape]")
    return {name: (path / f, tuple(shape)) for name, (f, shape) in tensors.items()}


def verify_checkpoint(path: Path, rank: int = 0, world_size: int = 1) -> tuple[dict, dict[str, tuple[Path, tuple]]]:
    """Check checkpoint `path` and index it: (meta, {tensor name: (file, shape)}).

    Every file listed in meta.json must exist; this rank hashes its share of them (file i when
    i % world_size == rank) and parses their safetensors headers, so the ranks together check each file once.
    The index comes from meta.json where it carries one (checked against each header by the rank hashing that
    file, so no rank opens every file), else from every file's header. Raises CheckpointError naming the first
    bad file."""
    meta = read_meta(path)
    named = STEP_DIR.fullmatch(path.name)
    if named and meta["step"] != int(named.group(1)):
        raise CheckpointError(f"{path / 'meta.json'}: says step {meta['step']}, the directory name another")
    listed = _manifest_index(path, meta)
    index: dict[str, tuple[Path, tuple]] = {}
    for i, (fname, digest) in enumerate(sorted(meta["files"].items())):
        f = path / fname
        if not f.is_file():
            raise CheckpointError(f"{f}: listed in meta.json but missing")
        mine = i % world_size == rank
        if mine and _sha256(f) != digest:
            raise CheckpointError(f"{f}: sha256 mismatch (corrupted or truncated)")
        if listed is None or mine:
            header = _header(f)
            if listed is not None and header != {n: shape for n, (g, shape) in listed.items() if g == f}:
                raise CheckpointError(f"{f}: its tensors differ from those meta.json lists for it")
            index.update({name: (f, shape) for name, shape in header.items()})
    return meta, index if listed is None else listed


def _expected(model: nn.Module, mesh: Mesh) -> tuple[dict[str, tuple], set[str]]:
    """({tensor name this rank reads on load: shape}, every tensor name of the whole model, all ranks')."""
    local, every = {}, set()
    for st in stored_params(model, mesh):
        shape = st.full_shape(mesh)
        for name in st.names:
            local[name] = shape
        if st.stacked:  # st.names are this rank's experts; the model has ep times as many
            base = st.names[0].rsplit(".", 1)[0]
            every.update(f"{base}.{e}" for e in range(len(st.names) * mesh.ep))
        else:
            every.update(st.names)
    local.update({f"{k}.{n}": shape for n, shape in list(local.items()) for k in MOMENTS})
    buffers = {name: tuple(b.shape) for name, b in stored_buffers(model).items()}
    every_buffer = set(buffers)
    whole = pipeline_whole(model)
    if whole is not None:  # a pipeline part: the rest of the model is on the other stages
        every = {f"{e.name}.{x}" for e in whole[0] for x in range(e.experts)} | {
            e.name for e in whole[0] if not e.experts
        }
        every_buffer = set(whole[1])
    return local | buffers, every | {f"{k}.{n}" for n in every for k in MOMENTS} | every_buffer


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


def load_checkpoint(engine, model: nn.Module, scheduler, path: Path, meta: dict, index: dict, mesh: Mesh) -> int:
    """Restore parameters, Adam moments and LR schedule from a verified checkpoint (`verify_checkpoint`'s
    meta and index, `check_fits` passed) into this rank's shard; returns the step."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    ensure_optimizer_state(engine, meta["adam_step"])
    handles: dict[Path, object] = {}

    def read(name: str, st: Stored) -> torch.Tensor:
        """This rank's part of stored tensor `name`: whole, or its TP slice read alone (get_slice)."""
        f = index[name][0]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        if st.tp_dim is None:
            return handles[f].get_tensor(name)
        stored = handles[f].get_slice(name)
        shape = stored.get_shape()
        dim = st.tp_dim - 1 if st.stacked else st.tp_dim  # a stored expert lacks the stacked dim
        parts = []
        for start, stop in shard_ranges(shape[dim], mesh.tp_rank, mesh.tp, st.tp_parts):  # shard's layout
            index_ = [slice(None)] * len(shape)
            index_[dim] = slice(start, stop)
            parts.append(stored[tuple(index_)])
        return torch.cat(parts, dim)

    # One state tensor at a time, experts read straight into their slot: a rank holds at most its largest local
    # tensor (and one expert's read) beyond what the model and optimizer hold anyway.
    for st in stored_params(model, mesh):
        p, partitioned = st.param, private_api.has_partitioned_fp32_state(st.param)
        for key in STATE_KEYS:
            names = [stored_name(key, n) for n in st.names]
            if st.stacked:
                v = torch.empty(p.shape, dtype=torch.float32)
                for j, n in enumerate(names):
                    v[j] = read(n, st)
            else:
                v = read(names[0], st)
            v = v.to(p.device)
            if key == "param":
                with torch.no_grad():
                    p.copy_(v.to(p.dtype))
                if partitioned:
                    safe_set_full_fp32_param(p, v)
            elif partitioned:
                safe_set_full_optimizer_state(p, v, key)
            else:
                inner_optimizer(engine).state[p][key].copy_(v)
            del v
    with torch.no_grad():
        for name, b in stored_buffers(model).items():
            f = index[name][0]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt")
            b.copy_(handles[f].get_tensor(name).to(b.dtype))
    # The schedule is a function of the step alone (skipped steps included, see guard.py); its state is not
    # loaded because the number of parameter groups depends on the layout (expert groups exist only with EP).
    step = int(meta["step"])
    scheduler.last_epoch = step
    for group, base, factor in zip(inner_optimizer(engine).param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(step)
    barrier()
    return step
