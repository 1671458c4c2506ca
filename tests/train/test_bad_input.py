"""Bad input: each is a one-line error naming the problem, exit status 2, and nothing already in the run
directory changes (every file's bytes and modification time are compared before and after).

Inputs rejected before any process group exists run launch/train.py's main() in this process (fast, not slow);
a checkpoint that does not fit needs the model and the process group, so those cases launch real processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support import free_port

from moe_dist.data.shards import ShardWriter, sidecar_of

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
CONFIG = "configs/debug.json"
SMALL = ["train.steps=2", "train.save_every=1", "train.eval_every=0"]

PRE_INIT = [
    "malformed_json",
    "unknown_key",
    "wrong_type",
    "wrong_type_in_file",
    "missing_data_path",
    "empty_corpus",
    "memmap_unknown_dtype",
    "memmap_read_with_wrong_dtype",
    "memmap_ids_beyond_vocab",
    "memmap_path_is_a_shard_file",
    "run_dir_under_a_file",
    "run_dir_is_a_file",
    "existing_run_without_resume",
    "checkpoints_without_resume",
    "mamba2_heads_tp_cannot_split",
]
CHECKPOINT = ["checkpoint_of_another_model_shape", "checkpoint_of_another_data_order"]


def _run(forks, args: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    """launch/train.py in `nproc` processes forked from the session's server (tests/forklaunch.py)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return forks.run(nproc, [str(a) for a in args], env, free_port() if nproc > 1 else None, 300)


def _snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = p.stat()
        out[str(p.relative_to(root))] = (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir",
            st.st_size if p.is_file() else 0,
            st.st_mtime_ns,
        )
    return out


def _fake_run(run: Path) -> Path:
    """What pre-init checks see of a finished run: its files (contents are never read by them)."""
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "checkpoints" / "step_1" / "meta.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (run / "config.json").write_text("{}")
    return run


@pytest.fixture(scope="module")
def existing(tmp_path_factory, debug_run):
    """A finished run (a copy of the session's single-process configs/debug.json run): what a bad input must
    leave untouched."""
    run = tmp_path_factory.mktemp("existing") / "run"
    shutil.copytree(debug_run("python"), run)
    assert {p.name for p in (run / "checkpoints").iterdir()} == {"step_3", "step_6"}
    return run


def _memmap(prefix: Path, tokens: np.ndarray, dtype: str = "uint16", vocab_size: int = 256) -> Path:
    """A one-shard, one-document shard set of `tokens`; returns its sidecar."""
    writer = ShardWriter(prefix, dtype, vocab_size, with_mask=False, shard_tokens=1 << 20)
    writer.add(tokens)
    writer.finish({"name": "bytes", "sha256": "bytes", "vocab_size": vocab_size, "eos_id": 0})
    return sidecar_of(prefix)


