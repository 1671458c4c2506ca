"""The bad-input corpus: what a careless or hostile user types, as one table of (script, arguments, expected exit
status, text the one error line must hold), each run as a real process of launch/*.py in a fresh directory.

Every case must end with exactly one `error:` line holding the expected text, no traceback, the expected exit
status, and nothing written or changed: every file under the case's directory (inputs, an earlier run, an earlier
export or shard set; the process's working directory) is compared, bytes and modification time, before and after.
All cases are single processes that stop before any process group or model exists, so they are in the quick
subset. Multi-process bad inputs (a checkpoint of another model on two ranks): tests/train/test_bad_input.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_dist.data.shards import ShardWriter, shard_files, sidecar_of

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.json")
TRAIN = ["train.py", "--config", DEBUG, "--run-dir", "run", "--set", "train.steps=2"]


def _shard_set(prefix: Path, tokens: np.ndarray, vocab_size: int = 256) -> Path:
    writer = ShardWriter(prefix, "uint16", vocab_size, with_mask=False, shard_tokens=1 << 20)
    for doc in np.array_split(tokens, 10):
        writer.add(doc)
    writer.finish({"name": "bytes", "sha256": "bytes", "vocab_size": vocab_size, "eos_id": 0})
    return sidecar_of(prefix)


def _corpus(n: int = 5000) -> np.ndarray:
    return np.frombuffer((b"def f(x):\n    return x + 1\n" * (n // 27 + 1))[:n], dtype=np.uint8).astype(np.int64)


def _garbage_index(d: Path) -> Path:
    """A shard set whose .idx has the right size but random content (document ends out of range)."""
    side = _shard_set(d / "tok", _corpus())
    idx = shard_files(d / "tok", 0)[1]
    idx.write_bytes(np.random.default_rng(0).integers(0, 2**62, idx.stat().st_size // 8, dtype=np.uint64).tobytes())
    return side


def _decreasing_index(d: Path) -> Path:
    side = _shard_set(d / "tok", _corpus())
    idx = shard_files(d / "tok", 0)[1]
    ends = np.fromfile(idx, dtype=np.uint64)
    ends[3], ends[4] = ends[4], ends[3]
    idx.write_bytes(ends.tobytes())
    return side


def _existing_run(d: Path) -> None:
    (d / "run" / "checkpoints" / "step_1").mkdir(parents=True)
    (d / "run" / "checkpoints" / "step_1" / "meta.json").write_text("{}")
    (d / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')


def _missing_data_extra(d: Path) -> dict:
    """An environment without the [data] extra's `tokenizers`: a package of that name earlier on the path whose
    import fails as a missing module's does (what `pip uninstall tokenizers` leaves, without touching the venv)."""
    pkg = d / "no_extra" / "tokenizers"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'tokenizers'\", name='tokenizers')\n")
    return {"PYTHONPATH": f"{d / 'no_extra'}{os.pathsep}{REPO}"}


def _text(d: Path, name: str, data: bytes) -> str:
    (d / name).write_bytes(data)
    return name


def _memmap(side: Path) -> list[str]:
    return ["data.source=memmap", f'data.paths=["{side}"]']


