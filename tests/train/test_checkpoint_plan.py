"""The checkpoint's writer plan (index math, no process group) and its tensor files (written, hashed and read
back with the safetensors library), without a training run."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from safetensors import safe_open

from moe_dist.config import load_config
from moe_dist.models.decoder import build_model
from moe_dist.train.checkpoint.io import FileWriterThread, TensorFileWriter
from moe_dist.train.checkpoint.plan import (
    BYTES_PER_ELEMENT,
    bytes_per_rank,
    holders,
    model_entries,
    plan_writers,
    tensors_in_order,
)

LAYOUTS = [(4, 2, 1), (2, 2, 2)]  # (dp, ep, tp), the two


@pytest.fixture(scope="module")
def mixtral_small():
    cfg = load_config("configs/mixtral_small.json", [])
    return model_entries(build_model(cfg.model, torch.device("meta")))


def _before(entries, dp: int, ep: int, tp: int) -> list[int]:
    """Bytes per rank under the previous rule: rank 0 wrote every dense tensor, the first expert-data-parallel
    replica (tp_rank 0) every expert."""
    out = [0] * (dp * tp)
    for _, entry, expert in tensors_in_order(entries):
        rank = 0 if expert is None else (expert // (entry.experts // ep)) * tp
        out[rank] += math.prod(entry.shape) * BYTES_PER_ELEMENT
    return out


@pytest.mark.parametrize("dp, ep, tp", LAYOUTS)
def test_every_tensor_once_by_a_holder_and_bytes_balanced(mixtral_small, dp, ep, tp):
    plan = plan_writers(mixtral_small, dp, ep, tp)
    tensors = tensors_in_order(mixtral_small)
    assert sorted(plan) == sorted(name for name, _, _ in tensors)  # each stored tensor has exactly one writer
    assert len(tensors) == len({name for name, _, _ in tensors})
    for name, entry, expert in tensors:  # the writer holds the tensor after the save's gathers
        assert plan[name] in holders(entry.experts, expert, dp, ep, tp), name
    after = bytes_per_rank(mixtral_small, plan, dp * tp)
    before = _before(mixtral_small, dp, ep, tp)
    assert sum(after) == sum(before)
    mean = sum(after) / len(after)
    print(f"\n(dp, ep, tp) = {(dp, ep, tp)}: MB written per rank before {[round(b / 1e6, 1) for b in before]}")
    print(f"  after {[round(b / 1e6, 1) for b in after]}; largest / mean {max(after) / mean:.4f}")
    assert max(after) <= 1.25 * mean
    assert max(before) > 1.5 * mean  # the old rule funnelled (the check above can fail)
    assert plan_writers(mixtral_small, dp, ep, tp) == plan  # deterministic: every rank computes the same plan


@pytest.mark.parametrize("dp, ep, tp", [(2, 2, 2), (2, 4, 2), (1, 4, 4)])
def test_folded_experts_are_written_by_a_rank_holding_them(mixtral_small, dp, ep, tp):
    """parallel.etp = 1: expert e is held by the ranks at EP position rank mod ep (TP peers hold other experts);
    every tensor still has exactly one writer among its holders, balanced."""
    plan = plan_writers(mixtral_small, dp, ep, tp, etp=1)
    for name, entry, expert in tensors_in_order(mixtral_small):
        ranks = holders(entry.experts, expert, dp, ep, tp, etp=1)
        assert plan[name] in ranks, name
        if expert is not None:
            assert ranks == tuple(r for r in range(dp * tp) if r % ep == expert // (entry.experts // ep))
    after = bytes_per_rank(mixtral_small, plan, dp * tp)
    assert max(after) <= 1.25 * sum(after) / len(after)


def test_experts_stay_on_their_ep_position_and_a_huge_dense_tensor_is_still_written_once(mixtral_small):
    dp, ep, tp = 8, 4, 1
    plan = plan_writers(mixtral_small, dp, ep, tp)
    for name, entry, expert in tensors_in_order(mixtral_small):
        if expert is not None:
            assert (plan[name] // tp) % ep == expert // (entry.experts // ep)
    # A layout with more ranks than tensors of some kinds: every rank still has a bounded share.
    after = bytes_per_rank(mixtral_small, plan, dp * tp)
    largest = max(math.prod(e.shape) * BYTES_PER_ELEMENT for _, e, _ in tensors_in_order(mixtral_small))
    assert max(after) <= sum(after) / len(after) + largest  # the greedy rule's bound


def test_tensor_file_is_safetensors_and_its_digest_covers_every_byte(tmp_path):
    tensors = {"a": torch.randn(3, 5), "exp_avg.a": torch.arange(7.0), "b.0": torch.randn(2, 2, 2)}
    path = tmp_path / "rank00000.safetensors"
    writer = TensorFileWriter(path, [(k, tuple(v.shape)) for k, v in tensors.items()], {"step": "3"})
    thread = FileWriterThread(writer, limit=16)  # smaller than one tensor: each waits for the previous
    for name, value in tensors.items():
        thread.reserve(value.numel() * 4)
        thread.put(value.numel() * 4, [(name, value)])
    digest, size = thread.finish()
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest() and size == path.stat().st_size
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"step": "3"}
        assert sorted(f.keys()) == sorted(tensors)
        for name, value in tensors.items():
            assert torch.equal(f.get_tensor(name), value)
        assert torch.equal(f.get_slice("a")[:, 1:3], tensors["a"][:, 1:3])


def test_tensor_file_refuses_out_of_order_or_missing_tensors(tmp_path):
    writer = TensorFileWriter(tmp_path / "f.safetensors", [("a", (2,)), ("b", (2,))])
    with pytest.raises(ValueError, match="expected a"):
        writer.write("b", torch.zeros(2))
    writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="1 of 2 tensors written"):
        writer.close()


def test_a_failing_writer_neither_blocks_the_gathering_nor_hides_its_error(tmp_path):
    writer = TensorFileWriter(tmp_path / "f.safetensors", [("a", (2,)), ("b", (4,))])
    thread = FileWriterThread(writer, limit=8)
    thread.reserve(8)
    thread.put(8, [("a", torch.zeros(3))])  # the wrong shape: the writer thread fails
    for _ in range(3):  # would block forever on the full buffer if the failure were not seen
        thread.reserve(16)
        thread.put(16, [("b", torch.zeros(4))])
    with pytest.raises(ValueError, match=r"got a \(3,\)"):
        thread.finish()
