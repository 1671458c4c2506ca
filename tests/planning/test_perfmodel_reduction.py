"""The performance model's once-per-step gradient reduction, its overlap with the last backward, the recompute of
activation checkpointing, and the context-parallel and Mamba-2 few-groups collectives, against values computed by
hand for a one-layer model small enough to count (every expected number below is written out from the shapes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_dist.config import load_config
from moe_dist.planning import collectives as co
from moe_dist.planning import perfmodel as pm
from moe_dist.planning import workload as wl

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# One attention + MoE layer: vocab 16, d 8, 2 heads of 4, 1 KV head, 4 experts top-2 of hidden 16, seq 8, bf16.
TINY = [
    "model.vocab_size=16",
    "model.d_model=8",
    "model.n_layers=1",
    "model.mixer_pattern=A",
    "model.ffn_pattern=E",
    "model.attention.n_heads=2",
    "model.attention.n_kv_heads=1",
    "model.d_ff=16",
    "train.seq_len=8",
    "train.dtype=bf16",
    "train.micro_batch_size=1",
    "train.global_batch_size=16",
    "train.eval_batches=4",
    "deepspeed.zero_stage=1",  # with bf16 weights: fp32 accumulation, one reduction per step
]
# embed 16·8 + mixer norm 8 + wq 8·8 + wk 4·8 + wv 4·8 + wo 8·8 + ffn norm 8 + router 4·8 + final norm 8 + head 16·8
DENSE = 128 + 8 + 64 + 32 + 32 + 64 + 8 + 32 + 8 + 128  # 504
EXPERT = 4 * 8 * 32 + 4 * 16 * 8  # w13 (E, d, 2f) + w2 (E, f, d) = 1536
# 2 · (head 128 + wq 64 + wk 32 + wv 32 + wo 64 + router 32 + experts 1536 · 2/4) + attention 2 · S · H · Dh
FWD = 2 * (128 + 64 + 32 + 32 + 64 + 32 + 768) + 2 * 8 * 2 * 4  # 2368 per token
RECOMPUTE = 2 * (64 + 32 + 32 + 64 + 768) + 2 * 8 * 2 * 4  # the mixer and the experts again: 2048


def tiny(*extra: str):
    return load_config(CONFIGS / "debug.json", [*TINY, *extra])


def by_label(calls):
    out = {}
    for c in calls:
        out.setdefault((c.label, c.kind), []).append(c)
    return out


def test_tiny_model_costs_what_its_shapes_say():
    cost = wl.model_cost(tiny())
    assert (cost.dense_params, cost.expert_params) == (DENSE, EXPERT)
    assert cost.fwd_flops_per_token == FWD and cost.recompute_flops_per_token == 0
    full = wl.model_cost(tiny("train.activation_checkpointing=full"))
    assert full.fwd_flops_per_token == FWD and full.recompute_flops_per_token == RECOMPUTE


@pytest.mark.parametrize("reduce_dtype, grad_bytes", [("fp32", 4), ("bf16", 2)])
def test_bf16_reduces_once_per_step_what_the_code_sends(reduce_dtype, grad_bytes):
    """dp 4, ep 2, 2 ranks per node, 4 micro-batches per rank: one reduce-scatter of the dense gradients over the 4
    data-parallel ranks and one of the expert gradients over the 2 expert-data-parallel ranks, in
    train.grad_reduce_dtype, then the bf16 parameters' all-gathers, whatever the number of micro-batches."""
    cfg = tiny(f"train.grad_reduce_dtype={reduce_dtype}")
    layout = wl.Layout(dp=4, ep=2, tp=1)
    assert wl.micro_batches_per_rank(cfg, layout) == 4
    calls = by_label(wl.step_calls(cfg, layout, ranks_per_node=2))
    [dense] = calls[("dense_grad", "reduce_scatter")]
    [expert] = calls[("expert_grad", "reduce_scatter")]
    assert (dense.count, dense.group_size, dense.ranks_per_node, dense.payload_bytes) == (1, 4, 2, DENSE * grad_bytes)
    assert (expert.count, expert.group_size, expert.ranks_per_node) == (1, 2, 1)  # ranks 0 and 2: two nodes
    assert expert.payload_bytes == EXPERT / 2 * grad_bytes
    assert dense.hides_behind == expert.hides_behind == co.LAST_BACKWARD
    [dparam] = calls[("dense_param", "all_gather")]
    [eparam] = calls[("expert_param", "all_gather")]
    assert (dparam.payload_bytes, eparam.payload_bytes) == (DENSE * 2, EXPERT / 2 * 2)
    assert ("dense_grad", "all_reduce") not in calls
    # bytes one rank sends per step: (n−1)/n of each buffer
    p = pm.predict_step(cfg, layout, co.Hardware("x", 1e12, 2, co.Link(0, 1e9), co.Link(0, 1e9)))
    assert p.bytes_per_rank["reduce_scatter"] == 3 / 4 * DENSE * grad_bytes + 1 / 2 * EXPERT / 2 * grad_bytes
    assert p.bytes_per_rank["all_gather"] == 3 / 4 * DENSE * 2 + 1 / 2 * EXPERT


