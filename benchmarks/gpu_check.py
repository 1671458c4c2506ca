"""The GPU verification: everything worth checking on a CUDA machine, in one run that fits in 8 minutes.

    python benchmarks/gpu_check.py                                  # every part, default budgets
    python benchmarks/gpu_check.py --parts tests,train --budget tests=300
    python benchmarks/gpu_check.py --dry-run --out /tmp/gc          # CPU: the training parts, tiny, PyTorch paths

Parts, in this order, each with a time budget in seconds (--budget PART=S; the defaults add up to 470 s). A part
stops itself when its budget is spent and says so: a verifying part (tests, train, resume) then counts as failed,
the benchmarks as partial.
  tests   pytest -q on tests/kernels/test_{flash_attention,permute,selective_scan}.py with MOE_DIST_KERNEL_DEVICE=cuda,
          one process per file, in parallel (most of the time is Triton compiling kernel variants)
  bench   each Triton kernel against its PyTorch path at training-like sizes in bf16, in the same interleaved
          rounds: flash attention vs SDPA (TFLOP/s, and as a fraction of the bf16 matmul peak measured here), the
          selective scan vs the chunked PyTorch scan and the token permutation vs index ops (GB/s moved)
  train   configs/debug.json (widened) in bf16 with the Triton kernels (model.{attention,mamba,moe}.impl=triton)
          and with the PyTorch paths (impl=torch): every step's loss within --loss-rtol; both step times
  resume  the same model, fp32, default kernels: N steps saving at N/2, then a fresh run directory holding only
          that checkpoint resumed to N: the resumed steps' losses equal the uninterrupted run's
Runs go to --out (default runs/gpu_check), one run directory each; a summary table ends the output and is
written to OUT/summary.txt. --dry-run checks this script on a machine without a GPU: the train and resume parts on
the CPU at a tiny size (both sides of `train` on the PyTorch paths), the GPU-only parts skipped.
Exit status: 0 every part passed; 1 a part failed or ran out of its budget; 2 bad usage, or no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from common import interleaved_ms, measure_matmul_gflops

REPO = Path(__file__).resolve().parents[1]
PARTS = ("tests", "bench", "train", "resume")
BUDGETS = {"tests": 200, "bench": 60, "train": 120, "resume": 90}  # seconds; 470 of the 480 the whole may take
KERNEL_TESTS = (
    "tests/kernels/test_flash_attention.py",
    "tests/kernels/test_permute.py",
    "tests/kernels/test_selective_scan.py",
)
CONFIG = "configs/debug.json"
# debug.json widened so that the kernels have work to do (head_dim 64, 256 positions); no evaluation or images.
WIDE = ["model.d_model=256", "model.d_ff=512", "train.seq_len=256", "train.eval_every=0", "train.image_every=0"]
TINY = ["train.seq_len=32", "train.eval_every=0", "train.image_every=0"]  # --dry-run, on the CPU
KERNEL_KEYS = ("model.attention.impl", "model.mamba.impl", "model.moe.impl")
BF16 = torch.bfloat16


class BudgetSpent(Exception):
    pass


class Budget:
    def __init__(self, part: str, seconds: float):
        self.part, self.seconds, self.start = part, seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def check(self, doing: str) -> None:
        if self.left() <= 0:
            raise BudgetSpent(f"budget of {self.seconds:.0f} s spent before {doing}")


@dataclass
class Result:
    part: str
    status: str  # ok | FAILED | STOPPED (budget spent) | partial (benchmarks cut short) | skipped
    seconds: float
    summary: str


# ----------------------------------------------------------------------------------------------- subprocesses


def _kill(proc: subprocess.Popen) -> None:
    """End a process we started and everything it started (its own session, so its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:  # a file, not a pipe: no process blocks on its output
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def finish(procs: dict[str, subprocess.Popen], budget: Budget) -> dict[str, int]:
    """Wait for every process until the budget is spent; then end the rest and raise BudgetSpent."""
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(budget.left(), 0.01))
        except subprocess.TimeoutExpired:
            for other in procs.values():
                if other.poll() is None:
                    _kill(other)
            raise BudgetSpent(f"budget of {budget.seconds:.0f} s spent while {name} was running (ended)") from None
    return codes


