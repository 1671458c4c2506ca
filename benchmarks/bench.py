"""Benchmarks: where the time of an MoE layer, the selective scan and a training step goes.

    python -m benchmarks.bench moe --tokens 4096 --d-model 512 --d-ff 1024 --experts 8 --top-k 2 [--dtype bf16]
    python -m benchmarks.bench scan --batch 2 --seq 2048 --dim 512 --state 16
    python -m benchmarks.bench step --config configs/mixtral_small.json [--set KEY=VALUE ...] [--steps 4]

Each prints readable lines, then one JSON object as the last stdout line. Speeds are ratios measured in the
same run (docs/benchmarks.md): achieved FLOP/s against this machine's own torch.mm rate for the dtype; our MoE layer
against the same layer written the plain way (`PlainMoE`: vs_plain = plain_ms / fwd_bwd_ms, ≥ 1 means ours is at
least as fast) and, where its kernels are not the PyTorch paths, against itself on them; the scan against its
sequential reference and the chunked PyTorch scan. Timings are medians over interleaved rounds (common.py); the
first rounds are warm-up. `implementations` says which kernels the layers chose for the device.
`--device auto` (the default) takes CUDA when present; CUDA timings synchronize around each measured call.
Bad input → one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_step import bench_step
from benchmarks.common import DTYPES, interleaved_ms, matmul_fns, matmul_gflops, resolve_device, sig
from moe_dist.config import ConfigError, MoEConfig

IMPLS = ["auto", "torch", "triton"]
POSITIVE = ("tokens", "d_model", "d_ff", "experts", "top_k", "batch", "seq", "dim", "state", "steps", "repeats")


def emit(result: dict) -> None:
    for key, value in result.items():
        print(f"  {key}: {value}")
    print(json.dumps(result))


# ----------------------------------------------------------------------------------------------- moe
# Shape suffixes as in moe_dist/layers/moe.py: T tokens, D d_model, F d_ff, E experts, K top_k, A = T·K, R kept rows


class PlainMoE(nn.Module):
    """The same MoE written the plain way, the yardstick of `bench moe`: router linear → softmax → top-k
    (renormalized) → one stable sort of the flattened expert ids → gather the token rows → torch's grouped GEMM for
    gate/up, SiLU · up, grouped GEMM for down → weight and `index_add_` back per token. No capacity, no aux or z
    losses. Its own weights, of our layer's shapes: router (E, D), w13 = [gate | up] (E, D, 2F), w2 (E, F, D)."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        align = 16 // torch.empty(0, dtype=dtype).element_size()
        if d_model % align or d_ff % align:  # torch's grouped GEMM takes 16-byte aligned rows only
            raise ConfigError(
                f"the plain layer (torch's grouped GEMM) needs --d-model and --d-ff multiples of "
                f"{align} in {dtype}, got {d_model} and {d_ff}"
            )
        self.top_k, g = top_k, torch.Generator().manual_seed(1)

        def w(*shape: int, std: float) -> nn.Parameter:
            return nn.Parameter((torch.randn(*shape, generator=g) * std).to(device, dtype))

        self.router = w(num_experts, d_model, std=1.0)  # as bench_moe sets ours: routing spread over all experts
        self.w13 = w(num_experts, d_model, 2 * d_ff, std=d_model**-0.5)
        self.w2 = w(num_experts, d_ff, d_model, std=d_ff**-0.5)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
        probs_TE = F.linear(x_TD, self.router).softmax(dim=-1, dtype=torch.float32)
        weight_TK, expert_TK = probs_TE.topk(self.top_k, dim=-1)
        weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True)
        order_A = torch.argsort(expert_TK.flatten(), stable=True)  # token-major assignments, grouped by expert
        token_A = order_A // self.top_k
        offs_E = torch.cumsum(torch.bincount(expert_TK.flatten(), minlength=self.w13.shape[0]), 0).to(torch.int32)
        gate_AF, up_AF = grouped_mm(x_TD[token_A], self.w13, offs=offs_E).chunk(2, dim=-1)
        y_AD = grouped_mm(F.silu(gate_AF) * up_AF, self.w2, offs=offs_E)
        y_AD = y_AD * weight_TK.flatten()[order_A, None].to(y_AD.dtype)
        return torch.zeros_like(x_TD).index_add_(0, token_A, y_AD)


