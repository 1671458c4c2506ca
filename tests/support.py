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


def load_script(path: Path):
    """A script of benchmarks/ (or launch/) imported as a module, with its own folder on sys.path while it loads,
    as when it runs as `python benchmarks/x.py` (its sibling `common` resolves the same way)."""
    import importlib.util

    name = f"script_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module
