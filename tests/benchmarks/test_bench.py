"""benchmarks/bench.py: every subcommand at tiny sizes, as a subprocess; the last stdout line is one JSON object with
the documented keys and sane figures. No timing thresholds (timings are noisy; the bench reports them). The plain
MoE layer it measures ours against is checked to compute what ours computes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_dist.config import MoEConfig
from moe_dist.layers.moe import MoE

REPO = Path(__file__).resolve().parents[2]
ON_CPU = {"permutation": "torch", "experts": "grouped_mm"}  # what a layer built for the CPU runs


def moe(shape: str, *args: str) -> list[str]:
    """`bench moe` at shape "T D F E K" (tokens, d_model, d_ff, experts, top_k), then `args`."""
    T, D, F, E, K = shape.split()
    return ["moe", "--tokens", T, "--d-model", D, "--d-ff", F, "--experts", E, "--top-k", K, *args]


def run_bench(*args: str, expect_rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", *args], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == expect_rc, proc.stderr[-2000:]
    return proc


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("dtype, cf", [("bf16", "1.0"), ("fp32", "null")])
def test_moe(dtype, cf):
    proc = run_bench(*moe("64 32 64 4 2", "--capacity-factor", cf, "--dtype", dtype, "--repeats", "2"))
    out = last_json(proc)
    for key in (
        "fwd_bwd_ms",
        "plain_ms",
        "vs_plain",
        "gemm_peak_gflops",
        "roofline_fraction",
        "expert_gemms_ms",
        "gemm_ceiling_fraction",
        "peak_mem_mb",
    ):
        assert out[key] > 0, key
    assert out["dtype"] == dtype and out["tokens"] == 64 and out["impl"] == "auto"
    assert out["implementations"] == ON_CPU
    assert "torch_impl_ms" not in out  # "auto" is the PyTorch path here: nothing else to compare with
    # ours against the plain layer, timed in rounds of their own (with page faults per call); the line says the same
    assert set(out["minor_faults_per_call"]) == {"layer", "plain"}
    assert out["vs_plain"] == pytest.approx(out["plain_ms"] / out["fwd_bwd_ms"], rel=0.01)
    assert f"vs_plain {out['vs_plain']} " in proc.stdout
    # where the time outside the expert GEMMs goes: each part alone, forward and backward
    assert set(out["parts_ms"]) == {"router", "permutation", "activation"}
    assert all(t > 0 for t in out["parts_ms"].values()), out["parts_ms"]
    assert 0 < out["kept_rows"] <= 64 * 2
    if cf == "null":
        assert out["kept_rows"] == 128  # dropless keeps every assignment
    # roofline_fraction is exactly the expert-GEMM FLOP rate over the measured torch.mm peak
    flops = 3 * 3 * 2 * out["kept_rows"] * 32 * 64
    assert out["roofline_fraction"] == pytest.approx(
        flops / out["fwd_bwd_ms"] / 1e6 / out["gemm_peak_gflops"], rel=0.02
    )
    # the ceiling: the same FLOPs over the time of the expert GEMMs alone
    assert out["gemm_ceiling_fraction"] == pytest.approx(
        flops / out["expert_gemms_ms"] / 1e6 / out["gemm_peak_gflops"], rel=0.02
    )
    for gone in ("fused_gate_up", "dense_gflops", "malloc", "flush_denormal", "hugepages"):  # removed with the kernels
        assert gone not in out


def test_moe_impl_torch():
    out = last_json(run_bench(*moe("64 32 64 4 2", "--repeats", "1", "--impl", "torch")))
    assert out["impl"] == "torch" and out["implementations"] == ON_CPU
    assert out["fwd_bwd_ms"] > 0 and out["expert_gemms_ms"] > 0 and out["plain_ms"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton permutation can run here")
def test_moe_impl_that_cannot_run_is_a_one_line_error():
    done = run_bench(*moe("8 32 32 2 1", "--impl", "triton"), expect_rc=2)
    assert one_error_line(done).startswith("error: --impl triton: model.moe.impl='triton': ")


def test_plain_layer_needs_aligned_sizes():
    """torch's grouped GEMM takes 16-byte aligned rows: the plain layer says so instead of failing inside it."""
    done = run_bench(*moe("8 30 32 2 1", "--dtype", "fp32"), expect_rc=2)
    assert "--d-model and --d-ff multiples of 4" in one_error_line(done)


@pytest.mark.parametrize("args", [["--impl", "cpu"], ["--malloc", "default"], ["--no-flush-denormal"], ["--hugepages"]])
def test_removed_host_and_cpu_kernel_options_are_rejected(args):
    done = run_bench(*moe("8 32 32 2 1", *args), expect_rc=2)
    assert args[0] in done.stderr


