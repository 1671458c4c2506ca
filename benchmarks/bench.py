"""Benchmarks: where the time of an MoE layer, the selective scan and a training step goes.

    python benchmarks/bench.py moe --tokens 4096 --d-model 512 --d-ff 1024 --experts 8 --top-k 2 [--dtype bf16]
    python benchmarks/bench.py scan --batch 2 --seq 2048 --dim 512 --state 16
    python benchmarks/bench.py step --config configs/mixtral_small.json [--set KEY=VALUE ...] [--steps 4]

Each prints readable lines, then one JSON object as the last stdout line. Speeds are ratios measured in the
same run (DESIGN.md §7): achieved FLOP/s against this machine's own dense-matmul rate for the dtype, and the
scan against its sequential reference and the chunked PyTorch scan. Timings are medians over repeats; the first
calls are warm-up.
`--device auto` (the default) takes CUDA when present; CUDA timings synchronize around each measured call.
Bad input → one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from moe_dist.config import ConfigError, MoEConfig, load_config
from moe_dist.train.host import configure_host

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ----------------------------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_ms(fns: dict, device: torch.device, repeats: int, warmup: int = 2) -> dict:
    """Median wall time in ms of each of `fns` (synchronized on CUDA), the calls interleaved round by round so
    that all of them see the same machine load (other jobs share these cores)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            tic = time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - tic) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def matmul_fns(shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device) -> dict:
    """Dense matmuls (M, K, N) of `dtype`, keyed by (implementation, M, K, N), to time alongside the thing measured:
    torch.mm, and the AMX GEMM kernel (one group, its weight packing included) where it runs, since it is a dense
    matmul of this machine too (the peak must not be a rate that one of our own kernels beats)."""
    from moe_dist.kernels import grouped_gemm_cpu

    fns = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        fns[("torch.mm", m, k, n)] = lambda a=a, b=b: torch.mm(a, b)
        rows = torch.tensor([m])
        if grouped_gemm_cpu.grouped_mm_unsupported(a, b[None], rows) is None and grouped_gemm_cpu.unavailable() is None:
            fns[("amx", m, k, n)] = lambda a=a, b=b[None], rows=rows: grouped_gemm_cpu.grouped_mm(a, b, rows)
    return fns


def dense_rates(ms: dict) -> dict:
    """GFLOP/s of each dense-matmul implementation timed: the median over its (impl, M, K, N) shapes of 2·M·K·N / time."""
    rates = {}
    for key, t in ms.items():
        if isinstance(key, tuple):
            impl, m, k, n = key
            rates.setdefault(impl, []).append(2 * m * k * n / t / 1e6)
    return {impl: round(statistics.median(r), 1) for impl, r in rates.items()}


def peak_gflops(ms: dict) -> float:
    """This machine's dense matmul rate for the dtype: the fastest implementation's `dense_rates`."""
    return max(dense_rates(ms).values())


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here")
    return torch.device(name)


def emit(result: dict) -> None:
    for key, value in result.items():
        print(f"  {key}: {value}")
    print(json.dumps(result))


# ----------------------------------------------------------------------------------------------- moe


