"""Checkpoints under RUN_DIR/checkpoints/step_N, written through the DeepSpeed engine.

A checkpoint counts as complete only once `meta.json` exists in it: rank 0 writes it after every rank has
finished its DeepSpeed files, so a run killed mid-save leaves a directory that resume ignores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_dist.config import JobConfig, config_to_dict
from moe_dist.parallel.comm import barrier


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def save_checkpoint(engine, ckpt_root: Path, step: int, cfg: JobConfig, rank: int) -> Path:
    """Collective: every rank calls it at the same step."""
    tag = f"step_{step}"
    engine.save_checkpoint(str(ckpt_root), tag=tag, client_state={"step": step}, save_latest=False)
    barrier()
    path = ckpt_root / tag
    if rank == 0:
        _write_json_atomic(path / "config.json", config_to_dict(cfg))
        _write_json_atomic(path / "meta.json", {"step": step})
    barrier()
    return path


def latest_checkpoint(ckpt_root: Path) -> tuple[int, str] | None:
    """(step, tag) of the newest complete checkpoint, or None."""
    best = None
    for meta in ckpt_root.glob("step_*/meta.json"):
        step = json.loads(meta.read_text())["step"]
        if best is None or step > best[0]:
            best = (step, meta.parent.name)
    return best


def load_checkpoint(engine, ckpt_root: Path, tag: str) -> int:
    """Restore model, optimizer and LR schedule; return the number of completed optimizer steps."""
    path, client_state = engine.load_checkpoint(str(ckpt_root), tag=tag)
    if path is None:
        raise RuntimeError(f"{ckpt_root / tag}: DeepSpeed could not load this checkpoint")
    return int(client_state["step"])
