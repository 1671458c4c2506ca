"""gpu_check's `bench` part: each Triton kernel against its PyTorch path at training-like sizes in bf16, in the same
interleaved rounds: flash attention vs SDPA (TFLOP/s, also with document masks, where SDPA has no fused kernel),
the selective scan, the Mamba-2 SSD and the gated delta rule (fla's kernels) vs their chunked PyTorch paths and
the token permutation vs index ops (GB/s moved). On --dry-run
the same plumbing runs on the CPU at tiny sizes with the PyTorch path on both sides."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.common import interleaved_ms
from benchmarks.gpu_check.budget import BudgetSpent
from moe_dist.train.throughput import measured_peak

BF16 = torch.bfloat16


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


def attention_cases(impls, dev, tiny):
    from moe_dist.layers.attention import attention_kernel

    flash, sdpa = (attention_kernel(i, dev) for i in impls)
    shapes = [(4, 32, 8, 4096, 128, "causal"), (4, 32, 8, 4096, 128, "documents"), (8, 16, 16, 2048, 64, "causal")]
    for batch, hq, hkv, seq, dh, mask in shapes[:2] if tiny else shapes:
        if tiny:
            batch, hq, hkv, seq, dh = 1, 4, 2, 64, 16
        q = torch.randn(batch, hq, seq, dh, device=dev, dtype=BF16)
        k, v = (torch.randn(batch, hkv, seq, dh, device=dev, dtype=BF16) for _ in range(2))
        kw = {"causal": True}
        if mask == "documents":  # four documents per row: SDPA needs an explicit mask, our kernel skips blocks
            kw["document_ids"] = (torch.arange(seq, device=dev) * 4 // seq).expand(batch, -1).contiguous()
        # causal QKᵀ and PV; with documents only the diagonal blocks' work is needed
        flops = 4 * batch * hq * seq * seq * dh * 0.5 / (4 if mask == "documents" else 1)
        shape = f"B{batch} H{hq}/{hkv} S{seq} D{dh} {mask}"
        yield Case("attention fwd vs SDPA", shape, flops, *[_fwd(fn, q, k, v, **kw) for fn in (flash, sdpa)], "TFLOP/s")
        grad = torch.randn_like(q)
        fwd_bwd = [_fwd_bwd(fn, [q, k, v], grad, **kw) for fn in (flash, sdpa)]
        yield Case("attention fwd+bwd vs SDPA", shape, 3.5 * flops, *fwd_bwd, unit="TFLOP/s")  # bwd = 2.5 × fwd


def scan_cases(impls, dev, tiny):
    from moe_dist.layers.mamba import scan_kernel

    scans = [scan_kernel(i, dev) for i in impls]  # the kernel, the chunked PyTorch scan
    batch, dim, seqlen, state = (1, 32, 64, 4) if tiny else (2, 4096, 2048, 16)
    u, delta, z = (torch.randn(batch, dim, seqlen, device=dev, dtype=BF16) for _ in range(3))
    B, C = (torch.randn(batch, state, seqlen, device=dev, dtype=BF16) for _ in range(2))
    A = -torch.rand(dim, state, device=dev) - 0.5
    D, bias = torch.randn(dim, device=dev), torch.randn(dim, device=dev) - 2.0
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


def recurrence_cases(impls, dev, tiny):
    """The Mamba-2 SSD and the gated delta rule: fla's chunked Triton kernels against our chunked PyTorch paths
    (bytes: each input read, the output and the final state written; bf16 activations, fp32 decays and state)."""
    from moe_dist.layers.gdn import delta_rule_kernel
    from moe_dist.layers.mamba2 import scan_kernel as ssd_kernel

    b, L, H, P, G, N = (1, 64, 2, 16, 1, 16) if tiny else (2, 4096, 64, 64, 8, 128)  # Nemotron-H-like heads
    ssds = [ssd_kernel(i, dev, d_state=N) for i in impls]
    x = torch.randn(b, L, H, P, device=dev, dtype=BF16)
    dt = torch.nn.functional.softplus(torch.randn(b, L, H, device=dev)) * 0.1
    A = -torch.rand(H, device=dev) - 0.5
    B, C = (torch.randn(b, L, G, N, device=dev, dtype=BF16) for _ in range(2))
    D = torch.randn(H, device=dev)
    state = b * H * P * N * 4
    ssd_bytes = 2 * x.numel() * 2 + 2 * B.numel() * 2 + dt.numel() * 4 + state
    shape = f"B{b} L{L} H{H} P{P} G{G} N{N}"
    yield Case("ssd fwd vs chunked torch", shape, ssd_bytes, *[_fwd(f, x, dt, A, B, C, D) for f in ssds])
    yield Case(
        "ssd fwd+bwd vs chunked torch",
        shape,
        2 * ssd_bytes,
        *[_fwd_bwd(lambda *t, f=f: f(*t)[0], [x, dt, A, B, C, D], torch.randn_like(x)) for f in ssds],
    )
    H, K, V = (2, 16, 16) if tiny else (32, 128, 128)  # Qwen3-Next's value heads and head sizes
    rules = [delta_rule_kernel(i, dev, head_k_dim=K) for i in impls]
    q, k = (torch.nn.functional.normalize(torch.randn(b, L, H, K, device=dev), dim=-1).to(BF16) for _ in range(2))
    v = torch.randn(b, L, H, V, device=dev, dtype=BF16)
    g = -torch.nn.functional.softplus(torch.randn(b, L, H, device=dev)) * 0.1
    beta = torch.rand(b, L, H, device=dev).to(BF16)
    gdn_bytes = (q.numel() + k.numel() + 2 * v.numel() + beta.numel()) * 2 + g.numel() * 4 + b * H * K * V * 4
    shape = f"B{b} L{L} H{H} K{K} V{V}"
    yield Case("gdn fwd vs chunked torch", shape, gdn_bytes, *[_fwd(f, q, k, v, g, beta) for f in rules])
    yield Case(
        "gdn fwd+bwd vs chunked torch",
        shape,
        2 * gdn_bytes,
        *[_fwd_bwd(lambda *t, f=f: f(*t)[0], [q, k, v, g, beta], torch.randn_like(v)) for f in rules],
    )


def permutation_cases(impls, dev, tiny):
    from moe_dist.layers.permutation import Permutation

    perms = [Permutation.for_device(i, dev) for i in impls]
    T, D, K, E, cf = (64, 32, 2, 4, 1.25) if tiny else (16384, 4096, 2, 8, 1.25)
    g = torch.Generator(device=dev).manual_seed(0)
    expert_A = torch.randint(0, E, (K * T,), device=dev, generator=g)
    order_A = torch.argsort(expert_A, stable=True)
    counts_E = torch.bincount(expert_A, minlength=E)
    position_A = torch.arange(K * T, device=dev) - (torch.cumsum(counts_E, 0) - counts_E)[expert_A[order_A]]
    rows_R = order_A[position_A < math.ceil(cf * T * K / E)]  # kept assignments, by expert
    R = rows_R.shape[0]
    weight_A = torch.rand(K * T, device=dev)
    x_TD, y_RD = torch.randn(T, D, device=dev, dtype=BF16), torch.randn(R, D, device=dev, dtype=BF16)
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


def part_bench(args, budget, figures) -> tuple[str, str]:
    """Runs the cases while the budget lasts; a kernel that fails is reported and the others still run. A budget
    stop keeps the ratios measured so far (in the message and the figures)."""
    tiny = args.dry_run
    dev = "cpu" if tiny else "cuda"
    impls = ("torch", "torch") if tiny else ("triton", "torch")
    if not tiny:
        import triton

        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    size = 256 if tiny else 8192
    peak = measured_peak(torch.device(dev), "bf16", n=size, repeats=2 if tiny else 10).flops_per_s / 1e12
    figures["matmul_peak_tflops"] = peak
    print(f"bf16 matmul peak ({size}³, measured): {peak:.1f} TFLOP/s")
    print(f"{'benchmark':<32} {'shape':<34} {'triton':>8} {'torch':>8} {'unit':<8} {'ratio':>7}")
    ratios, failed, short = figures.setdefault("ratios", {}), [], []
    for family in (attention_cases, scan_cases, recurrence_cases, permutation_cases):
        for case in family(impls, dev, tiny):
            try:
                budget.check(case.name)
            except BudgetSpent as stop:
                raise BudgetSpent(f"{stop}; measured {', '.join(f'{k} {v:.2f}x' for k, v in ratios.items())}") from None
            try:
                ms = interleaved_ms({"triton": case.triton, "torch": case.torch}, dev, repeats=2 if tiny else 10)
            except Exception as err:  # a kernel that fails here is reported; the other benchmarks still run
                failed.append(f"{case.name} {case.shape}: {type(err).__name__}: {str(err).splitlines()[0]}")
                print(f"{case.name:<32} {case.shape:<34} FAILED {failed[-1]}")
                continue
            scale = 1e12 if case.unit == "TFLOP/s" else 1e9
            tri, tor = (case.work / (ms[k] * 1e-3) / scale for k in ("triton", "torch"))
            note = f"{tri / peak:.0%} of matmul peak" if case.unit == "TFLOP/s" else ""
            print(f"{case.name:<32} {case.shape:<34} {tri:8.1f} {tor:8.1f} {case.unit:<8} {tri / tor:6.2f}x  {note}")
            ratios[f"{case.name.split(' vs')[0]} {case.shape}"] = tri / tor
            masked = " documents" if "documents" in case.shape else ""
            short.append(f"{case.name.split(' vs')[0]}{masked} {tri / tor:.2f}x")
    short = ", ".join(short)
    summary = f"bf16 matmul peak {peak:.0f} TFLOP/s; {impls[0]}/{impls[1]}: {short}"
    return ("FAILED", "\n".join([summary, *failed])) if failed else ("ok", summary)
