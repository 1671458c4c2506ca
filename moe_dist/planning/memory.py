"""The memory plan of one rank: what `launch/train.py --dry-run --world-size N` prints.

Counted from the meta model (no storage) and the config's layout at the given world size, by kind: params, grads,
optimizer, activations, runtime, transient and total. Invariants: `total` is params + optimizer + runtime + the
larger of the backward phase and the accumulation-boundary phase (not the sum of the other keys); shard sizes
follow apply_tp/apply_ep exactly (experts by EP and TP, by EP alone with parallel.etp = 1); the per-token
activation terms are those of the tensors autograd saves, so a change to what a layer saves must change them too;
the expert side of a dropless MoE layer under EP is planned at the busiest rank's load (`expert_rows_factor`).
On CUDA the total is held against one GPU's memory less a fragmentation margin (capacity.py).
Every term and the activation table: docs/memory.md, sections "The plan", "Activation bytes per token" and
"Headroom"; held to the saved tensors by tests/planning/test_memory.py.
"""

from __future__ import annotations

from typing import Callable

from moe_dist.config import JobConfig
from moe_dist.config.parallel_checks import check_layout
from moe_dist.layers import registry
from moe_dist.layers.mlp import hidden_kept
from moe_dist.models.activation_checkpointing import checkpointed_parts
from moe_dist.models.decoder import build_model, layer_kinds
from moe_dist.planning.capacity import headroom
from moe_dist.planning.stage_cut import stage_starts

GB = 1e9
# Parameters apply_tp splits over tensor-parallel ranks (parallel/tensor_parallel.py), by name suffix.
_TP_SPLIT = (
    "wq.weight",
    "wk.weight",
    "wv.weight",
    "wo.weight",
    "in_proj.weight",
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "dt_bias",
    "conv1d.weight",
    "conv1d.bias",
    "x_proj.weight",
    "dt_proj.weight",
    "dt_proj.bias",
    "A_log",
    ".D",
    "out_proj.weight",
    "w1.weight",
    "w2.weight",
    "w3.weight",
    "embed.weight",
    "head.weight",
)

# The framework's memory per rank beside our tensors (docs/memory.md, "runtime"), in bytes.
# CPU (the plan is of resident host memory): measured on this project's CPU runs, the peak of a training run of a
# tiny model less that model's own plan: DeepSpeed's engine and shared-memory all-reduce buffers, gloo, TensorBoard,
# the token data; the same at 1, 2 and 4 ranks.
CPU_RUNTIME = 0.27e9
# CUDA (the plan is of device memory): the CUDA context with lazy module loading, about 0.3 GB (pytorch/pytorch
# #107667; over 1 GB before CUDA 11.7), with cuBLAS/cuDNN workspaces 0.5 GB; NCCL's buffers, about 1.6 GB for a
# communicator that runs ring/tree collectives (NVIDIA/nccl #864; "more communicators, more memory", #986) and
# 3.3 GB more for the all-to-all's direct connections between 8 H100s, buffers per pair of GPUs (NVIDIA/nccl
# #1685): 3.3/7 GB per peer. Figures from those threads, not measured here.
CUDA_CONTEXT = 0.5e9
NCCL_PER_GROUP = 1.6e9
NCCL_ALL_TO_ALL_PER_PEER = 3.3e9 / 7


def local_param_counts(
    cfg: JobConfig, tp: int, ep: int, etp: int | None = None, holds: Callable[[str], bool] | None = None
) -> tuple[int, int]:
    """(dense, expert) parameters one rank holds (etp: the expert tensor-parallel size, default tp; `holds`: which
    parameters by name, a pipeline rank's stages; default all)."""
    dense = expert = 0
    for name, p in build_model(cfg.model, "meta").named_parameters():
        if holds is not None and not holds(name):
            continue
        if ".experts." in name:
            expert += p.numel() // (ep * (tp if etp is None else etp))
        elif tp > 1 and name.endswith(_TP_SPLIT) and not name.endswith("norm.weight"):
            dense += p.numel() // tp
        else:
            dense += p.numel()
    return dense, expert