def _moe_setup(args):
    from moe_dist.layers.moe import MoE

    device, dtype = resolve_device(args.device), DTYPES[args.dtype]
    cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k, d_ff=args.d_ff, capacity_factor=args.capacity_factor,
                    backend=args.backend, impl=args.impl)
    torch.manual_seed(0)
    try:
        moe = MoE(args.d_model, args.d_ff, cfg, init_std=0.02, n_layers=2).to(device)
    except ValueError as err:  # an impl that cannot run here
        raise ConfigError(f"--impl {args.impl}: {err}") from None
    moe.init_weights()
    with torch.no_grad():
        moe.router.weight.normal_(std=1.0)  # logits of std √D on random inputs: routing spread over all experts
    moe = moe.to(dtype)
    x = torch.randn(args.tokens, args.d_model, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(args.tokens, args.d_model, dtype=dtype, device=device)
    return moe, x, dy, device, dtype


def _moe_fwd_bwd(moe, x, dy):
    """Forward, then the gradients of x and every weight (output gradient dy, aux + z loss with weight 1)."""
    y, stats = moe(x)
    losses = stats.aux_loss + stats.z_loss
    torch.autograd.grad([y, losses], [x, *moe.parameters()], [dy, torch.ones_like(losses)])
    return stats


def _expert_gemms(moe, x, impl: str):
    """The layer's expert GEMMs alone (gate+up, down; the grouped GEMM of `impl`), forward and backward, on rows
    routed as the layer routes x: the time the layer would take if routing, permutation and the SwiGLU activation
    cost nothing (its ceiling)."""
    from moe_dist.layers.moe import select_grouped_mm

    grouped_mm = select_grouped_mm(impl)

    with torch.no_grad():
        routing, _ = moe.router(x)
    counts_E, w13, w2 = routing.tokens_per_expert_E, moe.experts.w13, moe.experts.w2
    R, (Fh, D) = int(counts_E.sum()), w2.shape[1:]
    x_RD, h_RF = (torch.randn(R, n, dtype=x.dtype, device=x.device, requires_grad=True) for n in (D, Fh))
    g_R2F, g_RD = (torch.randn(R, n, dtype=x.dtype, device=x.device) for n in (2 * Fh, D))

    def run():
        outs = [grouped_mm(x_RD, w13, counts_E), grouped_mm(h_RF, w2, counts_E)]
        torch.autograd.grad(outs, [x_RD, h_RF, w13, w2], [g_R2F, g_RD])

    return run


def _moe_parts(moe, x, dy) -> dict:
    """The layer's parts outside the expert GEMMs, each alone, forward and backward, on the layer's own routing and
    shapes: the router (with its losses), the permutation (the gather into expert order and the weighted combine
    back) and the SwiGLU activation between the two GEMMs (where the backend has a separate one). Where the time
    outside the GEMMs goes."""
    with torch.no_grad():
        routing, _ = moe.router(x)
    counts_E, w2 = routing.tokens_per_expert_E, moe.experts.w2
    R, Fh, D = int(counts_E.sum()), w2.shape[1], w2.shape[2]

    def leaf(*shape, dtype=x.dtype):
        return torch.randn(*shape, dtype=dtype, device=x.device, requires_grad=True)

    x_TD, y_RD, weight_A = x.detach().requires_grad_(), leaf(R, D), routing.weight_A.detach().requires_grad_()
    g_RD, g_A = torch.randn_like(y_RD), torch.randn_like(weight_A)

    def router():
        r, stats = moe.router(x_TD)
        losses = stats.aux_loss + stats.z_loss
        torch.autograd.grad([r.weight_A, losses], [x_TD, moe.router.weight], [g_A, torch.ones_like(losses)])

    def permutation():
        kept = dataclasses.replace(routing, weight_A=weight_A)
        rows_RD, _, state = moe.dispatcher.dispatch(x_TD, kept)
        torch.autograd.grad([rows_RD, moe.dispatcher.combine(y_RD, state)], [x_TD, y_RD, weight_A], [g_RD, dy])

    parts = {"router": router, "permutation": permutation}
    if not fused_gate_up(moe, x):
        activation = getattr(moe.experts.swiglu, "keywords", {}).get("activation")
        if activation is not None:
            ab_R2F, g_RF = leaf(R, 2 * Fh), torch.randn(R, Fh, dtype=x.dtype, device=x.device)
            parts["activation"] = lambda: torch.autograd.grad(activation(ab_R2F), ab_R2F, g_RF)
    return parts


def fused_gate_up(moe, x) -> bool:
    """Whether the layer's gated SiLU runs inside its gate/up GEMM (the AMX kernel's gated mode) for rows like x."""
    from moe_dist.kernels import grouped_gemm_cpu

    if getattr(moe.experts.swiglu, "keywords", {}).get("gate_up") is None:
        return False
    rows = torch.empty(1, x.shape[1], dtype=x.dtype, device=x.device)
    counts = torch.zeros(moe.experts.w13.shape[0], dtype=torch.long)
    counts[0] = 1
    return (grouped_gemm_cpu.unavailable() is None
            and grouped_gemm_cpu.grouped_mm_gated_unsupported(rows, moe.experts.w13, counts) is None)


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024  # kB → MiB


def moe_memory_child(args) -> None:
    """Runs in a fresh process (Linux): the rise of peak RSS over one forward+backward (the gradients it returns
    included), after a warm-up pass, with the layer and inputs already built and freed heap returned to the OS."""
    import ctypes

    moe, x, dy, _, _ = _moe_setup(args)
    _moe_fwd_bwd(moe, x, dy)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    before = _rss_mb("VmRSS")
    _moe_fwd_bwd(moe, x, dy)
    print(_rss_mb("VmHWM") - before)


def bench_moe(args) -> dict:
    moe, x, dy, device, dtype = _moe_setup(args)
    stats = _moe_fwd_bwd(moe, x, dy)
    kept = stats.assignments - int(stats.dropped.item())
    T, D, Fh, E, K = args.tokens, args.d_model, args.d_ff, args.experts, args.top_k
    # Peak reference: dense matmuls with all T·K rows as one expert, in the shapes of the forward and both
    # gradient GEMMs of w1/w3 (D → F) and w2 (F → D), timed in turn with the layer.
    rows = T * K
    parts = _moe_parts(moe, x, dy)
    fns = {"layer": lambda: _moe_fwd_bwd(moe, x, dy), "gemms": _expert_gemms(moe, x.detach(), args.impl),
           **{f"part:{name}": fn for name, fn in parts.items()},
           **matmul_fns([(rows, D, Fh), (rows, Fh, D), (D, rows, Fh), (Fh, rows, D)], dtype, device)}
    if args.impl != "torch":  # the same layer (same weights) on the PyTorch paths, in the same rounds: the kernels' gain
        torch_moe = _moe_setup(argparse.Namespace(**{**vars(args), "impl": "torch"}))[0]
        fns["layer_torch_impl"] = lambda: _moe_fwd_bwd(torch_moe, x, dy)
    ms = interleaved_ms(fns, device, args.repeats)
    fwd_bwd_ms, gemms_ms, peak = ms["layer"], ms["gemms"], peak_gflops(ms)
    gemm_flops = 3 * 3 * 2 * kept * D * Fh  # gate, up, down (D·F each), ×3 for forward + the two backward GEMMs
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _moe_fwd_bwd(moe, x, dy)
        peak_mem = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        mem_note = "torch.cuda.max_memory_allocated rise over one forward+backward"
    else:
        child = [sys.executable, __file__, "_moe_mem", *sys.argv[2:], "--malloc", "default"]
        out = subprocess.run(child, capture_output=True, text=True, check=True)
        peak_mem = float(out.stdout.strip().splitlines()[-1])
        mem_note = "peak-RSS rise over one forward+backward in a fresh process (after a warm-up pass)"
    print(f"moe T={T} D={D} F={Fh} E={E} K={K} cf={args.capacity_factor} {args.dtype} on {device}, "
          f"{torch.get_num_threads()} threads, malloc {args.malloc}; "
          f"kept rows {kept}/{stats.assignments}; gemm_ceiling_fraction = the layer's expert GEMMs alone (same calls "
          f"and shapes, forward and backward) against the same peak; parts_ms = the router, the permutation and the "
          f"activation (unless fused_gate_up: then in the gate/up GEMM) alone, forward and backward; "
          f"peak_mem_mb = {mem_note}")
    return {"bench": "moe", "device": str(device), "dtype": args.dtype, "tokens": T, "d_model": D, "d_ff": Fh,
            "experts": E, "top_k": K, "capacity_factor": args.capacity_factor, "kept_rows": kept,
            "threads": torch.get_num_threads(), "malloc": args.malloc, "flush_denormal": args.flush_denormal,
            "hugepages": args.hugepages,
            "impl": args.impl, "fwd_bwd_ms": round(fwd_bwd_ms, 3), "gemm_peak_gflops": round(peak, 1),
            "dense_gflops": dense_rates(ms),
            "achieved_gemm_gflops": round(gemm_flops / fwd_bwd_ms / 1e6, 1),
            "roofline_fraction": round(gemm_flops / fwd_bwd_ms / 1e6 / peak, 4),
            "expert_gemms_ms": round(gemms_ms, 3), "gemm_ceiling_fraction": round(gemm_flops / gemms_ms / 1e6 / peak, 4),
            "parts_ms": {name: round(ms[f"part:{name}"], 3) for name in parts},
            "fused_gate_up": fused_gate_up(moe, x),
            "peak_mem_mb": round(peak_mem, 2),
            **({"torch_impl_ms": round(ms["layer_torch_impl"], 3),
                "speedup_vs_torch_impl": round(ms["layer_torch_impl"] / fwd_bwd_ms, 3)} if "layer_torch_impl" in ms else {}),
            "weight_grad_mb": round(sum(p.numel() * p.element_size() for p in moe.parameters()) / 2**20, 2)}


# ----------------------------------------------------------------------------------------------- scan


def bench_scan(args) -> dict:
    from moe_dist.kernels.reference import selective_scan_ref
    from moe_dist.layers.mamba import select_scan

    device = resolve_device(args.device)
    try:
        scan, chunked = select_scan(args.impl, args.chunk_size), select_scan("torch", args.chunk_size)
    except ValueError as err:
        raise ConfigError(f"--impl {args.impl}: {err}") from None
    Bt, L, Dm, N = args.batch, args.seq, args.dim, args.state
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device).requires_grad_()

    u, delta, z = rnd(Bt, Dm, L), rnd(Bt, Dm, L, scale=0.5), rnd(Bt, Dm, L)
    A = (-torch.rand(Dm, N, generator=g) - 0.5).to(device).requires_grad_()
    B, C, Dskip, bias = rnd(Bt, N, L), rnd(Bt, N, L), rnd(Dm), rnd(Dm, scale=0.1)
    inputs = (u, delta, A, B, C, Dskip, z, bias)
    dy = torch.randn(Bt, Dm, L, generator=g).to(device)

    def run(fn):
        y = fn(*inputs, delta_softplus=True)
        torch.autograd.grad(y, inputs, dy)

    ms = interleaved_ms({"scan": lambda: run(scan), "chunked": lambda: run(chunked)}, device, args.repeats)
    # no warm-up for the reference: one call takes minutes at training sizes (its autograd graph has a node per
    # timestep, and the backward of each timestep's slice materializes a whole (B, D, L, N) gradient)
    ref_ms = interleaved_ms({"ref": lambda: run(selective_scan_ref)}, device, args.ref_repeats, warmup=0)["ref"]
    print(f"scan B={Bt} L={L} D={Dm} N={N} fp32 on {device}: model.mamba.impl={args.impl!r} and the chunked "
          f"PyTorch scan (chunk {args.chunk_size}) vs the sequential reference")
    return {"bench": "scan", "device": str(device), "batch": Bt, "seq": L, "dim": Dm, "state": N,
            "impl": args.impl, "chunk_size": args.chunk_size, "fwd_bwd_ms": round(ms["scan"], 3),
            "chunked_ms": round(ms["chunked"], 3), "speedup_vs_chunked": round(ms["chunked"] / ms["scan"], 2),
            "reference_ms": round(ref_ms, 3), "speedup": round(ref_ms / ms["scan"], 2),
            "malloc": args.malloc, "flush_denormal": args.flush_denormal, "hugepages": args.hugepages}