def test_fp32_training_keeps_the_measured_all_reduce_schedule():
    cfg = tiny("train.dtype=fp32", "deepspeed.zero_stage=2")  # DeepSpeed reduces every micro-batch, nothing overlapped
    calls = by_label(wl.step_calls(cfg, wl.Layout(dp=4, ep=2, tp=1), ranks_per_node=2))
    [dense] = calls[("dense_grad", "all_reduce")]
    assert (dense.count, dense.payload_bytes, dense.hides_behind) == (4, DENSE * 4, None)


def test_zero2_with_bf16_reduces_every_micro_batch():
    """ZeRO 2 keeps no full-size fp32 buffer: each of the 4 micro-batches' gradients is reduce-scattered into the
    partitions as the code does (train/optim.py), four times the bytes of ZeRO 1's one reduction, charged exposed."""
    layout = wl.Layout(dp=4, ep=2, tp=1)
    once = by_label(wl.step_calls(tiny(), layout, ranks_per_node=2))
    every = by_label(wl.step_calls(tiny("deepspeed.zero_stage=2"), layout, ranks_per_node=2))
    for label in ("dense_grad", "expert_grad"):
        [one], [each] = once[(label, "reduce_scatter")], every[(label, "reduce_scatter")]
        assert (one.count, each.count) == (1, 4) and one.payload_bytes == each.payload_bytes
        assert (one.hides_behind, each.hides_behind) == (co.LAST_BACKWARD, None)


def _hw(flops_per_s: float, beta: float) -> co.Hardware:
    return co.Hardware("hand", flops_per_s, 2, co.Link(0.0, beta), co.Link(0.0, beta))


