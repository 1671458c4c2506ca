"""Layout-independent, atomic, verified checkpoints: RUN_DIR/checkpoints/step_N/.

Invariants: every parameter is stored exactly once, whole, fp32, under its global name (experts by global index),
with its AdamW moments, so a checkpoint written at one (dp, ep, tp) loads at any other; nothing is pickled
(safetensors and JSON only); rank 0 writes meta.json, with every file's sha256, last and publishes `step_N/` by
renaming `.step_N.tmp/` once every rank has finished, so a killed save never leaves a `step_N/` that resume would
pick; on load every file is verified before a tensor is read, and resume falls back to the previous checkpoint.
Contents, writers, streaming, async saves and the modules (format, plan, state, io, snapshot, save, read, resume):
docs/reliability.md, sections "Checkpoints: atomic publish" and "Resume: verification and fallback".
"""

from moe_dist.train.checkpoint.format import FORMAT_VERSION, STEP_DIR, CheckpointError, CheckpointMismatch
from moe_dist.train.checkpoint.read import check_fits, latest_checkpoint, load_checkpoint, read_meta, verify_checkpoint
from moe_dist.train.checkpoint.resume import complete_checkpoints, prune_checkpoints, select_checkpoint
from moe_dist.train.checkpoint.save import (
    Checkpointer,
    CheckpointSaveError,
    save_checkpoint,
    write_whole_checkpoint,
)

__all__ = [
    "FORMAT_VERSION",
    "STEP_DIR",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointSaveError",
    "Checkpointer",
    "check_fits",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "read_meta",
    "save_checkpoint",
    "select_checkpoint",
    "verify_checkpoint",
    "write_whole_checkpoint",
]