def tail(log: Path, n: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").strip().splitlines()[-n:])


# ----------------------------------------------------------------------------------------------- tests


def part_tests(args, budget: Budget) -> tuple[str, str]:
    env = {"MOE_DIST_KERNEL_DEVICE": "cuda"}
    print(f"$ MOE_DIST_KERNEL_DEVICE=cuda python -m pytest -q FILE, in parallel for {' '.join(KERNEL_TESTS)}")
    logs = {f: args.out / "logs" / f"{Path(f).stem}.log" for f in KERNEL_TESTS}
    procs = {
        f: start([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f], logs[f], env)
        for f in KERNEL_TESTS
    }
    codes = finish(procs, budget)
    lines = []
    for f, code in codes.items():
        last = tail(logs[f], 1)
        print(f"--- {f}: {'ok' if code == 0 else f'FAILED (exit {code})'}: {last}")
        if code:
            print(tail(logs[f]))
        lines.append(f"{Path(f).stem.removeprefix('test_')}: {last}")
    return ("ok" if not any(codes.values()) else "FAILED"), "; ".join(lines)


# ----------------------------------------------------------------------------------------------- benchmarks


def _fwd(fn, *inputs, **kw):
    """A closure running fn forward only."""
    return torch.no_grad()(lambda: fn(*inputs, **kw))


def _fwd_bwd(fn, inputs: list[torch.Tensor], grad: torch.Tensor, **kw):
    """A closure running fn forward and backward into fresh gradients (no accumulation)."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    wrt = [t for t in leaves if t.requires_grad]
    return lambda: torch.autograd.grad(fn(*leaves, **kw), wrt, grad)


@dataclass
class Case:
    """One benchmark: the same work done by the Triton kernel and by the PyTorch path."""

    name: str
    shape: str
    work: float  # FLOPs where unit is TFLOP/s, else bytes moved (at least: each input read, each output written)
    triton: Callable
    torch: Callable
    unit: str = "GB/s"


def attention_cases():
    from moe_dist.layers.attention import attention_kernel

    flash, sdpa = attention_kernel("triton", "cuda"), attention_kernel("torch", "cuda")
    shapes = [(4, 32, 8, 4096, 128, True), (8, 16, 16, 2048, 64, True), (4, 32, 8, 4096, 128, False)]
    for batch, hq, hkv, seq, dh, causal in shapes:
        q = torch.randn(batch, hq, seq, dh, device="cuda", dtype=BF16)
        k, v = (torch.randn(batch, hkv, seq, dh, device="cuda", dtype=BF16) for _ in range(2))
        flops = 4 * batch * hq * seq * seq * dh * (0.5 if causal else 1.0)  # QKᵀ and PV
        shape = f"B{batch} H{hq}/{hkv} S{seq} D{dh} {'causal' if causal else 'full'}"
        fwd = [_fwd(fn, q, k, v, causal=causal) for fn in (flash, sdpa)]
        yield Case("attention fwd vs SDPA", shape, flops, *fwd, unit="TFLOP/s")
        grad = torch.randn_like(q)
        fwd_bwd = [_fwd_bwd(fn, [q, k, v], grad, causal=causal) for fn in (flash, sdpa)]
        yield Case("attention fwd+bwd vs SDPA", shape, 3.5 * flops, *fwd_bwd, unit="TFLOP/s")  # bwd = 2.5 × fwd


def scan_cases():
    from moe_dist.layers.mamba import scan_kernel

    scans = scan_kernel("triton", "cuda"), scan_kernel("torch", "cuda")  # the kernel, the chunked PyTorch scan
    batch, dim, seqlen, state = 2, 4096, 2048, 16
    u, delta, z = (torch.randn(batch, dim, seqlen, device="cuda", dtype=BF16) for _ in range(3))
    B, C = (torch.randn(batch, state, seqlen, device="cuda", dtype=BF16) for _ in range(2))
    A = -torch.rand(dim, state, device="cuda") - 0.5
    D, bias = torch.randn(dim, device="cuda"), torch.randn(dim, device="cuda") - 2.0
    inputs, grad = [u, delta, A, B, C, D, z, bias], torch.randn_like(u)
    fwd_bytes = 4 * u.numel() * 2 + 2 * B.numel() * 2  # read u, Δ, z, B, C; write y (bf16)
    shape = f"B{batch} D{dim} L{seqlen} N{state}"
    yield Case("scan fwd vs chunked torch", shape, fwd_bytes, *[_fwd(f, *inputs, delta_softplus=True) for f in scans])
    yield Case(
        "scan fwd+bwd vs chunked torch",
        shape,
        2 * fwd_bytes,  # bwd: read dy; write du, dΔ, dz, dB, dC
        *[_fwd_bwd(f, inputs, grad, delta_softplus=True) for f in scans],
    )


def permutation_cases():
    from moe_dist.layers.permutation import Permutation

    perms = Permutation.for_device("triton", "cuda"), Permutation.for_device("torch", "cuda")
    T, D, K, E, cf = 16384, 4096, 2, 8, 1.25
    g = torch.Generator(device="cuda").manual_seed(0)
    expert_A = torch.randint(0, E, (K * T,), device="cuda", generator=g)
    order_A = torch.argsort(expert_A, stable=True)
    counts_E = torch.bincount(expert_A, minlength=E)
    position_A = torch.arange(K * T, device="cuda") - (torch.cumsum(counts_E, 0) - counts_E)[expert_A[order_A]]
    rows_R = order_A[position_A < math.ceil(cf * T * K / E)]  # kept assignments, by expert
    R = rows_R.shape[0]
    weight_A = torch.rand(K * T, device="cuda")
    x_TD, y_RD = torch.randn(T, D, device="cuda", dtype=BF16), torch.randn(R, D, device="cuda", dtype=BF16)
    grad_RD, grad_TD = torch.randn_like(y_RD), torch.randn_like(x_TD)
    row, tok = R * D * 2, T * D * 2  # bytes of the (R, D) and (T, D) bf16 tensors
    shape = f"T{T} D{D} K{K} E{E} cf{cf} R{R}"
    # forward: read and write R rows; read R rows, write T rows. Backward: the reverse, plus the weights' rows
    yield Case("permute fwd vs index ops", shape, 2 * row, *[_fwd(p.permute, x_TD, rows_R, K) for p in perms])
    yield Case(
        "unpermute fwd vs index ops", shape, row + tok, *[_fwd(p.unpermute, y_RD, rows_R, weight_A, T) for p in perms]
    )
    yield Case(
        "permute fwd+bwd vs index ops",
        shape,
        3 * row + tok,
        *[_fwd_bwd(lambda x, p=p: p.permute(x, rows_R, K), [x_TD], grad_RD) for p in perms],
    )
    yield Case(
        "unpermute fwd+bwd vs index ops",
        shape,
        4 * row + tok,
        *[_fwd_bwd(lambda y, w, p=p: p.unpermute(y, rows_R, w, T), [y_RD, weight_A], grad_TD) for p in perms],
    )


def part_bench(args, budget: Budget) -> tuple[str, str]:
    import triton

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    peak = measure_matmul_gflops([(8192, 8192, 8192)], BF16, "cuda", repeats=10) / 1e3
    print(f"bf16 matmul peak (8192³, measured): {peak:.0f} TFLOP/s")
    print(f"{'benchmark':<32} {'shape':<34} {'triton':>8} {'torch':>8} {'unit':<8} {'ratio':>7}")
    done, ratios, failed = 0, [], []
    for family in (attention_cases, scan_cases, permutation_cases):
        for case in family():
            try:
                budget.check(case.name)
            except BudgetSpent as stop:
                return "partial", f"{done} benchmarks, then {stop}; ratios {', '.join(ratios)}"
            try:
                ms = interleaved_ms({"triton": case.triton, "torch": case.torch}, "cuda", repeats=10, warmup=3)
            except Exception as err:  # a kernel that fails here is reported; the other benchmarks still run
                failed.append(f"{case.name} {case.shape}: {type(err).__name__}: {str(err).splitlines()[0]}")
                print(f"{case.name:<32} {case.shape:<34} FAILED {failed[-1]}")
                continue
            scale = 1e12 if case.unit == "TFLOP/s" else 1e9
            tri, tor = (case.work / (ms[k] * 1e-3) / scale for k in ("triton", "torch"))
            note = f"{tri / peak:.0%} of matmul peak" if case.unit == "TFLOP/s" else ""
            print(f"{case.name:<32} {case.shape:<34} {tri:8.1f} {tor:8.1f} {case.unit:<8} {tri / tor:6.2f}x  {note}")
            done += 1
            ratios.append(f"{case.name.split(' vs')[0]} {tri / tor:.2f}x")
    summary = f"bf16 matmul peak {peak:.0f} TFLOP/s; triton/torch: {', '.join(ratios)}"
    return ("FAILED", "\n".join([summary, *failed])) if failed else ("ok", summary)


# ----------------------------------------------------------------------------------------------- training


def train_records(run_dir: Path) -> list[dict]:
    """The per-step training records of a run's metrics.jsonl (evaluation-only records left out)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "loss" in r]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(f"cannot compare {len(a)} losses with {len(b)}")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def step_ms(records: list[dict], tokens_per_step: int, warmup: int = 2) -> float:
    """Median step time after the first `warmup` steps (Triton compiling, allocator warming)."""
    timed = records[warmup:] or records
    return statistics.median(1e3 * tokens_per_step / r["tokens_per_s"] for r in timed)


def train(args, budget: Budget, name: str, overrides: list[str], resume_from: Path | None = None) -> list[dict]:
    """launch/train.py in one process (it picks a free port itself) into OUT/name; its training records."""
    run_dir = args.out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    if resume_from is not None:  # a fresh run directory holding only this checkpoint
        shutil.copytree(resume_from, run_dir / "checkpoints" / resume_from.name)
    cmd = [
        sys.executable,
        "launch/train.py",
        "--config",
        CONFIG,
        "--run-dir",
        str(run_dir),
        *(["--resume"] if resume_from is not None else []),
        "--set",
        *overrides,
    ]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    log = args.out / "logs" / f"{name}.log"
    env = {"CUDA_VISIBLE_DEVICES": ""} if args.dry_run else {}
    code = finish({name: start(cmd, log, env)}, budget)[name]
    if code != 0:
        raise RuntimeError(f"{name}: launch/train.py exited {code}:\n{tail(log)}")
    return train_records(run_dir)


def part_train(args, budget: Budget) -> tuple[str, str]:
    from moe_dist.config import load_config

    base = [*(TINY if args.dry_run else WIDE), f"train.steps={args.steps}", "train.dtype=bf16", "train.save_every=0"]
    base.append("deepspeed.zero_stage=2")  # bf16 accumulates gradients in fp32 (train.grad_accum_dtype): ZeRO 2
    t = load_config(REPO / CONFIG, base).train
    tokens = t.global_batch_size * t.seq_len
    kernels = "torch" if args.dry_run else "triton"  # --dry-run: no Triton on the CPU
    tri, tor = (
        train(args, budget, name, [*base, *(f"{k}={impl}" for k in KERNEL_KEYS)])
        for name, impl in (("train_triton", kernels), ("train_torch", "torch"))
    )
    diff = max_rel_diff([r["loss"] for r in tri], [r["loss"] for r in tor])
    status = "ok" if diff <= args.loss_rtol else "FAILED"
    return status, (
        f"{len(tri)} bf16 steps, impl {kernels} vs torch: max relative loss difference {diff:.2e} "
        f"(tolerance {args.loss_rtol:g}); final losses {tri[-1]['loss']:.4f} / {tor[-1]['loss']:.4f}; "
        f"step {step_ms(tri, tokens):.1f} / {step_ms(tor, tokens):.1f} ms"
    )


def part_resume(args, budget: Budget) -> tuple[str, str]:
    steps = max(2, args.resume_steps)
    half = steps // 2
    base = [*(TINY if args.dry_run else WIDE), f"train.steps={steps}", f"train.save_every={half}"]
    full = train(args, budget, "resume_full", base)
    resumed = train(
        args, budget, f"resume_from_{half}", base, resume_from=args.out / "resume_full" / "checkpoints" / f"step_{half}"
    )
    want = [r for r in full if r["step"] > half]
    if [r["step"] for r in resumed] != [r["step"] for r in want]:
        return "FAILED", (f"resumed steps {[r['step'] for r in resumed]}, expected {[r['step'] for r in want]}")
    got_loss, want_loss = [r["loss"] for r in resumed], [r["loss"] for r in want]
    diff = max_rel_diff(got_loss, want_loss)
    status = "ok" if diff <= args.resume_rtol else "FAILED"
    return status, (
        f"steps {half + 1}-{steps} resumed from step {half}: "
        f"{'bitwise equal' if got_loss == want_loss else f'max relative difference {diff:.1e}'} "
        f"(tolerance {args.resume_rtol:g})"
    )


# ----------------------------------------------------------------------------------------------- driver


def run_part(part: str, args, seconds: float) -> Result:
    fn = {"tests": part_tests, "bench": part_bench, "train": part_train, "resume": part_resume}[part]
    if args.dry_run and part in ("tests", "bench"):
        return Result(part, "skipped", 0.0, "--dry-run: needs CUDA")
    print(f"\n=== {part} (budget {seconds:.0f} s)", flush=True)
    budget = Budget(part, seconds)
    try:
        status, summary = fn(args, budget)
    except BudgetSpent as stop:
        status, summary = ("partial" if part == "bench" else "STOPPED"), str(stop)
    except Exception as err:  # a part's failure is reported, and the other parts still run
        status, summary = "FAILED", f"{type(err).__name__}: {err}"
    print(f"--- {part}: {status}: {summary}", flush=True)
    return Result(part, status, time.monotonic() - budget.start, summary)


def summary_table(results: list[Result], budgets: dict[str, float]) -> str:
    lines = [f"{'part':<7} {'status':<8} {'seconds':>7} {'budget':>6}  result"]
    for r in results:
        first, *rest = r.summary.splitlines() or [""]
        lines.append(f"{r.part:<7} {r.status:<8} {r.seconds:7.0f} {budgets[r.part]:6.0f}  {first}")
        lines += [f"{'':<32}{line}" for line in rest[-10:]]
    return "\n".join(lines)


def passed(results: list[Result]) -> bool:
    return all(r.status in ("ok", "partial", "skipped") for r in results)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {','.join(PARTS)} (default all)")
    p.add_argument(
        "--budget",
        nargs="+",
        default=[],
        metavar="PART=SECONDS",
        help="time budgets, default " + " ".join(f"{k}={v}" for k, v in BUDGETS.items()),
    )
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check", help="run directories and logs")
    p.add_argument("--steps", type=int, default=None, help="train: steps of each run (default 20; --dry-run 3)")
    p.add_argument(
        "--loss-rtol",
        type=float,
        default=0.02,
        help="train: largest relative difference of a step's bf16 loss, Triton vs PyTorch",
    )
    p.add_argument("--resume-steps", type=int, default=6, help="resume: steps of the uninterrupted run")
    p.add_argument(
        "--resume-rtol",
        type=float,
        default=1e-5,
        help="resume: largest relative loss difference (GPU atomics may reorder fp32 sums)",
    )
    p.add_argument("--dry-run", action="store_true", help="no GPU: the train and resume parts, tiny, on the CPU")
    args = p.parse_args(argv)
    args.parts = [s for s in args.parts.split(",") if s]
    if bad := [s for s in args.parts if s not in PARTS]:
        p.error(f"--parts: unknown {', '.join(bad)} (choose from {', '.join(PARTS)})")
    budgets = dict(BUDGETS)
    for item in args.budget:
        part, _, seconds = item.partition("=")
        if part not in PARTS or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--budget: expected PART=SECONDS with PART in {', '.join(PARTS)}, got {item!r}")
        budgets[part] = float(seconds)
    args.budgets = budgets
    args.steps = args.steps or (3 if args.dry_run else 20)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: torch sees no CUDA device; run this on a GPU machine (or --dry-run to check the script "
            "on the CPU)",
            file=sys.stderr,
        )
        return 2
    if os.environ.get("TRITON_INTERPRET"):
        print("gpu_check: unset TRITON_INTERPRET: it would run the kernels in the CPU interpreter", file=sys.stderr)
        return 2
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    start_s = time.monotonic()
    results = [run_part(part, args, args.budgets[part]) for part in args.parts]
    table = summary_table(results, args.budgets)
    verdict = "passed" if passed(results) else "FAILED"
    footer = f"gpu_check: {verdict} in {time.monotonic() - start_s:.0f} s{' (dry run, CPU)' if args.dry_run else ''}"
    print(f"\n{table}\n{footer}")
    (args.out / "summary.txt").write_text(f"{table}\n{footer}\n")
    return 0 if verdict == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