def test_reduction_hides_behind_the_last_backward_up_to_its_length():
    """The last micro-batch's backward: 2 × 2368 FLOPs × 8 tokens = 37,888 FLOPs; at 37,888 FLOP/s it lasts 1 s.
    In flight: 3/4 · 504 · 4 + 1/2 · 768 · 4 = 1512 + 1536 = 3048 bytes; at 1524 B/s, 2 s: 1 s exposed. The model
    follows the config: train.grad_reduce_overlap on here, off below."""
    cfg, layout = tiny("train.grad_reduce_overlap=true"), wl.Layout(dp=4, ep=2, tp=1)
    p = pm.predict_step(cfg, layout, _hw(37_888.0, 1524.0))
    grad = p.overlap[co.LAST_BACKWARD]
    assert grad["window_s"] == pytest.approx(1.0) and grad["in_flight_s"] == pytest.approx(2.0)
    assert grad["exposed_s"] == pytest.approx(1.0) and p.comm_s["reduce_scatter"] == pytest.approx(1.0)
    # compute: 4 micro-batches × 8 tokens × 3 × 2368 FLOPs = 227,328 FLOPs = 6 s
    assert p.compute_s == pytest.approx(6.0)
    # the parameter all-gather is exposed: (3/4 · 1008 + 1/2 · 1536) / 1524 = 1 s; behind the next forward
    # (2368 · 8 FLOPs = 0.5 s) half of it
    assert p.comm_s["all_gather"] == pytest.approx(1.0)
    q = pm.predict_step(cfg, layout, _hw(37_888.0, 1524.0), overlap_param_gather=True)
    assert q.comm_s["all_gather"] == pytest.approx(0.5) and q.comm_s["reduce_scatter"] == pytest.approx(1.0)
    # ... which the config asks for with train.param_gather_overlap (parallel/param_gather.py)
    gathered = tiny("train.grad_reduce_overlap=true", "train.param_gather_overlap=true")
    assert pm.predict_step(gathered, layout, _hw(37_888.0, 1524.0)).comm_s["all_gather"] == pytest.approx(0.5)
    # a backward longer than the reduction hides all of it
    assert pm.predict_step(cfg, layout, _hw(37_888.0, 3048.0)).comm_s["reduce_scatter"] == 0.0
    # not overlapped (asked, or the config's train.grad_reduce_overlap off): the whole 2 s of the reduction exposed
    for r in (
        pm.predict_step(cfg, layout, _hw(37_888.0, 1524.0), overlap_grad_reduce=False),
        pm.predict_step(tiny(), layout, _hw(37_888.0, 1524.0)),
    ):
        assert r.comm_s["reduce_scatter"] == pytest.approx(2.0)
        assert r.overlap[co.LAST_BACKWARD]["exposed_s"] == pytest.approx(2.0)


def test_recompute_lengthens_the_step_and_the_window():
    """Full checkpointing: compute 4 × 8 × (3 · 2368 + 2048) = 292,864 FLOPs; the backward window
    8 · (2 · 2368 + 2048) = 54,272 FLOPs: at 54,272 FLOP/s, 1 s."""
    cfg, layout = tiny("train.activation_checkpointing=full", "train.grad_reduce_overlap=true"), wl.Layout(4, 2, 1)
    p = pm.predict_step(cfg, layout, _hw(54_272.0, 1524.0))
    assert p.compute_s == pytest.approx(292_864 / 54_272)
    assert p.overlap[co.LAST_BACKWARD]["window_s"] == pytest.approx(1.0)
    assert p.mfu is None


def test_context_parallel_collectives_and_placement():
    """cp 2 (dp 2, tp 1): per attention layer and micro-batch an all-gather of the whole sequence's K and of its V
    (1 KV head × 4 dims × 8 positions × 2 bytes = 64 bytes each), their gradients reduce-scattered backward; each
    rank runs 4 of the 8 positions; ZeRO and the dense reduction span dp × cp = 4 ranks."""
    cfg, layout = tiny(), wl.Layout(dp=2, ep=1, tp=1, cp=2)
    assert layout.world == 4 and str(layout) == "dp2-cp2-ep1-tp1"
    assert wl.tokens_per_micro_batch(cfg, layout) == 4
    calls = by_label(wl.step_calls(cfg, layout, ranks_per_node=4))
    [gather] = calls[("cp_kv", "all_gather")]
    [scatter] = calls[("cp_kv", "reduce_scatter")]
    micro = 16 // (1 * 2)
    assert (gather.payload_bytes, gather.count, gather.group_size) == (64, 2 * micro, 2)
    assert (scatter.payload_bytes, scatter.count) == (64, 2 * micro)
    assert calls[("dense_grad", "reduce_scatter")][0].group_size == 4
    # the recompute of a checkpointed attention gathers K and V again
    ckpt = by_label(wl.step_calls(tiny("train.activation_checkpointing=full"), layout, ranks_per_node=4))
    assert ckpt[("cp_kv", "all_gather")][0].count == 4 * micro
    assert ckpt[("cp_kv", "reduce_scatter")][0].count == 2 * micro
    # FLOPs per rank: 16 sequences × 8 tokens / (dp 2 · cp 2) × 3 × 2368
    assert wl.step_flops_per_rank(cfg, layout) == 16 * 8 / 4 * 3 * FWD
    # rank = (dp_rank · cp + cp_rank) · tp + tp_rank, 4 ranks per node
    shapes = wl.group_shapes(wl.Layout(dp=2, ep=2, tp=2, cp=2), ranks_per_node=4)
    assert shapes["tp"] == (2, 2) and shapes["cp"] == (2, 2)  # ranks 0, 1 and ranks 0, 2
    assert shapes["dp"] == (4, 2)  # ranks 0, 2, 4, 6
    assert shapes["ep"] == (2, 2) and shapes["edp"] == (2, 1)  # ranks 0, 2 and ranks 0, 4


