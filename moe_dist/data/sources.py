"""Token sources: a run's token stream from `data.source`, split into training and validation parts.

The "stdlib" and "text" sources are raw bytes (vocab 256), so every machine can train on its own Python standard
library sources out of the box; "memmap" reads shard sets written by `launch/prepare_data.py` with any tokenizer
(`moe_dist.data.shards`), memory-mapped, optionally as a weighted mixture. Errors are one line naming the key
(and the file). Batches are cut from these streams by `moe_dist.data.batches`.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Optional

import numpy as np

from moe_dist.config import DataConfig
from moe_dist.data.prepare import resolve_paths
from moe_dist.data.shards import Stream, array_stream, check_length, open_shards
from moe_dist.data.tokenizer import BYTES, BYTES_EOS, BYTES_VOCAB, Tokenizer, TokenizerError, encode, load_tokenizer

DOC_SEPARATOR = BYTES_EOS  # the byte sources join their files with the byte tokenizer's EOS (NUL)

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


def join_files_as_bytes(files: list[Path], max_bytes: Optional[int]) -> np.ndarray:
    """The byte tokens of `files` read in the given order, joined by DOC_SEPARATOR, truncated to `max_bytes`
    (None = all): the whole stream of the "stdlib" and "text" sources."""
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


def _split(stream: Stream, val_fraction: float) -> tuple[Stream, Stream]:
    n_val = int(len(stream) * val_fraction)
    return stream.slice(0, len(stream) - n_val), stream.slice(len(stream) - n_val, len(stream))


def _open_component(patterns: list[str], key: str, tok: Tokenizer, vocab_size: int) -> Stream:
    """Shard sets (sidecars or globs of them) → one stream; each must name the run's tokenizer and fit the model."""
    pieces = []
    for path in resolve_paths(patterns, key, expected="a shard set's .json sidecar, written by launch/prepare_data.py"):
        stream, meta = open_shards(path, key)
        named = meta["tokenizer"]
        if named.get("sha256") != tok.sha256:
            raise ValueError(
                f"{key}: {path} was tokenized with {named.get('name')!r} (sha256 {str(named.get('sha256'))[:12]}), "
                f"but data.tokenizer={tok.name!r} is {tok.sha256[:12]}: set data.tokenizer to the data's tokenizer"
            )
        if meta["vocab_size"] > vocab_size:
            raise ValueError(
                f"{key}: {path} holds ids of a {meta['vocab_size']}-token vocabulary, "
                f"outside model.vocab_size={vocab_size}"
            )
        pieces += stream.pieces
    return Stream(pieces)


def load_tokens(cfg: DataConfig, seq_len: int = 1, vocab_size: int = BYTES_VOCAB) -> tuple[Stream, Stream, list[float]]:
    """The token stream of `cfg.source` split into (train, val, weights). For a mixture, train holds the training
    parts of the components one after another (component i, of probability `weights[i]`, ends at
    `train.component_ends[i]`), val the validation parts of all of them.

    Raises ValueError (one line naming the key) when the data does not fit the model or its tokenizer, or when a
    split cannot hold one sequence of `seq_len + 1` tokens."""
    try:
        tok = load_tokenizer(cfg.tokenizer)
    except TokenizerError as e:
        raise ValueError(f"data.{e}") from None
    if cfg.source != "memmap" and tok.sha256 != BYTES:
        raise ValueError(f"data.tokenizer: the {cfg.source!r} source is bytes; tokenize with launch/prepare_data.py")
    if cfg.source != "memmap" or tok.sha256 == BYTES:
        if vocab_size < BYTES_VOCAB:
            raise ValueError(f"model.vocab_size: {vocab_size} does not cover the {BYTES_VOCAB} byte tokens")
    if cfg.source == "stdlib":
        files = stdlib_files()
        if not files:
            raise ValueError(f"data.source: no .py files under {sysconfig.get_paths()['stdlib']}")
        components = [array_stream(join_files_as_bytes(files, cfg.max_bytes), DOC_SEPARATOR)]
    elif cfg.source == "text":
        files = resolve_paths(cfg.paths, expected="text files, read as bytes")
        components = [array_stream(join_files_as_bytes(files, cfg.max_bytes), DOC_SEPARATOR)]
    elif cfg.source == "memmap":
        parts = [(c.paths, f"data.mixture[{i}].paths", c.weight) for i, c in enumerate(cfg.mixture)]
        parts = parts or [(cfg.paths, "data.paths", 1.0)]
        components = [_open_component(paths, key, tok, vocab_size) for paths, key, _ in parts]
    else:
        raise ValueError(f"data.source: expected 'stdlib', 'text' or 'memmap', got {cfg.source!r}")
    weights = [1.0] if cfg.source != "memmap" or not cfg.mixture else [c.weight for c in cfg.mixture]
    splits = [_split(c, cfg.val_fraction) for c in components]
    for i, (train, val) in enumerate(splits):
        name = f"data.source={cfg.source!r}" + (f" (data.mixture[{i}])" if cfg.mixture else "")
        check_length(len(train), seq_len, f"training split of {name}")
        check_length(len(val), seq_len, f"validation split of {name}")
    train = Stream([p for t, _ in splits for p in t.pieces], list(np.cumsum([len(t) for t, _ in splits])))
    return train, Stream([p for _, v in splits for p in v.pieces]), weights
