"""Performance model of one training step, calibrated on measured runs (the fit of F, α and β to them is fit.py).

    step time = (model + recomputed FLOPs per rank) · ranks_per_device / F
                + Σ_collectives (hops · α + bytes_on_the_slowest_link / β)  −  what overlap hides

Overlap of communication with compute, where the code issues it so: the EP row all-to-alls under
`parallel.a2a_chunks` > 1 (`overlapped_rows_s`), and, with bf16 weights, the once-per-step gradient reduce-scatter
behind the last micro-batch's backward (an assumption for NCCL's asynchronous bucketed reduction, docs/perf_model.md,
"Overlap"). The collectives' α–β cost is collectives.py's; the step's list of them and its FLOPs, workload.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_dist.config import JobConfig
from moe_dist.planning.collectives import (
    KINDS,
    LAST_BACKWARD,
    NEXT_FORWARD,
    Call,
    Hardware,
    call_time,
    collective_terms,
)
from moe_dist.planning.workload import (
    Layout,
    ModelCost,
    micro_batches_per_rank,
    model_cost,
    recompute_flops_per_rank,
    stage_share,
    step_calls,
    step_flops_per_rank,
    tokens_per_micro_batch,
)


def expert_gemm_s(cfg: JobConfig, layout: Layout, hw: Hardware, ranks_per_device: int, cost: ModelCost) -> float:
    """Forward expert-GEMM seconds of one MoE layer and micro-batch on one rank (balanced routing, no drops): its
    share of the k·T rows × the active expert weights, 1/tp of them either way: all TP peers' rows through 1/tp of
    each expert's hidden units (etp = tp), or its own 1/tp token slice's rows through whole experts (etp = 1)."""
    moe = cfg.model.moe
    weights_per_row = cost.expert_params / max(cost.n_moe_layers, 1) / moe.num_experts  # one expert: 3·d·f, relu² 2·d·f
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
    bubble_s: float = 0.0  # pipeline parallelism: the stages' idle time in the schedule's fill and drain


def predict_step(
    cfg: JobConfig,
    layout: Layout,
    hw: Hardware,
    ranks_per_device: int = 1,
    ranks_per_node: int | None = None,
    cost: ModelCost | None = None,
    a2a_chunks: int | None = None,
    overlap_param_gather: bool | None = None,
    overlap_grad_reduce: bool | None = None,
) -> StepPrediction:
    """Step time of `cfg` at `layout` on `hw`. ranks_per_device > 1 when ranks share one device (CPU cores);
    a2a_chunks overrides `parallel.a2a_chunks` (the row all-to-alls pipelined against the expert GEMMs).

    Asynchronous calls hide behind their window (`Call.hides_behind`): the gradient reduction behind the last
    micro-batch's backward (its 2 × forward plus recompute), exposed = max(0, their time − the window); the
    parameter all-gather behind the next step's first forward with `overlap_param_gather` (None follows
    `train.param_gather_overlap`, parallel/param_gather.py), else all of it is exposed. `overlap_grad_reduce`:
    whether the once-per-step gradient reduction hides behind the last backward; None follows the config
    (`train.grad_reduce_overlap`, which the big configs set: the code then issues each bucket's reduce from the
    backward's hooks), False exposes it whole."""
    if overlap_grad_reduce is None:
        overlap_grad_reduce = bool(cfg.train.grad_reduce_overlap)
    if overlap_param_gather is None:  # train.param_gather_overlap: each module's weights behind the next forward
        overlap_param_gather = bool(cfg.train.param_gather_overlap)
    cost = stage_share(cost or model_cost(cfg), layout.pp)  # one pipeline stage's part
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
    # 1F1B idles each stage (pp − 1) micro-batch slots of m in fill and drain; v virtual stages cut the slot by v.
    bubble = compute * (layout.pp - 1) / (micro_batches_per_rank(cfg, layout) * cfg.parallel.pp_virtual)
    step = compute + bubble + sum(comm.values())
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    mfu = flops / step / hw.peak_flops_per_s if hw.peak_flops_per_s else None
    return StepPrediction(layout, compute, comm, sent, step, tokens / step, mfu, calls, chunks, overlap, bubble)
