"""Performance model of one training step, calibrated on measured runs (the fit of F, α and β to them is fit.py).

    step time = FLOPs_per_rank · ranks_per_device / F + Σ_collectives (hops · α + bytes_on_the_slowest_link / β)

One (α, β) pair for links inside a node and one across nodes; textbook collective algorithms; no overlap of
communication and compute except the EP row all-to-alls under `parallel.a2a_chunks` > 1 (`overlapped_rows_s`).
Invariant: the per-step list of collectives mirrors what a training step of this repository issues (EP, TP, ZeRO)
and the rank placement of moe_dist.parallel.mesh; a change to either must change this file too. The list, the
placement and the calibration: docs/perf_model.md, section "The model"; checked against benchmarks/scaling.py's
instrumented runs by tests/test_bench_common.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moe_dist.config import JobConfig

KINDS = ("all_to_all", "all_reduce", "reduce_scatter", "all_gather", "other")
SCALAR_ALL_REDUCES_PER_STEP = 5  # gradient-norm pieces and the metrics vector (measured: 4-6 tiny calls)


# --------------------------------------------------------------------------------------------- collectives


def collective_terms(kind: str, n: int, payload_bytes: float) -> tuple[int, float]:
    """(latency hops, bytes each rank sends) of one collective on n ranks.

    payload_bytes: all-reduce — the buffer; all-gather — the gathered (output) buffer; reduce-scatter — the
    input buffer; all-to-all — what this rank holds for all destinations (its own share stays local);
    other (broadcast, barrier) — the buffer, sent once along a tree.
    """
    if n <= 1:
        return 0, 0.0
    if kind == "all_reduce":  # ring: reduce-scatter then all-gather
        return 2 * (n - 1), 2.0 * (n - 1) / n * payload_bytes
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return n - 1, (n - 1) / n * payload_bytes
    if kind == "other":
        return math.ceil(math.log2(n)), float(payload_bytes)
    raise ValueError(f"unknown collective kind {kind!r}")


@dataclass(frozen=True)
class Link:
    alpha_s: float  # latency per hop (message), seconds
    beta_Bps: float  # bandwidth per rank, bytes/second

    def time(self, hops: float, wire_bytes: float) -> float:
        return hops * self.alpha_s + wire_bytes / self.beta_Bps


@dataclass(frozen=True)
class Hardware:
    name: str
    flops_per_s: float  # sustained throughput of one device (peak × MFU for a GPU; fitted for a CPU)
    ranks_per_node: int
    intra: Link  # inside a node (NVLink; loopback on one CPU machine)
    inter: Link  # across nodes (InfiniBand; the veth links between network namespaces)
    memory_bytes: float | None = None  # device memory, for the fit check of a layout
    peak_flops_per_s: float | None = None  # for reporting MFU


@dataclass(frozen=True)
class Layout:
    dp: int
    ep: int
    tp: int
    etp: int | None = None  # expert tensor-parallel size: tp (None) or 1 (whole experts, EP spans dp × tp)

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def folded(self) -> bool:
        return self.etp == 1 and self.tp > 1

    def __str__(self) -> str:
        return f"dp{self.dp}-ep{self.ep}-tp{self.tp}" + ("-etp1" if self.folded else "")


@dataclass(frozen=True)
class Call:
    """One collective issued `count` times per step by every rank of its group."""

    kind: str
    label: str  # what it moves: "moe_rows", "moe_counts", "tp_act", "dense_grad", "expert_param", ...
    group_size: int
    ranks_per_node: int  # ranks of the group on one node (== group_size when it stays inside a node)
    payload_bytes: float
    count: float

    @property
    def spans_nodes(self) -> bool:
        return self.ranks_per_node < self.group_size


def call_time(call: Call, hw: Hardware) -> float:
    """Seconds for one instance of `call`: α per hop plus the bytes over the slowest link they cross."""
    hops, wire = collective_terms(call.kind, call.group_size, call.payload_bytes)
    if not call.spans_nodes:
        return hw.intra.time(hops, wire)
    n, g = call.group_size, call.ranks_per_node
    if call.kind == "all_to_all":  # a (g-1)/n share stays in the node, (n-g)/n crosses it, concurrently
        intra = call.payload_bytes * (g - 1) / n
        inter = call.payload_bytes * (n - g) / n
        return hops * hw.inter.alpha_s + max(intra / hw.intra.beta_Bps, inter / hw.inter.beta_Bps)
    # A ring spanning nodes moves at the pace of its slowest edge (one NIC per rank: NCCL's rings use them all).
    return hops * hw.inter.alpha_s + wire / min(hw.intra.beta_Bps, hw.inter.beta_Bps)


def bottleneck_features(
    kind: str, n: int, g: int, payload_bytes: float, wire_bytes: float | None = None
) -> tuple[float, float]:
    """(hops, bytes) whose α–β cost `call_time` charges to the slower link: the regression features of a fit.

    wire_bytes overrides the bytes a rank sends (an uneven all-to-all measured exactly).
    """
    hops, wire = collective_terms(kind, n, payload_bytes)
    if wire_bytes is not None:
        wire = wire_bytes
    if g < n and kind == "all_to_all" and n > 1:
        wire = wire * (n - g) / (n - 1)  # the inter-node share of what this rank sends
    return hops, wire


# ------------------------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class ModelCost:
    """What a model costs per token, from its meta-built parameters (no memory allocated)."""

    fwd_flops_per_token: float
    dense_params: int  # everything but expert weights (embeddings, attention/Mamba, router, norms, dense FFN)
    expert_params: int  # stacked expert weights, all experts
    n_moe_layers: int
    n_layers: int
    d_model: int
    n_mamba_layers: int = 0
    ssm_proj_width: int = 0  # x_proj's output per token: dt_rank + 2 · d_state


def model_cost(cfg: JobConfig) -> ModelCost:
    """Forward FLOPs per token: 2 · (matmul weights a token touches) + causal attention scores + the SSM scan."""
    from moe_dist.models.decoder import build_model

    m = cfg.model
    model = build_model(m)
    matmul = dense = expert = 0.0
    for name, p in model.named_parameters():
        is_expert = ".experts." in name
        if is_expert:
            expert += p.numel()
        else:
            dense += p.numel()
        if p.ndim < 2 or name.endswith("A_log") or (name.startswith("embed.") and not m.tie_embeddings):
            continue  # vectors, the SSM's A and the embedding lookup cost no matmul FLOPs
        matmul += p.numel() * (m.moe.top_k / m.moe.num_experts if is_expert else 1.0)
    S = cfg.train.seq_len
    kinds = m.layer_kinds()
    n_attn = sum(mixer == "attention" for mixer, _ in kinds)
    n_mamba = sum(mixer == "mamba1" for mixer, _ in kinds)
    n_mamba2 = sum(mixer == "mamba2" for mixer, _ in kinds)
    n_gdn = sum(mixer == "gdn" for mixer, _ in kinds)
    head_dim = m.attention.head_dim or m.d_model // m.attention.n_heads
    attn = 2.0 * S * m.attention.n_heads * head_dim  # QKᵀ and AV, causal: half of 4·S·H·Dh per token
    scan = 9.0 * m.mamba.expand * m.d_model * m.mamba.d_state  # discretize + recurrence + readout (Mamba §3)
    # Chunked SSD per token: intra-chunk C·Bᵀ and its use (2·chunk·(N + P) per head, half for causality) plus the
    # state update and readout (4·P·N per head): the quadratic-in-chunk plus linear-in-state terms of Mamba-2.
    m2, g = m.mamba2, m.gdn
    ssd = m2.heads(m.d_model) * (2.0 * m2.chunk_size * (m2.d_state + m2.head_dim) + 4.0 * m2.head_dim * m2.d_state)
    # Chunked gated delta rule per token and value head: the same shape with dk for N and dv for P, plus the WY
    # correction (the chunk's triangular solve and k·S products, about 2·chunk·dk + 4·dk·dv).
    dk, dv = g.head_k_dim, g.head_v_dim
    delta = g.n_v_heads * (2.0 * g.chunk_size * (2 * dk + dv) + 8.0 * dk * dv)
    fwd = 2.0 * matmul + n_attn * attn + n_mamba * scan + n_mamba2 * ssd + n_gdn * delta
    n_moe = sum(ffn == "moe" for _, ffn in kinds)
    dt_rank = m.mamba.dt_rank or math.ceil(m.d_model / 16)
    return ModelCost(fwd, int(dense), int(expert), n_moe, m.n_layers, m.d_model, n_mamba, dt_rank + 2 * m.mamba.d_state)


def _group_placement(ranks: list[int], ranks_per_node: int) -> tuple[int, int]:
    """(group size, most ranks of the group on one node)."""
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[r // ranks_per_node] = per_node.get(r // ranks_per_node, 0) + 1
    return len(ranks), max(per_node.values())


def group_shapes(layout: Layout, ranks_per_node: int) -> dict[str, tuple[int, int]]:
    """(size, ranks per node) of rank 0's tp, ep, dp and edp groups under mesh.py's rank order."""
    tp, ep, dp = layout.tp, layout.ep, layout.dp
    rank = lambda d, t: d * tp + t  # noqa: E731
    folded = layout.folded  # EP groups of ep consecutive ranks, EDP groups strided by ep
    return {
        "tp": _group_placement([rank(0, t) for t in range(tp)], ranks_per_node),
        "ep": _group_placement(list(range(ep)) if folded else [rank(d, 0) for d in range(ep)], ranks_per_node),
        "dp": _group_placement([rank(d, 0) for d in range(dp)], ranks_per_node),
        "edp": _group_placement(
            list(range(0, layout.world, ep)) if folded else [rank(d, 0) for d in range(0, dp, ep)], ranks_per_node
        ),
    }


def micro_batches_per_rank(cfg: JobConfig, layout: Layout) -> int:
    t = cfg.train
    return t.global_batch_size // (t.micro_batch_size * layout.dp)


def step_flops_per_rank(cfg: JobConfig, layout: Layout, cost: ModelCost | None = None) -> float:
    """Training FLOPs (forward + 2 × backward) one rank executes per optimizer step."""
    cost = cost or model_cost(cfg)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len / layout.dp
    return 3.0 * cost.fwd_flops_per_token * tokens / layout.tp


def step_calls(cfg: JobConfig, layout: Layout, ranks_per_node: int, cost: ModelCost | None = None) -> list[Call]:
    """Every collective one rank issues in one optimizer step (docs/perf_model.md, section "The model")."""
    cost = cost or model_cost(cfg)
    t, moe = cfg.train, cfg.model.moe
    act = 2 if t.dtype == "bf16" else 4  # activations and the gradients DeepSpeed reduces, in the training dtype
    micro = micro_batches_per_rank(cfg, layout)
    tokens_mb = t.micro_batch_size * t.seq_len
    shapes = group_shapes(layout, ranks_per_node)
    calls: list[Call] = []

    def add(kind, label, group, payload, count):
        n, g = shapes[group]
        if n > 1 and count > 0:
            calls.append(Call(kind, label, n, g, float(payload), float(count)))

    # Expert parallelism: the micro-batch's rows, k assignments each, 1/tp of them from each TP rank.
    rows_bytes = tokens_mb * moe.top_k * cost.d_model * act / layout.tp
    etp = 1 if layout.folded else layout.tp
    add("all_to_all", "moe_counts", "ep", moe.num_experts * etp * 8, micro * cost.n_moe_layers)
    add("all_to_all", "moe_rows", "ep", rows_bytes, 4 * micro * cost.n_moe_layers)
    if layout.ep > 1 and etp > 1:  # the TP peers' received rows, gathered and reduce-scattered (tp · rows_bytes in all)
        add("all_gather", "moe_tp_rows", "tp", rows_bytes * layout.tp, 2 * micro * cost.n_moe_layers)
        add("reduce_scatter", "moe_tp_rows", "tp", rows_bytes * layout.tp, 2 * micro * cost.n_moe_layers)
    # Tensor parallelism (no sequence parallelism): all-reduces at the region boundaries, see the docstring.
    add("all_reduce", "tp_act", "tp", tokens_mb * cost.d_model * act, micro * (4 * cost.n_layers + 2))
    add("all_reduce", "tp_ssm", "tp", tokens_mb * cost.ssm_proj_width * act, 2 * micro * cost.n_mamba_layers)
    add("all_reduce", "tp_router", "tp", tokens_mb * moe.top_k * 4, micro * cost.n_moe_layers)
    add("all_reduce", "tp_loss", "tp", tokens_mb * 4, 3 * micro)
    # ZeRO-1 data parallelism (ZeRO-2: gradients reduced every micro-batch).
    reduces = micro if cfg.deepspeed.zero_stage >= 2 else 1
    dense_local = cost.dense_params / layout.tp
    expert_local = cost.expert_params / (layout.ep * etp)
    add("all_reduce", "dense_grad", "dp", dense_local * act, reduces)
    add("all_reduce", "expert_grad", "edp", expert_local * act, reduces)
    add("all_gather", "dense_param", "dp", dense_local * act, 1)
    add("all_gather", "expert_param", "edp", expert_local * act, 1)
    if layout.world > 1:
        n, g = layout.world, min(layout.world, ranks_per_node)
        calls.append(Call("all_reduce", "scalars", n, g, 8.0, SCALAR_ALL_REDUCES_PER_STEP))
    return calls


def expert_gemm_s(cfg: JobConfig, layout: Layout, hw: Hardware, ranks_per_device: int, cost: ModelCost) -> float:
    """Forward expert-GEMM seconds of one MoE layer and micro-batch on one rank (balanced routing, no drops): its
    share of the k·T rows × the active expert weights, 1/tp of them either way: all TP peers' rows through 1/tp of
    each expert's hidden units (etp = tp), or its own 1/tp token slice's rows through whole experts (etp = 1)."""
    t, moe = cfg.train, cfg.model.moe
    weights_per_row = cost.expert_params / max(cost.n_moe_layers, 1) / moe.num_experts  # one expert's 3·d·f
    flops = 2.0 * t.micro_batch_size * t.seq_len * moe.top_k * weights_per_row / layout.tp
    return flops * ranks_per_device / hw.flops_per_s


def overlapped_rows_s(call: Call, hw: Hardware, chunks: int, expert_fwd_s: float) -> float:
    """Exposed seconds of the row all-to-alls `call` stands for (4 per MoE layer and micro-batch: dispatch and
    combine, forward and backward) when each dispatch is cut in `chunks` chunks (moe_dist/parallel/dispatch.py).

    Per layer and direction, the link moves 2·C chunk all-to-alls of `a` seconds each (1/C of the bytes, the full
    latency α·hops) one after the other, and the device runs C chunk GEMMs of `g` = G/C (G = `expert_fwd_s`
    forward, 2G backward); chunk c's GEMM needs its dispatch, its combine needs the GEMM. The pipeline's makespan
    is then max(2C·a + g, C·g + 2a), of which C·g is compute: exposed max(2C·a − (C−1)·g, 2a). C = 1 gives 2a,
    the unchunked schedule's two blocking calls."""
    a = call_time(Call(call.kind, call.label, call.group_size, call.ranks_per_node, call.payload_bytes / chunks, 1), hw)
    per_layer = sum(max(2 * chunks * a - (chunks - 1) * m * expert_fwd_s / chunks, 2 * a) for m in (1, 2))
    return call.count / 4 * per_layer


