"""A shard's document index is checked when its set is opened: ends rising strictly to the shard's token count,
also across the chunks the check reads (tests/test_bad_inputs.py runs the same through launch/train.py)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_dist.data import shards
from moe_dist.data.shards import ShardWriter, open_shards, shard_files, sidecar_of


def _set(tmp_path, docs: int = 10, length: int = 7):
    writer = ShardWriter(tmp_path / "s", "uint16", 256, with_mask=False, shard_tokens=1 << 20)
    for _ in range(docs):
        writer.add(np.arange(length) % 200 + 1)
    writer.finish({"name": "bytes", "sha256": "bytes", "vocab_size": 256, "eos_id": 0})
    return sidecar_of(tmp_path / "s"), shard_files(tmp_path / "s", 0)[1]


@pytest.mark.parametrize("chunk", [3, 4, 1 << 22])
def test_a_good_index_opens_whatever_the_chunk(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(shards, "INDEX_CHECK_CHUNK", chunk)
    side, _ = _set(tmp_path)
    stream, meta = open_shards(side)
    assert len(stream) == meta["num_tokens"] == 70


@pytest.mark.parametrize(
    "edit, where",
    [
        (lambda e: e.__setitem__(4, e[3]), "entry 4 is 28"),  # a repeated end: an empty document
        (lambda e: e.__setitem__(3, 40), "entry 4 is 35"),  # a step back, just after a chunk boundary (chunk 4)
        (lambda e: e.__setitem__(9, 69), "the last is 69"),  # short of the shard's tokens
        (lambda e: e.__setitem__(0, 2**63 + 5), "entry 0 is"),  # beyond int64: garbage
    ],
)
def test_a_corrupt_index_is_refused_naming_the_file(tmp_path, monkeypatch, edit, where):
    monkeypatch.setattr(shards, "INDEX_CHECK_CHUNK", 4)
    side, idx = _set(tmp_path)
    ends = np.fromfile(idx, dtype=np.uint64)
    edit(ends)
    idx.write_bytes(ends.tobytes())
    with pytest.raises(ValueError, match="corrupt document index") as e:
        open_shards(side)
    assert str(idx) in str(e.value) and where in str(e.value) and "\n" not in str(e.value)