# ----------------------------------------------------------------------------------------------- step

SECTIONS = ("attention", "mamba", "moe.router", "moe.dispatch", "moe.experts", "moe.combine", "optimizer")


def _ranged(fn, name: str):
    """`fn` inside a profiler range named bench::<name>; the layer's own code is untouched."""
    from torch.profiler import record_function

    def wrapped(*args, **kwargs):
        with record_function(f"bench::{name}"):
            return fn(*args, **kwargs)

    return wrapped


class _RangedDispatcher:
    """Wraps an MoE dispatcher so that dispatch and combine each run inside their own profiler range."""

    def __init__(self, inner):
        self.inner = inner
        self.dispatch = _ranged(inner.dispatch, "moe.dispatch")
        self.combine = _ranged(inner.combine, "moe.combine")


def instrument(model) -> None:
    """Profiler ranges around every mixer and the four parts of every MoE layer (instance attributes only)."""
    from moe_dist.layers.attention import Attention
    from moe_dist.layers.moe import MoE

    for block in model.blocks:
        block.mixer.forward = _ranged(block.mixer.forward, "attention" if isinstance(block.mixer, Attention) else "mamba")
        if isinstance(block.ffn, MoE) and hasattr(block.ffn, "dispatcher"):
            block.ffn.router.forward = _ranged(block.ffn.router.forward, "moe.router")
            block.ffn.experts.forward = _ranged(block.ffn.experts.forward, "moe.experts")
            block.ffn.dispatcher = _RangedDispatcher(block.ffn.dispatcher)


