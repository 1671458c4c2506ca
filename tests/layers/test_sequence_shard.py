"""The context-parallel seam in one process: SeqShard's layout, and its gathers over an injected exchange that
stands in for the CP group (every rank's local tensor known up front). The collectives over a real group are
tested in tests/parallel/test_cp_*.py."""

import pytest
import torch

from moe_dist.layers.sequence_shard import SeqShard, piece_chunks


class FakeGroup:
    """A `SequenceExchange` for rank `rank` of a group whose ranks hold `tensors` (rank order)."""

    def __init__(self, rank: int, tensors: list[torch.Tensor]):
        self.rank, self.tensors = rank, tensors

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([x if r == self.rank else t for r, t in enumerate(self.tensors)], dim=dim)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(sum(t if r != self.rank else x for r, t in enumerate(self.tensors)))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_pieces_of_all_ranks_tile_the_sequence_once(cp):
    S = 8 * cp
    shards = [SeqShard(cp, r, S) for r in range(cp)]
    assert sorted(c for r in range(cp) for c in piece_chunks(cp, r)) == list(range(2 * cp))
    assert sorted(torch.cat([s.positions() for s in shards]).tolist()) == list(range(S))
    whole = torch.arange(S)[None]
    for s in shards:
        assert torch.equal(s.local(whole)[0], s.positions())
        assert s.global_order() == [c for r in range(cp) for c in piece_chunks(cp, r)]


@pytest.mark.parametrize("cp", [2, 3])
def test_gather_puts_every_rank_s_pieces_in_global_order(cp):
    S, B, D = 4 * cp, 2, 3
    whole = torch.randn(B, S, D)
    locals_ = [SeqShard(cp, r, S).local(whole) for r in range(cp)]
    for r in range(cp):
        shard = SeqShard(cp, r, S, FakeGroup(r, locals_))
        assert torch.equal(shard.gather(locals_[r], dim=1), whole)
        summaries = [torch.stack([torch.full((B,), float(c)) for c in piece_chunks(cp, q)]) for q in range(cp)]
        shard = SeqShard(cp, r, S, FakeGroup(r, summaries))
        got = shard.gather_pieces(summaries[r])  # (2·cp, B): piece c's summary at row c
        assert torch.equal(got, torch.arange(2 * cp, dtype=got.dtype)[:, None].expand(-1, B))


def test_sum_leaves_its_input_and_a_lone_rank_needs_no_exchange():
    counts = [torch.tensor([1, 2]), torch.tensor([10, 20])]
    x = counts[0].clone()
    assert torch.equal(SeqShard(2, 0, 8, FakeGroup(0, counts)).sum(x), torch.tensor([11, 22]))
    assert torch.equal(x, counts[0])
    alone = SeqShard(1, 0, 8)
    assert alone.gather(x) is x and alone.sum(x) is x
    with pytest.raises(ValueError, match="needs an exchange"):
        SeqShard(2, 0, 8).gather(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="divisible by 2·cp = 4"):
        SeqShard(2, 0, 6)
