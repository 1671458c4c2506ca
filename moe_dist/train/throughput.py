"""Model FLOPs utilisation in the training log, and torch.profiler traces of chosen steps.

MFU here is Megatron's and torchtitan's "model FLOPs": 3 × the forward FLOPs per token of the model as
configured (planning.workload.model_cost: every matmul weight a token touches, routed experts at top_k / E,
causal attention scores, the SSM and delta-rule scans), times tokens per second, per device, over the device's
dense peak in the training dtype. Recomputation under activation checkpointing is not counted (it is hardware
work, not model work), so MFU falls when recompute is on, as it should.

The peak is `train.peak_tflops` where set, else the vendor's dense (no 2:4 sparsity) figure of a known GPU, or, on
an unknown GPU, a matmul measured at start-up. On CPU it is one thread's best matmul rate over half a second times
the run's threads (`cpu_peak`): "what this machine's cores reach", not a datasheet's, and stable under load.
Measured with all threads at once, the figure swung from 0.013 to 0.100 TFLOP/s between runs on a shared 2-core
machine (two threads rarely get a clean time slice together); one thread's best of some 50 tries stayed within ±4 %
(docs/benchmarks.md, "CPU MFU"). So a CPU's MFU compares between runs, and falls when other work takes the cores, as
it should.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Dense bf16 and tf32 tensor-core peaks in FLOP/s, from the vendors' datasheets (SXM parts; the figure without
# sparsity). Matched by substring of torch.cuda.get_device_name(), first match wins: "H200" before "H100".
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("GH200", 989e12, 494e12),
    ("H200", 989e12, 494e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100", 989e12, 494e12),
    ("H800", 989e12, 494e12),
    ("H20", 148e12, 74e12),
    ("B200", 2250e12, 1100e12),
    ("B100", 1750e12, 875e12),
    ("A100", 312e12, 156e12),
    ("A800", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("MI300X", 1307e12, 654e12),
)


@dataclass(frozen=True)
class Peak:
    flops_per_s: float
    source: str  # where the figure comes from, for the start-up line


def table_peak(device_name: str, dtype: str) -> Peak | None:
    """The datasheet peak of a known GPU in `dtype` ('bf16' or 'fp32', the latter at tf32), else None."""
    for key, bf16, tf32 in GPU_PEAKS:
        if key in device_name:
            return Peak(bf16 if dtype == "bf16" else tf32, f"{device_name}: datasheet dense {dtype} peak")
    return None


def measured_peak(device: torch.device, dtype: str, n: int = 1024, repeats: int = 5) -> Peak:
    """The best of `repeats` n×n×n matmuls in `dtype` on `device` (after one warm-up), in FLOP/s."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(n, n, device=device, dtype=torch_dtype)
    b = torch.randn(n, n, device=device, dtype=torch_dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tic = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - tic)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return Peak(2.0 * n**3 / best, f"measured {n}^3 {dtype} matmul on {device.type}{threads}")


def cpu_peak(dtype: str, n: int = 512, budget_s: float = 0.5, min_repeats: int = 5) -> Peak:
    """One thread's best n×n×n matmul rate in `dtype` over `budget_s` (at least `min_repeats` tries, after one
    warm-up), times torch's thread count: the best of many short tries is a try no other process interrupted."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(n, n, dtype=torch_dtype), torch.randn(n, n, dtype=torch_dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a @ b
        best, tries, start = float("inf"), 0, time.perf_counter()
        while tries < min_repeats or time.perf_counter() - start < budget_s:
            tic = time.perf_counter()
            a @ b
            best, tries = min(best, time.perf_counter() - tic), tries + 1
    finally:
        torch.set_num_threads(threads)
    return Peak(
        threads * 2.0 * n**3 / best,
        f"one thread's best {n}^3 {dtype} matmul of {tries} on cpu, x {threads} threads",
    )


def device_peak(device: torch.device, dtype: str, given_tflops: float | None = None) -> Peak:
    """`train.peak_tflops` where given, else a known GPU's datasheet figure, else one measured here."""
    if given_tflops is not None:
        return Peak(given_tflops * 1e12, f"train.peak_tflops={given_tflops:g}")
    if device.type == "cuda":
        known = table_peak(torch.cuda.get_device_name(device), dtype)
        if known is not None:
            return known
        return measured_peak(device, dtype)
    return cpu_peak(dtype)


def model_flops_per_token(cfg) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward) of the model as configured."""
    from moe_dist.planning.workload import model_cost

    return 3.0 * model_cost(cfg).fwd_flops_per_token


@dataclass(frozen=True)
class Utilisation:
    """Turns a step's global tokens per second into model TFLOP/s per device and MFU."""

    flops_per_token: float
    devices: int
    peak: Peak

    def __call__(self, tokens_per_s: float) -> dict:
        per_device = self.flops_per_token * tokens_per_s / self.devices
        return {"tflops_per_device": per_device / 1e12, "mfu": per_device / self.peak.flops_per_s}

    def describe(self) -> str:
        return (
            f"model {self.flops_per_token / 1e9:.3g} GFLOP per token (forward + backward, no recompute); "
            f"peak {self.peak.flops_per_s / 1e12:.4g} TFLOP/s per device ({self.peak.source})"
        )


def profile_trace_path(run_dir: Path, step: int, rank: int) -> Path:
    return run_dir / "profile" / f"step{step:06d}-rank{rank:05d}.trace.json"


@contextlib.contextmanager
def maybe_profile(run_dir: Path, step: int, rank: int, steps: list[int], ranks: list[int], device: torch.device):
    """torch.profiler over optimizer step `step` when it is in `steps` and this rank in `ranks`; the trace is a
    Chrome/Perfetto JSON file (profile_trace_path). Otherwise does nothing."""
    if step not in steps or rank not in ranks:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield
    path = profile_trace_path(run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
