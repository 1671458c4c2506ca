"""What every checkpoint module agrees on: the format version, the names of a checkpoint's directory and tensor
files, and the errors reading one raises (the format itself: this package's docstring, __init__.py)."""

from __future__ import annotations

import re

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"step_(\d+)")
TENSOR_FILE = re.compile(r"rank\d{5}\.safetensors")  # the only files a checkpoint may ask us to open


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or unreadable; the message names the file."""


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint that does not fit this run (model shape, data order): an input error, not a fault
    to fall back from (every older checkpoint of the run would not fit either)."""
