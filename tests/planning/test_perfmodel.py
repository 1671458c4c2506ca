"""The performance model: α–β fits recover known constants from synthetic timings, the collective schedule
matches what a training step issues, and the H200 sweep is self-consistent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moe_dist.config import load_config
from moe_dist.planning import cluster, fit
from moe_dist.planning import collectives as co
from moe_dist.planning import perfmodel as pm
from moe_dist.planning import workload as wl

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

TRUE = co.Hardware(
    name="synthetic", flops_per_s=3e10, ranks_per_node=2, intra=co.Link(2e-4, 2e9), inter=co.Link(9e-4, 3e8)
)


def _samples(link: co.Link, rng, n_samples=400, noise=0.02, span_nodes=False):
    """Per-call timings of random collectives under the α–β law, with multiplicative noise."""
    rows = []
    for _ in range(n_samples):
        kind = rng.choice(["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
        n = int(rng.choice([2, 4, 8]))
        g = max(1, n // 2) if span_nodes else n
        payload = float(10 ** rng.uniform(2, 7.5))
        hops, wire = co.bottleneck_features(kind, n, g, payload)
        rows.append((hops, wire, link.time(hops, wire) * (1 + noise * rng.standard_normal())))
    return np.array(rows)


@pytest.mark.parametrize(
    "link",
    [co.Link(5e-6, 4.5e10), co.Link(2e-4, 2e9), co.Link(1e-3, 1e8)],
    ids=["nvlink-like", "loopback-like", "slow"],
)
def test_fit_link_recovers_alpha_and_beta(link):
    s = _samples(link, np.random.default_rng(0))
    got = fit.fit_link(s[:, 0], s[:, 1], s[:, 2])
    assert got.alpha_s == pytest.approx(link.alpha_s, rel=0.05)
    assert got.beta_Bps == pytest.approx(link.beta_Bps, rel=0.05)


def test_fit_link_exact_without_noise():
    s = _samples(co.Link(3e-5, 7e8), np.random.default_rng(1), noise=0.0)
    got = fit.fit_link(s[:, 0], s[:, 1], s[:, 2])
    assert got.alpha_s == pytest.approx(3e-5, rel=1e-9) and got.beta_Bps == pytest.approx(7e8, rel=1e-9)


def test_fit_link_never_returns_negative_constants():
    # Latency-bound timings that shrink slightly with size (noise on a busy machine): the bandwidth
    # coefficient comes out negative, so it is dropped (β = ∞) and α refitted alone.
    hops = np.array([1, 2, 3, 6, 7, 14], float)
    wire = np.array([1e3, 5e5, 1e2, 3e6, 2e4, 8e5])
    got = fit.fit_link(hops, wire, 1e-4 * hops - 1e-12 * wire)
    assert got.alpha_s == pytest.approx(1e-4, rel=0.01) and got.beta_Bps == float("inf")


def _measured_runs(hw: co.Hardware):
    """Runs of the debug config at several layouts, 'measured' on `hw` (the model's own prediction)."""
    runs = []
    for world, nodes, gbs in [
        (1, 1, 8),
        (2, 1, 8),
        (4, 1, 8),
        (2, 1, 16),
        (4, 1, 32),
        (2, 2, 8),
        (4, 2, 8),
        (4, 2, 32),
    ]:
        cfg = load_config(
            CONFIGS / "debug.json",
            [f"train.global_batch_size={gbs}", f"parallel.ep={world}", f"train.eval_batches={world}"],
        )
        layout = wl.Layout(world, world, 1)
        share = max(1, world // 2)
        p = pm.predict_step(cfg, layout, hw, ranks_per_device=share, ranks_per_node=world // nodes)
        comm = sum(p.comm_s.values())
        runs.append(
            fit.MeasuredRun(f"w{world}n{nodes}b{gbs}", cfg, layout, world // nodes, share, p.step_s, p.step_s - comm)
        )
    return runs


def test_fit_hardware_recovers_every_constant_and_predicts_the_runs():
    rng = np.random.default_rng(2)
    runs = _measured_runs(TRUE)
    samples = {"intra": _samples(TRUE.intra, rng), "inter": _samples(TRUE.inter, rng, span_nodes=True)}
    hw = fit.fit_hardware(runs, samples)
    assert hw.flops_per_s == pytest.approx(TRUE.flops_per_s, rel=1e-6)
    for got, want in ((hw.intra, TRUE.intra), (hw.inter, TRUE.inter)):
        assert got.alpha_s == pytest.approx(want.alpha_s, rel=0.05)
        assert got.beta_Bps == pytest.approx(want.beta_Bps, rel=0.05)
    for e in fit.fit_errors(runs, hw):
        assert abs(e["rel_error"]) < 0.03, e


def test_collective_terms_textbook_costs():
    assert co.collective_terms("all_reduce", 4, 1000) == (6, 1500.0)  # ring: 2(n-1) hops, 2(n-1)/n bytes
    assert co.collective_terms("all_gather", 4, 1000) == (3, 750.0)
    assert co.collective_terms("all_to_all", 8, 800) == (7, 700.0)
    assert co.collective_terms("all_reduce", 1, 1000) == (0, 0.0)


def test_spanning_all_to_all_pays_the_slow_link_only_for_its_inter_node_share():
    hw = cluster.h200_cluster()
    inside = co.Call("all_to_all", "x", 8, 8, 1e8, 1)
    across = co.Call("all_to_all", "x", 16, 8, 1e8, 1)
    t_in, t_across = co.call_time(inside, hw), co.call_time(across, hw)
    assert t_in == pytest.approx(7 * 3e-6 + 1e8 * 7 / 8 / (0.8 * 450e9))
    assert t_across == pytest.approx(15 * 8e-6 + 1e8 * 8 / 16 / (0.9 * 50e9))


def test_step_schedule_matches_an_instrumented_training_step():
    # benchmarks/scaling.py measured, for configs/debug.json at world 4, ep 2, ZeRO-1, one micro-batch per rank:
    # 2 count + 8 row all-to-alls in the 2-rank EP group, dense-gradient all-reduce over 4 ranks, expert-gradient
    # all-reduce over the 2-rank EDP group, parameter all-gathers over the same groups.
    cfg = load_config(CONFIGS / "debug.json", ["train.eval_batches=4"])
    calls = {(c.label, c.kind): c for c in wl.step_calls(cfg, wl.Layout(4, 2, 1), ranks_per_node=4)}
    assert calls[("moe_counts", "all_to_all")].count == 2 and calls[("moe_counts", "all_to_all")].group_size == 2
    assert calls[("moe_rows", "all_to_all")].count == 8
    assert calls[("moe_rows", "all_to_all")].payload_bytes == 2 * 32 * 2 * 64 * 4  # tokens · k · d · fp32
    cost = wl.model_cost(cfg)
    assert calls[("dense_grad", "all_reduce")].payload_bytes == cost.dense_params * 4
    assert calls[("dense_grad", "all_reduce")].group_size == 4
    assert calls[("expert_grad", "all_reduce")].payload_bytes == cost.expert_params / 2 * 4
    assert calls[("expert_grad", "all_reduce")].group_size == 2
    assert not any(c.label == "tp_act" for c in calls.values())


def test_tensor_parallel_schedule_matches_the_measured_one():
    # benchmarks/comm_report.py measured, for configs/mixtral_small.json at tp=2 (3 attention + 3 Mamba layers, 6 MoE
    # FFNs, one 8x128-token micro-batch, fp32): 28,504,064 bytes of TP all-reduces per rank per micro-batch.
    cfg = load_config(CONFIGS / "mixtral_small.json", ["train.micro_batch_size=8"])  # the measured micro-batch
    calls = wl.step_calls(cfg, wl.Layout(dp=1, ep=1, tp=2), ranks_per_node=2)
    tp = [c for c in calls if c.label.startswith("tp_")]
    assert all(c.kind == "all_reduce" and c.group_size == 2 for c in tp)
    micro = wl.micro_batches_per_rank(cfg, wl.Layout(dp=1, ep=1, tp=2))
    assert sum(c.payload_bytes * c.count for c in tp) == 28_504_064 * micro


def test_group_placement_follows_mesh_rank_order():
    shapes = wl.group_shapes(wl.Layout(dp=128, ep=8, tp=8), ranks_per_node=8)
    assert shapes["tp"] == (8, 8)  # tensor parallel stays inside a node
    assert shapes["ep"] == (8, 1)  # 8 EP ranks 8 apart: one per node
    assert shapes["dp"] == (128, 1)
    assert wl.group_shapes(wl.Layout(dp=16, ep=8, tp=1), 8)["ep"] == (8, 8)


def test_folded_layout_keeps_ep_in_a_node_and_drops_the_tp_row_gathers():
    """parallel.etp = 1: the EP group is ep consecutive ranks (inside a node where EP8 x TP2 spread it over 2),
    the experts are whole (tp times the expert bytes per rank, tp times fewer replicas) and no TP row gathers."""
    split, folded = wl.Layout(dp=64, ep=8, tp=2), wl.Layout(dp=64, ep=8, tp=2, etp=1)
    assert wl.group_shapes(split, 8)["ep"] == (8, 4) and wl.group_shapes(folded, 8)["ep"] == (8, 8)
    assert wl.group_shapes(folded, 8)["edp"] == (16, 1) and wl.group_shapes(split, 8)["edp"] == (8, 1)
    cfg = load_config(CONFIGS / "mixtral_8x7b.json")
    calls = {lay: {c.label: c for c in wl.step_calls(cfg, lay, 8)} for lay in (split, folded)}
    assert "moe_tp_rows" in calls[split] and "moe_tp_rows" not in calls[folded]
    assert calls[folded]["moe_rows"].payload_bytes == calls[split]["moe_rows"].payload_bytes  # 1/tp of the rows
    assert calls[folded]["expert_grad"].payload_bytes == 2 * calls[split]["expert_grad"].payload_bytes
    assert str(folded) == "dp64-ep8-tp2-etp1"
    # Under pipeline parallelism the expert replicas are those of one stage's world / pp ranks: (8·4/8, 1 per node).
    assert wl.group_shapes(wl.Layout(dp=8, ep=8, tp=4, etp=1, pp=8), 8)["edp"] == (4, 1)
    assert "EP8 x TP2 folded (etp 1, EP in node)" in cluster.candidate_layouts(128, 8, 1024, 1)


def test_mixtral_cost_and_memory():
    cfg = load_config(CONFIGS / "mixtral_8x7b.json", ["deepspeed.zero_stage=1"])
    cost = wl.model_cost(cfg)
    assert cost.dense_params + cost.expert_params == 46_702_792_704  # README's parameter count
    active = cost.dense_params + cost.expert_params * 2 / 8
    # 2 FLOPs per active weight (embedding lookup excluded) plus attention scores: within 5% of 2 · active
    assert cost.fwd_flops_per_token == pytest.approx(2 * active, rel=0.05)
    # activation_checkpointing=full repeats every block's mixer and experts, not the LM head (2 · 32000 · 4096)
    # nor the routers (2 · 32 · 8 · 4096): the forward less those two
    assert cost.recompute_flops_per_token == pytest.approx(
        cost.fwd_flops_per_token - 2 * 32000 * 4096 - 2 * 32 * 8 * 4096
    )
    hw = cluster.h200_cluster()
    dp_only = cluster.memory_per_device(cfg, wl.Layout(64, 1, 1), cost)
    ep8 = cluster.memory_per_device(cfg, wl.Layout(64, 8, 1), cost)
    # bf16 weights (93 GB) and the fp32 accumulation buffer (187 GB) alone exceed one H200's 143,771 MiB
    assert dp_only > hw.memory_bytes == 143_771 * 2**20 > ep8
    assert not cluster.fits(cfg, dp_only, hw) and cluster.fits(cfg, ep8, hw)


def test_h200_sweep_is_consistent():
    cfg = load_config(CONFIGS / "mixtral_8x7b.json", [])
    cost = wl.model_cost(cfg)
    rows = cluster.scaling_sweep(cfg, cluster.h200_cluster())
    assert {r["gpus"] for r in rows} == {8, 16, 32, 64, 128, 256, 512, 1024}
    # MFU counts model FLOPs (3 × forward), the device also runs the recompute (activation_checkpointing=full)
    model_share = 3 * cost.fwd_flops_per_token / (3 * cost.fwd_flops_per_token + cost.recompute_flops_per_token)
    for r in rows:
        assert 0 < r["scaling_efficiency"] <= 1
        assert r["mfu"] == pytest.approx(0.40 * r["scaling_efficiency"] * model_share, rel=1e-9)
        assert r["tokens_per_s"] == pytest.approx(1024 * 4096 / r["step_s"])
    best = cluster.recommend(rows)
    assert set(best) == {8, 16, 32, 64, 128, 256, 512, 1024} and all(b["fits"] for b in best.values())
    # more GPUs never lower the best throughput
    tps = [best[n]["tokens_per_s"] for n in sorted(best)]
    assert tps == sorted(tps)


def test_chunked_all_to_all_overlaps_the_expert_gemms_down_to_one_chunk_each_way():
    """parallel.a2a_chunks: the same bytes; exposed row all-to-all time falls with the chunks while the GEMMs hide
    it, never below the first dispatch and last combine chunk (2a per direction); one chunk is the plain schedule."""
    cfg = load_config(CONFIGS / "mixtral_8x7b.json", [])
    hw, lay = cluster.h200_cluster(), wl.Layout(16, 8, 2)  # EP spans 2 nodes: the all-to-all crosses InfiniBand
    plain, one = pm.predict_step(cfg, lay, hw), pm.predict_step(cfg, lay, hw, a2a_chunks=1)
    assert plain.step_s == one.step_s and plain.a2a_chunks == 1
    rows = next(c for c in plain.calls if c.label == "moe_rows")
    assert rows.count * co.call_time(rows, hw) == pytest.approx(pm.overlapped_rows_s(rows, hw, 1, 1.0))
    g = pm.expert_gemm_s(cfg, lay, hw, 1, wl.model_cost(cfg))
    assert 0 < g < plain.compute_s
    previous = plain.comm_s["all_to_all"]
    for chunks in (2, 4, 8):
        p = pm.predict_step(cfg, lay, hw, a2a_chunks=chunks)
        assert p.bytes_per_rank == plain.bytes_per_rank and p.compute_s == plain.compute_s
        assert p.comm_s["all_reduce"] == plain.comm_s["all_reduce"]
        assert p.comm_s["all_to_all"] < previous
        previous = p.comm_s["all_to_all"]
    # no compute to hide behind: C chunks cost C times the latency, so chunking only adds to the exposed time
    assert pm.overlapped_rows_s(rows, hw, 4, 0.0) > pm.overlapped_rows_s(rows, hw, 1, 0.0)
    # unlimited compute: only the first and the last chunk of each direction remain exposed
    chunk = co.Call(rows.kind, rows.label, rows.group_size, rows.ranks_per_node, rows.payload_bytes / 4, 1)
    assert pm.overlapped_rows_s(rows, hw, 4, 1e9) == pytest.approx(rows.count * co.call_time(chunk, hw))
