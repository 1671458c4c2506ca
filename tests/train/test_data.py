"""Data pipeline: sources, split, determinism in (seed, step), the micro-batch rule and prepare_data.py."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_dist.config import DataConfig
from moe_dist.data.shards import open_shards
from moe_dist.train.data import DOC_SEPARATOR, TokenDataset, decode, encode, load_tokens, micro_batches

REPO = Path(__file__).resolve().parents[2]
PREPARE = REPO / "launch" / "prepare_data.py"


@pytest.fixture
def corpus(tmp_path):
    """Three small text files in two directories; sorted glob order is a, b (then sub/c)."""
    (tmp_path / "sub").mkdir()
    texts = {"b.txt": "second file ü\n", "a.txt": "first file\n" * 50, "sub/c.txt": "third\n" * 30}
    for name, text in texts.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def _all(stream) -> np.ndarray:
    """Every token of a Stream, in order."""
    return stream.gather(np.arange(len(stream)))[0]


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


def test_stdlib_source_loads_python_source():
    train, val, _ = load_tokens(DataConfig(source="stdlib", max_bytes=400_000), seq_len=64)
    assert len(train) + len(val) == 400_000
    assert len(val) == int(400_000 * 0.05)
    text = decode(_all(train)[:200_000])
    assert "def " in text and "import " in text and "class " in text
    assert chr(DOC_SEPARATOR) in text  # several files were concatenated


def test_text_source_globs_sorted_and_split(corpus):
    cfg = DataConfig(
        source="text", paths=[str(corpus / "*.txt"), str(corpus / "sub" / "c.txt")], val_fraction=0.1, max_bytes=None
    )
    train, val, _ = load_tokens(cfg, seq_len=8)
    stream = np.concatenate([_all(train), _all(val)])
    sep = chr(DOC_SEPARATOR)
    expected = sep.join((corpus / n).read_text(encoding="utf-8") for n in ("a.txt", "b.txt", "sub/c.txt"))
    assert decode(stream) == expected
    assert np.array_equal(_all(val), stream[len(stream) - int(len(stream) * 0.1) :])
    capped, _, _ = load_tokens(DataConfig(source="text", paths=cfg.paths, max_bytes=100), seq_len=4)
    assert len(capped) == 100 - int(100 * 0.05)


@pytest.mark.parametrize("paths", [["missing.txt"], ["nowhere/*.txt"]])
def test_missing_paths_name_the_config_key(tmp_path, paths):
    cfg = DataConfig(source="text", paths=[str(tmp_path / p) for p in paths])
    with pytest.raises(ValueError, match=r"^data\.paths: .*(missing\.txt|nowhere)") as info:
        load_tokens(cfg)
    assert "\n" not in str(info.value)


def test_too_short_stream_is_a_clear_error(corpus):
    cfg = DataConfig(source="text", paths=[str(corpus / "b.txt")])
    with pytest.raises(ValueError, match="train.seq_len"):
        load_tokens(cfg, seq_len=64)


def _prepare(*args):
    return subprocess.run([sys.executable, str(PREPARE), *args], capture_output=True, text=True, cwd=REPO)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_prepare_data_round_trip_matches_the_files(corpus, tmp_path, dtype):
    out = tmp_path / "corpus"
    globs = [str(corpus / "*.txt"), str(corpus / "sub" / "*.txt")]
    result = _prepare("--input", *globs, "--output", str(out), "--dtype", dtype)
    assert result.returncode == 0, result.stderr
    meta = json.loads(Path(f"{out}.json").read_text())
    assert meta["dtype"] == dtype and meta["vocab_size"] == 256 and meta["eos_id"] == 0
    assert meta["tokenizer"]["sha256"] == "bytes" and meta["num_documents"] == 3
    # Every document, EOS (NUL) after each: the bytes of a, b, sub/c in the order of the globs.
    expected = "".join((corpus / n).read_text(encoding="utf-8") + "\0" for n in ("a.txt", "b.txt", "sub/c.txt"))
    stream, _ = open_shards(f"{out}.json")
    assert stream.pieces[0].tokens.dtype == np.dtype(dtype)
    assert decode(_all(stream)) == expected
    train, val, _ = load_tokens(DataConfig(source="memmap", paths=[f"{out}.json"]), seq_len=8)
    assert np.array_equal(np.concatenate([_all(train), _all(val)]), encode(expected))


def test_prepare_data_refuses_to_overwrite(corpus, tmp_path):
    out = tmp_path / "corpus"
    assert _prepare("--input", str(corpus / "a.txt"), "--output", str(out)).returncode == 0
    before = Path(f"{out}.00000.bin").read_bytes()
    refused = _prepare("--input", str(corpus / "b.txt"), "--output", str(out))
    assert refused.returncode == 2
    assert len(refused.stderr.strip().splitlines()) == 1 and "--force" in refused.stderr
    assert Path(f"{out}.00000.bin").read_bytes() == before
    forced = _prepare("--input", str(corpus / "b.txt"), "--output", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert decode(_all(open_shards(f"{out}.json")[0])) == (corpus / "b.txt").read_text(encoding="utf-8") + "\0"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_prepare_data_missing_input_exits_2(tmp_path):
    result = _prepare("--input", str(tmp_path / "none*.txt"), "--output", str(tmp_path / "x"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "--input" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_memmap_rejects_size_mismatch(corpus, tmp_path):
    out = tmp_path / "t"
    assert _prepare("--input", str(corpus / "a.txt"), "--output", str(out)).returncode == 0
    shard = Path(f"{out}.00000.bin")
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="implies"):
        open_shards(f"{out}.json")


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


def test_decode_round_trips_and_replaces_invalid_utf8():
    assert decode(torch.from_numpy(encode("héllo").astype(np.int64))) == "héllo"
    assert decode([0xFF, 0x41]) == "\ufffdA"
    with pytest.raises(ValueError):
        decode([300])
