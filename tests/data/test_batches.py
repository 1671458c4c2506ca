"""Batches: determinism in (seed, step), the micro-batch rule, and the fixed validation set."""

import numpy as np
import pytest
import torch

from moe_dist.data.batches import TokenDataset, micro_batches


def _stream(n: int = 5000) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=n).astype(np.uint8)


def test_global_batch_depends_only_on_seed_and_step():
    ds = TokenDataset(_stream(), seq_len=16, seed=3)
    batch = ds.global_batch(7, 8)
    assert batch.shape == (8, 17) and batch.dtype == torch.int64
    # A fresh dataset, queried after other steps, gives the same batch: no hidden RNG state.
    other = TokenDataset(_stream(), seq_len=16, seed=3)
    other.global_batch(0, 8)
    assert torch.equal(other.global_batch(7, 8), batch)
    assert not torch.equal(ds.global_batch(8, 8), batch)
    assert not torch.equal(TokenDataset(_stream(), seq_len=16, seed=4).global_batch(7, 8), batch)


def test_global_batch_rows_are_windows_of_the_stream():
    tokens = np.arange(300, dtype=np.int64) % 256
    batch = TokenDataset(tokens, seq_len=10, seed=0).global_batch(1, 32)
    starts = batch[:, 0]
    assert torch.equal(batch, (starts[:, None] + torch.arange(11)) % 256)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_micro_batches_of_all_ranks_reproduce_the_global_batch(dp):
    batch = TokenDataset(_stream(), seq_len=8, seed=0).global_batch(0, 16)
    per_rank = [micro_batches(batch, 2, r, dp) for r in range(dp)]
    assert all(len(mbs) == 8 // dp for mbs in per_rank)
    # Micro-batch m = j * dp + r is rank r's j-th accumulation step.
    in_m_order = [per_rank[m % dp][m // dp] for m in range(8)]
    assert torch.equal(torch.cat(in_m_order), batch)
    assert torch.equal(per_rank[dp - 1][0], batch[2 * (dp - 1) : 2 * dp])


def test_micro_batches_rejects_indivisible_layouts():
    batch = torch.zeros(12, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="data-parallel"):
        micro_batches(batch, 4, 0, 2)  # 3 micro-batches over 2 ranks
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro_batches(batch, 5, 0, 1)


def test_eval_batches_union_is_layout_independent():
    ds = TokenDataset(_stream(3000), seq_len=16, seed=0)
    single = [b.tokens for b in ds.eval_batches(4, 3, dp_rank=0, dp_size=1)]
    ranks = [[b.tokens for b in ds.eval_batches(2, 3, dp_rank=r, dp_size=2)] for r in range(2)]
    assert all(b.shape == (3, 17) for b in single)
    # Rank r holds global batches r, r + dp, ...
    assert all(torch.equal(ranks[b % 2][b // 2], single[b]) for b in range(4))
    # Independent of training steps, contiguous windows overlapping by one token from the stream start.
    flat = torch.cat(single)
    assert torch.equal(flat[0], torch.from_numpy(_stream(3000)[:17].astype(np.int64)))
    assert torch.equal(flat[1:, 0], flat[:-1, -1])


def test_eval_batches_wrap_around_a_short_stream():
    ds = TokenDataset(np.arange(41, dtype=np.int64), seq_len=10, seed=0)  # 4 windows
    (batch,) = ds.eval_batches(1, 6, dp_rank=0, dp_size=1)
    assert batch.tokens[:, 0].tolist() == [0, 10, 20, 30, 0, 10]
