"""Performance model of one training step, calibrated on measured runs (the fit of F, α and β to them is fit.py).

    step time = (model + recomputed FLOPs per rank) · ranks_per_device / F
                + Σ_collectives (hops · α + bytes_on_the_slowest_link / β)  −  what overlap hides

One (α, β) pair for links inside a node and one across nodes; textbook collective algorithms. Overlap of
communication with compute, where the code issues it so: the EP row all-to-alls under `parallel.a2a_chunks` > 1
(`overlapped_rows_s`), and, with bf16 weights, the once-per-step gradient reduce-scatter behind the last
micro-batch's backward (an assumption for NCCL's asynchronous bucketed reduction, docs/perf_model.md, "Overlap").
Invariant: the per-step list of collectives mirrors what a training step of this repository issues (EP, TP, CP,
the data-parallel reduction) and the rank placement of moe_dist.parallel.mesh; a change to either must change this
file too. The list, the placement and the calibration: docs/perf_model.md, section "The model"; checked against
benchmarks/scaling.py's instrumented runs by tests/test_bench_common.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moe_dist.config import JobConfig
from moe_dist.models.activation_checkpointing import checkpointed_parts

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
    flops_per_s: float  # sustained rate on the FLOPs a device runs (peak × a share on a GPU; fitted on a CPU)
    ranks_per_node: int
    intra: Link  # inside a node (NVLink; loopback on one CPU machine)
    inter: Link  # across nodes (InfiniBand; the veth links between network namespaces)
    memory_bytes: float | None = None  # device memory, for the fit check of a layout
    peak_flops_per_s: float | None = None  # for reporting MFU
    tree_all_reduce: bool = False  # tiny all-reduces take a tree's 2·⌈log2 n⌉ hops (NCCL picks it), not a ring's


@dataclass(frozen=True)
class Layout:
    dp: int
    ep: int
    tp: int
    etp: int | None = None  # expert tensor-parallel size: tp (None) or 1 (whole experts, EP spans dp × cp × tp)
    cp: int = (
        1  # context parallelism: each sequence split over cp ranks (rank = (dp_rank · cp + cp_rank) · tp + tp_rank)
    )

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def zero(self) -> int:
        """Ranks holding the same dense weights, over which ZeRO shards and the dense gradients are reduced."""
        return self.dp * self.cp

    @property
    def folded(self) -> bool:
        return self.etp == 1 and self.tp > 1

    def __str__(self) -> str:
        cp = f"-cp{self.cp}" if self.cp > 1 else ""
        return f"dp{self.dp}{cp}-ep{self.ep}-tp{self.tp}" + ("-etp1" if self.folded else "")


def config_layout(cfg: JobConfig, world: int) -> Layout | None:
    """The config's own layout at `world` ranks (None where its tp × cp does not divide the world)."""
    par = cfg.parallel
    cp = par.cp
    if world % (par.tp * cp):
        return None
    folded = par.tp > 1 and par.expert_tp == 1
    return Layout(world // (par.tp * cp), par.ep, par.tp, 1 if folded else None, cp)


# Overlap windows a call can hide behind (predict_step): the backward of the step's last micro-batch (the gradient
# reduction's buckets are issued as that backward produces them) and the forward of the next step's first
# micro-batch (the updated parameters' all-gather, where the caller asks for it: `overlap_param_gather`).
LAST_BACKWARD, NEXT_FORWARD = "last_backward", "next_forward"


@dataclass(frozen=True)
class Call:
    """One collective issued `count` times per step by every rank of its group."""

    kind: str
    label: str  # what it moves: "moe_rows", "moe_counts", "tp_act", "dense_grad", "expert_param", "cp_kv", ...
    group_size: int
    ranks_per_node: int  # ranks of the group on one node (== group_size when it stays inside a node)
    payload_bytes: float
    count: float
    hides_behind: str | None = None  # LAST_BACKWARD / NEXT_FORWARD: asynchronous, overlaps that compute
    tree: bool = False  # a latency-bound all-reduce of a few bytes: a tree where `Hardware.tree_all_reduce`

    @property
    def spans_nodes(self) -> bool:
        return self.ranks_per_node < self.group_size


def call_time(call: Call, hw: Hardware) -> float:
    """Seconds for one instance of `call`: α per hop plus the bytes over the slowest link they cross."""
    hops, wire = collective_terms(call.kind, call.group_size, call.payload_bytes)
    if call.tree and hw.tree_all_reduce:
        hops = min(hops, 2 * math.ceil(math.log2(call.group_size)))
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


# activation_checkpointing's part name of each mixer kind (MoE layers recompute only their experts).
_MIXER_PART = {"attention": "attention", "mamba1": "mamba", "mamba2": "mamba2", "gdn": "gdn"}


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
    recompute_flops_per_token: float = 0.0  # the forward FLOPs activation checkpointing repeats in the backward
    recomputed: frozenset = frozenset()  # train.activation_checkpointing's parts
    n_attn_layers: int = 0
    n_mamba2_layers: int = 0
    n_gdn_layers: int = 0


def mixer_flops_per_token(cfg: JobConfig, kind: str) -> float:
    """Forward FLOPs per token of a mixer beyond its weights: causal attention scores, or the recurrent scan."""
    m, S = cfg.model, cfg.train.seq_len
    if kind == "attention":  # QKᵀ and AV, causal: half of 4·S·H·Dh per token
        return 2.0 * S * m.attention.n_heads * (m.attention.head_dim or m.d_model // m.attention.n_heads)
    if kind == "mamba1":  # discretize + recurrence + readout (Mamba §3)
        return 9.0 * m.mamba.expand * m.d_model * m.mamba.d_state
    if kind == "mamba2":
        # Chunked SSD: intra-chunk C·Bᵀ and its use (2·chunk·(N + P) per head, half for causality) plus the state
        # update and readout (4·P·N per head): the quadratic-in-chunk plus linear-in-state terms of Mamba-2.
        m2 = m.mamba2
        return m2.heads(m.d_model) * (2.0 * m2.chunk_size * (m2.d_state + m2.head_dim) + 4.0 * m2.head_dim * m2.d_state)
    if kind == "gdn":
        # Chunked gated delta rule per value head: the same shape with dk for N and dv for P, plus the WY
        # correction (the chunk's triangular solve and k·S products, about 2·chunk·dk + 4·dk·dv).
        g = m.gdn
        dk, dv = g.head_k_dim, g.head_v_dim
        return g.n_v_heads * (2.0 * g.chunk_size * (2 * dk + dv) + 8.0 * dk * dv)
    return 0.0


def model_cost(cfg: JobConfig) -> ModelCost:
    """Forward FLOPs per token: 2 · (matmul weights a token touches) + attention scores + the SSM scans; and the
    part of them activation checkpointing runs again in the backward (models/activation_checkpointing.py: each
    checkpointed mixer and dense FFN whole, of an MoE layer only its experts)."""
    from moe_dist.models.decoder import build_model

    m = cfg.model
    model = build_model(m)
    kinds = m.layer_kinds()
    parts = frozenset(checkpointed_parts(cfg.train))

    def recomputed(name: str) -> bool:
        if not name.startswith("blocks."):
            return False  # embedding, final norm, LM head
        _, i, sub, *rest = name.split(".")
        mixer, ffn = kinds[int(i)]
        if sub == "mixer":
            return _MIXER_PART[mixer] in parts
        if sub == "ffn":
            return ("moe_experts" in parts and rest[0] == "experts") if ffn == "moe" else "mlp" in parts
        return False  # the blocks' norms

    matmul = dense = expert = again = 0.0
    for name, p in model.named_parameters():
        is_expert = ".experts." in name
        if is_expert:
            expert += p.numel()
        else:
            dense += p.numel()
        if p.ndim < 2 or name.endswith("A_log") or (name.startswith("embed.") and not m.tie_embeddings):
            continue  # vectors, the SSM's A and the embedding lookup cost no matmul FLOPs
        flops = p.numel() * (m.moe.top_k / m.moe.num_experts if is_expert else 1.0)
        matmul += flops
        again += flops if recomputed(name) else 0.0
    count = {k: sum(mixer == k for mixer, _ in kinds) for k in _MIXER_PART}
    mixers = {k: count[k] * mixer_flops_per_token(cfg, k) for k in _MIXER_PART}
    fwd = 2.0 * matmul + sum(mixers.values())
    again = 2.0 * again + sum(v for k, v in mixers.items() if _MIXER_PART[k] in parts)
    n_moe = sum(ffn == "moe" for _, ffn in kinds)
    dt_rank = m.mamba.dt_rank or math.ceil(m.d_model / 16)
    return ModelCost(
        fwd,
        int(dense),
        int(expert),
        n_moe,
        m.n_layers,
        m.d_model,
        count["mamba1"],
        dt_rank + 2 * m.mamba.d_state,
        again,
        parts,
        count["attention"],
        count["mamba2"],
        count["gdn"],
    )


def _group_placement(ranks: list[int], ranks_per_node: int) -> tuple[int, int]:
    """(group size, most ranks of the group on one node)."""
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[r // ranks_per_node] = per_node.get(r // ranks_per_node, 0) + 1
    return len(ranks), max(per_node.values())


def group_shapes(layout: Layout, ranks_per_node: int) -> dict[str, tuple[int, int]]:
    """(size, ranks per node) of rank 0's tp, cp, ep, dp (ZeRO: dp × cp) and edp groups under mesh.py's rank order
    rank = q · tp + tp_rank with q = dp_rank · cp + cp_rank: EP groups are blocks of ep consecutive q (of ep
    consecutive ranks with etp = 1), the EDP groups stride across them."""
    tp, ep, q = layout.tp, layout.ep, layout.zero
    rank = lambda q, t: q * tp + t  # noqa: E731
    folded = layout.folded
    return {
        "tp": _group_placement([rank(0, t) for t in range(tp)], ranks_per_node),
        "cp": _group_placement([rank(c, 0) for c in range(layout.cp)], ranks_per_node),
        "ep": _group_placement(list(range(ep)) if folded else [rank(d, 0) for d in range(ep)], ranks_per_node),
        "dp": _group_placement([rank(d, 0) for d in range(q)], ranks_per_node),
        "edp": _group_placement(
            list(range(0, layout.world, ep)) if folded else [rank(d, 0) for d in range(0, q, ep)], ranks_per_node
        ),
    }


def micro_batches_per_rank(cfg: JobConfig, layout: Layout) -> int:
    t = cfg.train
    return t.global_batch_size // (t.micro_batch_size * layout.dp)


def tokens_per_micro_batch(cfg: JobConfig, layout: Layout) -> int:
    """Positions one rank runs per micro-batch: its 1/cp of each of the micro-batch's sequences."""
    return cfg.train.micro_batch_size * cfg.train.seq_len // layout.cp


def step_flops_per_rank(cfg: JobConfig, layout: Layout, cost: ModelCost | None = None) -> float:
    """Model FLOPs (forward + 2 × backward, no recompute: what MFU counts) one rank executes per optimizer step."""
    cost = cost or model_cost(cfg)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len / layout.dp
    return 3.0 * cost.fwd_flops_per_token * tokens / (layout.tp * layout.cp)


def recompute_flops_per_rank(cfg: JobConfig, layout: Layout, cost: ModelCost | None = None) -> float:
    """The forward FLOPs activation checkpointing repeats in the backward, per rank and optimizer step."""
    cost = cost or model_cost(cfg)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len / layout.dp
    return cost.recompute_flops_per_token * tokens / (layout.tp * layout.cp)


def cp_piece_bytes(cfg: JobConfig, kind: str, tp: int, cp: int) -> tuple[float, float]:
    """(summary, halo) bytes of one piece of one sequence that a recurrent mixer all-gathers under CP, per rank (its
    1/tp of the channels), as parallel/state_passing.py sends them: the summary packs the piece's final state and its
    transition in fp32 (a per-channel decay for Mamba-1, a per-head one for Mamba-2, the dk × dk operator per value
    head for the delta rule); the conv halo is its last min(d_conv − 1, piece length) conv inputs, in the
    activation dtype, in a second all-gather. Neither grows with the sequence once pieces are d_conv − 1 long."""
    m = cfg.model
    act = 2 if cfg.train.dtype == "bf16" else 4
    piece = cfg.train.seq_len // (2 * cp)
    if kind == "mamba1":
        di, n = m.mamba.expand * m.d_model // tp, m.mamba.d_state
        return 4.0 * 2 * di * n, act * min(m.mamba.d_conv - 1, piece) * di
    if kind == "mamba2":
        m2 = m.mamba2
        heads, conv = m2.heads(m.d_model) // tp, (m2.d_inner(m.d_model) + 2 * m2.n_groups * m2.d_state) // tp
        return 4.0 * heads * (m2.head_dim * m2.d_state + 1), act * min(m2.d_conv - 1, piece) * conv
    g = m.gdn  # gdn
    hv, conv = g.n_v_heads // tp, (2 * g.n_k_heads * g.head_k_dim + g.n_v_heads * g.head_v_dim) // tp
    return 4.0 * hv * g.head_k_dim * (g.head_v_dim + g.head_k_dim), act * min(g.conv_size - 1, piece) * conv


def step_calls(cfg: JobConfig, layout: Layout, ranks_per_node: int, cost: ModelCost | None = None) -> list[Call]:
    """Every collective one rank issues in one optimizer step (docs/perf_model.md, section "The model")."""
    cost = cost or model_cost(cfg)
    m, t, moe = cfg.model, cfg.train, cfg.model.moe
    act = 2 if t.dtype == "bf16" else 4  # activations (and, in fp32 training, the gradients) in the training dtype
    micro = micro_batches_per_rank(cfg, layout)
    tokens_mb = tokens_per_micro_batch(cfg, layout)
    tp, cp = layout.tp, layout.cp
    shapes = group_shapes(layout, ranks_per_node)
    calls: list[Call] = []
    # A collective inside a checkpointed mixer's own forward runs again in its recompute (activation_checkpointing.py).
    fwd = lambda part: micro * (2 if part in cost.recomputed else 1)  # noqa: E731

    def add(kind, label, group, payload, count, hides_behind=None):
        n, g = shapes[group]
        if n > 1 and count > 0:
            calls.append(Call(kind, label, n, g, float(payload), float(count), hides_behind))

    # Expert parallelism: the micro-batch's rows, k assignments each, 1/tp of them from each TP rank.
    rows_bytes = tokens_mb * moe.top_k * cost.d_model * act / tp
    etp = 1 if layout.folded else tp
    add("all_to_all", "moe_counts", "ep", moe.num_experts * etp * 8, micro * cost.n_moe_layers)
    add("all_to_all", "moe_rows", "ep", rows_bytes, 4 * micro * cost.n_moe_layers)
    if layout.ep > 1 and etp > 1:  # the TP peers' received rows, gathered and reduce-scattered (tp · rows_bytes in all)
        add("all_gather", "moe_tp_rows", "tp", rows_bytes * tp, 2 * micro * cost.n_moe_layers)
        add("reduce_scatter", "moe_tp_rows", "tp", rows_bytes * tp, 2 * micro * cost.n_moe_layers)
    # Tensor parallelism: all-reduces at the region boundaries, see the docstring (sequence parallelism replaces each
    # by an all-gather and a reduce-scatter: the same hops and bytes).
    add("all_reduce", "tp_act", "tp", tokens_mb * cost.d_model * act, micro * (4 * cost.n_layers + 2))
    add(
        "all_reduce",
        "tp_ssm",
        "tp",
        tokens_mb * cost.ssm_proj_width * act,
        (fwd("mamba") + micro) * cost.n_mamba_layers,
    )
    add("all_reduce", "tp_router", "tp", tokens_mb * moe.top_k * 4, micro * cost.n_moe_layers)
    add("all_reduce", "tp_loss", "tp", tokens_mb * 4, 3 * micro)
    m2 = m.mamba2
    if cost.n_mamba2_layers and m2.n_groups < tp:  # a B/C group spans tp / n_groups ranks (apply_tp's _mamba2)
        bc = tokens_mb * m2.n_groups * m2.d_state * act  # B or C, all groups, gathered before the scan
        add("all_gather", "tp_ssd_groups", "tp", bc, 2 * fwd("mamba2") * cost.n_mamba2_layers)
        add("reduce_scatter", "tp_ssd_groups", "tp", bc, 2 * micro * cost.n_mamba2_layers)
        norm = tokens_mb * tp * 4  # the gated norm's fp32 sums of squares, one per rank and token
        add("all_gather", "tp_ssd_norm", "tp", norm, fwd("mamba2") * cost.n_mamba2_layers)
        add("reduce_scatter", "tp_ssd_norm", "tp", norm, micro * cost.n_mamba2_layers)
    # Context parallelism: attention all-gathers the whole sequence's K and V (this rank's KV heads), backward
    # reduce-scatters their gradients to the owners; a recurrent layer gathers the 2·cp pieces' summaries and conv
    # halos (parallel/state_passing.py); every gather's backward reduce-scatters its gradient.
    if cp > 1:
        head_dim = m.attention.head_dim or m.d_model // m.attention.n_heads
        kv = t.micro_batch_size * t.seq_len * (m.attention.n_kv_heads // tp) * head_dim * act  # K or V, whole
        add("all_gather", "cp_kv", "cp", kv, 2 * fwd("attention") * cost.n_attn_layers)
        add("reduce_scatter", "cp_kv", "cp", kv, 2 * micro * cost.n_attn_layers)
        for kind, n_layers in (
            ("mamba1", cost.n_mamba_layers),
            ("mamba2", cost.n_mamba2_layers),
            ("gdn", cost.n_gdn_layers),
        ):
            for label, per_piece in zip(("cp_state", "cp_halo"), cp_piece_bytes(cfg, kind, tp, cp), strict=True):
                payload = 2 * cp * t.micro_batch_size * per_piece  # every piece of the micro-batch's sequences
                add("all_gather", label, "cp", payload, fwd(_MIXER_PART[kind]) * n_layers)
                add("reduce_scatter", label, "cp", payload, micro * n_layers)
    # Data parallelism (dense over dp × cp, experts over the EDP group; docs/perf_model.md, "The reduction").
    dense_local = cost.dense_params / tp
    expert_local = cost.expert_params / (layout.ep * etp)
    stage = cfg.deepspeed.zero_stage
    if t.dtype == "bf16":  # fp32 accumulation, one reduction per step in train.grad_reduce_dtype, behind the backward
        g = 4 if t.grad_reduce_dtype == "fp32" else 2
        kind = "reduce_scatter" if stage >= 1 else "all_reduce"
        add(kind, "dense_grad", "dp", dense_local * g, 1, LAST_BACKWARD)
        add(kind, "expert_grad", "edp", expert_local * g, 1, LAST_BACKWARD)
        if stage >= 1:  # every rank's updated bf16 shard back to every rank
            add("all_gather", "dense_param", "dp", dense_local * 2, 1, NEXT_FORWARD)
            add("all_gather", "expert_param", "edp", expert_local * 2, 1, NEXT_FORWARD)
    else:  # fp32: DeepSpeed's ZeRO all-reduce after the backward (ZeRO-2: every micro-batch), as measured on gloo
        reduces = micro if stage >= 2 else 1
        add("all_reduce", "dense_grad", "dp", dense_local * act, reduces)
        add("all_reduce", "expert_grad", "edp", expert_local * act, reduces)
        add("all_gather", "dense_param", "dp", dense_local * act, 1)
        add("all_gather", "expert_param", "edp", expert_local * act, 1)
    if layout.world > 1:
        n, g = layout.world, min(layout.world, ranks_per_node)
        calls.append(Call("all_reduce", "scalars", n, g, 8.0, SCALAR_ALL_REDUCES_PER_STEP, tree=True))
    return calls


def expert_gemm_s(cfg: JobConfig, layout: Layout, hw: Hardware, ranks_per_device: int, cost: ModelCost) -> float:
    """Forward expert-GEMM seconds of one MoE layer and micro-batch on one rank (balanced routing, no drops): its
    share of the k·T rows × the active expert weights, 1/tp of them either way: all TP peers' rows through 1/tp of
    each expert's hidden units (etp = tp), or its own 1/tp token slice's rows through whole experts (etp = 1)."""
    moe = cfg.model.moe
    weights_per_row = cost.expert_params / max(cost.n_moe_layers, 1) / moe.num_experts  # one expert's 3·d·f
    flops = 2.0 * tokens_per_micro_batch(cfg, layout) * moe.top_k * weights_per_row / layout.tp
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


# ------------------------------------------------------------------------------------------- predictions


@dataclass
class StepPrediction:
    layout: Layout
    compute_s: float  # model and recomputed FLOPs
    comm_s: dict[str, float]  # exposed seconds, by collective kind
    bytes_per_rank: dict[str, float]  # bytes one rank sends per step, by kind
    step_s: float
    tokens_per_s: float
    mfu: float | None = None
    calls: list[Call] = field(default_factory=list)
    a2a_chunks: int = 1
    overlap: dict[str, dict[str, float]] = field(default_factory=dict)  # per window: in_flight_s, window_s, exposed_s


def predict_step(
    cfg: JobConfig,
    layout: Layout,
    hw: Hardware,
    ranks_per_device: int = 1,
    ranks_per_node: int | None = None,
    cost: ModelCost | None = None,
    a2a_chunks: int | None = None,
    overlap_param_gather: bool = False,
    overlap_grad_reduce: bool = True,
) -> StepPrediction:
    """Step time of `cfg` at `layout` on `hw`. ranks_per_device > 1 when ranks share one device (CPU cores);
    a2a_chunks overrides `parallel.a2a_chunks` (the row all-to-alls pipelined against the expert GEMMs).

    Asynchronous calls hide behind their window (`Call.hides_behind`): the gradient reduction behind the last
    micro-batch's backward (its 2 × forward plus recompute), exposed = max(0, their time − the window); the
    parameter all-gather behind the next step's first forward only with `overlap_param_gather` (what-if: the code
    may not overlap it), else all of it is exposed. `overlap_grad_reduce` False: the gradient reduction is exposed
    whole, as the code runs ZeRO 1 today (DeepSpeed 0.19.8's overlapped stage 1 is refused: docs/perf_model.md)."""
    cost = cost or model_cost(cfg)
    rpn = ranks_per_node or hw.ranks_per_node
    flops = step_flops_per_rank(cfg, layout, cost)
    compute = (flops + recompute_flops_per_rank(cfg, layout, cost)) * ranks_per_device / hw.flops_per_s
    per_mb = tokens_per_micro_batch(cfg, layout) / layout.tp * ranks_per_device / hw.flops_per_s  # s per FLOP/token
    windows = {
        LAST_BACKWARD: (2.0 * cost.fwd_flops_per_token + cost.recompute_flops_per_token) * per_mb
        if overlap_grad_reduce
        else 0.0,
        NEXT_FORWARD: cost.fwd_flops_per_token * per_mb if overlap_param_gather else 0.0,
    }
    comm = dict.fromkeys(KINDS, 0.0)
    sent = dict.fromkeys(KINDS, 0.0)
    hidden: dict[str, list[tuple[str, float]]] = {w: [] for w in windows}
    calls = step_calls(cfg, layout, rpn, cost)
    chunks = a2a_chunks or cfg.parallel.a2a_chunks
    for c in calls:
        if c.label == "moe_rows" and chunks > 1:
            comm[c.kind] += overlapped_rows_s(c, hw, chunks, expert_gemm_s(cfg, layout, hw, ranks_per_device, cost))
        elif c.hides_behind:
            hidden[c.hides_behind].append((c.kind, c.count * call_time(c, hw)))
        else:
            comm[c.kind] += c.count * call_time(c, hw)
        sent[c.kind] += c.count * collective_terms(c.kind, c.group_size, c.payload_bytes)[1]
    overlap = {}
    for w, parts in hidden.items():  # the exposed rest, shared among the kinds in proportion to their time
        in_flight = sum(s for _, s in parts)
        exposed = max(0.0, in_flight - windows[w])
        for kind, s in parts:
            comm[kind] += s * exposed / in_flight
        if parts:
            overlap[w] = {"in_flight_s": in_flight, "window_s": windows[w], "exposed_s": exposed}
    step = compute + sum(comm.values())
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    mfu = flops / step / hw.peak_flops_per_s if hw.peak_flops_per_s else None
    return StepPrediction(layout, compute, comm, sent, step, tokens / step, mfu, calls, chunks, overlap)


# Published figure (NVIDIA H200 Tensor Core GPU datasheet, SXM): BF16 Tensor Core 1,979 TFLOPS *with sparsity*,
# i.e. 989 TFLOPS dense. The cluster around it: cluster.py.
H200_BF16_DENSE_PEAK = 989e12