def activation_bytes(
    cfg: JobConfig, tp: int = 1, cp: int = 1, layers: set[int] | None = None, head: bool = True
) -> dict[str, float]:
    """Bytes autograd keeps for one micro-batch on one rank, by part, and the largest transient buffers. Under
    context parallelism (`cp`) a rank holds S / cp positions of each sequence, so every per-token term is of its
    T / cp tokens, except what an attention layer gathers: the keys and values of the whole sequence (its KV heads),
    kept for the backward, cp times the local K/V per local token. (The recurrent mixers' per-piece summaries are
    O(state), not per token; the MoE capacity is the whole micro-batch's, cf · K · T / E per expert, of which a rank's
    pieces take their share: planned at K·T/cp·cf rows, the balanced share.) `layers` and `head` restrict it to a
    pipeline rank's layers and whether it holds the LM head (default: the whole model)."""
    m, t = cfg.model, cfg.train
    a = 2 if t.dtype == "bf16" else 4
    T = t.micro_batch_size * t.seq_len // cp
    parts = checkpointed_parts(t)
    sp = tp if cfg.parallel.sequence_parallel else 1
    D = m.d_model
    etp = cfg.parallel.expert_tp
    f_moe = (m.moe.d_ff or m.d_ff) // etp
    E, K = m.moe.num_experts, m.moe.top_k
    cf = m.moe.capacity_factor or 1.0
    rho = expert_rows_factor(cfg)
    # MoE rows per token, in units of D (parallel/dispatch.py): under EP each TP rank dispatches its 1/tp slice of
    # the tokens (token side, the rows the combine keeps: K·cf/tp); the experts then meet the rows of the whole TP
    # group when they are split over it (etp = tp: K·rho) or this rank's own with whole experts (etp = 1: K·rho/tp).
    # Without EP every TP rank routes and runs all T tokens' rows (K·cf, K).
    split = tp if cfg.parallel.ep > 1 else 1
    token_rows, expert_rows = K * cf / split, K * rho / (tp // etp)
    norm_full = 3 * D * a / sp + 4  # norm input, norm output, the first linear's copy of it, rstd
    norm_kept = 2 * D * a / sp + 4  # the recomputed sublayer's input and the norm's input stay
    hidden = hidden_kept(m.ffn_activation)
    # Per part: each kind's recompute part (an MoE layer's rows and experts under "moe"), the head below.
    out = {k.part: 0.0 for k in registry.KINDS.values() if k.name != "moe"} | {"moe": 0.0}
    largest = 0.0  # the largest one sublayer's interior: its backward's working set (and its recompute)
    for i, (mixer, ffn) in enumerate(layer_kinds(m)):
        if layers is not None and i not in layers:
            continue
        for name in (mixer, ffn):
            kind = None if name is None else registry.kind(name)
            if kind is None or kind.name == "moe":  # MoE: its rows and experts, below
                continue
            inner = kind.activation_bytes(cfg, tp, cp, a)  # the sublayer's interior, kept unless recomputed
            out[kind.part] += norm_kept if kind.part in parts else norm_full + inner
            largest = max(largest, inner)
        if ffn == "moe":
            router = 8 * E + 12 + (D * 4 if a == 2 else 0)  # the router's fp32 copy of its input under bf16
            # The combine keeps the expert outputs in token order (token side); the experts keep their input rows
            # and, without recompute, their gate/up, SiLU and product (expert side).
            expert_kept = D * a if "moe_experts" in parts else (D + hidden * f_moe) * a
            out["moe"] += norm_full + router + token_rows * D * a + expert_rows * expert_kept
            largest = max(largest, expert_rows * hidden * f_moe * a)
    v = m.vocab_size // tp
    out["head"] = norm_full + 4 * v + 16 if head else 0.0
    per_token = {k: val * T for k, val in out.items()}
    transient = {
        "logits": 3 * 4 * v * T if head else 0.0,  # fp32 logits, log-softmax and its gradient at the backward's start
        # One sublayer's backward: its interior (recomputed first, under recompute) and the gradients of it.
        "layer_backward": (2 if parts else 1) * largest * T,
        # The rows sent (token side) and received (expert side).
        "all_to_all": ((token_rows + expert_rows) * T * D * a) if cfg.parallel.ep > 1 and m.has_kind("moe") else 0.0,
    }
    return {**per_token, "total": sum(per_token.values()), "transient": transient}


def expert_rows_factor(cfg: JobConfig) -> float:
    """Rows one rank's experts receive in a micro-batch, in units of K·T (the rows this rank routes).

    With a capacity factor cf, each expert keeps at most cf times its share: cf. Dropless with every expert on the
    rank (ep = 1): exactly K·T rows, however the router spreads them: 1. Dropless under EP, the busiest rank's
    load: `plan.expert_imbalance`, capped by the most routing can send one rank, every one of the ep ranks' T
    tokens choosing min(K, E/ep) of its experts: ep·min(K, E/ep)/K, planned when the key is null (the default:
    our dropless runs reach it, docs/memory.md "Headroom").
    """
    moe, ep = cfg.model.moe, cfg.parallel.ep
    if moe.capacity_factor is not None:
        return moe.capacity_factor
    if ep == 1:
        return 1.0
    most = ep * min(moe.top_k, moe.num_experts // ep) / moe.top_k
    return most if cfg.plan.expert_imbalance is None else min(cfg.plan.expert_imbalance, most)


def runtime_bytes(device: str, world_size: int, dp: int, tp: int, ep: int, edp: int, cp: int = 1, pp: int = 1) -> float:
    """The framework's memory on one rank of `device` ("cuda" or "cpu"): a constant per process on the CPU; on
    CUDA the context plus NCCL's buffers for each process group that communicates (world, dp (the dp × cp
    replicas), tp, cp, expert-data-parallel: ring/tree collectives; ep: the all-to-all, per peer; pp: one pair of
    point-to-point communicators, to the previous and the next stage)."""
    if device == "cpu":
        return CPU_RUNTIME
    if device != "cuda":
        raise ValueError(f"memory plan: device must be 'cuda' or 'cpu', got {device!r}")
    groups = [n for n in (world_size, dp if dp != world_size else 1, tp, cp, edp, pp, pp) if n > 1]
    return CUDA_CONTEXT + NCCL_PER_GROUP * len(groups) + NCCL_ALL_TO_ALL_PER_PEER * (ep - 1)


def pipeline_share(cfg: JobConfig, pp_rank: int, micro_batches: int, starts: list[int] | None):
    """What pipeline rank `pp_rank` holds: (its layers, which parameters by name, whether it holds the LM head, the
    micro-batches whose activations it keeps at once). Its stages are s ≡ pp_rank (mod pp) of the cut `starts`; the
    embedding sits on the first rank, the final norm and head on the last (a tied embedding on both).
    In flight: 1F1B's warm-up leaves pp − r micro-batches' activations on rank r; the interleaved schedule's leaves
    (v − 1)·pp + 2·(pp − 1 − r) + 1 stage-chunks of 1/v of the rank's layers (pp + (pp − 1)/v micro-batches' worth
    on rank 0, Megatron-LM's figure for its interleaved schedule); never more than the step's micro-batches."""
    pa, n = cfg.parallel, cfg.model.n_layers
    if pa.pp == 1:
        return None, None, True, 1.0
    ends = [*starts[1:], n]
    layers = {i for s in range(pp_rank, len(starts), pa.pp) for i in range(starts[s], ends[s])}
    first, last = pp_rank == 0, pp_rank == pa.pp - 1

    def holds(name: str) -> bool:
        if name.startswith("blocks."):
            return int(name.split(".")[1]) in layers
        if name.startswith("embed."):
            return first or (last and cfg.model.tie_embeddings)
        return last  # the final norm and the LM head

    v = pa.pp_virtual
    chunks = pa.pp - pp_rank if v == 1 else ((v - 1) * pa.pp + 2 * (pa.pp - 1 - pp_rank) + 1) / v
    return layers, holds, last, float(min(chunks, micro_batches))


def memory_plan(
    cfg: JobConfig,
    world_size: int,
    device: str = "cuda",
    capacity_bytes: int | None = None,
    pp_rank: int | None = None,
    starts: list[int] | None = None,
) -> dict:
    """The plan for one rank at `world_size` under the config's layout (checked as at start-up), on `device`
    ("cuda": device memory of a GPU rank; "cpu": resident memory of a CPU rank, as measured in docs/memory.md).
    On CUDA, `capacity` holds the total against one GPU's memory (`capacity_bytes`, else capacity.py's
    `planned_capacity`) less the fragmentation margin; None on the CPU (ranks share the host's memory).
    Under pipeline parallelism the plan is of the pipeline rank that needs the most (`pipeline` lists every rank's
    total and the cut `starts`, stage_cut's unless given), or of `pp_rank`."""
    dp = check_layout(cfg, world_size)
    pp = cfg.parallel.pp
    if pp > 1 and starts is None:
        starts = stage_starts(cfg)  # once: every pipeline rank's share reads the same cut
    if pp > 1 and pp_rank is None:
        plans = [memory_plan(cfg, world_size, device, capacity_bytes, r, starts) for r in range(pp)]
        worst = max(plans, key=lambda plan: plan["memory_per_rank_gb"]["total"])
        totals = [plan["memory_per_rank_gb"]["total"] for plan in plans]
        return {**worst, "pipeline": {"stage_starts": starts, "total_gb_by_pp_rank": totals}}
    micro_batches = cfg.train.grad_accum_steps(dp)
    layers, holds, head, in_flight = pipeline_share(cfg, pp_rank or 0, micro_batches, starts)
    tp, ep, etp, cp = cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.expert_tp, cfg.parallel.cp
    replicas = dp * cp  # ranks of a tp_rank holding the same weights: ZeRO partitions over them
    edp = replicas * tp // (ep * etp)  # the ranks holding the same experts
    runtime = runtime_bytes(device, world_size, replicas, tp, ep, edp, cp, pp)
    dense, expert = local_param_counts(cfg, tp, ep, etp, holds)
    w = 2 if cfg.train.dtype == "bf16" else 4
    stage = cfg.deepspeed.zero_stage
    shards = (dense / replicas + expert / edp) if stage >= 1 else dense + expert
    params = (dense + expert) * w
    # Gradients held while micro-batches accumulate, and those that exist only at the accumulation boundary.
    fp32_accumulation = w == 2 and cfg.train.grad_accum_dtype == "fp32"
    if stage == 2:
        accumulating, at_boundary = shards * 4, 0.0  # the fp32 partition; in-flight grads live in the bucket
    else:
        # Every local parameter's unsharded gradient: p.grad, or with bf16 weights and fp32 accumulation (ZeRO 1,
        # one reduction per step, train/optim.py) the fp32 buffer each micro-batch's bf16 p.grad is added into.
        accumulating = (dense + expert) * (4 if fp32_accumulation else w)
        at_boundary = shards * 4 if stage == 1 else 0.0  # stage 1: the reduced fp32 partition
    grads = accumulating + at_boundary
    optimizer = shards * 12 if stage >= 1 else (dense + expert) * 8  # ZeRO: fp32 master + m + v; 0: torch's m + v
    act = activation_bytes(cfg, tp, cp, layers, head)
    if pp > 1:  # the micro-batches in flight, each with its received activation and gradient (p2p buffers)
        t = cfg.train
        p2p = 2 * t.micro_batch_size * t.seq_len // cp * cfg.model.d_model * w
        act = {**act, **{k: v * in_flight for k, v in act.items() if k != "transient"}}
        act["p2p"] = p2p * in_flight
        act["total"] += act["p2p"]
    transient = dict(act["transient"])
    # train.grad_reduce_bucket_mb as elements. ZeRO 2's bucket holds copies of gradients in the parameter dtype, plus
    # their fp32 casts when bf16 is reduced in fp32; ZeRO 1's holds the fp32 sums, plus their bf16 casts when bf16
    # travels.
    bucket = min(cfg.train.reduce_bucket_elements(), dense + expert)
    bf16_travels = w == 2 and cfg.train.grad_reduce_dtype == "bf16"
    if stage == 1:
        transient["reduce_bucket"] = bucket * ((4 if fp32_accumulation else w) + (2 if bf16_travels else 0))
    else:
        transient["reduce_bucket"] = bucket * (w + (4 if fp32_accumulation else 0))
    largest = max(transient.values())
    # The peak is the larger of two phases, on top of parameters and optimizer state: the last micro-batch's
    # backward (gradients accumulating, every activation, the largest backward/logit/all-to-all buffer; ZeRO 2 also
    # fills its reduce bucket then) and the accumulation boundary (activations freed; stage 1 reduces into its
    # partition through the bucket).
    backward = accumulating + act["total"] + max(v for k, v in transient.items() if k != "reduce_bucket")
    backward += transient["reduce_bucket"] if stage == 2 else 0.0
    boundary = grads + (transient["reduce_bucket"] if stage < 2 else 0.0)
    total = params + optimizer + runtime + max(backward, boundary)
    # Host memory, beside the device plan: the asynchronous save's staging buffer (pinned on CUDA); the snapshot it
    # fills is pageable host memory of the rank's checkpoint share (train/checkpoint/snapshot.py).
    save_staging = cfg.train.save_staging_mb * 2**20 if cfg.train.async_save else 0.0
    return {
        "layout": {
            "world_size": world_size,
            "pp": pp,
            "pp_rank": pp_rank or 0,
            "micro_batches_in_flight": in_flight,
            "dp": dp,
            "cp": cp,
            "tp": tp,
            "ep": ep,
            "edp": edp,
            "zero_stage": stage,
            "device": device,
            "expert_rows_factor": expert_rows_factor(cfg),
        },
        "params_local": {"dense": dense, "expert": expert},
        "activations_by_part_gb": {k: v / GB for k, v in act.items() if k not in ("total", "transient", "p2p")},
        "transient_gb": {k: val / GB for k, val in transient.items()},
        "host_gb": {"save_staging": save_staging / GB},
        "memory_per_rank_gb": {
            "params": params / GB,
            "grads": grads / GB,
            "optimizer": optimizer / GB,
            "activations": act["total"] / GB,
            "transient": largest / GB,
            "runtime": runtime / GB,
            "total": total / GB,
        },
        "capacity": headroom(cfg, total, capacity_bytes) if device == "cuda" else None,
    }
