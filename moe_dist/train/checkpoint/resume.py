"""Which checkpoint a run resumes from, and which old ones it deletes.

Resume (`select_checkpoint`): the newest published checkpoint that verifies (every file's sha256 and
safetensors header, read.verify_checkpoint) on every rank; a corrupted or truncated one is reported in one
warning line naming the file, and the previous one is tried. The ranks take each decision together, so they all
load the same checkpoint. A run directory whose checkpoints all fail is an error, never a silent fresh start:
starting over would overwrite the evidence and the run's history.

Pruning (`prune_checkpoints`): keeps the newest `train.keep_last` checkpoints up to the one just published, which
is always among them, so the only complete checkpoint is never removed. A checkpoint is unpublished (renamed to
`.step_N.deleting`) before its files go, so a kill during pruning never leaves a half-deleted `step_N/`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from moe_dist.parallel.comm import agree_on_error, broadcast_bytes
from moe_dist.parallel.mesh import Mesh
from moe_dist.train.checkpoint.format import STEP_DIR, CheckpointError
from moe_dist.train.checkpoint.read import verify_checkpoint


def complete_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Published checkpoints (`step_N/` holding meta.json), newest first; unverified."""
    if not ckpt_root.is_dir():
        return []
    found = [
        (int(m.group(1)), d)
        for d in ckpt_root.iterdir()
        if (m := STEP_DIR.fullmatch(d.name)) and (d / "meta.json").is_file()
    ]
    return sorted(found, key=lambda t: t[0], reverse=True)


def select_checkpoint(ckpt_root: Path, mesh: Mesh, warn: Callable[[str], None]) -> tuple[Path, dict, dict] | None:
    """Collective: (path, meta, index) of the newest checkpoint that verifies on every rank, or None when the
    run directory holds no checkpoint. `warn` gets one line per rejected checkpoint."""
    # Rank 0's listing is everyone's, so all ranks walk the same candidates with the same collectives.
    steps = json.loads(broadcast_bytes(json.dumps([s for s, _ in complete_checkpoints(ckpt_root)]).encode()))
    rejected = []
    for step in steps:
        path = ckpt_root / f"step_{step}"
        error = ""
        try:
            meta, index = verify_checkpoint(path, mesh.rank, mesh.world_size)
        except CheckpointError as e:
            error = str(e)
        error = agree_on_error(error)
        if not error:
            return path, meta, index
        rejected.append(path.name)
        warn(f"warning: checkpoint {path.name} rejected: {error}; falling back to the previous complete checkpoint")
    if rejected:
        raise CheckpointError(
            f"{ckpt_root}: no usable checkpoint ({', '.join(rejected)} failed verification); "
            f"refusing to start over in this run directory (move them away to start fresh)"
        )
    return None


def prune_checkpoints(ckpt_root: Path, keep_last: int, current: int) -> list[Path]:
    """Delete published checkpoints older than the newest `keep_last` up to step `current` (the one just
    published, always kept), and leftovers of interrupted saves and prunes; returns the removed checkpoints.
    keep_last <= 0 keeps everything. Checkpoints after `current` (from an earlier trajectory that resume fell
    back from) are neither counted nor deleted here; saving over them replaces them."""
    for leftover in [*ckpt_root.glob(".step_*.tmp"), *ckpt_root.glob(".step_*.deleting")]:
        shutil.rmtree(leftover, ignore_errors=True)
    if keep_last <= 0:
        return []
    kept = [(s, p) for s, p in complete_checkpoints(ckpt_root) if s <= current]
    removed = []
    for _, path in kept[keep_last:]:
        doomed = path.with_name(f".{path.name}.deleting")
        os.replace(path, doomed)
        shutil.rmtree(doomed)
        removed.append(path)
    return removed