@pytest.mark.parametrize("seq_len, halo_positions", [(8, 2), (16, 3), (64, 3)])
def test_recurrent_state_passing_bytes_do_not_grow_with_the_sequence(seq_len, halo_positions):
    """Mamba-1 (d_inner 16, d_state 4, d_conv 4), cp 2, so 2·cp = 4 pieces: one all-gather of the pieces' fp32 final
    states and decays (2 · 16 · 4 · 4 = 512 bytes a piece) and one of their bf16 conv halos, the last
    min(d_conv − 1, S / 4) inputs of 16 channels: 2 positions of the 2-long pieces at S = 8, then 3 whatever S."""
    cfg = tiny("model.mixer_pattern=M", "model.mamba.d_state=4", f"train.seq_len={seq_len}")
    calls = by_label(wl.step_calls(cfg, wl.Layout(dp=1, ep=1, tp=1, cp=2), ranks_per_node=2))
    for label, per_piece in (("cp_state", 512), ("cp_halo", halo_positions * 16 * 2)):
        [gather] = calls[(label, "all_gather")]
        [scatter] = calls[(label, "reduce_scatter")]
        assert gather.payload_bytes == scatter.payload_bytes == 4 * per_piece
        assert gather.count == scatter.count == 16  # one layer, 16 micro-batches


def test_delta_rule_summary_carries_the_transition_operator():
    """Gated DeltaNet (4 value heads of dk = dv = 4, 2 key heads, conv 4), cp 2, S 16: per piece the final state
    (4 × 4 × 4) and the dk × dk transition (4 × 4 × 4) in fp32 = 512 bytes; the halo 3 positions of q, k, v
    (2·2·4 + 4·4 = 32 channels) in bf16 = 192 bytes."""
    sets = ['model.layers=["gdn+moe"]', "model.gdn.n_k_heads=2", "model.gdn.n_v_heads=4"]
    sets += ["model.gdn.head_k_dim=4", "model.gdn.head_v_dim=4", "train.seq_len=16"]
    calls = by_label(wl.step_calls(tiny(*sets), wl.Layout(dp=1, ep=1, tp=1, cp=2), ranks_per_node=2))
    assert calls[("cp_state", "all_gather")][0].payload_bytes == 4 * 512
    assert calls[("cp_halo", "all_gather")][0].payload_bytes == 4 * 192


def test_mamba2_groups_spanning_tp_ranks_gather_b_c_and_norm_statistics():
    """Mamba-2 with 1 group over tp 2 (heads 4 of 4, d_state 4): per layer and micro-batch the B and the C of the
    8 positions (8 · 1 · 4 · 2 bytes = 64 each) all-gathered forward and reduce-scattered backward, and the gated
    norm's fp32 sums of squares (8 positions × 2 ranks × 4 bytes = 64) the same; none with 2 groups."""
    sets = ['model.layers=["mamba2+moe"]', "model.mamba2.head_dim=4", "model.mamba2.d_state=4"]
    layout = wl.Layout(dp=1, ep=1, tp=2)
    calls = by_label(wl.step_calls(tiny(*sets, "model.mamba2.n_groups=1"), layout, ranks_per_node=2))
    micro = 16
    [bc] = calls[("tp_ssd_groups", "all_gather")]
    assert (bc.payload_bytes, bc.count) == (64, 2 * micro)
    assert calls[("tp_ssd_groups", "reduce_scatter")][0].count == 2 * micro
    [norm] = calls[("tp_ssd_norm", "all_gather")]
    assert (norm.payload_bytes, norm.count) == (64, micro)
    two = by_label(wl.step_calls(tiny(*sets, "model.mamba2.n_groups=2"), layout, ranks_per_node=2))
    assert not any(label.startswith("tp_ssd") for label, _ in two)


