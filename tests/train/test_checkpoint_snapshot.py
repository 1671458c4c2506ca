"""The asynchronous save's host snapshot (train/checkpoint/snapshot.py): tensors far larger than the staging buffer
are copied bit for bit through it, and the buffer never grows past its bound. The whole save through it, equal to
the synchronous save bit for bit: tests/train/test_reliability.py (async save, staging of 64 KiB)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_dist.train.checkpoint.snapshot import HostSnapshot


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _awkward(n: int, seed: int) -> torch.Tensor:
    """fp32 values a copy through another dtype or a rounding would change: NaN payloads, -0, subnormals."""
    t = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    t[::7] = -0.0
    t[1::11] = 1e-42
    t.view(torch.int32)[2::13] = 0x7FC00123  # a NaN with a payload
    return t


@pytest.mark.parametrize("staging_bytes, expect", [(4096, 4096), (5000, 4992)])
def test_snapshot_copies_tensors_larger_than_its_staging_buffer_bit_for_bit(staging_bytes, expect):
    snap = HostSnapshot(staging_bytes)
    big = _awkward(10_001, 0).view(73, 137)  # 40 KB: ten times the buffer, not a multiple of its halves
    out = snap.copy("big", big)
    assert out.shape == big.shape and torch.equal(_bits(out), _bits(big))
    assert out.data_ptr() != big.data_ptr()  # a copy, not the source
    assert snap.staging.numel() == expect and not snap.staging.is_pinned()  # the bound; no pinning on the CPU
    assert snap.staged_copies == math.ceil(big.numel() * 4 / (expect // 2))  # every byte went through it
    small, empty = _awkward(5, 1), torch.empty(0, 3)
    assert torch.equal(_bits(snap.copy("small", small)), _bits(small))
    assert snap.copy("empty", empty).shape == (0, 3)
    # The next save reuses the host copy and overwrites it with the source's new values.
    big.mul_(3)
    again = snap.copy("big", big)
    assert again.data_ptr() == out.data_ptr() and torch.equal(_bits(again), _bits(big))
    assert snap.staging.numel() == expect


def test_snapshot_staging_buffer_has_a_floor():
    with pytest.raises(ValueError, match="staging buffer"):
        HostSnapshot(31)


def test_the_memory_plan_counts_the_staging_buffer_as_host_memory():
    from moe_dist.config import load_config
    from moe_dist.planning.memory import memory_plan

    on = memory_plan(load_config("configs/debug.json", ["train.async_save=true", "train.save_staging_mb=256"]), 1)
    off = memory_plan(load_config("configs/debug.json", ["train.save_staging_mb=256"]), 1)
    assert on["host_gb"]["save_staging"] == 256 * 2**20 / 1e9 and off["host_gb"]["save_staging"] == 0
    assert on["memory_per_rank_gb"] == off["memory_per_rank_gb"]  # not device memory