def _moe_setup(args, impl: str | None = None):
    from moe_dist.layers.moe import MoE

    device, dtype, impl = resolve_device(args.device), DTYPES[args.dtype], impl or args.impl
    cfg = MoEConfig(
        num_experts=args.experts,
        top_k=args.top_k,
        d_ff=args.d_ff,
        capacity_factor=args.capacity_factor,
        backend=args.backend,
        impl=impl,
    )
    torch.manual_seed(0)
    try:
        moe = MoE(args.d_model, args.d_ff, cfg, init_std=0.02, n_layers=2, device=device).to(device)
    except ValueError as err:  # an impl that cannot run here
        raise ConfigError(f"--impl {impl}: {err}") from None
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


def _expert_gemms(moe, x):
    """The layer's expert GEMMs alone (gate+up, down; `moe_dist.layers.experts.grouped_mm`), forward and backward, on
    rows routed as the layer routes x: the time the layer would take if routing, permutation and the SwiGLU
    activation cost nothing (its ceiling)."""
    from moe_dist.layers.experts import grouped_mm

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
    back) and the gated SiLU between the two GEMMs (`moe_dist.layers.mlp.gated_silu`, native backend). Where the
    time outside the GEMMs goes."""
    from moe_dist.layers.mlp import gated_silu

    with torch.no_grad():
        routing, _ = moe.router(x)
    R, Fh, D = int(routing.tokens_per_expert_E.sum()), *moe.experts.w2.shape[1:]
    x_TD, weight_A = x.detach().requires_grad_(), routing.weight_A.detach().requires_grad_()
    y_RD = torch.randn(R, D, dtype=x.dtype, device=x.device, requires_grad=True)
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
    if moe.implementations["experts"] == "grouped_mm":
        ab_R2F = torch.randn(R, 2 * Fh, dtype=x.dtype, device=x.device, requires_grad=True)
        g_RF = torch.randn(R, Fh, dtype=x.dtype, device=x.device)
        parts["activation"] = lambda: torch.autograd.grad(gated_silu(ab_R2F), ab_R2F, g_RF)
    return parts


def _minor_faults(fn, calls: int = 3) -> int:
    """Page faults (minor: pages the kernel had to map in again) per call of `fn`, the median of `calls`."""
    counts = []
    for _ in range(calls):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return int(statistics.median(counts))


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


def _peak_mem_mb(moe, x, dy, device) -> tuple[float, str]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _moe_fwd_bwd(moe, x, dy)
        return (
            (torch.cuda.max_memory_allocated(device) - base) / 2**20,
            "torch.cuda.max_memory_allocated rise over one forward+backward",
        )
    out = subprocess.run(
        [sys.executable, "-m", __spec__.name, "_moe_mem", *sys.argv[2:]], capture_output=True, text=True, check=True
    )
    return (
        float(out.stdout.strip().splitlines()[-1]),
        "peak-RSS rise over one forward+backward in a fresh process (after a warm-up pass)",
    )


def bench_moe(args) -> dict:
    moe, x, dy, device, dtype = _moe_setup(args)
    plain = PlainMoE(args.d_model, args.d_ff, args.experts, args.top_k, dtype, device)

    def plain_fwd_bwd():
        torch.autograd.grad(plain(x), [x, *plain.parameters()], dy)

    stats = _moe_fwd_bwd(moe, x, dy)
    try:
        plain_fwd_bwd()
    except RuntimeError as err:  # a dtype or device that torch's grouped GEMM does not take
        raise ConfigError(f"the plain layer: torch's grouped GEMM: {str(err).splitlines()[0]}") from None
    kept = stats.assignments - int(stats.dropped.item())
    T, D, Fh, E, K = args.tokens, args.d_model, args.d_ff, args.experts, args.top_k
    parts = _moe_parts(moe, x, dy)

    def layer():
        _moe_fwd_bwd(moe, x, dy)

    # vs_plain from rounds of the two layers alone, each first in half of them: on CPU, glibc hands large freed
    # blocks back to the kernel, and the page faults of touching them again land on whichever call comes next,
    # so the other closures' live buffers and the order within a round would otherwise decide the ratio.
    pair = {"layer": layer, "plain": plain_fwd_bwd}
    halves = [interleaved_ms(order, device, args.repeats) for order in (pair, dict(reversed(pair.items())))]
    fwd_bwd_ms, plain_ms = (statistics.mean(h[name] for h in halves) for name in pair)
    faults = {name: _minor_faults(fn) for name, fn in pair.items()} if device.type == "cpu" else None
    # Peak reference: dense matmuls with all T·K rows as one expert, in the shapes of the forward and both
    # gradient GEMMs of w1/w3 (D → F) and w2 (F → D), timed in turn with the breakdown right after the layers.
    fns = {
        "gemms": _expert_gemms(moe, x.detach()),
        **{f"part:{name}": fn for name, fn in parts.items()},
        **matmul_fns([(T * K, D, Fh), (T * K, Fh, D), (D, T * K, Fh), (Fh, T * K, D)], dtype, device),
    }
    torch_moe = _moe_setup(args, impl="torch")[0]
    if torch_moe.implementations != moe.implementations:  # the same layer (same weights) on the PyTorch paths,
        fns["layer"] = layer  # and the layer beside it in these rounds
        fns["layer_torch_impl"] = lambda: _moe_fwd_bwd(torch_moe, x, dy)
    ms = interleaved_ms(fns, device, args.repeats)
    gemms_ms, peak = ms["gemms"], matmul_gflops(ms)
    vs_plain = sig(plain_ms / fwd_bwd_ms)
    gemm_flops = 3 * 3 * 2 * kept * D * Fh  # gate, up, down (D·F each), ×3 for forward + the two backward GEMMs
    peak_mem, mem_note = _peak_mem_mb(moe, x, dy, device)
    print(
        f"moe T={T} D={D} F={Fh} E={E} K={K} cf={args.capacity_factor} {args.dtype} on {device}, "
        f"{torch.get_num_threads()} threads, implementations {moe.implementations}; "
        f"kept rows {kept}/{stats.assignments}"
    )
    print(
        f"  ours {fwd_bwd_ms:.3f} ms, plain {plain_ms:.3f} ms (dropless, all {T * K} rows): vs_plain {vs_plain} "
        f"(plain_ms / fwd_bwd_ms, >= 1: ours at least as fast); gemm_ceiling_fraction = the layer's expert GEMMs "
        f"alone (same calls and shapes, forward and backward) against the same peak; parts_ms = the router, the "
        f"permutation and the activation alone, forward and backward; peak_mem_mb = {mem_note}"
    )
    return {
        "bench": "moe",
        "device": str(device),
        "dtype": args.dtype,
        "tokens": T,
        "d_model": D,
        "d_ff": Fh,
        "experts": E,
        "top_k": K,
        "capacity_factor": args.capacity_factor,
        "kept_rows": kept,
        "threads": torch.get_num_threads(),
        "impl": args.impl,
        "implementations": moe.implementations,
        "fwd_bwd_ms": sig(fwd_bwd_ms),
        "plain_ms": sig(plain_ms),
        "vs_plain": vs_plain,
        **({"minor_faults_per_call": faults} if faults else {}),
        "gemm_peak_gflops": sig(peak),
        "achieved_gemm_gflops": sig(gemm_flops / fwd_bwd_ms / 1e6),
        "roofline_fraction": sig(gemm_flops / fwd_bwd_ms / 1e6 / peak),
        "expert_gemms_ms": sig(gemms_ms),
        "gemm_ceiling_fraction": sig(gemm_flops / gemms_ms / 1e6 / peak),
        "parts_ms": {name: sig(ms[f"part:{name}"]) for name in parts},
        "peak_mem_mb": sig(peak_mem),
        **(
            {
                "torch_impl_ms": sig(ms["layer_torch_impl"]),
                "speedup_vs_torch_impl": sig(ms["layer_torch_impl"] / ms["layer"]),
            }
            if "layer_torch_impl" in ms
            else {}
        ),
        "weight_grad_mb": sig(sum(p.numel() * p.element_size() for p in moe.parameters()) / 2**20),
    }


# ----------------------------------------------------------------------------------------------- scan


def bench_scan(args) -> dict:
    from moe_dist.kernels.reference import selective_scan_ref

    from moe_dist.layers.mamba import scan_kernel

    device = resolve_device(args.device)
    try:
        scan, chunked = scan_kernel(args.impl, device, args.chunk_size), scan_kernel("torch", device, args.chunk_size)
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
    print(
        f"scan B={Bt} L={L} D={Dm} N={N} fp32 on {device}: model.mamba.impl={args.impl!r} (runs {scan.name!r}) and "
        f"the chunked PyTorch scan (chunk {args.chunk_size}) vs the sequential reference"
    )
    return {
        "bench": "scan",
        "device": str(device),
        "batch": Bt,
        "seq": L,
        "dim": Dm,
        "state": N,
        "impl": args.impl,
        "implementation": scan.name,
        "chunk_size": args.chunk_size,
        "fwd_bwd_ms": sig(ms["scan"]),
        "chunked_ms": sig(ms["chunked"]),
        "speedup_vs_chunked": sig(ms["chunked"] / ms["scan"]),
        "reference_ms": sig(ref_ms),
        "speedup": sig(ref_ms / ms["scan"]),
    }


# ----------------------------------------------------------------------------------------------- ssd, gdn


def _recurrence_inputs(args, device, shapes: dict) -> dict:
    """fp32 inputs of a recurrent op, named and shaped as `shapes` says, from one seeded generator; a shape's
    entry may name a transform ("neg" → −rand − 0.5, "pos" → softplus, "unit" → sigmoid, "l2" → unit rows)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    out = {}
    for name, (shape, kind) in shapes.items():
        t = torch.randn(*shape, generator=g)
        t = {
            "neg": lambda t: -t.abs() - 0.5,
            "pos": lambda t: F.softplus(t) * 0.5,
            "unit": torch.sigmoid,
            "logdecay": lambda t: -F.softplus(t) * 0.1,
            "l2": lambda t: F.normalize(t, dim=-1),
            None: lambda t: t,
        }[kind](t)
        out[name] = t.to(device).requires_grad_()
    return out


