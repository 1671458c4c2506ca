"""The H200 predictions of `python -m benchmarks.scaling predict` (docs/perf_model.md, "Mixtral 8x7B and Jamba on
H200"): every layout family at 8 to 1,024 GPUs, the chunked all-to-all's overlap, the fastest layout per GPU count,
and with --levers what moves 64 and 1,024 GPUs and the global batch at which an efficiency target holds."""

from __future__ import annotations

from pathlib import Path


def overlap_lines(cfg, hw) -> list[str]:
    """Per MoE layer and micro-batch: the row all-to-alls (dispatch + combine, forward + backward) unchunked and
    what `parallel.a2a_chunks` leaves exposed, beside the expert GEMMs that hide them (perfmodel.overlapped_rows_s)."""
    from moe_dist.planning import collectives as co
    from moe_dist.planning import perfmodel as pm
    from moe_dist.planning import workload as wl

    cost = wl.model_cost(cfg)
    layouts = {
        "EP8 in node (NVLink)": wl.Layout(8, 8, 1),
        "EP8 x TP2, EP over 2 nodes (InfiniBand)": wl.Layout(8, 8, 2),
    }
    lines = [
        "Row all-to-alls per MoE layer and micro-batch (forward + backward), exposed ms by parallel.a2a_chunks:",
        "",
        "| layout | expert GEMMs fwd + bwd ms | 1 (all of it) | 2 | 4 | 8 |",
        "|---|---|---|---|---|---|",
    ]
    for name, lay in layouts.items():
        calls = wl.step_calls(cfg, lay, hw.ranks_per_node, cost)
        rows = next(c for c in calls if c.label == "moe_rows")
        per_layer = co.Call(rows.kind, rows.label, rows.group_size, rows.ranks_per_node, rows.payload_bytes, 4)
        g = pm.expert_gemm_s(cfg, lay, hw, 1, cost)
        exposed = [1e3 * pm.overlapped_rows_s(per_layer, hw, c, g) for c in (1, 2, 4, 8)]
        lines.append(f"| {name} | {3e3 * g:.2f} | " + " | ".join(f"{e:.2f}" for e in exposed) + " |")
    return lines


def best_efficiency(cfg, hw, gpus: int, overlap_param_gather: bool = False) -> dict | None:
    """The fastest layout that fits at `gpus`, or None."""
    from moe_dist.planning import cluster

    rows = cluster.scaling_sweep(cfg, hw, gpu_counts=(gpus,), overlap_param_gather=overlap_param_gather)
    return cluster.recommend(rows).get(gpus)


def summary_lines(config: str, hw, rows: list[dict]) -> list[str]:
    """Per GPU count, the fastest layout that fits: as configured, with the parameter all-gather behind the next
    forward, and without activation checkpointing (the compute basis of a model that ignores the recompute)."""
    from moe_dist.config import load_config
    from moe_dist.planning import cluster

    best = cluster.recommend(rows)
    hidden = cluster.recommend(cluster.scaling_sweep(load_config(config, []), hw, overlap_param_gather=True))
    plain = cluster.recommend(cluster.scaling_sweep(load_config(config, ["train.activation_checkpointing=none"]), hw))
    # ZeRO 1 as the code runs it today: the once-per-step reduction after the backward, not behind it
    exposed = cluster.recommend(cluster.scaling_sweep(load_config(config, []), hw, overlap_grad_reduce=False))
    lines = [
        "| GPUs | fastest layout | tokens/s | efficiency | MFU | reduction not overlapped: efficiency | "
        "param all-gather hidden: efficiency | no activation checkpointing: tokens/s, efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, r in best.items():
        h, p, e = hidden.get(n), plain.get(n), exposed.get(n)
        lines.append(
            f"| {n} | {r['layout']} | {r['tokens_per_s']:,.0f} | {r['scaling_efficiency']:.2f} | {r['mfu']:.2f} | "
            + (f"{e['scaling_efficiency']:.2f} ({e['layout']})" if e else "does not fit")
            + " | "
            + (f"{h['scaling_efficiency']:.2f} ({h['layout']})" if h else "does not fit")
            + " | "
            + (f"{p['tokens_per_s']:,.0f}, {p['scaling_efficiency']:.2f} ({p['layout']})" if p else "does not fit")
            + " |"
        )
    return lines


def lever_lines(config: str, hw, gpu_counts=(64, 1024), target: float = 0.80) -> list[str]:
    """What moves the efficiency of the fastest layout that fits: each lever alone, against the config as it is;
    then the smallest global batch (a multiple of 256 sequences) at which the config as it is reaches `target`."""
    from moe_dist.config import load_config

    base = load_config(config, [])
    levers = {
        "the config as it is": ([], False),
        "train.grad_reduce_dtype=bf16": (["train.grad_reduce_dtype=bf16"], False),
        "parameter all-gather behind the next forward": ([], True),
        "both": (["train.grad_reduce_dtype=bf16"], True),
        "global batch × 2": ([f"train.global_batch_size={2 * base.train.global_batch_size}"], False),
        "no activation checkpointing": (["train.activation_checkpointing=none"], False),
    }
    lines = [
        "Levers: efficiency of the fastest layout that fits (layout; exposed all-gather + reduce-scatter s):",
        "",
        "| lever | " + " | ".join(f"{n} GPUs" for n in gpu_counts) + " |",
        "|---|" + "---|" * len(gpu_counts),
    ]
    for name, (sets, opg) in levers.items():
        cfg = load_config(config, sets)
        cells = []
        for n in gpu_counts:
            r = best_efficiency(cfg, hw, n, opg)
            cells.append(
                "does not fit"
                if r is None
                else f"{r['scaling_efficiency']:.3f} ({r['layout']}, {r['all_gather_s'] + r['reduce_scatter_s']:.2f} s)"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, sets in (("as it is", []), ("without activation checkpointing", ["train.activation_checkpointing=none"])):
        for n in gpu_counts:
            for batch in range(base.train.global_batch_size, 256 * 33, 256):
                cfg = load_config(config, [*sets, f"train.global_batch_size={batch}"])
                r = best_efficiency(cfg, hw, n)
                if r and r["scaling_efficiency"] >= target:
                    lines.append(
                        f"- {n} GPUs, the config {name}: efficiency ≥ {target:.2f} from a global batch of {batch} "
                        f"sequences ({batch * cfg.train.seq_len / 1e6:.1f} M tokens): {r['scaling_efficiency']:.3f} "
                        f"with {r['layout']}"
                    )
                    break
            else:
                lines.append(f"- {n} GPUs, the config {name}: efficiency < {target:.2f} up to {256 * 32} sequences")
    return lines


# Megatron-LM's published Qwen3-235B-A22B layout (as issue #34 quotes it): 256 H100s, TP2 · EP32 · PP8 with 4 virtual
# stages, sequence 4096, 245 TFLOP/s per GPU in bf16. EP32 over dp 16 × tp 2 is whole experts (our etp 1).
PUBLISHED = ["parallel.pp=8", "parallel.pp_virtual=4", "parallel.tp=2", "parallel.sequence_parallel=true"]
PUBLISHED += ["parallel.ep=32", "parallel.etp=1", "parallel.cp=1"]
PUBLISHED_TFLOPS = 245e12


def published_lines(config: str, mfu: float) -> list[str]:
    """The performance model at the published layout on the H100 and H200 profiles, with full and no activation
    checkpointing, beside the published figure: step terms, model TFLOP/s per GPU (MFU's FLOPs: no recompute)."""
    from moe_dist.config import load_config
    from moe_dist.planning import cluster
    from moe_dist.planning.memory import memory_plan
    from moe_dist.planning.perfmodel import predict_step
    from moe_dist.planning.workload import config_layout

    lines = [
        f"Published layout (256 GPUs, {' '.join(s.split('.', 1)[1] for s in PUBLISHED)}), {mfu:.0%} of peak "
        f"sustained; published: {PUBLISHED_TFLOPS / 1e12:.0f} TFLOP/s per GPU on H100 "
        f"(MFU {PUBLISHED_TFLOPS / 989e12:.3f}):",
        "",
        "| GPU | recompute | step s | compute s | bubble s | all-to-all s | TP s | reduction s (exposed) | "
        "p2p s | model TFLOP/s per GPU | MFU | memory GB (usable) |",
        "|" + "---|" * 12,
    ]
    for name, hw in (("H100", cluster.h100_cluster(mfu)), ("H200", cluster.h200_cluster(mfu))):
        for ac in ("full", "none"):
            cfg = load_config(config, [*PUBLISHED, f"train.activation_checkpointing={ac}"])
            lay = config_layout(cfg, 256)
            p = min((predict_step(cfg, lay, hw, a2a_chunks=c) for c in (1, 2, 4)), key=lambda q: q.step_s)
            plan = memory_plan(cfg, 256, capacity_bytes=int(hw.memory_bytes))
            reduce = p.comm_s["reduce_scatter"] + p.comm_s["all_gather"]
            tp = p.comm_s["all_reduce"]
            lines.append(
                f"| {name} | {ac} | {p.step_s:.2f} | {p.compute_s:.2f} | {p.bubble_s:.2f} | "
                f"{p.comm_s['all_to_all']:.2f} | {tp:.2f} | {reduce:.2f} | {p.comm_s['other']:.2f} | "
                f"{p.mfu * hw.peak_flops_per_s / 1e12:.0f} | {p.mfu:.3f} | "
                f"{plan['memory_per_rank_gb']['total']:.1f} ({plan['capacity']['usable_gb']:.1f}) |"
            )
    return lines


def predict_table(config: str, mfu: float, levers: bool = False, published: bool = False) -> str:
    from moe_dist.config import load_config
    from moe_dist.planning import cluster

    cfg = load_config(config, [])
    hw = cluster.h200_cluster(mfu)
    rows = cluster.scaling_sweep(cfg, hw)
    lines = [
        f"# {Path(config).name} on {hw.name}",
        "",
        "| GPUs | layout | (dp, ep, tp) | tokens/s | per GPU | efficiency | MFU | step s | compute s | "
        "a2a_chunks | a2a s (unchunked) | all-reduce s | grad RS s in flight (exposed) | param AG s | GB / GPU |",
        "|" + "---|" * 15,
    ]
    for r in rows:
        lines.append(
            f"| {r['gpus']} | {r['family']} | {r['layout']} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {r['scaling_efficiency']:.2f} | {r['mfu']:.2f} | "
            f"{r['step_s']:.2f} | {r['compute_s']:.2f} | {r['a2a_chunks']} | "
            f"{r['all_to_all_s']:.2f} ({r['all_to_all_unchunked_s']:.2f}) | {r['all_reduce_s']:.2f} |"
            f" {r['grad_reduce_s']:.2f} ({r['grad_exposed_s']:.2f}) | {r['all_gather_s']:.2f} | "
            f"{r['memory_gb']:.0f}{'' if r['fits'] else ' (does not fit)'} |"
        )
    lines += ["", *overlap_lines(cfg, hw)]
    lines += ["", "Recommended (fastest layout that fits in one H200 less the fragmentation margin):", ""]
    for n, r in cluster.recommend(rows).items():
        lines.append(
            f"- {n} GPUs: {r['family']} ({r['layout']}, a2a_chunks={r['a2a_chunks']}), "
            f"{r['tokens_per_s']:,.0f} tokens/s, efficiency {r['scaling_efficiency']:.2f}, MFU {r['mfu']:.2f}"
        )
    if levers:
        lines += ["", *summary_lines(config, hw, rows), "", *lever_lines(config, hw)]
    if published:
        lines += ["", *published_lines(config, mfu)]
    return "\n".join(lines)
