"""The context-parallel seam: this rank's part of every sequence of a micro-batch, as a layer receives it.

Layout (load-balanced for causal attention): the sequence of S positions is cut into 2·cp equal chunks; CP rank r
holds chunks r and 2·cp − 1 − r (a head and a tail piece), concatenated in that order as its local sequence of
S / cp positions. Every rank's causal attention work is then the same. Mixers see their local sequence plus a
`SeqShard`, which says where each local position sits in the whole sequence and exchanges what a mixer needs from
the other pieces: keys and values (attention), or one summary per piece (the recurrent mixers' states and conv
halos, layers/state_passing.py). Whole-sequence metadata (document ids, prefix mask) is given to every rank whole: it
is tiny (int/bool per position) and lets each rank compute masks, RoPE positions and document starts in global
positions without a collective.

The layers own this interface; the collectives behind it (`SequenceExchange`) are built over the CP group in
moe_dist/parallel/context_parallel.py, as the MoE dispatcher is built in parallel/expert_parallel.py.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Protocol

import torch


class SequenceExchange(Protocol):
    """The collectives a `SeqShard` needs over the ranks of its CP group (in cp_rank order)."""

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x concatenated along `dim` in rank order (size · x.shape[dim] there). Differentiable: the
        backward sums the ranks' gradients of the result and returns this rank its own slice (a reduce-scatter)."""
        ...

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of every rank's x, without gradient; may write the sum into x and return it."""
        ...


def takes_shard(module_class: type) -> bool:
    """Whether a mixer class's forward is shard-aware (takes `shard=`): only those may run under CP; any other would
    silently mix its local pieces as if they were one sequence."""
    return "shard" in inspect.signature(module_class.forward).parameters


def piece_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2·cp) CP rank `cp_rank` holds, in local order: head, tail."""
    return cp_rank, 2 * cp - 1 - cp_rank


@dataclass(frozen=True)
class SeqShard:
    """This rank's part of every sequence of the micro-batch (see the module docstring for the layout)."""

    size: int  # cp
    rank: int  # cp_rank
    seq_len: int  # S, the whole sequence
    exchange: Optional[SequenceExchange] = None  # over the CP group; None when no collective is needed (size 1)

    def __post_init__(self):
        if self.seq_len % (2 * self.size):
            raise ValueError(
                f"context parallelism: the sequence length {self.seq_len} must be divisible by 2·cp = {2 * self.size}"
            )

    @property
    def chunk(self) -> int:
        """Positions per piece: S / (2·cp)."""
        return self.seq_len // (2 * self.size)

    @property
    def pieces(self) -> tuple[tuple[int, int], ...]:
        """(global start, length) of this rank's pieces, in local order."""
        return tuple((c * self.chunk, self.chunk) for c in piece_chunks(self.size, self.rank))

    def global_order(self) -> list[int]:
        """Piece index (global chunk number) of each piece of the rank-order gather [rank 0's two pieces, rank 1's
        two, ...]: gathered piece j is chunk global_order()[j]."""
        return [c for r in range(self.size) for c in piece_chunks(self.size, r)]

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(S / cp,) int64: the global position of each local position."""
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in self.pieces])

    def local(self, whole: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions of a whole-sequence tensor (size S along `dim`), in local order."""
        return torch.cat([whole.narrow(dim, s, n) for s, n in self.pieces], dim=dim)

    def _exchange(self) -> SequenceExchange:
        if self.exchange is None:
            raise ValueError(f"context parallelism: a SeqShard of size {self.size} needs an exchange for its group")
        return self.exchange

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """All-gather the local sequences (size S / cp along `dim`) of the group into the whole sequence in global
        order. Differentiable: the backward sums every rank's gradient of the whole sequence and returns this rank
        its own positions' (a reduce-scatter), so a K/V gradient reaches the rank that owns the position."""
        if self.size == 1:
            return x
        gathered = self._exchange().all_gather(x, dim)  # rank order: r0 head, r0 tail, r1 head, ...
        c = self.chunk
        order = self.global_order()
        inverse = sorted(range(len(order)), key=order.__getitem__)  # gathered piece holding chunk k
        index = torch.cat([torch.arange(j * c, (j + 1) * c, device=x.device) for j in inverse])
        return gathered.index_select(dim, index)

    def gather_pieces(self, summary: torch.Tensor) -> torch.Tensor:
        """All-gather per-piece summaries: `summary` (2, ...) for this rank's pieces in local order → (2·cp, ...)
        for every piece of the sequence in global order. Differentiable as `gather`: the gradient of a piece's
        summary, summed over the ranks that used it, returns to the rank that produced it."""
        if summary.shape[0] != 2:
            raise ValueError(f"gather_pieces: expected a summary per local piece, (2, ...), got {tuple(summary.shape)}")
        if self.size == 1:
            return summary  # chunks 0 and 1: already in global order
        gathered = self._exchange().all_gather(summary, 0)  # (2·cp, ...) in rank order
        order = self.global_order()
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return gathered.index_select(0, torch.tensor(inverse, device=summary.device))

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of a per-rank tensor without gradient (counts: every rank gets the whole
        micro-batch's); x is left as it is."""
        return x if self.size == 1 else self._exchange().all_reduce_sum(x.detach().clone())
