"""Bounded host memory of a checkpoint save and load, measured in a subprocess (benchmarks/studies/ckpt_bench.py: a real
DeepSpeed engine, ZeRO 1, one process): the peak growth of resident memory stays below train.save_buffer_mb plus
the largest tensor, far below the checkpoint's size (which the previous save held whole)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUFFER_MB = 16
SIZE = ["model.d_model=512", "model.d_ff=1024", "model.n_layers=4", "model.vocab_size=256"]  # 0.65 GB checkpoint
LARGEST_MB = 8 * 512 * 2 * 1024 * 4 / 2**20  # one MoE layer's stacked w13 (E, D, 2F), fp32: 32 MB
# what glibc's allocator keeps of freed tensors, the writer thread, JSON: the peak growth of this save measured
# 70-130 MB (buffer and largest tensor included) over 9 runs of this tree and of the one before (0422cd4) on one
# day, so up to ~82 MB of slack; holding the whole state instead would be 667 MB
SLACK_MB = 96

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_save_and_load_memory_is_bounded_by_the_buffer_and_the_largest_tensor(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.studies.ckpt_bench", "--dir", str(tmp_path), "--set", *SIZE]
    cmd.append(f"train.save_buffer_mb={BUFFER_MB}")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\n{result}")
    assert result["written_GB"] > 0.6  # the whole state was written ...
    bound = BUFFER_MB + LARGEST_MB + SLACK_MB
    assert result["save_peak_growth_MB"] < bound  # ... while at most the buffer and one tensor were held
    assert result["save_peak_growth_MB"] < result["written_GB"] * 1000 / 5  # the old save held all of it
    # Loading: one state tensor at a time, never the whole checkpoint (mapped file pages aside: page cache).
    assert result["load_anon_peak_growth_MB"] < result["written_GB"] * 1000 / 2