def section_times(events, cuda: bool) -> dict:
    """Seconds per bench:: section, forward and backward: a backward node counts for the section whose forward
    op created it (same autograd sequence number), found through its forward op's enclosing range."""
    def elapsed(e) -> float:
        return (e.device_time_total if cuda else e.time_range.elapsed_us()) / 1e6

    def section_of(e):
        while e is not None:
            if e.name.startswith("bench::"):
                return e.name[len("bench::"):]
            e = e.cpu_parent
        return None

    out = {name: 0.0 for name in SECTIONS}
    seq_section = {}
    for e in events:
        if e.name.startswith("bench::") and e.name[7:] in out:
            out[e.name[7:]] += elapsed(e)
        elif e.sequence_nr >= 0 and not e.name.startswith("autograd::engine"):
            sec = section_of(e)
            if sec is not None:
                seq_section.setdefault(e.sequence_nr, sec)
    for e in events:
        if e.name.startswith("autograd::engine::evaluate_function") and e.sequence_nr in seq_section:
            out[seq_section[e.sequence_nr]] += elapsed(e)
    return out


def flops_per_token(model, cfg) -> tuple[float, int]:
    """6 × active matmul parameters (embedding lookup, norms, conv and scan excluded) + causal attention scores."""
    from moe_dist.layers.attention import Attention
    from moe_dist.layers.moe import MoE

    m = cfg.model
    active = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, torch.nn.Linear))
    if model.head is None:
        active += m.vocab_size * m.d_model
    attn_flops = 0.0
    for block in model.blocks:
        if isinstance(block.ffn, MoE):
            active += block.ffn.router.weight.numel()
            active += m.moe.top_k * sum(p.numel() for p in block.ffn.experts.parameters()) // m.moe.num_experts
        if isinstance(block.mixer, Attention):
            a = block.mixer
            span = min(cfg.train.seq_len, m.attention.sliding_window or cfg.train.seq_len)
            # QKᵀ and AV: 2 matmuls × 2 FLOPs × heads × head_dim × keys seen (half the span on average, causal),
            # ×3 for forward + backward
            attn_flops += 3 * 2 * 2 * a.n_heads * a.head_dim * span / 2
    return 6 * active + attn_flops, active


