"""Token shards on disk: writing them atomically, and reading many of them memory-mapped as one stream.

A shard set with prefix P is P.NNNNN.bin (token ids), .idx (uint64 document ends), optional .mask (loss targets)
and the sidecar P.json. Invariants: every file is written to a temp file and renamed into place, the sidecar last;
a reader opens a set only through its sidecar and checks each file's size against it, so an interrupted write is
never read as complete; documents never straddle shards and every document ends with EOS. The format in full:
docs/data.md, section "Shard sets on disk".
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

FORMAT = "moe_dist.shards/1"
DTYPES = ("uint16", "uint32")


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same directory, fsync'd and renamed: a crash never
    leaves a truncated file under the final name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; the final file gets the usual permissions
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def sidecar_of(prefix: str | Path) -> Path:
    return Path(f"{prefix}.json")


def shard_files(prefix: str | Path, i: int) -> tuple[Path, Path, Path]:
    """(tokens, index, mask) paths of shard i."""
    p = Path(prefix)
    stem = f"{p.name}.{i:05d}"
    return p.with_name(f"{stem}.bin"), p.with_name(f"{stem}.idx"), p.with_name(f"{stem}.mask")


def existing_outputs(prefix: str | Path) -> list[Path]:
    """Files of a shard set with this prefix already on disk (sidecar and shards)."""
    p = Path(prefix)
    if not p.parent.is_dir():
        return []
    # Exactly PREFIX.NNNNN.{bin,idx,mask}: another set whose prefix extends this one ("train.v2") is not ours.
    shard = re.compile(rf"{re.escape(p.name)}\.\d{{5}}\.(bin|idx|mask)")
    found = [f for f in p.parent.iterdir() if shard.fullmatch(f.name)]
    return sorted(found + ([sidecar_of(p)] if sidecar_of(p).exists() else []))


class ShardWriter:
    """Collects documents in order and writes shards of about `shard_tokens` tokens (cut at document ends).
    `finish` writes the sidecar. Same documents in the same order → the same bytes."""

    def __init__(self, prefix: str | Path, dtype: str, vocab_size: int, with_mask: bool, shard_tokens: int):
        if dtype not in DTYPES:
            raise ValueError(f"--dtype: expected one of {list(DTYPES)}, got {dtype!r}")
        if vocab_size - 1 > np.iinfo(dtype).max:
            raise ValueError(f"--dtype: vocabulary of {vocab_size} tokens does not fit {dtype} (use --dtype uint32)")
        self.prefix, self.dtype, self.with_mask, self.shard_tokens = Path(prefix), dtype, with_mask, shard_tokens
        self.shards: list[dict] = []
        self._tokens: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._n = 0

    def add(self, tokens: np.ndarray, mask: Optional[np.ndarray] = None) -> None:
        """One document's ids (n,), EOS included; with_mask: its (n,) loss mask."""
        self._tokens.append(tokens.astype(self.dtype))
        if self.with_mask:
            self._masks.append(mask.astype(np.uint8))
        self._n += len(tokens)
        if self._n >= self.shard_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._tokens:
            return
        tok_path, idx_path, mask_path = shard_files(self.prefix, len(self.shards))
        ends = np.cumsum([len(t) for t in self._tokens], dtype=np.uint64)
        atomic_write(tok_path, np.concatenate(self._tokens).tobytes())
        atomic_write(idx_path, ends.tobytes())
        if self.with_mask:
            atomic_write(mask_path, np.concatenate(self._masks).tobytes())
        self.shards.append(
            {
                "tokens": tok_path.name,
                "index": idx_path.name,
                "mask": mask_path.name if self.with_mask else None,
                "num_tokens": int(ends[-1]),
                "num_documents": len(ends),
            }
        )
        self._tokens, self._masks, self._n = [], [], 0

    def finish(self, tokenizer: dict) -> dict:
        """Write the last shard, then the sidecar (last of all); returns the sidecar's content."""
        self._flush()
        meta = {
            "format": FORMAT,
            "tokenizer": tokenizer,
            "vocab_size": tokenizer["vocab_size"],
            "eos_id": tokenizer["eos_id"],
            "dtype": self.dtype,
            "loss_mask": self.with_mask,
            "num_tokens": sum(s["num_tokens"] for s in self.shards),
            "num_documents": sum(s["num_documents"] for s in self.shards),
            "shards": self.shards,
        }
        atomic_write(sidecar_of(self.prefix), (json.dumps(meta, indent=2) + "\n").encode())
        return meta


# ----------------------------------------------------------------------------------------------- reading


