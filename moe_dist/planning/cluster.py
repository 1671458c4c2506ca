"""The H200 cluster the performance model predicts for, the layout families compared on it, and the sweep of
docs/perf_model.md ("Mixtral 8x7B and Jamba on H200"): `python -m benchmarks.scaling predict` prints it."""

from __future__ import annotations

import dataclasses

from moe_dist.config import JobConfig
from moe_dist.layers import registry
from moe_dist.planning.capacity import H100_MIB, H200_MIB, MIB, headroom
from moe_dist.planning.collectives import H200_BF16_DENSE_PEAK, LAST_BACKWARD, Hardware, Link
from moe_dist.planning.memory import memory_plan
from moe_dist.planning.perfmodel import predict_step
from moe_dist.planning.workload import Layout, ModelCost, config_layout, model_cost, tokens_per_micro_batch

# Published figures (NVIDIA H200 Tensor Core GPU datasheet/product page, SXM): BF16 Tensor Core 1,979 TFLOPS
# *with sparsity*, i.e. 989 TFLOPS dense; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s per GPU (bidirectional,
# 450 GB/s each way). The cluster of the issue: 8 GPUs per node, one 400 Gb/s InfiniBand NIC per GPU
# (50 GB/s each way). Assumptions (ours, not published): the device sustains 40% of dense peak on the FLOPs it
# runs (recompute included; MFU counts model FLOPs only); collectives reach 80% of NVLink's and 90% of
# InfiniBand's one-way bandwidth; α = 3 µs per hop in a node, 8 µs across. Memory: capacity.py's H200 figure.


def h200_cluster(mfu: float = 0.40) -> Hardware:
    return Hardware(
        name=f"H200 SXM, 8/node, NVLink 900 GB/s, 400 Gb/s IB per GPU, {mfu:.0%} of peak sustained",
        flops_per_s=H200_BF16_DENSE_PEAK * mfu,
        ranks_per_node=8,
        intra=Link(alpha_s=3e-6, beta_Bps=0.8 * 450e9),
        inter=Link(alpha_s=8e-6, beta_Bps=0.9 * 50e9),
        memory_bytes=H200_MIB * MIB,
        peak_flops_per_s=H200_BF16_DENSE_PEAK,
        tree_all_reduce=True,
    )


def h100_cluster(mfu: float = 0.40) -> Hardware:
    """H100 SXM, as published (NVIDIA H100 datasheet): BF16 Tensor Core 989 TFLOPS dense (1,979 with sparsity), the
    H200's; 80 GB HBM3 at 3.35 TB/s (the H200: 4.8); NVLink 900 GB/s per GPU; nodes of 8 with 8 × 400 Gb/s
    InfiniBand. Every term this model charges is the H200's; only the memory a layout must fit in differs (HBM
    bandwidth is inside the sustained share `mfu`, which is where the two GPUs differ in practice)."""
    name = f"H100 SXM, 8/node, NVLink 900 GB/s, 400 Gb/s IB per GPU, {mfu:.0%} of peak sustained"
    return dataclasses.replace(h200_cluster(mfu), name=name, memory_bytes=H100_MIB * MIB)


def fits(cfg: JobConfig, memory_bytes: float, hw: Hardware) -> bool:
    """Whether a device of `hw` holds `memory_bytes`, less `plan.fragmentation_margin` (capacity.py's rule)."""
    return hw.memory_bytes is None or headroom(cfg, memory_bytes, int(hw.memory_bytes))["fits"]


def memory_per_device(cfg: JobConfig, layout: Layout, cost: ModelCost | None = None) -> float:
    """Rough bytes per device, to reject layouts (the plan of record is planning/memory.py): weights in the training
    dtype; gradients (bf16: the unsharded local accumulation buffer in train.grad_accum_dtype; fp32: in the
    training dtype, ZeRO-2-sharded); fp32 master + Adam moments sharded over dp × cp (12 bytes per parameter); and
    the activations one micro-batch keeps for backward (flash attention; under full checkpointing the checkpointed
    parts' inputs and one layer recomputed), 1/(tp · cp) of the sequence's, plus the whole sequence's gathered K/V
    per attention layer under CP."""
    cost = cost or model_cost(cfg)
    m, t = cfg.model, cfg.train
    act = 2 if t.dtype == "bf16" else 4
    local = cost.dense_params / layout.tp + cost.expert_params / (layout.ep * (1 if layout.folded else layout.tp))
    if t.dtype == "bf16":
        grads = local * (4 if t.grad_accum_dtype == "fp32" else 2)
    else:
        grads = local * act / (layout.zero if cfg.deepspeed.zero_stage >= 2 else 1)
    states = 12.0 * (cost.dense_params + cost.expert_params) / (layout.tp * layout.zero)
    # what a layer's mixer keeps per token beyond its projections: at most the attention's K/V (cp_gathered_bytes)
    kv_bytes = max([registry.kind(k).cp_gathered_bytes(m, 1, act) for k in cost.layers] + [0.0])
    d, f = m.d_model, m.moe.d_ff or m.d_ff
    per_token_layer = act * (6 * d + m.moe.top_k * (d + 3 * f)) + kv_bytes
    tokens = tokens_per_micro_batch(cfg, layout)
    if t.activation_checkpointing == "full":  # per layer: residual, two norm outputs, mixer input, expert rows
        acts = act * (4 * d + m.moe.top_k * d) * m.n_layers * tokens + per_token_layer * tokens
    else:
        acts = per_token_layer * m.n_layers * tokens
    acts /= layout.tp
    if layout.cp > 1:  # what the kinds gather of the whole sequence and keep (attention's K/V), unless recomputed
        for name, n_layers in cost.layers.items():
            kind = registry.kind(name)
            if kind.part not in cost.recomputed:
                whole = kind.cp_gathered_bytes(m, layout.tp, act) * t.micro_batch_size * t.seq_len
                acts += whole * n_layers
    return local * act + grads + states + acts


def candidate_layouts(gpus: int, num_experts: int, global_batch: int, micro_batch: int) -> dict[str, Layout]:
    """The layout families compared in docs/perf_model.md, where they are valid at this GPU count."""
    families = {
        "DP only (ZeRO)": lambda n: Layout(n, 1, 1),
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
            and (lay.world if lay.folded else lay.zero) % lay.ep == 0
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
    overlap_param_gather: bool | None = None,
    overlap_grad_reduce: bool | None = None,
) -> list[dict]:
    """Predictions for every candidate layout (and the config's own) at every GPU count, each at its fastest
    `parallel.a2a_chunks` of `chunk_options` (with the unchunked all-to-all time beside it). Scaling efficiency =
    tokens/s ÷ (GPUs × the compute-bound rate of one GPU) = compute time / step time: what communication leaves of
    linear scaling."""
    cost = model_cost(cfg)
    t = cfg.train
    rows = []
    for n in gpu_counts:
        layouts = candidate_layouts(n, cfg.model.moe.num_experts, t.global_batch_size, t.micro_batch_size)
        own = config_layout(cfg, n)
        valid = own and (own.world // own.pp if own.folded else own.zero) % own.ep == 0
        if valid and own not in layouts.values() and t.global_batch_size % (t.micro_batch_size * own.dp) == 0:
            layouts[f"config's layout (tp {own.tp}, ep {own.ep})"] = own
        for family, lay in layouts.items():
            kw = dict(cost=cost, overlap_param_gather=overlap_param_gather, overlap_grad_reduce=overlap_grad_reduce)
            plain = predict_step(cfg, lay, hw, a2a_chunks=1, **kw)
            p = min((predict_step(cfg, lay, hw, a2a_chunks=c, **kw) for c in chunk_options), key=lambda q: q.step_s)
            grad = p.overlap.get(LAST_BACKWARD, {})
            # A pipeline layout (the config's own: the families have none) by the plan of record: its stages' weights
            # and the micro-batches in flight are not in the rough figure.
            memory = memory_per_device(cfg, lay, cost) if lay.pp == 1 else _plan_bytes(cfg, n, hw)
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
                    "grad_reduce_s": grad.get("in_flight_s", 0.0),
                    "grad_exposed_s": grad.get("exposed_s", 0.0),
                    "a2a_chunks": p.a2a_chunks,
                    "all_to_all_unchunked_s": plain.comm_s["all_to_all"],
                    "memory_gb": memory / 1e9,
                    "fits": fits(cfg, memory, hw),
                }
            )
    return rows


def _plan_bytes(cfg: JobConfig, world: int, hw: Hardware) -> float:
    return memory_plan(cfg, world, capacity_bytes=hw.memory_bytes)["memory_per_rank_gb"]["total"] * 1e9


def recommend(rows: list[dict]) -> dict[int, dict]:
    """Per GPU count, the fastest layout that fits in memory."""
    best: dict[int, dict] = {}
    for r in rows:
        if r["fits"] and (r["gpus"] not in best or r["tokens_per_s"] > best[r["gpus"]]["tokens_per_s"]):
            best[r["gpus"]] = r
    return best