def memory_per_device(cfg: JobConfig, layout: Layout, cost: ModelCost | None = None) -> float:
    """Rough bytes per device: weights + gradients (training dtype), fp32 master + Adam moments (ZeRO-sharded),
    and the activations one micro-batch keeps for backward (flash attention, no recomputation)."""
    cost = cost or model_cost(cfg)
    m, t = cfg.model, cfg.train
    act = 2 if t.dtype == "bf16" else 4
    local = cost.dense_params / layout.tp + cost.expert_params / (layout.ep * (1 if layout.folded else layout.tp))
    grads = local * act / (layout.dp if cfg.deepspeed.zero_stage >= 2 else 1)
    states = 12.0 * (cost.dense_params + cost.expert_params) / (layout.tp * layout.dp)  # dense/dp, expert/(dp/ep)/ep
    kv = m.attention.n_kv_heads * (m.attention.head_dim or m.d_model // m.attention.n_heads)
    d, f = m.d_model, m.moe.d_ff or m.d_ff
    per_token_layer = act * (6 * d + 2 * kv + m.moe.top_k * (d + 3 * f))
    acts = per_token_layer * m.n_layers * t.micro_batch_size * t.seq_len / layout.tp
    return local * act + grads + states + acts


# ------------------------------------------------------------------------------------------- predictions


@dataclass
class StepPrediction:
    layout: Layout
    compute_s: float
    comm_s: dict[str, float]  # by collective kind
    bytes_per_rank: dict[str, float]  # bytes one rank sends per step, by kind
    step_s: float
    tokens_per_s: float
    memory_bytes: float
    mfu: float | None = None
    calls: list[Call] = field(default_factory=list)
    a2a_chunks: int = 1


def predict_step(
    cfg: JobConfig,
    layout: Layout,
    hw: Hardware,
    ranks_per_device: int = 1,
    ranks_per_node: int | None = None,
    cost: ModelCost | None = None,
    a2a_chunks: int | None = None,
) -> StepPrediction:
    """Step time of `cfg` at `layout` on `hw`. ranks_per_device > 1 when ranks share one device (CPU cores);
    a2a_chunks overrides `parallel.a2a_chunks` (the row all-to-alls pipelined against the expert GEMMs)."""
    cost = cost or model_cost(cfg)
    rpn = ranks_per_node or hw.ranks_per_node
    flops = step_flops_per_rank(cfg, layout, cost)
    compute = flops * ranks_per_device / hw.flops_per_s
    comm = dict.fromkeys(KINDS, 0.0)
    sent = dict.fromkeys(KINDS, 0.0)
    calls = step_calls(cfg, layout, rpn, cost)
    chunks = a2a_chunks or cfg.parallel.a2a_chunks
    for c in calls:
        if c.label == "moe_rows" and chunks > 1:
            comm[c.kind] += overlapped_rows_s(c, hw, chunks, expert_gemm_s(cfg, layout, hw, ranks_per_device, cost))
        else:
            comm[c.kind] += c.count * call_time(c, hw)
        sent[c.kind] += c.count * collective_terms(c.kind, c.group_size, c.payload_bytes)[1]
    step = compute + sum(comm.values())
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    mfu = flops / step / hw.peak_flops_per_s if hw.peak_flops_per_s else None
    memory = memory_per_device(cfg, layout, cost)
    return StepPrediction(layout, compute, comm, sent, step, tokens / step, memory, mfu, calls, chunks)


# --------------------------------------------------------------------------------------------------- H200

# Published figures (NVIDIA H200 Tensor Core GPU datasheet/product page, SXM): BF16 Tensor Core 1,979 TFLOPS
# *with sparsity*, i.e. 989 TFLOPS dense; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s per GPU (bidirectional,
# 450 GB/s each way). The cluster of the issue: 8 GPUs per node, one 400 Gb/s InfiniBand NIC per GPU
# (50 GB/s each way). Assumptions (ours, not published): MFU 40% of dense peak on the model FLOPs; collectives
# reach 80% of NVLink's and 90% of InfiniBand's one-way bandwidth; α = 3 µs per hop in a node, 8 µs across.
H200_BF16_DENSE_PEAK = 989e12
H200_MEMORY = 141e9


def h200_cluster(mfu: float = 0.40) -> Hardware:
    return Hardware(
        name=f"H200 SXM, 8/node, NVLink 900 GB/s, 400 Gb/s IB per GPU, MFU {mfu:.0%}",
        flops_per_s=H200_BF16_DENSE_PEAK * mfu,
        ranks_per_node=8,
        intra=Link(alpha_s=3e-6, beta_Bps=0.8 * 450e9),
        inter=Link(alpha_s=8e-6, beta_Bps=0.9 * 50e9),
        memory_bytes=H200_MEMORY,
        peak_flops_per_s=H200_BF16_DENSE_PEAK,
    )


def candidate_layouts(gpus: int, num_experts: int, global_batch: int, micro_batch: int) -> dict[str, Layout]:
    """The layout families compared in docs/perf_model.md, where they are valid at this GPU count."""
    families = {
        "ZeRO-1 DP only": lambda n: Layout(n, 1, 1),
        "EP8 in node": lambda n: Layout(n, 8, 1),
        "EP4 x TP2 in node": lambda n: Layout(n // 2, 4, 2),
        "TP8 in node": lambda n: Layout(n // 8, 1, 8),
        "EP8 x TP2 (EP over 2 nodes)": lambda n: Layout(n // 2, 8, 2),
        "EP8 x TP8 (EP over 8 nodes)": lambda n: Layout(n // 8, 8, 8),
        "EP8 x TP2 folded (etp 1, EP in node)": lambda n: Layout(n // 2, 8, 2, etp=1),
        "EP8 x TP8 folded (etp 1, EP = TP node)": lambda n: Layout(n // 8, 8, 8, etp=1),
        "EP16 x TP2 folded (etp 1, EP over 2 nodes)": lambda n: Layout(n // 2, 16, 2, etp=1),
    }
    out = {}
    for name, make in families.items():
        lay = make(gpus)
        if (
            lay.dp >= 1
            and lay.world == gpus
            and (lay.world if lay.folded else lay.dp) % lay.ep == 0
            and num_experts % lay.ep == 0
            and global_batch % (micro_batch * lay.dp) == 0
        ):
            out[name] = lay
    return out


def scaling_sweep(
    cfg: JobConfig,
    hw: Hardware,
    gpu_counts=(8, 16, 32, 64, 128, 256, 512, 1024),
    chunk_options=(1, 2, 4),
) -> list[dict]:
    """Predictions for every candidate layout at every GPU count, each at its fastest `parallel.a2a_chunks` of
    `chunk_options` (with the unchunked all-to-all time beside it). Scaling efficiency = tokens/s ÷ (GPUs × the
    compute-bound rate of one GPU) = compute time / step time: what communication leaves of linear scaling."""
    cost = model_cost(cfg)
    rows = []
    for n in gpu_counts:
        for family, lay in candidate_layouts(
            n, cfg.model.moe.num_experts, cfg.train.global_batch_size, cfg.train.micro_batch_size
        ).items():
            plain = predict_step(cfg, lay, hw, cost=cost, a2a_chunks=1)
            p = min(
                (predict_step(cfg, lay, hw, cost=cost, a2a_chunks=c) for c in chunk_options), key=lambda q: q.step_s
            )
            rows.append(
                {
                    "gpus": n,
                    "family": family,
                    "layout": str(lay),
                    "step_s": p.step_s,
                    "tokens_per_s": p.tokens_per_s,
                    "tokens_per_s_per_gpu": p.tokens_per_s / n,
                    "scaling_efficiency": p.compute_s / p.step_s,
                    "mfu": p.mfu,
                    "compute_s": p.compute_s,
                    **{f"{k}_s": v for k, v in p.comm_s.items()},
                    "a2a_chunks": p.a2a_chunks,
                    "all_to_all_unchunked_s": plain.comm_s["all_to_all"],
                    "memory_gb": p.memory_bytes / 1e9,
                    "fits": hw.memory_bytes is None or p.memory_bytes <= hw.memory_bytes,
                }
            )
    return rows


def recommend(rows: list[dict]) -> dict[int, dict]:
    """Per GPU count, the fastest layout that fits in memory."""
    best: dict[int, dict] = {}
    for r in rows:
        if r["fits"] and (r["gpus"] not in best or r["tokens_per_s"] > best[r["gpus"]]["tokens_per_s"]):
            best[r["gpus"]] = r
    return best
