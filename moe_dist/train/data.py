"""Training data: byte tokens from a source, a train/validation split, and layout-independent batches.

Tokens are raw bytes (vocab 256), so no tokenizer has to be downloaded or versioned and every machine can
train on its own Python standard library sources out of the box.

Why batches look the way they do (DESIGN.md §5 "Capacity"): MoE capacity, drops and the aux loss are
computed per micro-batch per rank, so a run on `dp` ranks only equals one process with `dp`-fold gradient
accumulation if both see the same micro-batches. Hence the global batch of a step depends only on
(seed, step), and every layout cuts it into the same consecutive micro-batches (`micro_batches`).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from moe_dist.config import DataConfig

VOCAB_SIZE = 256  # one token per byte value
TOKENIZER = "bytes"  # recorded in memmap sidecars so a reader can refuse files from another tokenizer
DOC_SEPARATOR = 0  # NUL never occurs in text, so it marks document boundaries unambiguously
MEMMAP_DTYPES = ("uint16", "uint32")  # wide enough for vocabularies beyond bytes without a format change

# Stdlib directories that are not representative library code (tests, vendored packages, demos, tools)
# or are not part of every installation; skipping them keeps the embedded corpus comparable across machines.
_STDLIB_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "__pycache__",
        "ensurepip",
        "turtledemo",
        "tkinter",
        "pydoc_data",
    }
)


# ----------------------------------------------------------------------------------------------- tokens


def encode(data: bytes | str) -> np.ndarray:
    """Bytes (or UTF-8 text) → token ids, shape (N,) uint8: the token of a byte is its value."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return np.frombuffer(raw, dtype=np.uint8)


def decode(ids) -> str:
    """Token ids (tensor, array or list, any shape) → text; invalid UTF-8 is replaced, not raised,
    because model samples routinely cut multi-byte characters."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"decode: token ids must lie in [0, {VOCAB_SIZE}), got range [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def read_documents(files: list[Path], max_bytes: Optional[int]) -> np.ndarray:
    """Read files in the given order, joined by DOC_SEPARATOR, truncated to `max_bytes` (None = all)."""
    parts: list[bytes] = []
    total = 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        if parts:
            parts.append(bytes([DOC_SEPARATOR]))
            total += 1
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
    stream = b"".join(parts)
    return encode(stream if max_bytes is None else stream[:max_bytes])


def stdlib_files() -> list[Path]:
    """The standard library's own `.py` files in sorted walk order (deterministic on a given Python)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of skipped trees; sorting makes the walk order reproducible.
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-"))
        files.extend(Path(dirpath) / name for name in sorted(filenames) if name.endswith(".py"))
    return files


def resolve_paths(patterns: list[str], key: str = "data.paths") -> list[Path]:
    """Files and globs → existing files: globs sorted, entries kept in the given order, duplicates dropped.

    `key` names the setting in errors (the config key, or a CLI flag for scripts)."""
    files: list[Path] = []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise ValueError(f"{key}: {pattern!r} matches no files")
            files.extend(Path(p) for p in matches)
        elif not os.path.isfile(pattern):
            raise ValueError(f"{key}: {pattern!r} is not an existing file")
        else:
            files.append(Path(pattern))
    return list(dict.fromkeys(files))


# ----------------------------------------------------------------------------------------------- memmap files


def sidecar_path(path: str | Path) -> Path:
    return Path(f"{path}.json")


