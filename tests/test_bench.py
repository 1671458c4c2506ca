"""benchmarks/bench.py: every subcommand at tiny sizes, as a subprocess; the last stdout line is one JSON object with
the documented keys and sane figures. No timing thresholds (timings are noisy; the bench reports them)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_dist.kernels import grouped_gemm_cpu

REPO = Path(__file__).resolve().parents[1]
BENCH = str(REPO / "benchmarks" / "bench.py")


def run_bench(*args: str, expect_rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == expect_rc, proc.stderr[-2000:]
    return proc


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype, cf", [("bf16", "1.0"), ("fp32", "null")])
def test_moe(dtype, cf):
    out = last_json(run_bench("moe", "--tokens", "64", "--d-model", "32", "--d-ff", "64", "--experts", "4",
                              "--top-k", "2", "--capacity-factor", cf, "--dtype", dtype, "--repeats", "2"))
    for key in ("fwd_bwd_ms", "gemm_peak_gflops", "roofline_fraction", "expert_gemms_ms", "gemm_ceiling_fraction",
                "peak_mem_mb"):
        assert out[key] > 0, key
    assert out["dtype"] == dtype and out["tokens"] == 64
    # where the time outside the expert GEMMs goes: each part alone, forward and backward
    # (the activation is a part of its own unless the AMX gate/up GEMM runs it in its epilogue: bf16 on AMX)
    fused = dtype == "bf16" and grouped_gemm_cpu.unavailable() is None
    assert out["fused_gate_up"] == fused
    assert set(out["parts_ms"]) == {"router", "permutation"} | (set() if fused else {"activation"})
    assert all(t > 0 for t in out["parts_ms"].values()), out["parts_ms"]
    assert 0 < out["kept_rows"] <= 64 * 2
    if cf == "null":
        assert out["kept_rows"] == 128  # dropless keeps every assignment
    # roofline_fraction is exactly the expert-GEMM FLOP rate over the measured peak
    flops = 3 * 3 * 2 * out["kept_rows"] * 32 * 64
    assert out["roofline_fraction"] == pytest.approx(flops / out["fwd_bwd_ms"] / 1e6 / out["gemm_peak_gflops"],
                                                     rel=0.02)
    # the ceiling: the same FLOPs over the time of the expert GEMMs alone
    assert out["gemm_ceiling_fraction"] == pytest.approx(
        flops / out["expert_gemms_ms"] / 1e6 / out["gemm_peak_gflops"], rel=0.02)
    # the peak is the fastest dense matmul timed: torch.mm, and the AMX kernel where it takes these tensors
    assert out["gemm_peak_gflops"] == max(out["dense_gflops"].values())
    assert "torch.mm" in out["dense_gflops"]
    assert ("amx" in out["dense_gflops"]) == (dtype == "bf16" and grouped_gemm_cpu.unavailable() is None)


@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_moe_impl(impl):
    out = last_json(run_bench("moe", "--tokens", "64", "--d-model", "32", "--d-ff", "64", "--experts", "4",
                              "--top-k", "2", "--repeats", "1", "--impl", impl))
    assert out["impl"] == impl and out["fwd_bwd_ms"] > 0 and out["expert_gemms_ms"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton permutation can run here")
def test_moe_impl_that_cannot_run_is_a_one_line_error():
    done = run_bench("moe", "--tokens", "8", "--d-model", "32", "--d-ff", "32", "--experts", "2", "--top-k", "1",
                     "--impl", "triton", expect_rc=2)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --impl triton: model.moe.impl='triton': "), lines


def test_moe_host_switches():
    """--malloc default and --no-flush-denormal run glibc and the FPU as they come; the JSON says so."""
    out = last_json(run_bench("moe", "--tokens", "32", "--d-model", "16", "--d-ff", "32", "--experts", "2",
                              "--top-k", "1", "--repeats", "1", "--malloc", "default", "--no-flush-denormal"))
    assert out["malloc"] == "default" and out["flush_denormal"] is False and out["fwd_bwd_ms"] > 0


@pytest.mark.parametrize("impl", ["auto", "cpu", "torch"])
def test_scan(impl):
    out = last_json(run_bench("scan", "--batch", "1", "--seq", "40", "--dim", "8", "--state", "4", "--repeats", "2",
                              "--impl", impl))
    assert out["impl"] == impl
    for key in ("fwd_bwd_ms", "chunked_ms", "reference_ms", "speedup", "speedup_vs_chunked"):
        assert out[key] > 0, key
    assert out["speedup"] == pytest.approx(out["reference_ms"] / out["fwd_bwd_ms"], rel=0.02)
    assert out["speedup_vs_chunked"] == pytest.approx(out["chunked_ms"] / out["fwd_bwd_ms"], rel=0.02)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton scan can run here")
def test_scan_impl_that_cannot_run_is_a_one_line_error():
    done = run_bench("scan", "--batch", "1", "--seq", "4", "--dim", "2", "--state", "2", "--impl", "triton",
                     expect_rc=2)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --impl triton: model.mamba.impl='triton': "), lines
    assert not done.stdout.strip()


def test_step():
    out = last_json(run_bench("step", "--config", "configs/debug.json", "--steps", "1",
                              "--set", "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=32"))
    assert out["tokens_per_step"] == 4 * 32
    assert out["tokens_per_s"] > 0 and out["flops_per_token"] > 0 and out["gemm_peak_gflops"] > 0
    assert 0 < out["mfu"] < 1
    shares = out["time_share"]
    assert set(shares) == {"attention", "mamba", "moe.router", "moe.dispatch", "moe.experts", "moe.combine",
                           "optimizer", "other"}
    assert all(v >= 0 for v in shares.values())
    for key in ("attention", "mamba", "moe.router", "moe.experts", "optimizer"):  # debug.json has all of them
        assert shares[key] > 0, key
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("args, needle", [
    (["moe", "--tokens", "0", "--d-model", "8", "--d-ff", "8", "--experts", "2", "--top-k", "1"], "--tokens"),
    (["moe", "--tokens", "8", "--d-model", "8", "--d-ff", "8", "--experts", "2", "--top-k", "3"], "--top-k"),
    (["step", "--config", "configs/debug.json", "--set", "model.moe.top_kk=2"], "model.moe.top_kk"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    proc = run_bench(*args, expect_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and needle in lines[-1]
