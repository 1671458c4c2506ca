"""Training data: token streams from a source, a train/validation split, and layout-independent batches.

The "stdlib" and "text" sources are raw bytes (vocab 256), so every machine can train on its own Python standard
library sources out of the box; "memmap" reads shard sets written by `launch/prepare_data.py` with any tokenizer
(`moe_dist.data`), memory-mapped, optionally as a weighted mixture.

Why batches look the way they do (DESIGN.md §5 "Capacity"): MoE capacity, drops and the aux loss are
computed per micro-batch per rank, so a run on `dp` ranks only equals one process with `dp`-fold gradient
accumulation if both see the same micro-batches. Hence the global batch of a step depends only on
(seed, step), and every layout cuts it into the same consecutive micro-batches (`micro_batches`).
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from moe_dist.config import DataConfig
from moe_dist.data.prepare import resolve_paths
from moe_dist.data.shards import Stream, array_stream, atomic_write, document_starts, open_shards
from moe_dist.data.tokenizer import BYTES, Tokenizer, TokenizerError, load_tokenizer

VOCAB_SIZE = 256  # one token per byte value
DOC_SEPARATOR = 0  # NUL never occurs in text, so it marks document boundaries unambiguously
IGNORE = -100  # target of a position that has no loss (prompt tokens, a document's first token under masking)

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


# ----------------------------------------------------------------------------------------------- loading


def _check_length(n_tokens: int, seq_len: int, what: str) -> None:
    if n_tokens < seq_len + 1:
        raise ValueError(
            f"data: the {what} has {n_tokens} tokens, fewer than one sequence of "
            f"train.seq_len + 1 = {seq_len + 1} (add data.paths, raise data.max_bytes "
            f"or change data.val_fraction)"
        )


def _split(stream: Stream, val_fraction: float) -> tuple[Stream, Stream]:
    n_val = int(len(stream) * val_fraction)
    return stream.slice(0, len(stream) - n_val), stream.slice(len(stream) - n_val, len(stream))


def _open_component(patterns: list[str], key: str, tok: Tokenizer, vocab_size: int) -> Stream:
    """Shard sets (sidecars or globs of them) → one stream; each must name the run's tokenizer and fit the model."""
    pieces = []
    for path in resolve_paths(patterns, key):
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


def load_tokens(cfg: DataConfig, seq_len: int = 1, vocab_size: int = VOCAB_SIZE) -> tuple[Stream, Stream, list[float]]:
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
        if vocab_size < VOCAB_SIZE:
            raise ValueError(f"model.vocab_size: {vocab_size} does not cover the {VOCAB_SIZE} byte tokens")
    if cfg.mixture and cfg.source != "memmap":
        raise ValueError("data.mixture: only the 'memmap' source takes a mixture")
    if cfg.source == "stdlib":
        files = stdlib_files()
        if not files:
            raise ValueError(f"data.source: no .py files under {sysconfig.get_paths()['stdlib']}")
        components = [array_stream(read_documents(files, cfg.max_bytes), DOC_SEPARATOR)]
    elif cfg.source == "text":
        components = [array_stream(read_documents(resolve_paths(cfg.paths), cfg.max_bytes), DOC_SEPARATOR)]
    elif cfg.source == "memmap":
        if cfg.mixture and cfg.paths:
            raise ValueError("data.paths: give either data.paths or data.mixture, not both")
        if not cfg.mixture and not cfg.paths:
            raise ValueError("data.paths: the memmap source needs shard-set sidecars (PREFIX.json) or data.mixture")
        parts = [(c.paths, f"data.mixture[{i}].paths", c.weight) for i, c in enumerate(cfg.mixture)]
        parts = parts or [(cfg.paths, "data.paths", 1.0)]
        for i, (_, _, w) in enumerate(parts):
            if not w > 0:
                raise ValueError(f"data.mixture[{i}].weight: must be positive, got {w}")
        components = [_open_component(paths, key, tok, vocab_size) for paths, key, _ in parts]
    else:
        raise ValueError(f"data.source: expected 'stdlib', 'text' or 'memmap', got {cfg.source!r}")
    weights = [1.0] if cfg.source != "memmap" or not cfg.mixture else [c.weight for c in cfg.mixture]
    splits = [_split(c, cfg.val_fraction) for c in components]
    for i, (train, val) in enumerate(splits):
        name = f"data.source={cfg.source!r}" + (f" (data.mixture[{i}])" if cfg.mixture else "")
        _check_length(len(train), seq_len, f"training split of {name}")
        _check_length(len(val), seq_len, f"validation split of {name}")
    train = Stream([p for t, _ in splits for p in t.pieces], list(np.cumsum([len(t) for t, _ in splits])))
    return train, Stream([p for _, v in splits for p in v.pieces]), weights


