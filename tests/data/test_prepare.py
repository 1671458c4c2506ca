"""Tokenizing into shard sets: Hugging Face tokenizers built locally, JSONL/Parquet inputs, workers, determinism,
shards, bad input; and reading shard sets back (tokenizer checks, mixtures, per-rank micro-batches)."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from moe_dist.config import DataConfig, MixtureComponent
from moe_dist.data.batches import TokenDataset, micro_batches
from moe_dist.data.shards import open_shards, sidecar_of
from moe_dist.data.sources import load_tokens
from moe_dist.data.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
PREPARE = REPO / "launch" / "prepare_data.py"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) + "." for _ in range(n)]


def _run(forks, *args):
    """`python launch/prepare_data.py ARGS`, forked from the session's server (tests/forklaunch.py)."""
    return forks.script(PREPARE, args)


def _ok(forks, *args):
    """`_run` that must succeed."""
    r = _run(forks, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _all(stream):
    return stream.gather(np.arange(len(stream)))


@pytest.fixture
def jsonl(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    docs = _docs(300)
    (src / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return src / "docs.jsonl", docs


def test_trained_bpe_round_trips_documents_and_is_deterministic(tmp_path, jsonl, forks):
    path, docs = jsonl
    outs = []
    for workers in (1, 2):
        d = tmp_path / "out"  # the same output path both times: the sidecar names the tokenizer by its path
        d.mkdir()
        r = _run(forks, "--input", path, "--output", d / "train", "--train-tokenizer", "--vocab-size", 300,
                 "--workers", workers, "--shard-tokens", 500)  # fmt: skip
        assert r.returncode == 0, r.stderr
        outs.append(d.rename(tmp_path / f"w{workers}"))
    # Same inputs → the same bytes, whatever the number of workers (tokenizer included).
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(p.name for p in outs[1].iterdir()) and "tokenizer.json" in names
    assert all((outs[0] / n).read_bytes() == (outs[1] / n).read_bytes() for n in names)
    meta = json.loads((outs[0] / "train.json").read_text())
    tok_bytes = (outs[0] / "tokenizer.json").read_bytes()
    assert meta["tokenizer"]["sha256"] == hashlib.sha256(tok_bytes).hexdigest()
    tok = load_tokenizer(str(outs[0]))  # the directory: tokenizer.json + tokenizer_config.json naming EOS
    assert meta["vocab_size"] == tok.vocab_size == 300 and meta["eos_id"] == tok.eos_id
    assert len(meta["shards"]) > 3 and meta["num_documents"] == len(docs)
    stream, _ = open_shards(outs[0] / "train.json")
    tokens, doc_numbers, mask = _all(stream)
    assert mask is None
    # Every document is its text + EOS, and no document straddles a shard.
    ends = np.flatnonzero(tokens == tok.eos_id) + 1
    pieces = np.split(tokens, ends[:-1])
    assert [tok.decode(p[:-1].tolist()) for p in pieces] == docs
    assert len(np.unique(doc_numbers)) == len(docs)
    for p in stream.pieces:
        assert p.tokens[-1] == tok.eos_id and int(p.doc_ends[-1]) == len(p.tokens)


def test_parquet_and_hf_directory_tokenizer(tmp_path, jsonl, forks):
    path, docs = jsonl
    assert (
        _run(forks, "--input", path, "--output", tmp_path / "bpe", "--train-tokenizer", "--vocab-size", 280).returncode
        == 0
    )
    table = pa.table({"body": docs[:50], "n": list(range(50))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=16)
    r = _run(
        forks,
        "--input",
        tmp_path / "d.parquet",
        "--column",
        "body",
        "--tokenizer",
        tmp_path,
        "--output",
        tmp_path / "pq",
    )
    assert r.returncode == 0, r.stderr
    assert "tokens/s on 1 worker(s)" in r.stdout
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    tokens = _all(open_shards(tmp_path / "pq.json")[0])[0]
    expected = np.concatenate([np.asarray(tok.encode(d) + [tok.eos_id]) for d in docs[:50]])
    assert np.array_equal(tokens, expected)


def _wordlevel(path: Path, n: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(n)} | {"</s>": n}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@pytest.mark.parametrize("case", ["missing_field", "empty_input", "bad_tokenizer", "vocab_too_large", "bad_json"])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(tmp_path, jsonl, case, forks):
    path, _ = jsonl
    out = tmp_path / "out"
    _ok(forks, "--input", path, "--output", out)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    args, fragment = {
        "missing_field": (["--input", path, "--field", "body"], "has no string field 'body'"),
        "empty_input": (["--input", tmp_path / "empty.jsonl"], "hold no documents"),
        "bad_tokenizer": (["--input", path, "--tokenizer", tmp_path / "tok.json"], "does not load"),
        "vocab_too_large": (
            ["--input", path, "--tokenizer", _wordlevel(tmp_path / "big.json", 70000), "--dtype", "uint16"],
            "does not fit uint16",
        ),
        "bad_json": (["--input", path, tmp_path / "broken.jsonl"], "broken.jsonl:2: invalid JSON"),
    }[case]
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "tok.json").write_text('{"version": "1.0", "model": 42}')
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    before.update({p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name not in before})
    r = _run(forks, *args, "--output", out, "--force")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and fragment in r.stderr, r.stderr
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == before  # the old shard set is intact, nothing was added, no staging left behind
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_set_without_its_sidecar_is_never_read(tmp_path, jsonl, forks):
    """What an interrupted run can leave: shards but no sidecar (prepare publishes the sidecar last)."""
    path, _ = jsonl
    _ok(forks, "--input", path, "--output", tmp_path / "x", "--shard-tokens", 1000)
    sidecar_of(tmp_path / "x").unlink()
    with pytest.raises(ValueError, match=r"^data\.paths: .*x\.json. is not an existing file"):
        load_tokens(DataConfig(source="memmap", paths=[str(tmp_path / "x.json")]), 8)


def _bpe_set(tmp_path: Path, jsonl_path: Path, forks) -> Path:
    _ok(forks, "--input", jsonl_path, "--output", tmp_path / "bpe", "--train-tokenizer", "--vocab-size", 300)
    return tmp_path / "bpe.json"


def test_reading_checks_tokenizer_and_vocabulary(tmp_path, jsonl, forks):
    side = _bpe_set(tmp_path, jsonl[0], forks)
    cfg = DataConfig(source="memmap", paths=[str(side)])
    with pytest.raises(ValueError, match=r"^data\.paths: .* was tokenized with .*set data\.tokenizer") as e:
        load_tokens(cfg, 8, vocab_size=512)  # the run says bytes
    assert "\n" not in str(e.value)
    cfg.tokenizer = str(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"300-token vocabulary, outside model\.vocab_size=256"):
        load_tokens(cfg, 8, vocab_size=256)
    train, val, _ = load_tokens(cfg, 8, vocab_size=320)
    assert len(train) + len(val) == json.loads(side.read_text())["num_tokens"]
    cfg.tokenizer = str(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=r"^data\.tokenizer: .*missing\.json not found"):
        load_tokens(cfg, 8, vocab_size=320)


def test_mixture_is_deterministic_weighted_and_split_per_rank(tmp_path, forks):
    (tmp_path / "a.txt").write_text("a" * 5000)
    (tmp_path / "b.txt").write_text("b" * 5000)
    for name in ("a", "b"):
        _ok(forks, "--input", tmp_path / f"{name}.txt", "--output", tmp_path / name)
    cfg = DataConfig(
        source="memmap",
        mixture=[MixtureComponent([str(tmp_path / "a.json")], 3.0), MixtureComponent([str(tmp_path / "b.json")], 1.0)],
    )
    train, val, weights = load_tokens(cfg, 16)
    ds = TokenDataset(train, 16, seed=5, weights=weights)
    rows = torch.cat([ds.global_batch(s, 32) for s in range(20)])  # (640, 17)
    from_a = (rows == ord("a")).all(dim=1)
    assert ((rows == ord("b")).all(dim=1) | from_a).all()  # a window never mixes components
    assert 0.65 < from_a.float().mean().item() < 0.85  # 3 : 1
    assert torch.equal(TokenDataset(train, 16, seed=5, weights=weights).global_batch(7, 32), ds.global_batch(7, 32))
    # Each rank gathers only its rows, and together they are the global batch in the layout-independent order.
    full = ds.global_batch(3, 8)
    for dp in (1, 2, 4):
        for r in range(dp):
            mine = [b.tokens for b in ds.micro_batches(3, 8, 2, r, dp)]
            assert all(torch.equal(a, b) for a, b in zip(mine, micro_batches(full, 2, r, dp)))
    assert len(val) == 2 * int(5001 * 0.05)


def test_document_ids_and_targets_of_packed_documents(tmp_path, forks):
    docs = ["x" * 5, "y" * 3, "z" * 30]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d)
    assert (
        _run(forks, "--input", *(tmp_path / f"{i}.txt" for i in range(3)), "--output", tmp_path / "p").returncode == 0
    )
    stream, _ = open_shards(tmp_path / "p.json")
    ds = TokenDataset(stream, 12, seed=0, document_masking=True)
    (batch,) = ds.eval_batches(1, 1, 0, 1)  # the first window: xxxxx\0 yyy\0 zzzzz
    assert batch.document_ids[0].tolist() == [0] * 6 + [1] * 4 + [2] * 3
    targets = batch.targets()[0].tolist()
    # No target predicts a document's first token from the previous document's EOS.
    assert targets[5] == -100 and targets[9] == -100 and targets[4] == 0 and targets[6] == ord("y")
    assert sum(t == -100 for t in targets) == 2


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_fine_tuning_data_masks_the_prompt(tmp_path, jsonl, forks):
    path, _ = jsonl
    assert (
        _run(forks, "--input", path, "--output", tmp_path / "bpe", "--train-tokenizer", "--vocab-size", 300).returncode
        == 0
    )
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    records = [
        {"prompt": "alpha beta?", "completion": " gamma delta."},
        {"messages": [{"role": "user", "content": "mu?"}, {"role": "assistant", "content": "eta theta."}]},
    ]
    (tmp_path / "ft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    r = _run(forks, "--input", tmp_path / "ft.jsonl", "--sft", "--tokenizer", tmp_path, "--output", tmp_path / "ft")
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "ft.json").read_text())
    assert meta["loss_mask"] and meta["shards"][0]["mask"] == "ft.00000.mask"
    tok = load_tokenizer(str(tmp_path))
    tokens, _, mask = _all(open_shards(tmp_path / "ft.json")[0])
    ends = np.flatnonzero(tokens == tok.eos_id) + 1
    (t0, t1), (m0, m1) = np.split(tokens, ends[:-1]), np.split(mask, ends[:-1])
    # The loss mask covers the completion and its EOS, never the prompt; the chat prompt ends with the template's
    # generation prompt.
    assert tok.decode(t0[~m0].tolist()) == "alpha beta?" and tok.decode(t0[m0][:-1].tolist()) == " gamma delta."
    assert tok.decode(t1[~m1].tolist()) == "<|user|>mu?\n<|assistant|>"
    assert tok.decode(t1[m1][:-1].tolist()) == "eta theta.\n" and m1[-1] and t1[-1] == tok.eos_id
    # Training targets: only completion tokens; prefix-LM's prompt = the inputs that are prompt tokens.
    ds = TokenDataset(open_shards(tmp_path / "ft.json")[0], len(t0) - 1, seed=0, document_masking=True)
    (batch,) = ds.eval_batches(1, 1, 0, 1)  # exactly the first document
    targets = batch.targets()[0]
    assert (targets != -100).sum() == m0[1:].sum() and torch.equal(batch.prefix()[0], torch.from_numpy(~m0[:-1]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "no reply"}]}) + "\n")
    r = _run(forks, "--input", bad, "--sft", "--tokenizer", tmp_path, "--output", tmp_path / "bad")
    assert r.returncode == 2 and "bad.jsonl:1: the last message must be the assistant's" in r.stderr