def test_plain_layer_computes_our_layer():
    """With our layer's weights and no capacity, the plain layer's output and every gradient are ours: the
    benchmark compares the same work."""
    from benchmarks import bench

    torch.manual_seed(0)
    moe = MoE(16, 32, MoEConfig(num_experts=4, top_k=2, d_ff=32, capacity_factor=None), init_std=0.5, n_layers=2)
    moe.init_weights()
    plain = bench.PlainMoE(16, 32, 4, 2, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for mine, ours in ((plain.router, moe.router.weight), (plain.w13, moe.experts.w13), (plain.w2, moe.experts.w2)):
            mine.copy_(ours)
    x = torch.randn(50, 16, requires_grad=True)
    dy = torch.randn(50, 16)
    y, _ = moe(x)
    ours = torch.autograd.grad(y, [x, moe.router.weight, moe.experts.w13, moe.experts.w2], dy)
    y_plain = plain(x)
    got = torch.autograd.grad(y_plain, [x, plain.router, plain.w13, plain.w2], dy)
    torch.testing.assert_close(y_plain, y)
    for g, o, name in zip(got, ours, ("x", "router", "w13", "w2"), strict=True):
        torch.testing.assert_close(g, o, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_scan(impl):
    out = last_json(
        run_bench("scan", "--batch", "1", "--seq", "40", "--dim", "8", "--state", "4", "--repeats", "2", "--impl", impl)
    )
    assert out["impl"] == impl and out["implementation"] == "torch"  # the chunked PyTorch scan on CPU
    for key in ("fwd_bwd_ms", "chunked_ms", "reference_ms", "speedup", "speedup_vs_chunked"):
        assert out[key] > 0, key
    assert out["speedup"] == pytest.approx(out["reference_ms"] / out["fwd_bwd_ms"], rel=0.02)
    assert out["speedup_vs_chunked"] == pytest.approx(out["chunked_ms"] / out["fwd_bwd_ms"], rel=0.02)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton scan can run here")
def test_scan_impl_that_cannot_run_is_a_one_line_error():
    done = run_bench(
        "scan", "--batch", "1", "--seq", "4", "--dim", "2", "--state", "2", "--impl", "triton", expect_rc=2
    )
    assert one_error_line(done).startswith("error: --impl triton: model.mamba.impl='triton': ")
    assert not done.stdout.strip()


@pytest.mark.parametrize(
    "cmd, shape",
    [
        ("ssd", ["--heads", "4", "--head-dim", "4", "--groups", "2", "--state", "3"]),
        ("gdn", ["--heads", "2", "--dk", "4", "--dv", "3"]),
    ],
)
def test_recurrences_chunked_against_reference(cmd, shape):
    common = ["--batch", "2", "--seq", "21", "--chunk-size", "8", "--repeats", "2"]
    out = last_json(run_bench(cmd, *common, *shape))
    assert out["bench"] == cmd and out["seq"] == 21 and out["chunk_size"] == 8
    assert out["max_abs_diff"] < 1e-4  # the chunked path computes what the step-by-step reference does
    assert out["speedup"] == pytest.approx(out["reference_ms"] / out["chunked_ms"], rel=0.02)


def test_step():
    small = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=32"]
    out = last_json(run_bench("step", "--config", "configs/debug.json", "--steps", "1", "--set", *small))
    assert out["tokens_per_step"] == 4 * 32
    assert out["tokens_per_s"] > 0 and out["flops_per_token"] > 0 and out["gemm_peak_gflops"] > 0
    assert 0 < out["mfu"] < 1
    assert out["implementations"] == {"attention": "sdpa", "scan": "torch", **ON_CPU}
    shares = out["time_share"]
    assert set(shares) == {*"attention mamba moe.router moe.dispatch moe.experts moe.combine optimizer other".split()}
    assert all(v >= 0 for v in shares.values())
    for key in ("attention", "mamba", "moe.router", "moe.experts", "optimizer"):  # debug.json has all of them
        assert shares[key] > 0, key
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize(
    "args, needle",
    [
        (moe("0 8 8 2 1"), "--tokens"),
        (moe("8 8 8 2 3"), "--top-k"),
        (["ssd", "--batch", "1", "--seq", "8", "--heads", "3", "--groups", "2"], "--groups"),
        (["step", "--config", "configs/debug.json", "--set", "model.moe.top_kk=2"], "model.moe.top_kk"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    proc = run_bench(*args, expect_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and needle in lines[-1]
