"""Writing a checkpoint's tensor file: streamed tensor by tensor, hashed while written, from a bounded queue.

The format is safetensors' (read back with the safetensors library), written by hand so that a rank never holds
all its tensors at once nor re-reads its file: the header goes first (the plan fixes tensors, shapes and order),
each tensor's bytes follow as it arrives and the sha256 is updated from the same buffers, never from the disk.
Invariant of `FileWriterThread`: bytes reserved and not yet written stay at most `limit` (or one tensor, when a
single one is larger); `limit=None` is the asynchronous snapshot. Details: docs/reliability.md, section
"Checkpoints: atomic publish" ("Streaming and integrity").
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from collections import deque
from pathlib import Path

import torch

DTYPE_NAMES = {torch.float32: "F32"}  # checkpoints hold fp32 only


def fsync(path: Path) -> None:
    """Flush a file or directory to stable storage, so a published checkpoint survives a machine crash too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TensorFileWriter:
    """One safetensors file whose tensors (name, shape; fp32) are known up front, written in that order."""

    def __init__(self, path: Path, specs: list[tuple[str, tuple[int, ...]]], metadata: dict[str, str] | None = None):
        self.path, self._specs, self._next = path, specs, 0
        header, offset = {}, 0
        for name, shape in specs:
            size = math.prod(shape) * 4
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        if metadata:
            header["__metadata__"] = metadata
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self._hash = hashlib.sha256()
        self._file = path.open("wb")
        self._emit(struct.pack("<Q", len(text)) + text)

    def _emit(self, data) -> None:
        self._file.write(data)
        self._hash.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the file, in the order given at construction."""
        want, shape = self._specs[self._next]
        if name != want or tuple(tensor.shape) != tuple(shape) or tensor.dtype != torch.float32:
            raise ValueError(f"{self.path}: got {name} {tuple(tensor.shape)} {tensor.dtype}, expected {want} {shape}")
        data = tensor.detach().cpu().contiguous().numpy()  # a view of the tensor's memory (no copy) on CPU
        self._emit(memoryview(data).cast("B"))
        self._next += 1

    def close(self) -> tuple[str, int]:
        """Flush and fsync; (sha256 hex digest, size in bytes) of what was written."""
        if self._next != len(self._specs):
            raise ValueError(f"{self.path}: {self._next} of {len(self._specs)} tensors written")
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        return self._hash.hexdigest(), size

    def abort(self) -> None:
        self._file.close()


class FileWriterThread:
    """A TensorFileWriter fed from a bounded queue by the gathering thread (see the module docstring)."""

    def __init__(self, writer: TensorFileWriter | None, limit: int | None):
        self.writer, self.limit = writer, limit
        self._queue: deque = deque()  # (bytes accounted, [(name, tensor)]); None ends it
        self._pending = 0  # bytes reserved and not yet written
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.result: tuple[str, int] | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def reserve(self, nbytes: int) -> None:
        """Block until `nbytes` more fit in the buffer (always, when nothing is pending)."""
        with self._cond:
            while self.limit is not None and self._pending and self._pending + nbytes > self.limit and not self._error:
                self._cond.wait()
            self._pending += nbytes

    def release(self, nbytes: int) -> None:
        """Give back a reservation that turned out to hold nothing to write."""
        with self._cond:
            self._pending -= nbytes
            self._cond.notify_all()

    def put(self, nbytes: int, pieces: list[tuple[str, torch.Tensor]]) -> None:
        """Write `pieces` (this reservation of `nbytes`): host tensors, or device tensors the writer copies."""
        with self._cond:
            if self._error is not None:  # the writer stopped: drop it (finish() raises the writer's error)
                self._pending -= nbytes
                return
            self._queue.append((nbytes, pieces))
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue:
                        self._cond.wait()
                    item = self._queue.popleft()
                if item is None:
                    break
                nbytes, pieces = item
                for name, tensor in pieces:
                    self.writer.write(name, tensor)
                del pieces, item
                self.release(nbytes)
            if self.writer is not None:
                self.result = self.writer.close()
        except BaseException as e:  # re-raised in the caller's thread by finish()
            self._error = e
            if self.writer is not None:
                self.writer.abort()
            with self._cond:
                self._cond.notify_all()

    def finish_quietly(self) -> None:
        """End the thread after a failure elsewhere; its own error, if any, is dropped (the other one is raised)."""
        try:
            self.finish()
        except Exception:
            pass

    def finish(self) -> tuple[str, int] | None:
        """Wait until everything queued is written and the file closed; (sha256, size), None without a file."""
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.result
