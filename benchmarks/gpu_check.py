"""GPU check of the Triton kernels: their tests on CUDA, then each kernel against its PyTorch path.

    python benchmarks/gpu_check.py                 # tests, then benchmarks
    python benchmarks/gpu_check.py --tests-only
    python benchmarks/gpu_check.py --bench-only

Tests: the same files as on CPU (tests/kernels), run by pytest with MOE_DIST_KERNEL_DEVICE=cuda instead of the
Triton interpreter (which adds a few realistic sizes), one process per file, in parallel.
Benchmarks, at training-like sizes in bf16: flash attention against SDPA (TFLOP/s, also as a fraction of the bf16
matmul peak measured here), the selective scan against the reference and against the chunked PyTorch scan the
model uses off-GPU (GB/s of the minimum bytes moved), token permutation against PyTorch index ops (GB/s).
Ratios are Triton / PyTorch, measured in the same run. Sized to finish within 5 minutes on one H200, most of it
Triton compiling kernel variants for the tests (cached in ~/.triton afterwards).
Exit status: nonzero when a test fails or there is no CUDA device.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16


def run_tests() -> int:
    """pytest on each file of tests/kernels with MOE_DIST_KERNEL_DEVICE=cuda, the files in parallel processes:
    most of the time is Triton compiling kernel variants, one CPU core per process. Returns the failure count."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MOE_DIST_KERNEL_DEVICE"] = "cuda"
    # Every test file but the runner that a plain pytest run uses to start these same files in subprocesses.
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "kernels").glob("test_*.py")
                   if p.name != "test_kernel_suites.py")
    print(f"$ MOE_DIST_KERNEL_DEVICE=cuda python -m pytest -q <file>, in parallel for: {' '.join(files)}", flush=True)
    logs = [tempfile.TemporaryFile(mode="w+") for _ in files]  # files, not pipes: no process blocks on output
    procs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f], cwd=REPO, env=env,
                              stdout=log, stderr=subprocess.STDOUT, text=True) for f, log in zip(files, logs)]
    failed = 0
    for f, proc, log in zip(files, procs, logs):
        ok = proc.wait() == 0
        failed += not ok
        log.seek(0)
        lines = log.read().strip().splitlines()
        print(f"--- {f}: {'ok' if ok else f'FAILED (exit {proc.returncode})'}")
        print("\n".join(lines if not ok else lines[-1:]), flush=True)
    return failed


def time_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 10) -> float:
    """Mean wall time of fn on the GPU stream, in milliseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def fwd_bwd(fn: Callable, inputs: list[torch.Tensor], grad: torch.Tensor, **kw) -> Callable[[], object]:
    """A closure running fn forward and backward into fresh gradients (no accumulation)."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    wrt = [t for t in leaves if t.requires_grad]
    return lambda: torch.autograd.grad(fn(*leaves, **kw), wrt, grad)


def report(name: str, shape: str, unit: str, work: float, triton_ms: float, torch_ms: float, note: str = "") -> None:
    """`work` is FLOPs (unit TFLOP/s) or bytes (unit GB/s)."""
    scale = 1e12 if unit == "TFLOP/s" else 1e9
    tri, tor = work / (triton_ms * 1e-3) / scale, work / (torch_ms * 1e-3) / scale
    print(f"{name:<30} {shape:<34} {tri:8.1f} {tor:8.1f} {unit:<8} {tri / tor:6.2f}x  {note}", flush=True)


def matmul_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    b = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    return 2 * 8192**3 / (time_ms(lambda: a @ b, reps=20) * 1e-3) / 1e12


