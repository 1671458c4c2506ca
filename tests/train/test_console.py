"""What the console says (moe_dist/train/startup.py): the run line and the threads line at start-up and the `done:`
line at the end of configs/debug.json's real single-process run (shared with other tests), and the thread choice
of train.threads=0 on a busy and on an idle machine."""

from __future__ import annotations

import json
import os
import re

import pytest

from moe_dist.train import startup
from moe_dist.train.startup import choose_threads, summary_line


def test_a_run_says_what_it_is_and_how_it_ended(debug_run):
    run = debug_run("python")
    lines = debug_run.stderr["python"].splitlines()
    (run_line,) = [line for line in lines if line.startswith("run: ")]
    assert run_line == (
        f"run: {run} (fresh); 0.36M parameters, 0.27M active per token; world 1 = dp 1 x tp 1, ep 1, ZeRO 1, fp32; "
        "6 steps of 8 x 32 tokens; eval every 3 steps and at the end (2 batches); checkpoint every 3 steps and at "
        "the end"
    )
    assert [line for line in lines if line.startswith("threads: ")] == ["threads: 1 per process (train.threads=1)"]
    (done,) = [line for line in lines if line.startswith("done: ")]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert done.startswith(
        f"done: step 6, loss {last['loss']:.4f}, last eval loss {last['eval_loss']:.4f} (step 6), "
        f"last checkpoint {run / 'checkpoints' / 'step_6'}, wall time "
    )
    assert re.fullmatch(r".*wall time (\d+ min \d+ s|\d+\.\d s)", done)
    assert not [line for line in lines if "Setting accelerator to CPU" in line]  # DeepSpeed's detection, said once


@pytest.mark.parametrize(
    "cores, load, local, threads",
    [
        (2, 0.4, 1, 1),  # a 2-core machine: one core left to other work, idle or not
        (2, 6.9, 1, 1),
        (16, 0.4, 1, 15),  # idle: the cores less one
        (16, 1.0, 1, 15),  # our own start-up is counted out of the load
        (16, 10.0, 1, 7),  # other work keeps 9 cores busy: the 7 it leaves
        (16, 4.0, 2, 7),  # two processes: (16 - 1) // 2
        (16, 0.0, 4, 3),
        (1, 0.0, 2, 1),  # never fewer than one
    ],
)
def test_threads_by_default_leave_a_core_and_what_other_work_holds(monkeypatch, cores, load, local, threads):
    monkeypatch.setattr(startup, "_cores", lambda: cores)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    n, why = choose_threads(0, local)
    assert n == threads
    assert why.startswith(f"train.threads=0: {cores} cores less 1 left to other work, / {local} local process(es)")
    assert ("other work keeps" in why) == (n < max(1, (cores - 1) // local))


def test_threads_requested_are_taken_as_they_are():
    assert choose_threads(3, 2) == (3, "train.threads=3")


def test_schedules_read_as_said():
    assert startup._steps_every(0, "eval") == "eval at the end"
    assert startup._steps_every(1, "checkpoint") == "checkpoint every step"
    assert startup._steps_every(50, "eval") == "eval every 50 steps and at the end"


def test_summary_line_without_eval_or_checkpoint():
    line = summary_line([{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.5}], None, 75.4)
    assert line == "done: step 2, loss 4.5000, no eval, no checkpoint, wall time 1 min 15 s"


def test_the_shm_op_build_is_announced_only_when_not_built(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    note = startup.shm_op_note()
    assert note is not None and note.startswith("note: building DeepSpeed's CPU shared-memory op once")
    assert str(tmp_path / "deepspeed_shm_comm") in note
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"\x7fELF")
    assert startup.shm_op_note() is None