def bench_step(args) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    from moe_dist.models.decoder import build_model, lm_loss, materialize
    from moe_dist.train.data import TokenDataset, load_tokens, micro_batches
    from moe_dist.train.loop import maybe_compile
    from moe_dist.train.optim import build_optimizer

    cfg = load_config(args.config, args.set)
    t, moe_cfg = cfg.train, cfg.model.moe
    configure_host(args.threads or t.threads or os.cpu_count() or 1, t.flush_denormal, t.cpu_malloc,
                   t.cpu_hugepages)  # as train does
    device = resolve_device(args.device)
    dtype = DTYPES[t.dtype]
    try:
        train_tokens, _ = load_tokens(cfg.data, t.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    data = TokenDataset(train_tokens, t.seq_len, t.seed)
    model = materialize(build_model(cfg.model), device, t.seed)
    fpt, active = flops_per_token(model, cfg)
    # bf16 as the DeepSpeed engine runs it: bf16 weights and gradients, fp32 master weights in the optimizer.
    master = copy.deepcopy(model).float() if dtype != torch.float32 else model
    model = model.to(dtype)
    optimizer, scheduler = build_optimizer(master, cfg)
    params, master_params = list(model.parameters()), list(master.parameters())
    compiled = maybe_compile(model, cfg)
    if not t.compile:
        instrument(model)  # profiler ranges would only break a compiled graph

    def step(s: int) -> None:
        for batch in micro_batches(data.global_batch(s, t.global_batch_size), t.micro_batch_size, 0, 1):
            batch = batch.to(device)
            out = compiled(batch[:, :-1])
            loss = lm_loss(out.logits, batch[:, 1:]) + moe_cfg.aux_loss_coef * out.aux_loss + moe_cfg.z_loss_coef * out.z_loss
            loss.backward()
        with record_function("bench::optimizer"):
            if master is not model:
                for mp, p in zip(master_params, params):
                    mp.grad = p.grad.float()
            if t.grad_clip:
                torch.nn.utils.clip_grad_norm_(master_params, t.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if master is not model:
                with torch.no_grad():
                    torch._foreach_copy_(params, master_params)
                model.zero_grad(set_to_none=True)

    step(0)  # compilation, when train.compile is on
    steps = iter(range(1, 1 << 30))
    fns = {"step": lambda: step(next(steps)),
           **matmul_fns([(4096, 1024, 1024), (1024, 4096, 1024), (2048, 2048, 2048)], dtype, device)}
    ms = interleaved_ms(fns, device, args.steps, warmup=1)
    step_s, peak = ms["step"] / 1e3, peak_gflops(ms)
    tokens = t.global_batch_size * t.seq_len
    tokens_per_s = tokens / step_s
    result = {"bench": "step", "device": str(device), "config": args.config, "dtype": t.dtype,
              "compile": t.compile, "tokens_per_step": tokens, "step_ms": round(step_s * 1e3, 1),
              "tokens_per_s": round(tokens_per_s, 1), "active_matmul_params": active,
              "flops_per_token": round(fpt), "gemm_peak_gflops": round(peak, 1), "dense_gflops": dense_rates(ms),
              "mfu": round(fpt * tokens_per_s / (peak * 1e9), 4)}
    if not t.compile:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            _sync(device)
            tic = time.perf_counter()
            step(next(steps))
            _sync(device)
            total = time.perf_counter() - tic
        secs = section_times(prof.events(), device.type == "cuda")
        shares = {k: round(v / total, 4) for k, v in secs.items()}
        shares["other"] = round(max(0.0, 1 - sum(secs.values()) / total), 4)
        result["time_share"] = shares
        result["profiled_step_ms"] = round(total * 1e3, 1)
    print(f"step {args.config} {t.dtype} on {device}: {t.global_batch_size}×{t.seq_len} tokens per step, median of "
          f"{args.steps} steps after one warm-up; one process, no DeepSpeed (fp32 master weights for bf16); "
          f"time_share from one more step under torch.profiler (forward + backward per section)")
    return result


# ----------------------------------------------------------------------------------------------- cli


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    parsers = []
    for name in ("_moe_mem", "moe"):
        m = sub.add_parser(name, help="forward+backward of one MoE layer" if name == "moe" else argparse.SUPPRESS)
        m.add_argument("--tokens", type=int, required=True)
        m.add_argument("--d-model", type=int, required=True)
        m.add_argument("--d-ff", type=int, required=True)
        m.add_argument("--experts", type=int, required=True)
        m.add_argument("--top-k", type=int, required=True)
        m.add_argument("--capacity-factor", type=lambda s: None if s in ("null", "none") else float(s), default=1.25,
                       help="per-expert capacity factor; 'null' = dropless (default 1.25)")
        m.add_argument("--backend", choices=["native", "megablocks"], default="native", help="model.moe.backend")
        m.add_argument("--dtype", choices=list(DTYPES), default="bf16")
        m.add_argument("--impl", choices=["auto", "torch", "triton", "cpu"], default="auto",
                       help="model.moe.impl (auto: the compiled CPU kernels on CPU, Triton on CUDA)")
        m.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        m.add_argument("--repeats", type=int, default=10)
        parsers.append(m)
    s = sub.add_parser("scan", help="forward+backward of the training selective scan vs the sequential reference")
    s.add_argument("--batch", type=int, required=True)
    s.add_argument("--seq", type=int, required=True)
    s.add_argument("--dim", type=int, required=True)
    s.add_argument("--state", type=int, required=True)
    s.add_argument("--impl", choices=["auto", "torch", "triton", "cpu"], default="auto",
                   help="model.mamba.impl of the scan timed (auto: the compiled CPU kernel on CPU, Triton on CUDA)")
    s.add_argument("--chunk-size", type=int, default=16, help="model.mamba.chunk_size of the chunked scan")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--ref-repeats", type=int, default=1)
    t = sub.add_parser("step", help="training steps of a config (one process, no DeepSpeed)")
    t.add_argument("--config", required=True)
    t.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    t.add_argument("--steps", type=int, default=4, help="measured optimizer steps (after one warm-up step)")
    t.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    t.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = train.threads, else all cores)")
    for sp in (*parsers, s):
        sp.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
        sp.add_argument("--malloc", choices=["keep", "default"], default="keep",
                        help="keep (as train.cpu_malloc): glibc keeps freed memory for reuse, no page faults on fresh "
                             "tensors; default: glibc as it is")
        sp.add_argument("--flush-denormal", action=argparse.BooleanOptionalAction, default=True,
                        help="flush subnormal floats to zero, as train.flush_denormal (default: on)")
        sp.add_argument("--hugepages", action=argparse.BooleanOptionalAction, default=True,
                        help="transparent huge pages for CPU tensors of 2 MiB and more, as train.cpu_hugepages "
                             "(default: on)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        for key in ("tokens", "d_model", "d_ff", "experts", "top_k", "batch", "seq", "dim", "state", "steps",
                    "repeats", "ref_repeats", "chunk_size"):
            if getattr(args, key, 1) < 1:
                raise ConfigError(f"--{key.replace('_', '-')}: must be positive, got {getattr(args, key)}")
        if args.cmd in ("moe", "_moe_mem") and args.top_k > args.experts:
            raise ConfigError(f"--top-k: must be at most --experts={args.experts}, got {args.top_k}")
        if args.cmd != "step":  # step applies its config's settings
            configure_host(args.threads, args.flush_denormal, args.malloc, args.hugepages)
        if args.cmd == "_moe_mem":
            moe_memory_child(args)
            return 0
        result = {"moe": bench_moe, "scan": bench_scan, "step": bench_step}[args.cmd](args)
    except ConfigError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