@dataclass
class Piece:
    """A contiguous range [lo, hi) of one token array, with its document ends and loss mask."""

    tokens: np.ndarray  # (N,) uint16/uint32/uint8 (memmap or array)
    doc_ends: np.ndarray  # (D,) uint64/int64, increasing, exclusive ends within `tokens`
    mask: Optional[np.ndarray]  # (N,) uint8 or None
    lo: int
    hi: int

    def __len__(self) -> int:
        return self.hi - self.lo


class Stream:
    """Token pieces read as one stream (shards of a set, sets of a mixture component, splits): `len(s)`,
    `s.slice(a, b)` and `s.gather(positions)`. Only the pages that a gather touches are read."""

    def __init__(self, pieces: list[Piece], component_ends: Optional[list[int]] = None):
        self.pieces = [p for p in pieces if len(p)]
        # A mixture's training stream: where each component ends in it (None: one component).
        self.component_ends = component_ends
        self.starts = np.cumsum([0] + [len(p) for p in self.pieces])  # (P + 1,) stream offset of each piece
        self.has_mask = any(p.mask is not None for p in self.pieces)
        # A global document number per piece: offset of its first document (documents never cross pieces).
        self.doc_base = np.cumsum([0] + [len(p.doc_ends) + 1 for p in self.pieces])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def slice(self, a: int, b: int) -> Stream:
        out = []
        for p, s in zip(self.pieces, self.starts[:-1]):
            lo, hi = max(a, s), min(b, s + len(p))
            if lo < hi:
                out.append(Piece(p.tokens, p.doc_ends, p.mask, p.lo + lo - s, p.lo + hi - s))
        return Stream(out)

    def gather(
        self, positions: np.ndarray, documents: bool = True
    ) -> tuple[np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]:
        """Stream positions (any shape) → (tokens int64, document numbers int64 or None without `documents`, loss
        mask bool or None), each of the same shape. Document numbers are equal exactly for tokens of the same
        document; without `documents` the index is not read at all."""
        flat = positions.reshape(-1)
        which = np.searchsorted(self.starts, flat, side="right") - 1
        tokens = np.empty(flat.shape, dtype=np.int64)
        docs = np.empty(flat.shape, dtype=np.int64) if documents else None
        mask = np.ones(flat.shape, dtype=bool) if self.has_mask else None
        for i in np.unique(which):
            sel = which == i
            p = self.pieces[i]
            local = flat[sel] - self.starts[i] + p.lo
            tokens[sel] = p.tokens[local]
            if documents:  # same dtype as the index: mixing uint64 with int64 would make numpy compare in float64
                ends = p.doc_ends
                docs[sel] = self.doc_base[i] + np.searchsorted(ends, local.astype(ends.dtype), side="right")
            if mask is not None:
                mask[sel] = p.mask[local] != 0 if p.mask is not None else True
        shape = positions.shape
        reshape = lambda t: None if t is None else t.reshape(shape)
        return tokens.reshape(shape), reshape(docs), reshape(mask)


def check_length(n_tokens: int, seq_len: int, what: str) -> None:
    """A stream (or split) must hold one sequence of seq_len + 1 tokens."""
    if n_tokens < seq_len + 1:
        raise ValueError(
            f"data: the {what} has {n_tokens} tokens, fewer than one sequence of "
            f"train.seq_len + 1 = {seq_len + 1} (add data.paths, raise data.max_bytes "
            f"or change data.val_fraction)"
        )


def document_starts(stream: Stream, positions: np.ndarray) -> np.ndarray:
    """(n,) stream positions → (n,) stream position of the first token of the document holding each (never
    before the start of its piece, where a split may have cut a document)."""
    which = np.searchsorted(stream.starts, positions, side="right") - 1
    out = np.empty_like(positions)
    for i in np.unique(which):
        sel = which == i
        p = stream.pieces[i]
        local = positions[sel] - stream.starts[i] + p.lo
        ends = p.doc_ends
        doc = np.searchsorted(ends, local.astype(ends.dtype), side="right")  # index of the holding document
        start = np.where(doc > 0, np.asarray(ends[np.maximum(doc - 1, 0)], dtype=np.int64), 0)
        out[sel] = stream.starts[i] + np.maximum(start, p.lo) - p.lo
    return out


def array_stream(tokens: np.ndarray, separator: int) -> Stream:
    """An in-memory stream whose documents end at each `separator` token (the text and stdlib sources)."""
    ends = np.flatnonzero(tokens == separator) + 1
    return Stream([Piece(tokens, ends, None, 0, len(tokens))])


_SHARD_FILE = re.compile(r"(?P<prefix>.+)\.\d{5}")  # a shard file's stem: PREFIX.NNNNN
_SHARD_KINDS = {".bin": "a shard's token file", ".idx": "a shard's document index", ".mask": "a shard's loss mask"}
_EXPECTED = "expected the .json sidecar of a shard set written by launch/prepare_data.py"