# id → (setup(d) → (arguments, extra environment), expected exit status, text of the one error line)
CASES = {
    # train.py: the optimizer and the schedule, checked at load (config/checks.py)
    "lr_negative": (lambda d: ([*TRAIN, "train.lr=-0.1"], {}), 2, "train.lr: must be a positive finite number"),
    "lr_zero": (lambda d: ([*TRAIN, "train.lr=0"], {}), 2, "train.lr: must be a positive finite number, got 0.0"),
    "peak_negative": (lambda d: ([*TRAIN, "train.peak_tflops=-1"], {}), 2, "train.peak_tflops: must be null or a"),
    "min_lr_ratio": (lambda d: ([*TRAIN, "train.min_lr_ratio=1.5"], {}), 2, "train.min_lr_ratio: must be in [0, 1]"),
    "beta_one": (lambda d: ([*TRAIN, "train.betas=[0.9,1.0]"], {}), 2, "train.betas[1]: must be in [0, 1), got 1.0"),
    "beta_negative": (lambda d: ([*TRAIN, "train.betas=[-0.1,0.9]"], {}), 2, "train.betas[0]: must be in [0, 1)"),
    "betas_count": (lambda d: ([*TRAIN, "train.betas=[0.9]"], {}), 2, "train.betas: expected two numbers"),
    "adam_eps": (lambda d: ([*TRAIN, "train.adam_eps=0"], {}), 2, "train.adam_eps: must be positive"),
    "weight_decay": (lambda d: ([*TRAIN, "train.weight_decay=-0.1"], {}), 2, "train.weight_decay: must be >= 0"),
    "warmup_negative": (lambda d: ([*TRAIN, "train.warmup_steps=-1"], {}), 2, "train.warmup_steps: must be >= 0"),
    "grad_clip": (lambda d: ([*TRAIN, "train.grad_clip=-1"], {}), 2, "train.grad_clip: must be >= 0"),
    "decay_fraction": (lambda d: ([*TRAIN, "train.decay_fraction=0"], {}), 2, "train.decay_fraction: must be in"),
    "wsd_too_short": (
        lambda d: ([*TRAIN, "train.lr_schedule=wsd", "train.warmup_steps=2"], {}),
        2,
        "wsd needs at least 1 and train.warmup_steps=2 + them <= train.steps",
    ),
    # train.py: the config file and its keys (tests/test_config.py has the in-process forms)
    "malformed_json": (
        lambda d: (["train.py", "--config", _text(d, "bad.json", b'{"train": {"steps": 2,}}')], {}),
        2,
        "invalid JSON at line 1",
    ),
    "missing_config": (lambda d: (["train.py", "--config", "nope.json"], {}), 2, "nope.json"),
    "unknown_key": (lambda d: ([*TRAIN, "train.stepz=2"], {}), 2, "train.stepz: unknown config key (did you mean"),
    "wrong_type": (lambda d: ([*TRAIN, 'train.steps="two"'], {}), 2, "train.steps: expected int"),
    "steps_zero": (lambda d: ([*TRAIN, "train.steps=0"], {}), 2, "train.steps: must be positive"),
    "d_model_zero": (lambda d: ([*TRAIN, "model.d_model=0"], {}), 2, "model.d_model: must be positive"),
    "mixer_letter": (lambda d: ([*TRAIN, "model.mixer_pattern=AX"], {}), 2, "model.mixer_pattern: letters"),
    "profile_step_outside": (lambda d: ([*TRAIN, "train.profile_steps=[9]"], {}), 2, "train.profile_steps: [9]"),
    "val_fraction": (lambda d: ([*TRAIN, "data.val_fraction=1.5"], {}), 2, "data.val_fraction: must be in (0, 1)"),
    "layout_world": (
        lambda d: ([*TRAIN, "parallel.tp=2"], {"WORLD_SIZE": "3"}),
        2,
        "parallel.tp: 2 does not divide the world size 3",
    ),
    # train.py: data and run directory (checked before anything is joined or written)
    "text_missing_file": (
        lambda d: ([*TRAIN, "data.source=text", 'data.paths=["/nonexistent/corpus.txt"]'], {}),
        2,
        "is not an existing file",
    ),
    "text_empty_corpus": (
        lambda d: ([*TRAIN, "data.source=text", f'data.paths=["{_text(d, "empty.txt", b"")}"]'], {}),
        2,
        "has 0 tokens",
    ),
    "memmap_garbage_index": (
        lambda d: ([*TRAIN, *_memmap(_garbage_index(d)), "data.document_masking=true"], {}),
        2,
        "corrupt document index",
    ),
    "memmap_decreasing_index": (
        lambda d: ([*TRAIN, *_memmap(_decreasing_index(d))], {}),
        2,
        "corrupt document index (ends must rise strictly to the shard's 5000 tokens; entry 4",
    ),
    "memmap_ids_beyond_vocab": (
        lambda d: ([*TRAIN, *_memmap(_shard_set(d / "big", (np.arange(5000) * 37) % 50000, 50000))], {}),
        2,
        "outside model.vocab_size=256",
    ),
    "memmap_shard_file": (
        lambda d: ([*TRAIN, *_memmap(shard_files(_shard_set(d / "tok", _corpus()).with_suffix(""), 0)[0])], {}),
        2,
        "a shard's token file, expected the shard set's .json sidecar",
    ),
    "existing_run_without_resume": (
        lambda d: (_existing_run(d) or TRAIN, {}),
        2,
        "already holds a run (metrics.jsonl or checkpoints); pass --resume",
    ),
    "run_dir_is_a_file": (
        lambda d: ([*TRAIN[:4], _text(d, "afile", b"x"), "--resume"], {}),
        2,
        "exists and is not a directory",
    ),
    # prepare_data.py
    "prepare_empty_text": (
        lambda d: (["prepare_data.py", "--input", _text(d, "e.txt", b""), "--output", "out/e"], {}),
        2,
        "hold no text: 1 empty document(s)",
    ),
    "prepare_empty_jsonl": (
        lambda d: (["prepare_data.py", "--input", _text(d, "e.jsonl", b""), "--output", "out/e"], {}),
        2,
        "hold no documents",
    ),
    "prepare_non_utf8_bpe": (
        lambda d: (
            ["prepare_data.py", "--input", _text(d, "ok.txt", b"fine text\n"), _text(d, "bad.txt", b"abc\xff\xfedef")]
            + ["--train-tokenizer", "--vocab-size", "300", "--output", "out/b"],
            {},
        ),
        2,
        "bad.txt: not UTF-8 at byte 3 (invalid start byte)",
    ),
    "prepare_non_utf8_jsonl": (
        lambda d: (
            ["prepare_data.py", "--input", _text(d, "x.jsonl", b'{"text": "ok"}\n{"text": "b\xffd"}\n')]
            + ["--output", "out/j"],
            {},
        ),
        2,
        "x.jsonl: not UTF-8 at byte 26",
    ),
    "prepare_without_data_extra": (
        lambda d: (
            ["prepare_data.py", "--input", _text(d, "t.txt", b"some text\n"), "--output", "out/t"]
            + ["--train-tokenizer", "--vocab-size", "300"],
            _missing_data_extra(d),
        ),
        2,
        "need the [data] extra (module 'tokenizers' is missing): pip install -e '.[data]'",
    ),
    "prepare_output_exists": (
        lambda d: (
            _shard_set(d / "old", _corpus())
            and ["prepare_data.py", "--input", _text(d, "t.txt", b"text\n"), "--output", "old"],
            {},
        ),
        2,
        "already exists, refusing to overwrite (pass --force to replace it)",
    ),
    "prepare_vocab_without_training": (
        lambda d: (["prepare_data.py", "--input", _text(d, "t.txt", b"x"), "--output", "o", "--vocab-size", "300"], {}),
        2,
        "--train-tokenizer and --vocab-size go together",
    ),
    "prepare_bad_json_line": (
        lambda d: (
            ["prepare_data.py", "--input", _text(d, "b.jsonl", b'{"text": "a"}\n{"text": \n'), "--output", "o"],
            {},
        ),
        2,
        "b.jsonl:2: invalid JSON",
    ),
    "prepare_missing_field": (
        lambda d: (["prepare_data.py", "--input", _text(d, "f.jsonl", b'{"body": "a"}\n'), "--output", "o"], {}),
        2,
        "has no string field 'text'",
    ),
    # generate.py: sampling settings are checked before the model is read
    "generate_negative_tokens": (
        lambda d: (["generate.py", "--checkpoint", "ck", "--prompt", "x", "--max-new-tokens", "-5"], {}),
        2,
        "--max-new-tokens: must be at least 1, got -5",
    ),
    "generate_negative_temperature": (
        lambda d: (["generate.py", "--checkpoint", "ck", "--prompt", "x", "--temperature", "-1"], {}),
        2,
        "--temperature: must be >= 0 (0 = greedy), got -1.0",
    ),
    "generate_top_p": (
        lambda d: (["generate.py", "--checkpoint", "ck", "--prompt", "x", "--top-p", "0"], {}),
        2,
        "--top-p: must be in (0, 1]",
    ),
    "generate_top_k": (
        lambda d: (["generate.py", "--checkpoint", "ck", "--prompt", "x", "--top-k", "0"], {}),
        2,
        "--top-k: must be at least 1",
    ),
    "generate_missing_checkpoint": (
        lambda d: (["generate.py", "--checkpoint", "ck", "--prompt", "x"], {}),
        2,
        "ck: neither a checkpoint (no meta.json) nor a run directory",
    ),
    # convert.py
    "export_into_non_empty_dir": (
        lambda d: (["convert.py", "export", "ck", _text(d, "hf", b"") and "."], {}),
        2,
        "not empty (it holds hf); pass --force",
    ),
    "export_missing_checkpoint": (
        lambda d: (["convert.py", "export", "ck", "hf_out"], {}),
        2,
        "ck: neither a checkpoint (no meta.json) nor a run directory",
    ),
}