def _text_corpus(n: int = 5000) -> np.ndarray:
    return np.frombuffer((b"def f(x):\n    return x + 1\n" * (n // 27 + 1))[:n], dtype=np.uint8).astype(np.int64)


def _case_inputs(case: str, tmp: Path) -> tuple[list[str], str]:
    """(extra command-line arguments, expected fragment of the error) for one bad input."""
    if case == "malformed_json":
        bad = tmp / "bad.json"
        bad.write_text('{"train": {"steps": 2,}}')
        return ["--config", str(bad)], "invalid JSON at line 1"
    if case == "unknown_key":
        return ["--set", "train.stepz=2"], "train.stepz: unknown config key (did you mean 'train.steps'?)"
    if case == "wrong_type":
        return ["--set", 'train.steps="two"'], "train.steps: expected int"
    if case == "wrong_type_in_file":
        cfg = json.loads((REPO / CONFIG).read_text())
        cfg["model"]["d_model"] = "64"
        f = tmp / "typed.json"
        f.write_text(json.dumps(cfg))
        return ["--config", str(f)], "model.d_model: expected int"
    if case == "missing_data_path":
        return ["--set", "data.source=text", 'data.paths=["/nonexistent/corpus.txt"]'], "is not an existing file"
    if case == "empty_corpus":
        (tmp / "empty.txt").write_text("")
        return ["--set", "data.source=text", f'data.paths=["{tmp / "empty.txt"}"]'], "has 0 tokens"
    if case == "memmap_unknown_dtype":
        f = _memmap(tmp / "tokens", _text_corpus())
        f.write_text(json.dumps({**json.loads(f.read_text()), "dtype": "float32"}))
        return ["--set", "data.source=memmap", f'data.paths=["{f}"]'], "needs 'dtype' in ['uint16', 'uint32']"
    if case == "memmap_read_with_wrong_dtype":  # written as uint32, sidecar claims uint16
        f = _memmap(tmp / "tokens", _text_corpus(), "uint32")
        f.write_text(json.dumps({**json.loads(f.read_text()), "dtype": "uint16"}))
        return ["--set", "data.source=memmap", f'data.paths=["{f}"]'], f"bytes, {f} implies"
    if case == "memmap_ids_beyond_vocab":  # e.g. tokens of a 50k-word tokenizer given to a byte-level model
        f = _memmap(tmp / "tokens", (np.arange(5000) * 37) % 50000, vocab_size=50000)
        return ["--set", "data.source=memmap", f'data.paths=["{f}"]'], "outside model.vocab_size=256"
    if case == "memmap_path_is_a_shard_file":  # data.paths names a shard's .bin instead of the set's sidecar
        f = _memmap(tmp / "tokens", _text_corpus())
        shard = tmp / "tokens.00000.bin"
        return ["--set", "data.source=memmap", f'data.paths=["{shard}"]'], (
            f"data.paths: {shard}: a shard's token file, expected the shard set's .json sidecar ({f})"
        )
    if case == "checkpoint_of_another_model_shape":
        return ["--resume", "--set", "model.d_model=32"], "written for a different model shape"
    if case == "checkpoint_of_another_data_order":
        return ["--resume", "--set", "train.seed=1"], "resuming would repeat or skip samples"
    if case == "run_dir_under_a_file":
        (tmp / "afile").write_text("x")
        return ["--run-dir", str(tmp / "afile" / "run")], "cannot create the run directory"
    if case == "run_dir_is_a_file":
        (tmp / "afile").write_text("x")
        return ["--run-dir", str(tmp / "afile"), "--resume"], "exists and is not a directory"
    if case == "existing_run_without_resume":
        return [], "already holds a run (metrics.jsonl or checkpoints); pass --resume"
    if case == "checkpoints_without_resume":  # e.g. a run whose metrics.jsonl was deleted
        (tmp / "existing" / "metrics.jsonl").unlink()
        return [], "already holds a run (metrics.jsonl or checkpoints); pass --resume"
    if case == "mamba2_heads_tp_cannot_split":
        layers = '["mamba2+mlp","gdn+moe","attention+moe","mamba2+moe"]'
        tiny = ["model.mamba2.n_heads=3", "model.mamba2.head_dim=16", "model.mamba2.n_groups=1"]
        patterns = ["model.mixer_pattern=A", "model.ffn_pattern=E", f"model.layers={layers}"]
        return ["--set", *patterns, *tiny, "model.attention.n_kv_heads=4", "parallel.tp=2"], (
            "model.mamba2.n_heads: the 3 Mamba-2 heads"
        )
    raise ValueError(case)


def _arguments(case: str, tmp: Path, run_dir: Path) -> tuple[list[str], str]:
    extra, expected = _case_inputs(case, tmp)
    args = ["--config", CONFIG, "--run-dir", str(run_dir), "--set", *SMALL]
    # A case's --config / --run-dir replaces the default; its --set items join the one --set list.
    if "--set" in extra:
        i = extra.index("--set")
        args, extra = [*args, *extra[i + 1 :]], extra[:i]
    if "--resume" in extra:
        extra.remove("--resume")
        args.append("--resume")
    for flag in ("--config", "--run-dir"):
        if flag in extra:
            i = extra.index(flag)
            args[args.index(flag) + 1] = extra[i + 1]
    return args, expected


def _check_one_line(stderr: str, expected: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr
    return errors[0]


@pytest.mark.parametrize("case", PRE_INIT)
def test_bad_input_before_start_up(tmp_path, capsys, case):
    run = _fake_run(tmp_path / "existing")
    args, expected = _arguments(case, tmp_path, run)
    main = runpy.run_path(TRAIN)["main"]
    before = _snapshot(run)
    assert main(args) == 2
    line = _check_one_line(capsys.readouterr().err, expected)
    assert _snapshot(run) == before
    print(f"{case}: {line[:200]}")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [*CHECKPOINT, "missing_data_path", "memmap_path_is_a_shard_file"])
def test_bad_input_in_a_real_process(tmp_path, existing, case, forks):
    """Real processes: the exit status, and the checkpoint cases (they build the model and join a group)."""
    args, expected = _arguments(case, tmp_path, existing)
    before = _snapshot(existing)
    proc = _run(forks, args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _check_one_line(proc.stderr, expected)
    assert _snapshot(existing) == before
    print(f"\n{case}: {line[:200]}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_of_another_model_fails_every_rank_without_hanging(existing, tmp_path, forks):
    run = tmp_path / "run"
    shutil.copytree(existing, run)
    before = _snapshot(run)
    proc = _run(
        forks, ["--config", CONFIG, "--run-dir", str(run), "--resume", "--set", *SMALL, "model.n_layers=2"], nproc=2
    )
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0
    assert errors and all("different model" in line for line in errors), out[-3000:]
    assert _snapshot(run) == before


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (2, ["train.global_batch_size=2"], "train.global_batch_size: 2 gives 1 micro-batches per pipeline, fewer than"),
        (2, ["parallel.pp_virtual=2", "train.global_batch_size=10"], "is not a multiple of the interleaved schedule"),
        (4, ["parallel.cp=2"], "parallel.pp: 2 does not run with parallel.cp=2 yet"),
        (2, ["train.compile=true"], "parallel.pp: 2 does not run with train.compile=true yet"),
        (
            2,
            ["model.moe.aux_loss_scope=global_batch", "model.moe.global_batch_load=this_step"],
            "model.moe.global_batch_load: 'this_step' needs a routing pre-pass of the whole step",
        ),
        (3, [], "parallel.pp: 2 does not divide the world size 3"),
        (
            4,
            ["parallel.pp_virtual=2", "model.mixer_pattern=A", "model.ffn_pattern=E"]
            + ['model.layers=["attention+moe","mlp","mlp","mlp"]'],
            "parallel.pp: 4 stages of model.n_layers=4 cannot be cut evenly enough",
        ),
    ],
    ids=["too-few-micro-batches", "interleaved-rounds", "cp", "compile", "this-step-load", "world", "uneven-cut"],
)
def test_pipeline_layouts_the_schedule_cannot_run_are_refused(tmp_path, capsys, monkeypatch, world, overrides, message):
    """parallel.pp > 1: what the schedule or the runtime cannot honour stops at once, one line naming the key, exit
    2, before anything is read or written."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    run = tmp_path / "run"
    main = runpy.run_path(TRAIN)["main"]
    assert main(["--config", CONFIG, "--run-dir", str(run), "--set", *SMALL, "parallel.pp=2", *overrides]) == 2
    _check_one_line(capsys.readouterr().err, message)
    assert not run.exists()
