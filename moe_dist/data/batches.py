"""Batches: layout-independent sequences of a token stream, and the loss's ignore index.

MoE capacity, drops and the aux loss are computed per micro-batch per rank, so a run on `dp` ranks only equals
one process with `dp`-fold gradient accumulation if both see the same micro-batches. Hence the global batch of a
step depends only on (seed, step), and every layout cuts it into the same consecutive micro-batches
(`micro_batch_rows`): tests/data/test_batches.py checks the rule, and tests/parallel/test_ep_e2e.py that an
expert-parallel run equals one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from moe_dist.config.parallel_checks import check_global_batch
from moe_dist.data.shards import Stream, array_stream, check_length, document_starts
from moe_dist.data.tokenizer import BYTES_EOS

IGNORE = -100  # target of a position that has no loss (prompt tokens, a document's first token under masking)


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
        # An array is a byte stream (the text and stdlib sources), its documents ending at the byte tokenizer's EOS.
        self.stream = tokens if isinstance(tokens, Stream) else array_stream(np.asarray(tokens), BYTES_EOS)
        check_length(len(self.stream), seq_len, "token stream")
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
    check_global_batch(n_rows, micro_batch_size, dp_size)
    n_micro = n_rows // micro_batch_size
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"micro_batches: dp_rank must be in [0, {dp_size}), got {dp_rank}")
    mb = micro_batch_size
    return [(m * mb, (m + 1) * mb) for m in range(dp_rank, n_micro, dp_size)]


def micro_batches(global_batch: torch.Tensor, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[torch.Tensor]:
    """This rank's micro-batches of a (G, S+1) global batch (rows by `micro_batch_rows`)."""
    rows = micro_batch_rows(global_batch.shape[0], micro_batch_size, dp_rank, dp_size)
    return [global_batch[lo:hi] for lo, hi in rows]