def _snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(root))] = (digest, st.st_mtime_ns)
    return out


def run_script(forks, args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python launch/<args[0]> args[1:]` in `cwd`, importing this checkout: forked from the session's server
    (tests/forklaunch.py), or a fresh process where the case changes what imports find (PYTHONPATH)."""
    base = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        base.pop(key, None)
    script, env = REPO / "launch" / args[0], {**base, **(env or {})}
    if env["PYTHONPATH"] == base["PYTHONPATH"]:
        return forks.run(1, args[1:], env, None, 300, script=script, cwd=cwd)
    cmd = [sys.executable, str(script), *args[1:]]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, forks, case):
    setup, status, expected = CASES[case]
    args, env = setup(tmp_path)
    before = _snapshot(tmp_path)
    proc = run_script(forks, args, tmp_path, env)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == status, proc.stderr[-3000:]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert _snapshot(tmp_path) == before  # nothing written, nothing changed (also no run directory created)


def test_warmup_longer_than_the_run_is_one_warning_line(tmp_path, forks):
    """train.warmup_steps > train.steps is legal (a smoke run of a long job's config) but the run never reaches
    train.lr: one `warning:` line says so, and the run goes on (here a dry run, exit 0)."""
    proc = run_script(forks, ["train.py", "--config", DEBUG, "--dry-run", "--set", "train.steps=1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: train.")]
    assert warnings == [
        "warning: train.warmup_steps=2 > train.steps=1: the run ends in the warm-up, at lr 0.0015 of train.lr=0.003"
    ]
    assert json.loads(proc.stdout.splitlines()[-1])["params_total"] > 0