def test_a_killed_run_leaves_the_previous_set_as_it_was(tmp_path, jsonl, forks):
    """SIGKILL while shards are being written: the previous shard set under the prefix is still the one read,
    byte for byte, and nothing of the new run is visible under the final names."""
    import os
    import signal
    import time

    path, _ = jsonl
    _ok(forks, "--input", path, "--output", tmp_path / "x")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(20000, seed=1)))
    proc = subprocess.Popen(
        [
            sys.executable,
            str(PREPARE),
            "--input",
            str(big),
            "--output",
            str(tmp_path / "x"),
            "--force",
            "--shard-tokens",
            "2000",
        ],  # fmt: skip
        cwd=REPO,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".x.staging.*/x.00001.bin")):  # two shards written: the run is mid-way
        assert proc.poll() is None and time.monotonic() < deadline, "prepare_data.py ended before it could be killed"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != "big.jsonl"}
    assert after == before
    stream, meta = open_shards(tmp_path / "x.json")
    assert meta["num_documents"] == 300 and len(stream) == meta["num_tokens"]


def test_documents_start_with_the_tokenizers_bos_and_end_with_one_eos(tmp_path, forks):
    """A Llama/Mixtral-style tokenizer (post-processor adding <s>): every document starts with BOS, as the model
    saw in pretraining, and ends with exactly one EOS; for fine-tuning data the BOS is part of the prompt."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "alpha beta"}) + "\n" + json.dumps({"text": "mu"}) + "\n")
    (tmp_path / "ft.jsonl").write_text(json.dumps({"prompt": "alpha", "completion": "beta gamma"}) + "\n")
    assert (
        _run(forks, "--input", tmp_path / "d.jsonl", "--tokenizer", tmp_path, "--output", tmp_path / "d").returncode
        == 0
    )
    assert _all(open_shards(tmp_path / "d.json")[0])[0].tolist() == [1, 3, 4, 2, 1, 14, 2]
    r = _run(forks, "--input", tmp_path / "ft.jsonl", "--sft", "--tokenizer", tmp_path, "--output", tmp_path / "ft")
    assert r.returncode == 0, r.stderr
    tokens, _, mask = _all(open_shards(tmp_path / "ft.json")[0])
    assert tokens.tolist() == [1, 3, 4, 5, 2] and mask.tolist() == [False, False, True, True, True]


def test_replacing_a_set_leaves_a_set_with_a_longer_prefix_alone(tmp_path, jsonl, forks):
    path, _ = jsonl
    _ok(forks, "--input", path, "--output", tmp_path / "x.v2", "--shard-tokens", 1000)
    v2 = {p.name: p.read_bytes() for p in tmp_path.glob("x.v2*")}
    _ok(forks, "--input", path, "--output", tmp_path / "x", "--shard-tokens", 1000)
    _ok(forks, "--input", path, "--output", tmp_path / "x", "--shard-tokens", 4000, "--force")
    assert {p.name: p.read_bytes() for p in tmp_path.glob("x.v2*")} == v2
    meta = json.loads((tmp_path / "x.json").read_text())
    listed = {f for s in meta["shards"] for f in (s["tokens"], s["index"])}
    assert {p.name for p in tmp_path.glob("x.0*")} == listed  # the stale shards of the first x are gone


def test_aligned_windows_start_at_document_starts(tmp_path, forks):
    docs = [("x" * int(n)) for n in np.random.default_rng(0).integers(5, 80, size=60)]
    for i, d in enumerate(docs):
        (tmp_path / f"{i:02d}.txt").write_text(d)
    assert (
        _run(forks, "--input", str(tmp_path / "*.txt"), "--output", tmp_path / "p", "--shard-tokens", 500).returncode
        == 0
    )
    stream, _ = open_shards(tmp_path / "p.json")
    tokens = _all(stream)[0]
    starts_of_docs = set(np.concatenate([[0], np.flatnonzero(tokens == 0) + 1]).tolist())
    plain = TokenDataset(stream, 16, seed=1)
    aligned = TokenDataset(stream, 16, seed=1, align_to_documents=True)
    s_plain, s_aligned = plain._starts(3, 64), aligned._starts(3, 64)
    assert set(s_aligned.tolist()) <= starts_of_docs and not set(s_plain.tolist()) <= starts_of_docs
    # Each aligned start is the start of the document its unaligned draw fell in.
    assert all(a <= p and not (starts_of_docs & set(range(a + 1, p + 1))) for a, p in zip(s_aligned, s_plain))
    assert torch.equal(aligned.global_batch(3, 64)[:, 0], torch.full((64,), ord("x")))