def _bench_recurrence(name: str, args, chunked_fn, ref_fn, inputs: dict, desc: str) -> dict:
    """forward+backward of the chunked PyTorch path against the step-by-step reference, on the same inputs."""
    device = next(iter(inputs.values())).device
    leaves = tuple(inputs.values())

    def run(fn):
        y, state = fn(**inputs)
        torch.autograd.grad((y * dy).sum() + state.sum(), leaves)

    with torch.no_grad():
        (y, state), (y_ref, state_ref) = chunked_fn(**inputs), ref_fn(**inputs)
        diff = max((y - y_ref).abs().max().item(), (state - state_ref).abs().max().item())
        dy = torch.randn_like(y)
    ms = interleaved_ms({"chunked": lambda: run(chunked_fn)}, device, args.repeats)
    ref_ms = interleaved_ms({"ref": lambda: run(ref_fn)}, device, args.ref_repeats, warmup=0)["ref"]
    print(f"{desc} fp32 on {device}: the chunked PyTorch path (chunk {args.chunk_size}) vs the step-by-step reference")
    return {
        "bench": name,
        "device": str(device),
        **{k: getattr(args, k) for k in ("batch", "seq", "heads", "chunk_size")},
        "chunked_ms": sig(ms["chunked"]),
        "reference_ms": sig(ref_ms),
        "speedup": sig(ref_ms / ms["chunked"]),
        "max_abs_diff": sig(diff),  # of the outputs and final states, chunked against the reference
    }


