"""A full disk under the run directory: said in one line naming the path and what to free, and found before a start
or a resume changes anything (tests/train/test_disk_full.py runs the drill on a real 12 MB tmpfs).

`NoSpaceError` is a TrainingError (exit status 1: free space, then rerun with --resume; nothing already written is
lost). `check_room` runs on rank 0 before the run directory is written: it removes the partial `.step_N.tmp/` a
killed save left behind (resume never reads one), proves that the run directory and `tb/` take a write, and that
the file system holds one more checkpoint, whose size it reads from the newest one or estimates from the model.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Iterator

from moe_dist.train.guard import TrainingError

PARTIAL = re.compile(r"\.step_\d+\.tmp")  # a save's directory before it is published (checkpoint/save.py)
PUBLISHED = re.compile(r"step_(\d+)")
MARGIN = 1 << 20  # metrics, TensorBoard events and config.json between two checkpoints: a MiB is plenty here


class NoSpaceError(TrainingError):
    """The run directory's file system is full (or would be by the next checkpoint); one line, exit status 1."""


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def what_to_free(run_dir: Path) -> str:
    """The advice that ends every no-space line: where the space goes in a run directory, and how to go on."""
    return (
        f"free space on the file system of {run_dir} (older checkpoints in {run_dir / 'checkpoints'}, or set "
        "train.keep_last) and rerun with --resume"
    )


def no_space(path: Path | str | None, run_dir: Path) -> NoSpaceError:
    """The error for an ENOSPC met while writing `path` (None: a file under `run_dir` the error did not name)."""
    free = shutil.disk_usage(run_dir).free if run_dir.exists() else 0
    where = f"writing {path}" if path else f"writing under {run_dir}"
    return NoSpaceError(f"no space left on device {where} ({_mb(free)} free): {what_to_free(run_dir)}")


def is_no_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def remove_partial_saves(ckpt_root: Path) -> list[str]:
    """Delete the unpublished `.step_N.tmp/` directories of saves that never finished; returns their names."""
    if not ckpt_root.is_dir():
        return []
    removed = []
    for d in sorted(ckpt_root.iterdir()):
        if PARTIAL.fullmatch(d.name) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def checkpoint_bytes(ckpt_root: Path, estimate: int) -> int:
    """Bytes of the newest published checkpoint (its files' sizes), else `estimate`."""
    done = [
        (int(m.group(1)), d)
        for d in (ckpt_root.iterdir() if ckpt_root.is_dir() else [])
        if (m := PUBLISHED.fullmatch(d.name)) and (d / "meta.json").is_file()
    ]
    if not done:
        return estimate
    newest = max(done)[1]
    return sum(f.stat().st_size for f in newest.iterdir() if f.is_file())


def _probe(directory: Path, run_dir: Path) -> None:
    """A small write in `directory` (created if missing), synced and removed: a file system that is full or read-only
    answers here, before anything of the run is changed."""
    probe = directory / f".write_probe_{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with probe.open("wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        probe.unlink(missing_ok=True)
        if is_no_space(e):
            raise no_space(probe, run_dir) from None
        raise NoSpaceError(f"{directory}: cannot write there ({e.strerror})") from None
    probe.unlink()


def check_room(run_dir: Path, checkpoint_estimate: int) -> list[str]:
    """Rank 0, before the run directory is written (a fresh start, or a resume before metrics.jsonl is cut back).
    Removes partial saves, probes run_dir and run_dir/tb, and requires one checkpoint plus MARGIN free. Returns
    lines to print (what was removed); raises NoSpaceError."""
    ckpt_root = run_dir / "checkpoints"
    removed = remove_partial_saves(ckpt_root)
    lines = [f"removed {ckpt_root / name}, the partial checkpoint of a save that did not finish" for name in removed]
    for d in (run_dir, run_dir / "tb"):
        _probe(d, run_dir)
    need = checkpoint_bytes(ckpt_root, checkpoint_estimate) + MARGIN
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise NoSpaceError(
            f"{run_dir}: {_mb(free)} free, the next checkpoint needs about {_mb(need)}: {what_to_free(run_dir)}"
        )
    return lines


@contextlib.contextmanager
def quiet_full_disk_in_threads() -> Iterator[None]:
    """While training: a full disk met in a background thread (TensorBoard's event writer) prints no traceback of
    its own; the writer raises it again in the training thread, which says it in one line. Other errors in threads
    print as before."""
    previous = threading.excepthook

    def hook(args):
        if not is_no_space(args.exc_value):
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous
