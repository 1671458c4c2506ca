"""Token sources: stdlib and text bytes, the train/validation split, shard sets written by prepare_data.py, and
the one-line errors of bad data paths."""

import json
from pathlib import Path

import numpy as np
import pytest

from moe_dist.config import DataConfig
from moe_dist.data.shards import open_shards
from moe_dist.data.sources import DOC_SEPARATOR, load_tokens
from moe_dist.data.tokenizer import decode, encode

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


def _prepare(forks, *args):
    """`python launch/prepare_data.py ARGS`, forked from the session's server (tests/forklaunch.py)."""
    return forks.script(PREPARE, args)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_prepare_data_round_trip_matches_the_files(corpus, tmp_path, dtype, forks):
    out = tmp_path / "corpus"
    globs = [str(corpus / "*.txt"), str(corpus / "sub" / "*.txt")]
    result = _prepare(forks, "--input", *globs, "--output", str(out), "--dtype", dtype)
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


def test_prepare_data_refuses_to_overwrite(corpus, tmp_path, forks):
    out = tmp_path / "corpus"
    assert _prepare(forks, "--input", str(corpus / "a.txt"), "--output", str(out)).returncode == 0
    before = Path(f"{out}.00000.bin").read_bytes()
    refused = _prepare(forks, "--input", str(corpus / "b.txt"), "--output", str(out))
    assert refused.returncode == 2
    assert len(refused.stderr.strip().splitlines()) == 1 and "--force" in refused.stderr
    assert Path(f"{out}.00000.bin").read_bytes() == before
    forced = _prepare(forks, "--input", str(corpus / "b.txt"), "--output", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert decode(_all(open_shards(f"{out}.json")[0])) == (corpus / "b.txt").read_text(encoding="utf-8") + "\0"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_prepare_data_missing_input_exits_2(tmp_path, forks):
    result = _prepare(forks, "--input", str(tmp_path / "none*.txt"), "--output", str(tmp_path / "x"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "--input" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_memmap_rejects_size_mismatch(corpus, tmp_path, forks):
    out = tmp_path / "t"
    assert _prepare(forks, "--input", str(corpus / "a.txt"), "--output", str(out)).returncode == 0
    shard = Path(f"{out}.00000.bin")
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="implies"):
        open_shards(f"{out}.json")


def test_prepare_data_creates_the_outputs_directories(corpus, tmp_path, forks):
    """The README's `--output data/train` on a fresh clone: the missing directories are made, and a failed job
    leaves none behind."""
    failed = _prepare(
        forks, "--input", str(tmp_path / "none*.txt"), "--output", str(tmp_path / "new" / "data" / "train")
    )
    assert failed.returncode == 2 and not (tmp_path / "new").exists()
    out = tmp_path / "new" / "data" / "train"
    result = _prepare(forks, "--input", str(corpus / "a.txt"), "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert decode(_all(open_shards(f"{out}.json")[0])) == (corpus / "a.txt").read_text(encoding="utf-8") + "\0"
    refused = _prepare(forks, "--input", str(corpus / "b.txt"), "--output", str(out))
    assert refused.returncode == 2 and "--force" in refused.stderr
    (tmp_path / "afile").write_text("x")
    under_a_file = _prepare(
        forks, "--input", str(corpus / "a.txt"), "--output", str(tmp_path / "afile" / "d" / "train")
    )
    assert under_a_file.returncode == 2
    assert under_a_file.stderr.strip().splitlines() == [
        f"prepare_data.py: error: --output: {tmp_path / 'afile'} is not a directory"
    ]


def _bad_path(case: str, corpus: Path, tmp_path: Path, forks) -> tuple[Path, str]:
    """(a wrong data.paths entry, what the error must say besides the file) for one case."""
    out = tmp_path / "train"
    assert _prepare(forks, "--input", str(corpus / "a.txt"), "--output", str(out)).returncode == 0
    if case == "mask":  # a fine-tuning set's loss mask (this set has none: a stand-in of that name)
        Path(f"{out}.00000.mask").write_bytes(b"\x01" * 8)
    if case in ("bin", "idx", "mask"):
        return Path(f"{out}.00000.{case}"), f"expected the shard set's .json sidecar ({out}.json)"
    if case == "binary":
        (tmp_path / "blob.json").write_bytes(b"\x1f\x8b\x08\x00\xff\xfe\x00")  # gzip-like bytes, not UTF-8
        return tmp_path / "blob.json", "a binary file, not JSON (expected the .json sidecar of a shard set"
    if case == "other_json":
        (tmp_path / "config.json").write_text('{"model": {"d_model": 64}}')
        return tmp_path / "config.json", "not a shard-set sidecar"
    if case == "missing":
        return tmp_path / "nowhere.json", "is not an existing file (expected a shard set's .json sidecar"
    raise ValueError(case)


BAD_PATHS = ["bin", "idx", "mask", "binary", "other_json", "missing"]


@pytest.mark.parametrize("case", BAD_PATHS)
def test_a_wrong_data_path_names_the_file_and_what_was_expected(corpus, tmp_path, case, forks):
    path, expected = _bad_path(case, corpus, tmp_path, forks)
    with pytest.raises(ValueError) as info:
        load_tokens(DataConfig(source="memmap", paths=[str(path)]), seq_len=8)
    message = str(info.value)
    assert message.startswith("data.paths: ") and str(path) in message and expected in message, message
    assert "\n" not in message