def write_memmap(tokens: np.ndarray, path: str | Path, dtype: str = "uint16", overwrite: bool = False) -> None:
    """Write `tokens` (N,) as a raw `dtype` file plus the JSON sidecar `PATH.json` that `read_memmap` needs.

    Each file goes to a temp file in the target directory and is moved into place with os.replace, so a crash
    never leaves a truncated file under the final name. The sidecar is written last: a reader finding it
    knows the token file is complete (and checks its size against num_tokens anyway)."""
    path = Path(path)
    if dtype not in MEMMAP_DTYPES:
        raise ValueError(f"dtype: expected one of {list(MEMMAP_DTYPES)}, got {dtype!r}")
    if not path.parent.is_dir():
        raise ValueError(f"{path}: directory {path.parent} does not exist")
    if not overwrite and (path.exists() or sidecar_path(path).exists()):
        raise FileExistsError(f"{path}: already exists, refusing to overwrite")
    tokens = np.asarray(tokens)
    if tokens.size and int(tokens.max()) > np.iinfo(dtype).max:
        raise ValueError(f"dtype: token id {int(tokens.max())} does not fit {dtype}")
    meta = {"dtype": dtype, "num_tokens": int(tokens.size), "vocab_size": VOCAB_SIZE, "tokenizer": TOKENIZER}
    _atomic_write(path, tokens.astype(dtype).tobytes())
    _atomic_write(sidecar_path(path), (json.dumps(meta, indent=2) + "\n").encode())


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_sidecar(path: str | Path) -> dict:
    """Validated metadata of a `write_memmap` file; errors are one line naming the file."""
    side = sidecar_path(path)
    if not side.is_file():
        raise ValueError(f"data.paths: {side} not found (write the token file with launch/prepare_data.py)")
    try:
        meta = json.loads(side.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"data.paths: {side}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if meta.get("dtype") not in MEMMAP_DTYPES or not isinstance(meta.get("num_tokens"), int):
        raise ValueError(f"data.paths: {side}: needs 'dtype' in {list(MEMMAP_DTYPES)} and integer 'num_tokens'")
    if meta.get("tokenizer") != TOKENIZER:
        raise ValueError(f"data.paths: {side}: tokenizer {meta.get('tokenizer')!r}, expected {TOKENIZER!r}")
    return meta


def read_memmap(path: str | Path) -> np.ndarray:
    """Open a `write_memmap` file read-only without loading it: (N,) uint16/uint32 memmap."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data.paths: {str(path)!r} is not an existing file")
    meta = read_sidecar(path)
    expected = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
    if path.stat().st_size != expected:
        raise ValueError(f"data.paths: {path} has {path.stat().st_size} bytes, sidecar implies {expected}")
    if meta["num_tokens"] == 0:  # np.memmap cannot map an empty file
        return np.zeros(0, dtype=meta["dtype"])
    return np.memmap(path, dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],))


# ----------------------------------------------------------------------------------------------- loading


def _check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"data: the {what} has {len(tokens)} tokens, fewer than one sequence of "
            f"train.seq_len + 1 = {seq_len + 1} (add data.paths, raise data.max_bytes "
            f"or change data.val_fraction)"
        )


def load_tokens(cfg: DataConfig, seq_len: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The token stream of `cfg.source` split into (train, val), each (N,), val = the last `val_fraction`.

    Raises ValueError when either split cannot hold one sequence of `seq_len + 1` tokens."""
    if cfg.source == "stdlib":
        files = stdlib_files()
        if not files:
            raise ValueError(f"data.source: no .py files under {sysconfig.get_paths()['stdlib']}")
        tokens = read_documents(files, cfg.max_bytes)
    elif cfg.source == "text":
        tokens = read_documents(resolve_paths(cfg.paths), cfg.max_bytes)
    elif cfg.source == "memmap":
        if len(cfg.paths) != 1:
            raise ValueError(f"data.paths: the memmap source takes exactly one .bin file, got {len(cfg.paths)}")
        tokens = read_memmap(cfg.paths[0])
    else:
        raise ValueError(f"data.source: expected 'stdlib', 'text' or 'memmap', got {cfg.source!r}")
    n_val = int(len(tokens) * cfg.val_fraction)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    _check_length(train, seq_len, f"training split of data.source={cfg.source!r}")
    _check_length(val, seq_len, f"validation split of data.source={cfg.source!r}")
    return train, val


# ----------------------------------------------------------------------------------------------- batches


class TokenDataset:
    """Deterministic sequences of `seq_len + 1` tokens (inputs = [:, :-1], targets = [:, 1:]) from a stream.

    Holds no RNG state: every batch is a pure function of its arguments, so resuming from a checkpoint at
    step s, or changing the number of ranks, reproduces the same data without saving a sampler."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        if seed < 0:
            raise ValueError(f"train.seed: must be non-negative to seed the data sampler, got {seed}")
        _check_length(tokens, seq_len, "token stream")
        self.tokens = tokens  # (N,)
        self.seq_len = seq_len
        self.seed = seed

    def _windows(self, starts: np.ndarray) -> torch.Tensor:
        idx = starts[:, None] + np.arange(self.seq_len + 1)  # (B, S+1)
        return torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        """The (batch_size, seq_len + 1) int64 batch of optimizer step `step`, depending only on (seed, step).

        Every rank builds the whole global batch (a cheap gather) and keeps its micro-batches, which is what
        makes the data identical under every layout."""
        if step < 0:
            raise ValueError(f"global_batch: step must be non-negative, got {step}")
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=batch_size)  # (B,), last start N-S-1
        return self._windows(starts)

    def eval_batches(self, n_batches: int, batch_size: int, dp_rank: int, dp_size: int) -> list[torch.Tensor]:
        """This rank's share of the fixed validation set: `n_batches` tensors of (batch_size, seq_len + 1).

        Rule: the stream is cut into windows of seq_len + 1 tokens starting every seq_len tokens (consecutive
        windows share one token, so each token is a target exactly once). Global eval batch b holds windows
        [b * batch_size, (b + 1) * batch_size), wrapping around when the stream holds fewer windows, so a small
        validation set still gives a full pass. The global set is batches 0 .. n_batches * dp_size - 1, and
        rank r takes batches r, r + dp_size, r + 2 * dp_size, ...: for the same n_batches * dp_size the union
        over ranks is the same set whatever dp_size is, and it never depends on the step."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"eval_batches: dp_rank must be in [0, {dp_size}), got {dp_rank}")
        n_windows = (len(self.tokens) - 1) // self.seq_len
        batches = []
        for b in range(dp_rank, n_batches * dp_size, dp_size):
            windows = (b * batch_size + np.arange(batch_size)) % n_windows  # (B,) window indices
            batches.append(self._windows(windows * self.seq_len))
        return batches


def micro_batches(global_batch: torch.Tensor, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[torch.Tensor]:
    """This data-parallel rank's micro-batches of a global batch, in gradient-accumulation order.

    The (G, S+1) batch is cut into n_micro = G // micro_batch_size consecutive micro-batches (m covers rows
    [m * mb, (m + 1) * mb)); rank r processes m = j * dp_size + r for j = 0 .. n_micro / dp_size - 1. One
    process (dp_size = 1) thus sees the same micro-batches as all ranks together."""
    n_rows = global_batch.shape[0]
    if micro_batch_size <= 0 or n_rows % micro_batch_size:
        raise ValueError(
            f"train.global_batch_size: {n_rows} sequences is not a multiple of "
            f"train.micro_batch_size={micro_batch_size}"
        )
    n_micro = n_rows // micro_batch_size
    if n_micro % dp_size:
        raise ValueError(
            f"train.global_batch_size: {n_micro} micro-batches of {micro_batch_size} are not "
            f"divisible among {dp_size} data-parallel ranks"
        )
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"micro_batches: dp_rank must be in [0, {dp_size}), got {dp_rank}")
    mb = micro_batch_size
    return [global_batch[m * mb : (m + 1) * mb] for m in range(dp_rank, n_micro, dp_size)]
