"""Context parallelism's collectives: the exchange a `SeqShard` (moe_dist/layers/sequence_shard.py, where the
layout of the pieces is described) runs over the `cp` ranks of a group, and the one function that builds a rank's
shard. The layers receive the shard and never name a group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_dist.layers.sequence_shard import SeqShard
from moe_dist.parallel.comm import all_reduce_sum, gather_sequence


@dataclass(frozen=True)
class GroupExchange:
    """`SequenceExchange` over a process group, ranks in cp_rank order."""

    group: dist.ProcessGroup

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return gather_sequence(x, dim, self.group)  # backward: reduce-scatter

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(x, self.group)  # in place


def seq_shard(group: dist.ProcessGroup | None, cp: int, cp_rank: int, seq_len: int) -> SeqShard:
    """CP rank `cp_rank`'s pieces of sequences of `seq_len` positions, exchanging over `group` (the cp ranks in
    cp_rank order; unused, and may be None, when cp is 1)."""
    return SeqShard(cp, cp_rank, seq_len, None if cp == 1 else GroupExchange(group))
