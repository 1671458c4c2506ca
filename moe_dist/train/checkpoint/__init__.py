"""Layout-independent, atomic, verified checkpoints: RUN_DIR/checkpoints/step_N/.

Contents: `rankNNNNN.safetensors` files holding every parameter exactly once under its global name, experts
split out by global index (`blocks.0.ffn.experts.w13.5`), each with its AdamW moments (`exp_avg.<name>`,
`exp_avg_sq.<name>`), all fp32; `meta.json` (step, Adam step count, learning rate, layout it was written
at, skipped-step count, the data identity, sha256 of every file) and `config.json`. Nothing is pickled:
tensors are read with safetensors (a JSON header and raw bytes), metadata with `json`, so loading runs no
code whatever the files contain.

Because names are global and tensors whole (tensor-parallel shards are gathered on save; on load each rank
reads only its slice along each parameter's `tp_dim`), a checkpoint written at one (dp, ep, tp) layout loads at
any other.

Saving (`Checkpointer`, save.py): every rank holding a replica of a tensor gathers it, and the tensors are spread over
those ranks by bytes (plan.py): each rank writes its own file, streaming tensor by tensor through a
bounded buffer and hashing the bytes as it writes them (io.py). Ranks write into `.step_N.tmp/` and
fsync; rank 0 gathers the digests, writes meta.json last and publishes the directory by renaming it once every
rank has finished, so a run killed mid-save never leaves a `step_N/` that resume would pick. With
train.async_save the tensors are first copied to host memory and written and published in the background. On
load every file is checked against its sha256 before a single tensor is read (read.py); resume.py
falls back to the previous checkpoint when that fails.

DeepSpeed's own checkpoints are not used: they pickle, and their expert files are tied to the EP size.

Modules: format.py (version, file names, errors), plan.py (which rank writes which tensor), state.py (a rank's
parameters and Adam state under global names), io.py (the streamed tensor file), save.py (writing and
publishing), read.py (verifying and loading), resume.py (which checkpoint a run resumes from; pruning).
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