def read_sidecar(path: str | Path, key: str = "data.paths") -> dict:
    """Validated sidecar of a shard set. Errors are one line naming `key`, the file, what it is (when it is
    recognizably something else, e.g. one of a set's shard files) and what was expected."""
    side = Path(path)
    if side.suffix in _SHARD_KINDS:
        stem = _SHARD_FILE.fullmatch(side.stem)
        sidecar = side.with_name(f"{stem['prefix']}.json") if stem else "PREFIX.json"
        raise ValueError(
            f"{key}: {side}: {_SHARD_KINDS[side.suffix]}, expected the shard set's .json sidecar ({sidecar})"
        )
    if not side.is_file():
        raise ValueError(f"{key}: {side} not found ({_EXPECTED})")
    try:
        text = side.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{key}: {side}: a binary file, not JSON ({_EXPECTED})") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{key}: {side}: invalid JSON ({e.msg} at line {e.lineno}); {_EXPECTED}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{key}: {side}: JSON, but not a shard-set sidecar (format {FORMAT!r}); {_EXPECTED}")
    if meta.get("dtype") not in DTYPES:
        raise ValueError(f"{key}: {side}: needs 'dtype' in {list(DTYPES)}, got {meta.get('dtype')!r}")
    shards = meta.get("shards")
    fields = {"tokens", "index", "num_tokens", "num_documents"}
    if not isinstance(shards, list) or not all(isinstance(x, dict) and fields <= x.keys() for x in shards):
        raise ValueError(f"{key}: {side}: needs 'shards', a list of {sorted(fields)} per shard; rerun prepare_data.py")
    if not isinstance(meta.get("tokenizer"), dict) or not isinstance(meta.get("vocab_size"), int):
        raise ValueError(f"{key}: {side}: needs 'tokenizer' (an object) and 'vocab_size'; rerun prepare_data.py")
    return meta


INDEX_CHECK_CHUNK = 1 << 22  # document ends checked at a time (32 MiB of the index in memory, whatever its size)


def _check_index(ends: np.ndarray, n: int, path: Path, key: str) -> None:
    """A shard's document ends (D,) must rise strictly and end at its token count n: an index of the right size
    but wrong content would put document boundaries outside the shard (data.document_masking). Reads the index
    once, in chunks: 8 bytes per document, about 0.4 % of the token bytes at 1k-token documents (docs/data.md)."""
    if len(ends) == 0:
        raise ValueError(f"{key}: {path}: no document ends for {n} tokens; rerun prepare_data.py")
    previous = 0
    for lo in range(0, len(ends), INDEX_CHECK_CHUNK):
        chunk = np.asarray(ends[lo : lo + INDEX_CHECK_CHUNK]).astype(np.int64)  # above 2**63: negative, refused
        bad = np.flatnonzero(np.diff(chunk, prepend=previous) <= 0)
        if len(bad):
            _corrupt_index(path, n, key, f"entry {lo + bad[0]} is {int(ends[lo + bad[0]])}")
        previous = int(chunk[-1])
    if previous != n:
        _corrupt_index(path, n, key, f"the last is {int(ends[-1])}")


def _corrupt_index(path: Path, n: int, key: str, where: str) -> None:
    raise ValueError(
        f"{key}: {path}: corrupt document index (ends must rise strictly to the shard's {n} tokens; {where}); "
        "rerun prepare_data.py"
    )


def open_shards(path: str | Path, key: str = "data.paths") -> tuple[Stream, dict]:
    """A shard set's sidecar → (memory-mapped Stream of all its shards in order, sidecar). Each file's size is
    checked against the sidecar before anything is read."""
    side = Path(path)
    meta = read_sidecar(side, key)
    itemsize = np.dtype(meta["dtype"]).itemsize
    pieces = []
    for shard in meta["shards"]:
        n, d = shard["num_tokens"], shard["num_documents"]
        files = [(shard["tokens"], n * itemsize), (shard["index"], d * 8)]
        if shard.get("mask"):
            files.append((shard["mask"], n))
        for name, size in files:
            f = side.parent / name
            if not f.is_file():
                raise ValueError(f"{key}: {f} (listed in {side}) not found")
            if f.stat().st_size != size:
                raise ValueError(f"{key}: {f} has {f.stat().st_size} bytes, {side} implies {size}")
        if n == 0:
            continue
        tokens = np.memmap(side.parent / shard["tokens"], dtype=meta["dtype"], mode="r", shape=(n,))
        ends = np.memmap(side.parent / shard["index"], dtype=np.uint64, mode="r", shape=(d,))
        _check_index(ends, n, side.parent / shard["index"], key)
        mask = (
            np.memmap(side.parent / shard["mask"], dtype=np.uint8, mode="r", shape=(n,)) if shard.get("mask") else None
        )
        pieces.append(Piece(tokens, ends, mask, 0, n))
    return Stream(pieces), meta