def bench_ssd(args) -> dict:
    from moe_dist.kernels.reference import ssd_scan_ref

    from moe_dist.layers.ssd import ssd_scan

    if args.heads % args.groups:
        raise ConfigError(f"--groups: must divide --heads={args.heads}, got {args.groups}")
    b, L, H, P, G, N = args.batch, args.seq, args.heads, args.head_dim, args.groups, args.state
    shapes = {
        "x": ((b, L, H, P), None),
        "dt": ((b, L, H), "pos"),
        "A": ((H,), "neg"),
        "B": ((b, L, G, N), None),
        "C": ((b, L, G, N), None),
        "D": ((H,), None),
    }
    inputs = _recurrence_inputs(args, resolve_device(args.device), shapes)
    chunked = lambda **kw: ssd_scan(**kw, chunk_size=args.chunk_size)  # noqa: E731
    result = _bench_recurrence(
        "ssd", args, chunked, ssd_scan_ref, inputs, f"Mamba-2 SSD B={b} L={L} H={H} P={P} G={G} N={N}"
    )
    return {**result, "head_dim": P, "groups": G, "state": N}


def bench_gdn(args) -> dict:
    from moe_dist.kernels.reference import gated_delta_rule_ref

    from moe_dist.layers.delta_rule import chunk_gated_delta_rule

    b, L, H, K, V = args.batch, args.seq, args.heads, args.dk, args.dv
    shapes = {
        "q": ((b, L, H, K), "l2"),
        "k": ((b, L, H, K), "l2"),
        "v": ((b, L, H, V), None),
        "g": ((b, L, H), "logdecay"),
        "beta": ((b, L, H), "unit"),
    }
    inputs = _recurrence_inputs(args, resolve_device(args.device), shapes)
    chunked = lambda **kw: chunk_gated_delta_rule(**kw, chunk_size=args.chunk_size)  # noqa: E731
    result = _bench_recurrence(
        "gdn", args, chunked, gated_delta_rule_ref, inputs, f"gated delta rule B={b} L={L} H={H} dk={K} dv={V}"
    )
    return {**result, "dk": K, "dv": V}