def bench_attention(peak: float) -> None:
    from moe_dist.kernels.flash_attention import flash_attention

    def sdpa(q, k, v, causal=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

    for batch, hq, hkv, seq, dh, causal in [(4, 32, 8, 4096, 128, True), (8, 16, 16, 2048, 64, True),
                                            (4, 32, 8, 4096, 128, False)]:
        q = torch.randn(batch, hq, seq, dh, device="cuda", dtype=BF16)
        k, v = (torch.randn(batch, hkv, seq, dh, device="cuda", dtype=BF16) for _ in range(2))
        grad = torch.randn_like(q)
        flops = 4 * batch * hq * seq * seq * dh * (0.5 if causal else 1.0)  # QKᵀ and PV
        shape = f"B{batch} H{hq}/{hkv} S{seq} D{dh} {'causal' if causal else 'full'}"
        with torch.no_grad():
            t_tri = time_ms(lambda: flash_attention(q, k, v, causal=causal))
            t_tor = time_ms(lambda: sdpa(q, k, v, causal=causal))
        report("attention fwd vs SDPA", shape, "TFLOP/s", flops, t_tri, t_tor,
               f"{flops / (t_tri * 1e-3) / 1e12 / peak:.0%} of matmul peak")
        t_tri = time_ms(fwd_bwd(flash_attention, [q, k, v], grad, causal=causal))
        t_tor = time_ms(fwd_bwd(sdpa, [q, k, v], grad, causal=causal))
        report("attention fwd+bwd vs SDPA", shape, "TFLOP/s", 3.5 * flops, t_tri, t_tor,  # bwd = 2.5 × fwd
               f"{3.5 * flops / (t_tri * 1e-3) / 1e12 / peak:.0%} of matmul peak")


def bench_scan() -> None:
    from moe_dist.kernels.reference import selective_scan_ref
    from moe_dist.kernels.selective_scan import selective_scan
    from moe_dist.layers.scan import selective_scan as chunked_scan

    batch, dim, seqlen, state = 2, 4096, 2048, 16
    act = dict(device="cuda", dtype=BF16)
    u, delta, z = (torch.randn(batch, dim, seqlen, **act) for _ in range(3))
    B, C = (torch.randn(batch, state, seqlen, **act) for _ in range(2))
    A = -torch.rand(dim, state, device="cuda") - 0.5
    D, bias = torch.randn(dim, device="cuda"), torch.randn(dim, device="cuda") - 2.0
    inputs, grad = [u, delta, A, B, C, D, z, bias], torch.randn_like(u)
    kw = dict(delta_softplus=True)
    act_bytes, bc_bytes = u.numel() * 2, B.numel() * 2
    fwd_bytes = 4 * act_bytes + 2 * bc_bytes  # read u, Δ, z, B, C; write y
    bwd_bytes = fwd_bytes + 4 * act_bytes + 2 * bc_bytes  # plus read dy; write du, dΔ, dz, dB, dC
    shape = f"B{batch} D{dim} L{seqlen} N{state}"
    with torch.no_grad():
        t_tri = time_ms(lambda: selective_scan(*inputs, **kw))
        for name, fn in [("reference", selective_scan_ref), ("chunked torch", chunked_scan)]:
            report(f"scan fwd vs {name}", shape, "GB/s", fwd_bytes, t_tri, time_ms(lambda: fn(*inputs, **kw), reps=3))
    t_tri = time_ms(fwd_bwd(selective_scan, inputs, grad, **kw))
    for name, fn in [("reference", selective_scan_ref), ("chunked torch", chunked_scan)]:
        report(f"scan fwd+bwd vs {name}", shape, "GB/s", bwd_bytes, t_tri,
               time_ms(fwd_bwd(fn, inputs, grad, **kw), warmup=1, reps=3))


def bench_permutation() -> None:
    from moe_dist.kernels.permute import permute_tokens, unpermute_tokens
    from moe_dist.kernels.reference import permute_tokens_ref, unpermute_tokens_ref

    T, D, K, E, cf = 16384, 4096, 2, 8, 1.25
    g = torch.Generator(device="cuda").manual_seed(0)
    expert_A = torch.randint(0, E, (K * T,), device="cuda", generator=g)
    order_A = torch.argsort(expert_A, stable=True)
    counts_E = torch.bincount(expert_A, minlength=E)
    position_A = torch.arange(K * T, device="cuda") - (torch.cumsum(counts_E, 0) - counts_E)[expert_A[order_A]]
    rows_R = order_A[position_A < math.ceil(cf * T * K / E)]
    R = rows_R.shape[0]
    weight_A = torch.rand(K * T, device="cuda")
    x_TD = torch.randn(T, D, device="cuda", dtype=BF16)
    y_RD = torch.randn(R, D, device="cuda", dtype=BF16)
    row, tok = R * D * 2, T * D * 2  # bytes of the (R, D) and (T, D) bf16 tensors
    shape = f"T{T} D{D} K{K} E{E} cf{cf} R{R}"
    with torch.no_grad():
        report("permute fwd vs index ops", shape, "GB/s", 2 * row,  # read and write R rows
               time_ms(lambda: permute_tokens(x_TD, rows_R, K)), time_ms(lambda: permute_tokens_ref(x_TD, rows_R, K)))
        report("unpermute fwd vs index ops", shape, "GB/s", row + tok,  # read R rows, write T rows
               time_ms(lambda: unpermute_tokens(y_RD, rows_R, weight_A, T)),
               time_ms(lambda: unpermute_tokens_ref(y_RD, rows_R, weight_A, T)))
    grad_RD = torch.randn(R, D, device="cuda", dtype=BF16)
    report("permute fwd+bwd vs index ops", shape, "GB/s", 2 * row + row + tok,  # bwd: read R rows, write T rows
           time_ms(fwd_bwd(lambda x: permute_tokens(x, rows_R, K), [x_TD], grad_RD)),
           time_ms(fwd_bwd(lambda x: permute_tokens_ref(x, rows_R, K), [x_TD], grad_RD)))
    grad_TD = torch.randn(T, D, device="cuda", dtype=BF16)
    report("unpermute fwd+bwd vs index ops", shape, "GB/s", row + tok + 3 * row,  # bwd: read dout rows, y; write dy
           time_ms(fwd_bwd(lambda y, w: unpermute_tokens(y, rows_R, w, T), [y_RD, weight_A], grad_TD)),
           time_ms(fwd_bwd(lambda y, w: unpermute_tokens_ref(y, rows_R, w, T), [y_RD, weight_A], grad_TD)))


def run_benchmarks() -> None:
    import triton

    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    peak = matmul_peak_tflops()
    print(f"bf16 matmul peak (8192³, measured): {peak:.0f} TFLOP/s\n")
    print(f"{'benchmark':<30} {'shape':<34} {'triton':>8} {'torch':>8} {'unit':<8} {'ratio':>7}")
    bench_attention(peak)
    bench_scan()
    bench_permutation()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tests-only", action="store_true", help="run the kernel tests on CUDA, no benchmarks")
    which.add_argument("--bench-only", action="store_true", help="run the benchmarks, no tests")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; run this on a GPU machine (the CPU kernel tests run in the "
              "ordinary `python -m pytest`, under the Triton interpreter)", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET"):
        print("gpu_check: unset TRITON_INTERPRET: it would run the kernels in the CPU interpreter", file=sys.stderr)
        return 2
    start = time.time()
    status = 0 if args.bench_only else run_tests()
    if not args.tests_only:
        run_benchmarks()
    print(f"\ngpu_check: tests {'skipped' if args.bench_only else 'passed' if status == 0 else 'FAILED'}, "
          f"{time.time() - start:.0f} s")
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