def test_config_layout_reads_the_configs_parallel_keys():
    cfg = load_config(CONFIGS / "jamba_v0.1.json")  # tp 4, ep 2
    assert wl.config_layout(cfg, 64) == wl.Layout(dp=16, ep=2, tp=4)
    assert wl.config_layout(cfg, 6) is None
    mixtral = load_config(CONFIGS / "mixtral_8x7b.json")  # tp 1: whole experts either way, the plain EP layout
    assert wl.config_layout(mixtral, 64) == wl.Layout(dp=64, ep=8, tp=1)


def test_scalar_all_reduces_take_a_tree_on_the_gpu_cluster_and_a_ring_elsewhere():
    """8 bytes over 1,024 ranks spanning nodes: 2·⌈log2 1024⌉ = 20 hops of 8 µs where the hardware picks a tree
    (NCCL), the ring's 2 · 1023 hops where it does not (gloo, as calibrated)."""
    from moe_dist.planning.cluster import h200_cluster

    call = co.Call("all_reduce", "scalars", 1024, 8, 8.0, 1, tree=True)
    wire = 2 * 1023 / 1024 * 8 / (0.9 * 50e9)
    assert co.call_time(call, h200_cluster()) == pytest.approx(20 * 8e-6 + wire)
    ring = co.Hardware("gloo", 1e9, 8, co.Link(3e-6, 1e9), co.Link(8e-6, 1e9))
    assert co.call_time(call, ring) == pytest.approx(2 * 1023 * 8e-6 + 2 * 1023 / 1024 * 8 / 1e9)


def test_pipeline_stages_bubble_and_transfers():
    """pp 2 over dp 4 (world 8): each rank runs half the FLOPs and reduces half the gradients; the schedule idles
    (pp − 1)/(m · v) of the compute (m = 4 micro-batches: a quarter; v = 2 virtual stages: an eighth), and each
    micro-batch's hidden state (8 tokens × 8 × 2 bytes) goes to the next stage and its gradient back, per virtual
    stage, across nodes (the stages are 4 ranks apart, 2 ranks per node)."""
    cfg, hw = tiny(), _hw(37_888.0, 1524.0)
    one, two = wl.Layout(dp=4, ep=2, tp=1), wl.Layout(dp=4, ep=2, tp=1, pp=2)
    assert two.world == 8 and str(two) == "pp2-dp4-ep2-tp1"
    p1, p2 = pm.predict_step(cfg, one, hw), pm.predict_step(cfg, two, hw)
    assert p1.bubble_s == 0.0 and p2.compute_s == pytest.approx(p1.compute_s / 2)
    assert p2.bubble_s == pytest.approx(p2.compute_s / 4)
    calls = by_label(p2.calls)
    [p2p] = calls[("pp_p2p", "other")]
    assert (p2p.count, p2p.payload_bytes, p2p.group_size, p2p.ranks_per_node) == (8, 8 * 8 * 2, 2, 1)
    [dense] = calls[("dense_grad", "reduce_scatter")]
    assert dense.payload_bytes == pytest.approx(DENSE / 2 * 4)
    assert p2.step_s == pytest.approx(p2.compute_s + p2.bubble_s + sum(p2.comm_s.values()))
    cfg.parallel.pp_virtual = 2
    assert pm.predict_step(cfg, two, hw).bubble_s == pytest.approx(p2.compute_s / 8)
    assert ("pp_p2p", "other") not in by_label(p1.calls)