# ----------------------------------------------------------------------------------------------- cli


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    impl_help = "model.{}.impl (auto: the Triton kernel on CUDA, the PyTorch path elsewhere)"
    parsers = []
    for name in ("_moe_mem", "moe"):
        m = sub.add_parser(name, help="forward+backward of one MoE layer" if name == "moe" else argparse.SUPPRESS)
        m.add_argument("--tokens", type=int, required=True)
        m.add_argument("--d-model", type=int, required=True)
        m.add_argument("--d-ff", type=int, required=True)
        m.add_argument("--experts", type=int, required=True)
        m.add_argument("--top-k", type=int, required=True)
        m.add_argument(
            "--capacity-factor",
            type=lambda s: None if s in ("null", "none") else float(s),
            default=1.25,
            help="per-expert capacity factor; 'null' = dropless (default 1.25)",
        )
        m.add_argument("--backend", choices=["native", "megablocks"], default="native", help="model.moe.backend")
        m.add_argument("--dtype", choices=list(DTYPES), default="bf16")
        m.add_argument("--impl", choices=IMPLS, default="auto", help=impl_help.format("moe"))
        m.add_argument("--repeats", type=int, default=10)
        parsers.append(m)
    s = sub.add_parser("scan", help="forward+backward of the training selective scan vs the sequential reference")
    s.add_argument("--batch", type=int, required=True)
    s.add_argument("--seq", type=int, required=True)
    s.add_argument("--dim", type=int, required=True)
    s.add_argument("--state", type=int, required=True)
    s.add_argument("--impl", choices=IMPLS, default="auto", help=impl_help.format("mamba"))
    s.add_argument("--chunk-size", type=int, default=16, help="model.mamba.chunk_size of the chunked scan")
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--ref-repeats", type=int, default=1)
    recurrences = []
    for name, what in (("ssd", "the Mamba-2 SSD scan"), ("gdn", "the gated delta rule")):
        r = sub.add_parser(name, help=f"forward+backward of {what}: chunked PyTorch path vs step-by-step reference")
        r.add_argument("--batch", type=int, required=True)
        r.add_argument("--seq", type=int, required=True)
        r.add_argument("--heads", type=int, required=True)
        r.add_argument("--chunk-size", type=int, default=64, help="chunk size of the chunked path")
        r.add_argument("--repeats", type=int, default=5)
        r.add_argument("--ref-repeats", type=int, default=1)
        recurrences.append(r)
    recurrences[0].add_argument("--head-dim", type=int, default=64)
    recurrences[0].add_argument("--groups", type=int, default=1)
    recurrences[0].add_argument("--state", type=int, default=128)
    recurrences[1].add_argument("--dk", type=int, default=128)
    recurrences[1].add_argument("--dv", type=int, default=128)
    t = sub.add_parser("step", help="training steps of a config (one process, no DeepSpeed)")
    t.add_argument("--config", required=True)
    t.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    t.add_argument("--steps", type=int, default=4, help="measured optimizer steps (after one warm-up step)")
    for sp in (*parsers, s, *recurrences, t):
        sp.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        sp.add_argument(
            "--threads",
            type=int,
            default=0,
            help="torch CPU threads (0 = torch's default; step: train.threads, else torch's default)",
        )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        for key in (*POSITIVE, "ref_repeats", "chunk_size"):
            if getattr(args, key, 1) < 1:
                raise ConfigError(f"--{key.replace('_', '-')}: must be positive, got {getattr(args, key)}")
        if args.cmd in ("moe", "_moe_mem") and args.top_k > args.experts:
            raise ConfigError(f"--top-k: must be at most --experts={args.experts}, got {args.top_k}")
        if args.threads and args.cmd != "step":  # step takes train.threads where --threads is 0
            torch.set_num_threads(args.threads)
        if args.cmd == "_moe_mem":
            moe_memory_child(args)
            return 0
        benches = {"moe": bench_moe, "scan": bench_scan, "ssd": bench_ssd, "gdn": bench_gdn, "step": bench_step}
        result = benches[args.cmd](args)
    except ConfigError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
