"""Plain helpers the test modules import (`pythonpath = ["tests"]` in pyproject.toml); fixtures live in conftest."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path


def free_port() -> int:
    """A free TCP port on localhost for a launcher's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def console_script(name: str) -> str:
    """The launcher (deepspeed, torchrun, accelerate) installed beside this Python, else the one on PATH."""
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else shutil.which(name)


def train_records(records: list[dict]) -> list[dict]:
    """The per-step training records of a metrics.jsonl (evaluation-only records, e.g. step 0, left out)."""
    return [r for r in records if "loss" in r]