def tokenizer_identity(spec: str) -> str:
    """The sha256 of the run's tokenizer ("bytes" for bytes): recorded with the data order in checkpoints."""
    return load_tokenizer(spec).sha256


TOKENIZER_DIR = "tokenizer"  # RUN_DIR/tokenizer/: the run's tokenizer files, which generate.py and export use


def copy_tokenizer(spec: str, run_dir: Path) -> Optional[Path]:
    """Copy the run's tokenizer.json (and its tokenizer_config.json, special_tokens_map.json) into
    RUN_DIR/tokenizer/, so the run stays usable when the original files move; None for bytes."""
    tok = load_tokenizer(spec)
    if tok.source_dir is None:
        return None
    out = run_dir / TOKENIZER_DIR
    out.mkdir(exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tok.source_dir / name).is_file():
            atomic_write(out / name, (tok.source_dir / name).read_bytes())
    atomic_write(out / "tokenizer.json", tok.json.encode())
    return out


# ----------------------------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """Sequences of seq_len + 1 tokens (inputs = tokens[:, :-1], targets from tokens[:, 1:]) and what goes with
    them; `rows` slices all of it."""

    tokens: torch.Tensor  # (B, S+1) int64
    document_ids: Optional[torch.Tensor] = None  # (B, S+1) int64 with data.document_masking: 0, 1, ... per row
    loss_mask: Optional[torch.Tensor] = None  # (B, S+1) bool, fine-tuning data: True where a token is a target

    def targets(self) -> torch.Tensor:
        """(B, S) next-token targets, IGNORE where a position has no loss: the target is a prompt token, or (with
        document masking) the first token of the next document, which nothing in its own document predicts."""
        targets = self.tokens[:, 1:].clone()
        if self.loss_mask is not None:
            targets[~self.loss_mask[:, 1:]] = IGNORE
        if self.document_ids is not None:
            targets[self.document_ids[:, 1:] != self.document_ids[:, :-1]] = IGNORE
        return targets

    def prefix(self) -> Optional[torch.Tensor]:
        """(B, S) bool, True at input positions holding prompt tokens (tokens that are no target): the part of each
        fine-tuning document that prefix-LM attention lets see itself bidirectionally. None without a loss mask."""
        return None if self.loss_mask is None else ~self.loss_mask[:, :-1]

    def rows(self, lo: int, hi: int) -> Batch:
        cut = lambda t: None if t is None else t[lo:hi]
        return Batch(self.tokens[lo:hi], cut(self.document_ids), cut(self.loss_mask))


class TokenDataset:
    """Deterministic sequences of `seq_len + 1` tokens from a stream (or a mixture of streams).

    Holds no RNG state: every batch is a pure function of its arguments, so resuming from a checkpoint at
    step s, or changing the number of ranks, reproduces the same data without saving a sampler."""

    def __init__(
        self,
        tokens: Union[np.ndarray, Stream],
        seq_len: int,
        seed: int,
        weights: Optional[list[float]] = None,
        document_masking: bool = False,
        align_to_documents: bool = False,
    ):
        if seed < 0:
            raise ValueError(f"train.seed: must be non-negative to seed the data sampler, got {seed}")
        self.stream = tokens if isinstance(tokens, Stream) else array_stream(np.asarray(tokens), DOC_SEPARATOR)
        _check_length(len(self.stream), seq_len, "token stream")
        self.seq_len = seq_len
        self.seed = seed
        self.document_masking = document_masking
        self.align_to_documents = align_to_documents
        self.weights = None
        if weights is not None and len(weights) > 1:
            self.weights = np.asarray(weights, dtype=np.float64) / sum(weights)
            self.ends = np.asarray(self.stream.component_ends)  # (K,) end of each component in the stream

    def _windows(self, starts: np.ndarray) -> Batch:
        idx = starts[:, None] + np.arange(self.seq_len + 1)  # (B, S+1)
        tokens, docs, mask = self.stream.gather(idx, documents=self.document_masking)
        doc_ids = torch.from_numpy(docs - docs[:, :1]) if self.document_masking else None
        return Batch(torch.from_numpy(tokens), doc_ids, None if mask is None else torch.from_numpy(mask))

    def _starts(self, step: int, batch_size: int) -> np.ndarray:
        """(batch_size,) window starts of optimizer step `step`, depending only on (seed, step): a draw of a
        few integers, so each rank draws them all and gathers only the rows it processes."""
        if step < 0:
            raise ValueError(f"global_batch: step must be non-negative, got {step}")
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        if self.weights is None:
            starts = rng.integers(0, len(self.stream) - self.seq_len, size=batch_size)  # (B,), last start N-S-1
        else:
            comp = rng.choice(len(self.weights), size=batch_size, p=self.weights)  # (B,) component of each row
            lo = np.concatenate([[0], self.ends[:-1]])[comp]
            span = self.ends[comp] - lo - self.seq_len  # starts within the component: its windows never leave it
            starts = lo + np.floor(rng.random(batch_size) * span).astype(np.int64)
        # Moved back to the start of the document they fall in (documents drawn in proportion to their length):
        # the window still ends inside its component, and a fine-tuning window never opens mid-prompt.
        return document_starts(self.stream, starts) if self.align_to_documents else starts

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        """The (batch_size, seq_len + 1) int64 tokens of optimizer step `step` (all rows; for tests and tools)."""
        return self._windows(self._starts(step, batch_size)).tokens

    def micro_batches(self, step: int, batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> list:
        """This rank's micro-batches (Batch) of step `step`'s global batch, in accumulation order, the rule of
        `micro_batch_rows`; only their rows are read from the stream."""
        starts = self._starts(step, batch_size)
        return [
            self._windows(starts[lo:hi]) for lo, hi in micro_batch_rows(batch_size, micro_batch_size, dp_rank, dp_size)
        ]

    def eval_batches(self, n_batches: int, batch_size: int, dp_rank: int, dp_size: int) -> list[Batch]:
        """This rank's share of the fixed validation set: `n_batches` Batches of (batch_size, seq_len + 1).

        Rule: the stream is cut into windows of seq_len + 1 tokens starting every seq_len tokens (consecutive
        windows share one token, so each token is a target exactly once). Global eval batch b holds windows
        [b * batch_size, (b + 1) * batch_size), wrapping around when the stream holds fewer windows, so a small
        validation set still gives a full pass. The global set is batches 0 .. n_batches * dp_size - 1, and
        rank r takes batches r, r + dp_size, r + 2 * dp_size, ...: for the same n_batches * dp_size the union
        over ranks is the same set whatever dp_size is, and it never depends on the step."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"eval_batches: dp_rank must be in [0, {dp_size}), got {dp_rank}")
        n_windows = (len(self.stream) - 1) // self.seq_len
        batches = []
        for b in range(dp_rank, n_batches * dp_size, dp_size):
            windows = (b * batch_size + np.arange(batch_size)) % n_windows  # (B,) window indices
            batches.append(self._windows(windows * self.seq_len))
        return batches


def micro_batch_rows(n_rows: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[tuple[int, int]]:
    """Row ranges [lo, hi) of this data-parallel rank's micro-batches of a global batch, in accumulation order.

    The G rows are cut into n_micro = G // micro_batch_size consecutive micro-batches (m covers rows
    [m * mb, (m + 1) * mb)); rank r processes m = j * dp_size + r for j = 0 .. n_micro / dp_size - 1. One
    process (dp_size = 1) thus sees the same micro-batches as all ranks together."""
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
    return [(m * mb, (m + 1) * mb) for m in range(dp_rank, n_micro, dp_size)]


def micro_batches(global_batch: torch.Tensor, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[torch.Tensor]:
    """This rank's micro-batches of a (G, S+1) global batch (rows by `micro_batch_rows`)."""
    rows = micro_batch_rows(global_batch.shape[0], micro_batch_size, dp_rank, dp_size)
    return [global_batch[lo:hi] for lo, hi in rows]
