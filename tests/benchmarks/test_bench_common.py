"""benchmarks/common.py (the timer, the matmul reference, the collective tracer) and the two scripts built on its
tracer: comm_report.py and scaling_worker.py, whose counts must match moe_dist.planning.perfmodel's schedule of the
same job."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from support import CP_HYBRID, free_port

from benchmarks import common
from moe_dist.config import load_config
from moe_dist.planning import workload as wl

REPO = Path(__file__).resolve().parents[2]


def test_interleaved_ms_runs_round_by_round():
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    ms = common.interleaved_ms(fns, "cpu", repeats=3, warmup=1, number=2)
    assert set(ms) == {"a", "b"} and all(t >= 0 for t in ms.values())
    # one warm-up round, then three rounds of two calls each, a's and b's in turn
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3


def test_matmul_gflops_is_the_median_rate_of_the_mm_entries():
    ms = {"layer": 1.0, ("mm", 10, 20, 30): 2.0, ("mm", 100, 10, 10): 1.0, ("mm", 10, 10, 10): 0.001}
    rates = sorted([2 * 10 * 20 * 30 / 2.0 / 1e6, 2 * 100 * 10 * 10 / 1.0 / 1e6, 2 * 1000 / 0.001 / 1e6])
    assert common.matmul_gflops(ms) == pytest.approx(rates[1])
    with pytest.raises(ValueError, match="matmul_fns"):
        common.matmul_gflops({"layer": 1.0})
    fns = common.matmul_fns([(4, 8, 16)], torch.float32, "cpu")
    assert list(fns) == [("mm", 4, 8, 16)] and fns[("mm", 4, 8, 16)]().shape == (4, 16)


def test_collective_tracer_sees_each_outermost_call_once_and_uninstalls():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    originals = (dist.all_reduce, c10d.all_reduce, dist.all_gather_into_tensor)
    seen = []
    try:
        with common.CollectiveTracer(seen.append):
            assert dist.all_reduce is not originals[0] and c10d.all_reduce is not originals[1]
            dist.all_reduce(torch.ones(4))
            out = torch.empty(3)
            # all_gather_into_tensor calls all_gather_single where torch has it: one call, under the name called
            getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, torch.ones(3))
            dist.barrier()
    finally:
        dist.destroy_process_group()
    assert (dist.all_reduce, c10d.all_reduce, dist.all_gather_into_tensor) == originals
    assert [(c.kind, c.group_size, c.payload_bytes) for c in seen] == [
        ("all_reduce", 1, 16),
        ("all_gather", 1, 12),
        ("other", 1, 0),
    ]
    assert seen[1].contributed_bytes == 12 and all(c.seconds >= 0 for c in seen)
    assert seen[0].args["tensor"].shape == (4,)


def _world(forks, nproc: int, module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N -m MODULE ARGS`, ranks forked from the session's server (tests/forklaunch.py)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = forks.run(nproc, list(args), env, free_port(), timeout, module=module, cwd=REPO)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_comm_report_matches_the_performance_model(forks):
    """The tensor-parallel all-reduces that comm_report counts are the bytes perfmodel schedules for the job."""
    proc = _world(forks, 2, "benchmarks.comm_report", "--config", "configs/debug.json", "--set", "parallel.tp=2")
    total = int(re.search(r"total bytes per rank for one micro-batch: ([\d,]+)", proc.stdout)[1].replace(",", ""))
    rows = re.findall(r"^\| (blocks\.\d+\.\w+) \| (forward|backward) \| (\w+) \| 2 \|", proc.stdout, re.MULTILINE)
    assert {layer for layer, _, _ in rows} == {f"blocks.{i}.{p}" for i in range(4) for p in ("mixer", "ffn")}
    cfg = load_config(REPO / "configs" / "debug.json", ["parallel.tp=2"])
    layout = wl.Layout(dp=1, ep=1, tp=2)
    tp = [c for c in wl.step_calls(cfg, layout, ranks_per_node=2) if c.label.startswith("tp_")]
    assert total == sum(c.payload_bytes * c.count for c in tp) / wl.micro_batches_per_rank(cfg, layout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_scaling_worker_counts_the_scheduled_collectives(tmp_path, forks):
    """scaling_worker.py (a sweep point) times every collective of a 2-rank job with ep=2 and attributes it to its
    step: as many all-to-alls per step as perfmodel schedules, and samples for the α-β fit."""
    steps = 3
    sets = [
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.save_every=0",
        "train.image_every=0",
        "parallel.ep=2",
        "train.threads=1",
    ]
    _world(
        forks,
        2,
        "benchmarks.scaling_worker",
        "--config",
        "configs/debug.json",
        "--set",
        *sets,
        "--run-dir",
        str(tmp_path),
    )
    profiles = [json.loads((tmp_path / "profile" / f"rank{r}.json").read_text()) for r in (0, 1)]
    cfg = load_config(REPO / "configs" / "debug.json", sets)
    a2a = sum(c.count for c in wl.step_calls(cfg, wl.Layout(2, 2, 1), ranks_per_node=2) if c.kind == "all_to_all")
    for prof in profiles:
        assert len(prof["steps"]) == steps
        for step in prof["steps"]:
            seconds, sent, calls = step["kinds"]["all_to_all"]
            assert calls == a2a and sent > 0 and seconds > 0
            assert step["kinds"]["all_reduce"][2] > 0
            assert step["wall_s"] > seconds
        assert {s[0] for s in prof["samples"] if s[6] == "train"} >= {"all_to_all", "all_reduce"}
        assert {s[6] for s in prof["samples"]} == {"train", "calibration"}


def test_scaling_predict_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.scaling", "predict"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| GPUs | layout |" in proc.stdout and "Recommended" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_scaling_sweep_on_one_node_writes_its_report(tmp_path):
    """A two-point sweep (1 and 2 ranks) end to end: runs, aggregation, the fit and every output; the bytes each
    rank sent agree with the fitted model's schedule (bytes, not times: they do not depend on the machine's load)."""
    cmd = [sys.executable, "-m", "benchmarks.scaling", "--worlds", "1", "2", "--steps", "3", "--no-netns"]
    proc = subprocess.run([*cmd, "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for name in ("scaling.md", "scaling.csv", "predictions.md", "points.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    rows = list(csv.DictReader((tmp_path / "scaling.csv").open()))
    assert [r["name"] for r in rows] == ["both_1node_w1", "strong_1node_w2", "weak_1node_w2"]
    for r in rows[1:]:
        assert float(r["bytes_per_rank"]) == pytest.approx(float(r["predicted_bytes_per_rank"]), rel=0.15), r["name"]
        assert float(r["all_to_all_s"]) > 0 and float(r["tokens_per_s"]) > 0


CP_SETS = ["parallel.cp=2", "model.moe.capacity_factor=null", *CP_HYBRID]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_comm_report_counts_context_parallel_bytes_that_grow_only_for_attention(forks):
    """comm_report under parallel.cp=2 on a hybrid of every mixer, at two sequence lengths: attention all-gathers
    K and V, each rank contributing its S / 2 positions of the KV heads (fp32), so its bytes grow with S; the
    recurrent mixers send their conv halos and state summaries, the same bytes whatever S."""
    per_layer = {}
    for seq in (64, 256):
        proc = _world(
            forks,
            2,
            "benchmarks.comm_report",
            "--config",
            "configs/debug.json",
            "--set",
            *CP_SETS,
            f"train.seq_len={seq}",
        )
        rows = re.findall(
            r"^\| (blocks\.\d)\.mixer \| forward \| all_gather\w* \| 2 \| (\d+) \| ([\d,]+) \|", proc.stdout, re.M
        )
        per_layer[seq] = {layer: int(nbytes.replace(",", "")) for layer, _, nbytes in rows}
    assert set(per_layer[64]) == {f"blocks.{i}" for i in range(4)}
    cfg = load_config(REPO / "configs" / "debug.json", CP_SETS)
    a, batch = cfg.model.attention, cfg.train.micro_batch_size
    head_dim = a.head_dim or cfg.model.d_model // a.n_heads
    for seq in (64, 256):  # K and V: each rank contributes its S / 2 positions of the KV heads, fp32
        assert per_layer[seq]["blocks.0"] == 2 * batch * (seq // 2) * a.n_kv_heads * head_dim * 4
    for layer in ("blocks.1", "blocks.2", "blocks.3"):  # Mamba-1, Mamba-2, Gated DeltaNet
        assert per_layer[64][layer] == per_layer[256][layer] > 0
