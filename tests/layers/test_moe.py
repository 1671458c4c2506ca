"""MoE layer: hand-worked routing/capacity/drops/losses, grouped experts against a naive per-token loop,
one expert == dense SwiGLU, capacity arithmetic, meta build.

Expected values are computed here independently of moe.py: by hand (math.exp) for the small routing examples,
and by a plain per-token Python loop (its own top-k and its own GShard capacity fill) for the random ones.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import moe_dist.layers.router as router_mod
from moe_dist.config import MoEConfig
from moe_dist.layers.mlp import SwiGLU
from moe_dist.layers.moe import MoE
from moe_dist.layers.router import Router, expert_capacity

F64 = torch.float64


# ----------------------------------------------------------------------------------------------- helpers


def softmax_row(logits):
    z = sum(math.exp(v) for v in logits)
    return [math.exp(v) / z for v in logits]


def logsumexp_row(logits):
    return math.log(sum(math.exp(v) for v in logits))


def swiglu_ref(x_D, w1_DF, w3_DF, w2_FD):
    return (F.silu(x_D @ w1_DF) * (x_D @ w3_DF)) @ w2_FD


def per_expert_sets(routing):
    """rows_R split by the kept count of each expert, as sets (order inside an expert is not part of the contract)."""
    counts = routing.tokens_per_expert_E.tolist()
    rows = routing.rows_R.tolist()
    out, start = [], 0
    for c in counts:
        out.append(set(rows[start : start + c]))
        start += c
    assert start == len(rows)
    return out


def build_moe(d_model, d_ff, dtype, seed=0, router_scale=1.0, **cfg_kw):
    """An MoE with random (not init-scaled) weights so that routing is diverse and outputs are O(1)."""
    cfg = MoEConfig(**cfg_kw)
    moe = MoE(d_model, d_ff, cfg, init_std=0.02, n_layers=2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * (0.5 if p.dim() == 3 else router_scale))
    return moe.to(dtype)


def naive_moe(x_TD, router_w_ED, w1_EDF, w3_EDF, w2_EFD, cfg):
    """Per-token loop: own top-k, own GShard/probability capacity fill, expert SwiGLU, weighted sum.

    Returns (out_TD, aux, z, counts_E before drops, kept set of (t, k), capacity).
    """
    T, _ = x_TD.shape
    E, K = cfg.num_experts, cfg.top_k
    logits_TE = x_TD @ router_w_ED.T
    probs_TE = logits_TE.softmax(-1)
    pv = probs_TE.detach().tolist()
    choice = [sorted(range(E), key=lambda e: -pv[t][e])[:K] for t in range(T)]  # (T, K) expert ids
    for row in logits_TE.detach().tolist():  # the reference must not depend on how ties are broken
        ranked = sorted(row, reverse=True)
        assert all(ranked[i] - ranked[i + 1] > 1e-4 for i in range(min(K, E - 1))), "near tie in test data"
    weights = []
    for t in range(T):
        p = [probs_TE[t, e] for e in choice[t]]
        s = sum(p)
        weights.append([pk / s for pk in p] if cfg.renormalize else p)

    if cfg.capacity_factor is None:
        cap = None
        kept = {(t, k) for t in range(T) for k in range(K)}
    else:
        cap = max(math.ceil(cfg.capacity_factor * T * K / E), cfg.min_capacity)
        kept = set()
        if cfg.drop_policy == "position":
            fill = [0] * E
            for k in range(K):  # all first choices before any second choice (GShard) ...
                for t in range(T):  # ... and earlier tokens first
                    e = choice[t][k]
                    if fill[e] < cap:
                        kept.add((t, k))
                        fill[e] += 1
        else:
            for e in range(E):
                cands = [(t, k) for k in range(K) for t in range(T) if choice[t][k] == e]
                cands.sort(key=lambda tk: -pv[tk[0]][e])  # highest router probability first
                kept.update(cands[:cap])

    rows = []
    for t in range(T):
        terms = [
            weights[t][k] * swiglu_ref(x_TD[t], w1_EDF[choice[t][k]], w3_EDF[choice[t][k]], w2_EFD[choice[t][k]])
            for k in range(K)
            if (t, k) in kept
        ]
        rows.append(sum(terms) if terms else x_TD.new_zeros(x_TD.shape[1]))
    out_TD = torch.stack(rows)

    counts = [sum(1 for t in range(T) for k in range(K) if choice[t][k] == e) for e in range(E)]
    f_E = torch.tensor([c / (T * K) for c in counts], dtype=x_TD.dtype)
    aux = E * (f_E * probs_TE.mean(0)).sum()
    z = torch.logsumexp(logits_TE, -1).square().mean()
    return out_TD, aux, z, counts, kept, cap


# -------------------------------------------------------------------------------- hand-worked routing

# Router weight = identity (D = E = 3), so each token row below *is* its router logits.
#   token  logits            1st  2nd     slot-major assignment ids a = k*T + t (T = 4)
#   t0     [0.2, 0, -0.1]    e0   e1      a0 -> e0, a4 -> e1
#   t1     [-1, 2, 1]        e1   e2      a1 -> e1, a5 -> e2
#   t2     [3, -1, 0]        e0   e2      a2 -> e0, a6 -> e2
#   t3     [3, -3, 3.2]      e2   e0      a3 -> e2, a7 -> e0
# Counts before drops: e0 {a0, a2, a7} = 3, e1 {a1, a4} = 2, e2 {a3, a5, a6} = 3.
# capacity_factor 0.5: ceil(0.5 * 4 * 2 / 3) = ceil(1.33) = 2.
#   position:    e0 keeps a0, a2 (first choices in token order), drops a7 (t3's 2nd choice);
#                e2 keeps a3 (t3's 1st choice beats the earlier tokens' 2nd choices) and a5 (t1 before t2), drops a6.
#                (Plain token order would instead keep a5, a6 and drop t3's first choice a3.)
#   probability: e0 probs: a2 = 0.936 > a7 = 0.450 > a0 = 0.391 -> keeps a2, a7, drops a0 (t0's 1st choice!);
#                e2 probs: a3 = 0.549 > a5 = 0.260 > a6 = 0.047 -> keeps a3, a5, drops a6.
HAND_LOGITS = [[0.2, 0.0, -0.1], [-1.0, 2.0, 1.0], [3.0, -1.0, 0.0], [3.0, -3.0, 3.2]]
HAND_CHOICE = [(0, 1), (1, 2), (0, 2), (2, 0)]


def hand_router(dtype=torch.float32, **cfg_kw):
    cfg = MoEConfig(num_experts=3, top_k=2, **cfg_kw)
    router = Router(3, cfg, init_std=0.02)
    with torch.no_grad():
        router.weight.copy_(torch.eye(3))
    return router.to(dtype), torch.tensor(HAND_LOGITS, dtype=dtype)


def test_hand_worked_probabilities_are_as_the_comment_says():
    """Guards the hand-derived orderings above (pure math, no code under test)."""
    p = [softmax_row(r) for r in HAND_LOGITS]
    for t, (first, second) in enumerate(HAND_CHOICE):
        others = [e for e in range(3) if e not in (first, second)]
        assert p[t][first] > p[t][second] > p[t][others[0]]
    assert p[2][0] > p[3][0] > p[0][0]  # e0 under probability: a2, a7, a0
    assert p[3][2] > p[1][2] > p[2][2]  # e2 under probability: a3, a5, a6


@pytest.mark.parametrize(
    "policy, kept_sets, dropped_ids",
    [
        ("position", [{0, 2}, {1, 4}, {3, 5}], {6, 7}),
        ("probability", [{2, 7}, {1, 4}, {3, 5}], {0, 6}),
    ],
)
def test_hand_worked_routing_and_drops(policy, kept_sets, dropped_ids):
    router, x = hand_router(capacity_factor=0.5, drop_policy=policy)
    assert expert_capacity(router.cfg, 4) == 2
    routing, stats = router(x)

    assert per_expert_sets(routing) == kept_sets
    assert set(range(8)) - set(routing.rows_R.tolist()) == dropped_ids
    assert routing.tokens_per_expert_E.tolist() == [2, 2, 2]
    assert routing.num_tokens == 4
    experts_of_rows = [HAND_CHOICE[a % 4][a // 4] for a in routing.rows_R.tolist()]
    assert experts_of_rows == sorted(experts_of_rows)  # rows grouped by expert, expert 0 first

    assert stats.tokens_per_expert_E.tolist() == [3.0, 2.0, 3.0]  # before drops
    assert stats.dropped.item() == 2.0
    assert stats.assignments == 8

    # combine weights of every assignment (renormalized over the chosen two), slot-major
    p = [softmax_row(r) for r in HAND_LOGITS]
    expected_w = [0.0] * 8
    for t, (e1, e2) in enumerate(HAND_CHOICE):
        s = p[t][e1] + p[t][e2]
        expected_w[t], expected_w[4 + t] = p[t][e1] / s, p[t][e2] / s
    torch.testing.assert_close(routing.weight_A.double(), torch.tensor(expected_w, dtype=F64), rtol=1e-6, atol=1e-7)

    # aux = E * sum_i f_i P_i with f from counts before drops; z = mean_t logsumexp(logits_t)^2
    f = [3 / 8, 2 / 8, 3 / 8]
    P = [sum(p[t][e] for t in range(4)) / 4 for e in range(3)]
    aux = 3 * sum(fi * Pi for fi, Pi in zip(f, P))
    z = sum(logsumexp_row(r) ** 2 for r in HAND_LOGITS) / 4
    assert stats.aux_loss.item() == pytest.approx(aux, rel=1e-6)
    assert stats.z_loss.item() == pytest.approx(z, rel=1e-6)
    entropy = -sum(pi * math.log(pi) for row in p for pi in row) / 4
    assert stats.entropy.item() == pytest.approx(entropy, rel=1e-6)


def test_hand_worked_no_renormalize_weights_are_raw_probabilities():
    router, x = hand_router(capacity_factor=0.5, renormalize=False)
    routing, _ = router(x)
    p = [softmax_row(r) for r in HAND_LOGITS]
    expected = [p[t][HAND_CHOICE[t][0]] for t in range(4)] + [p[t][HAND_CHOICE[t][1]] for t in range(4)]
    torch.testing.assert_close(routing.weight_A.double(), torch.tensor(expected, dtype=F64), rtol=1e-6, atol=1e-7)


def test_hand_worked_min_capacity_and_dropless():
    router, x = hand_router(capacity_factor=0.5, min_capacity=3)
    routing, stats = router(x)
    assert per_expert_sets(routing) == [{0, 2, 7}, {1, 4}, {3, 5, 6}]
    assert routing.tokens_per_expert_E.tolist() == [3, 2, 3] and stats.dropped.item() == 0.0

    router, x = hand_router(capacity_factor=None)
    routing, stats = router(x)
    assert per_expert_sets(routing) == [{0, 2, 7}, {1, 4}, {3, 5, 6}]
    assert stats.dropped.item() == 0.0 and stats.tokens_per_expert_E.tolist() == [3.0, 2.0, 3.0]

    # capacity 1 (cf 0.375: 0.375 * 4 * 2 / 3 = 1 exactly): one assignment per expert survives
    router, x = hand_router(capacity_factor=0.375)
    routing, stats = router(x)
    assert per_expert_sets(routing) == [{0}, {1}, {3}]
    assert stats.dropped.item() == 5.0


def test_router_loss_gradients_match_hand_formula():
    """aux and z are differentiable w.r.t. the router weight; check against the same formulas in autograd fp64."""
    router, x = hand_router(capacity_factor=0.5)
    _, stats = router(x)
    (stats.aux_loss + stats.z_loss).backward()
    w = torch.eye(3, dtype=F64, requires_grad=True)
    logits = torch.tensor(HAND_LOGITS, dtype=F64) @ w.T
    probs = logits.softmax(-1)
    f = torch.tensor([3 / 8, 2 / 8, 3 / 8], dtype=F64)
    (3 * (f * probs.mean(0)).sum() + torch.logsumexp(logits, -1).square().mean()).backward()
    torch.testing.assert_close(router.weight.grad.double(), w.grad, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------ dropped assignments in the MoE


def hand_moe(policy, renormalize, capacity_factor, logits):
    moe = build_moe(
        3,
        4,
        F64,
        seed=3,
        num_experts=3,
        top_k=2,
        capacity_factor=capacity_factor,
        drop_policy=policy,
        renormalize=renormalize,
    )
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(3, dtype=F64))
    return moe, torch.tensor(logits, dtype=F64)


def expected_output(moe, x, kept, renormalize, choice):
    """kept: list of (t, k) written down by hand; weights from math.exp."""
    w1, w3, w2 = (p.detach() for p in (*moe.experts.gate_up(), moe.experts.w2))
    out = torch.zeros(x.shape, dtype=F64)
    for t, k in kept:
        p = softmax_row(x[t].tolist())
        chosen = [p[e] for e in choice[t]]
        wt = chosen[k] / sum(chosen) if renormalize else chosen[k]
        e = choice[t][k]
        out[t] += wt * swiglu_ref(x[t], w1[e], w3[e], w2[e])
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    "policy, kept",
    [
        ("position", [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1)]),  # a6 = (t2, 2nd), a7 = (t3, 2nd) dropped
        ("probability", [(1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (3, 1)]),  # a0 = (t0, 1st), a6 dropped
    ],
)
def test_dropped_assignments_contribute_nothing(policy, kept, renormalize):
    moe, x = hand_moe(policy, renormalize, 0.5, HAND_LOGITS)
    out, stats = moe(x)
    assert stats.dropped.item() == 2.0
    # a token that lost one assignment keeps the other with its original (top-k) weight, not re-renormalized
    torch.testing.assert_close(out, expected_output(moe, x, kept, renormalize, HAND_CHOICE), rtol=1e-6, atol=1e-7)


# All four tokens rank e0 > e1 > e2; capacity 1.
#   position:    e0 keeps t0 (a0), e1 keeps t0's 2nd (a4): t1, t2, t3 lose everything.
#   probability: e0 keeps the largest p0: t2 (0.98); e1 keeps the largest p1 among all 2nd choices: t3 (0.307),
#                so t3 keeps its 2nd choice although its 1st was dropped; t0 and t1 lose everything.
ALL_E0_LOGITS = [[3.0, 1.0, 0.0], [2.0, 1.0, -1.0], [4.0, 0.0, -2.0], [1.0, 0.5, 0.0]]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    "policy, kept, zero_tokens",
    [("position", [(0, 0), (0, 1)], [1, 2, 3]), ("probability", [(2, 0), (3, 1)], [0, 1])],
)
def test_fully_dropped_token_gets_zero_output(policy, kept, zero_tokens, renormalize):
    p = [softmax_row(r) for r in ALL_E0_LOGITS]
    assert max(range(4), key=lambda t: p[t][0]) == 2 and max(range(4), key=lambda t: p[t][1]) == 3
    moe, x = hand_moe(policy, renormalize, 0.375, ALL_E0_LOGITS)
    x.requires_grad_(True)
    out, stats = moe(x)
    assert stats.dropped.item() == 6.0
    assert stats.tokens_per_expert_E.tolist() == [4.0, 4.0, 0.0]
    choice = [(0, 1)] * 4
    torch.testing.assert_close(
        out.detach(), expected_output(moe, x.detach(), kept, renormalize, choice), rtol=1e-6, atol=1e-7
    )
    assert torch.equal(out[zero_tokens].detach(), torch.zeros(len(zero_tokens), 3, dtype=F64))
    out.sum().backward()  # no aux/z here: a fully dropped token's input gets no gradient through the MoE output
    assert torch.equal(x.grad[zero_tokens], torch.zeros(len(zero_tokens), 3, dtype=F64))
    kept_tokens = sorted({t for t, _ in kept})
    assert (x.grad[kept_tokens].abs().sum(-1) > 0).all()


def test_zero_capacity_drops_everything_and_backward_works():
    moe = build_moe(16, 32, torch.float32, num_experts=4, top_k=2, capacity_factor=0.0)
    x = torch.randn(5, 16, requires_grad=True)
    out, stats = moe(x)
    assert stats.dropped.item() == 10.0 and torch.equal(out.detach(), torch.zeros(5, 16))
    (out.sum() + stats.aux_loss).backward()
    for w in (moe.experts.w13, moe.experts.w2):
        assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w))


# ------------------------------------------------------------------------------ one expert == SwiGLU


@pytest.mark.parametrize("capacity_factor", [1.0, None])
@pytest.mark.parametrize("d_model, d_ff, dtype, tol", [(7, 5, F64, 1e-6), (16, 32, torch.float32, 1e-5)])
def test_single_expert_top1_equals_dense_swiglu(d_model, d_ff, dtype, tol, capacity_factor):
    moe = build_moe(d_model, d_ff, dtype, seed=1, num_experts=1, top_k=1, capacity_factor=capacity_factor)
    dense = SwiGLU(d_model, d_ff, init_std=0.02, n_layers=2).to(dtype)
    with torch.no_grad():
        w1, w3 = moe.experts.gate_up()
        dense.w1.weight.copy_(w1[0].T)
        dense.w3.weight.copy_(w3[0].T)
        dense.w2.weight.copy_(moe.experts.w2[0].T)
    x = torch.randn(2, 9, d_model, dtype=dtype)
    g = torch.randn(2, 9, d_model, dtype=dtype)
    xm, xd = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_m, stats = moe(xm)
    out_d = dense(xd)
    assert out_m.shape == x.shape and stats.dropped.item() == 0.0
    torch.testing.assert_close(out_m, out_d, rtol=tol, atol=tol)
    (out_m * g).sum().backward()
    (out_d * g).sum().backward()
    torch.testing.assert_close(xm.grad, xd.grad, rtol=tol, atol=tol)
    w1_grad, w3_grad = moe.experts.w13.grad[0].chunk(2, dim=1)  # [gate | up]
    torch.testing.assert_close(w1_grad, dense.w1.weight.grad.T, rtol=tol, atol=tol)
    torch.testing.assert_close(w3_grad, dense.w3.weight.grad.T, rtol=tol, atol=tol)
    torch.testing.assert_close(moe.experts.w2.grad[0], dense.w2.weight.grad.T, rtol=tol, atol=tol)
    # one expert: softmax is identically 1, so the router gets no gradient from the output
    assert torch.equal(moe.router.weight.grad, torch.zeros_like(moe.router.weight))


# ------------------------------------------------------------------ grouped experts == naive per-token loop

AUX_C, Z_C = 0.3, 0.1


def check_against_naive(moe, x_shape, seed, tol, force_expert=None, expect_drops=None, expect_idle=()):
    dtype = moe.router.weight.dtype
    cfg = moe.router.cfg
    g = torch.Generator().manual_seed(seed)
    x64 = torch.randn(x_shape, generator=g, dtype=F64)
    if force_expert is not None:
        # Feature 0 positive for every token, and the router only reads feature 0 with distinct slopes:
        # every token ranks the experts identically, `force_expert` first.
        x64[..., 0] = x64[..., 0].abs() + 1.0
        slopes = torch.linspace(0.0, 0.6, cfg.num_experts, dtype=F64)
        slopes[force_expert] = 5.0
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[:, 0] = slopes.to(dtype)
    up = torch.randn(x_shape, generator=g, dtype=F64)

    ref = {n: p.detach().to(F64).clone().requires_grad_(True) for n, p in moe.named_parameters()}
    xr = x64.clone().requires_grad_(True)
    out_r, aux_r, z_r, counts_r, kept_r, cap = naive_moe(
        xr.reshape(-1, x_shape[-1]), ref["router.weight"], *ref["experts.w13"].chunk(2, dim=2), ref["experts.w2"], cfg
    )
    ((out_r.view(x_shape) * up).sum() + AUX_C * aux_r + Z_C * z_r).backward()

    xm = x64.to(dtype).requires_grad_(True)
    out_m, stats = moe(xm)
    ((out_m * up.to(dtype)).sum() + AUX_C * stats.aux_loss + Z_C * stats.z_loss).backward()

    dropped_r = sum(counts_r) - len(kept_r)
    if expect_drops is not None:
        assert (dropped_r > 0) == expect_drops  # the scenario exercises what it claims to
    for e in expect_idle:
        assert counts_r[e] == 0
    assert stats.tokens_per_expert_E.tolist() == [float(c) for c in counts_r]
    assert stats.dropped.item() == float(dropped_r)
    assert router_mod.expert_capacity(cfg, xm.numel() // x_shape[-1]) == cap

    torch.testing.assert_close(out_m.double(), out_r.view(x_shape).detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(stats.aux_loss.double(), aux_r.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(stats.z_loss.double(), z_r.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(xm.grad.double(), xr.grad, rtol=tol, atol=tol)
    for n, p in moe.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad.double(), ref[n].grad, rtol=tol, atol=tol, msg=n)
    for e in expect_idle:  # experts that got no token: zero gradients, not garbage
        for w in (moe.experts.w13, moe.experts.w2):
            assert torch.equal(w.grad[e], torch.zeros_like(w.grad[e]))


# (d_model, d_ff, dtype, tol, grouped_mm expected): odd sizes take the per-expert fallback (fp64, tight);
# 16/32 in fp32 are 16-byte aligned and take torch's grouped_mm (fp32 tolerance against the fp64 loop).
PATHS = [(7, 5, F64, 2e-6, False), (16, 32, torch.float32, 1e-4, True)]
SCENARIOS = [  # (id, cfg kwargs, x shape, expect drops)
    ("capacity_drops", dict(num_experts=4, top_k=2, capacity_factor=0.6), (3, 7), True),
    ("capacity_prob", dict(num_experts=4, top_k=2, capacity_factor=0.6, drop_policy="probability"), (3, 7), True),
    ("capacity_min", dict(num_experts=5, top_k=2, capacity_factor=0.3, min_capacity=4), (13,), True),
    ("capacity_no_renorm", dict(num_experts=4, top_k=3, capacity_factor=0.8, renormalize=False), (2, 5), True),
    ("dropless", dict(num_experts=4, top_k=2, capacity_factor=None), (3, 7), False),
    ("dropless_top1", dict(num_experts=6, top_k=1, capacity_factor=None), (17,), False),
    ("one_token", dict(num_experts=4, top_k=2, capacity_factor=1.0), (1,), False),
]


@pytest.mark.parametrize("d_model, d_ff, dtype, tol, uses_gmm", PATHS, ids=["fallback_fp64", "grouped_mm_fp32"])
@pytest.mark.parametrize("name, cfg_kw, lead_shape, drops", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_grouped_matches_naive_loop(path_spy, name, cfg_kw, lead_shape, drops, d_model, d_ff, dtype, tol, uses_gmm):
    moe = build_moe(d_model, d_ff, dtype, seed=5, router_scale=0.7, **cfg_kw)
    check_against_naive(moe, (*lead_shape, d_model), seed=11, tol=tol, expect_drops=drops)
    answers, calls = path_spy
    assert len(answers) == 2 and all(a == uses_gmm for a in answers)  # w13 (gate and up fused), w2
    assert len(calls) == (2 if uses_gmm else 0)


@pytest.mark.parametrize("d_model, d_ff, dtype, tol, uses_gmm", PATHS, ids=["fallback_fp64", "grouped_mm_fp32"])
@pytest.mark.parametrize(
    "cfg_kw, drops",
    [
        (dict(num_experts=4, top_k=1, capacity_factor=1.0), True),  # capacity 5 of 20 tokens on one expert
        (dict(num_experts=4, top_k=2, capacity_factor=1.0), True),
        (dict(num_experts=4, top_k=1, capacity_factor=None), False),
        (dict(num_experts=4, top_k=2, capacity_factor=None), False),
    ],
    ids=["cap_top1", "cap_top2", "dropless_top1", "dropless_top2"],
)
def test_all_tokens_to_one_expert(path_spy, cfg_kw, drops, d_model, d_ff, dtype, tol, uses_gmm):
    moe = build_moe(d_model, d_ff, dtype, seed=6, **cfg_kw)
    # slopes rank experts 2 (forced) > 3 > 1 > 0: with top-1 experts 0, 1, 3 idle, with top-2 experts 0, 1 idle
    idle = (0, 1, 3) if cfg_kw["top_k"] == 1 else (0, 1)
    check_against_naive(moe, (4, 5, d_model), seed=12, tol=tol, force_expert=2, expect_drops=drops, expect_idle=idle)
    answers, calls = path_spy
    assert all(a == uses_gmm for a in answers) and len(calls) == (2 if uses_gmm else 0)


# --------------------------------------------------------------------------------------- capacity math


@pytest.mark.parametrize(
    "cf, tokens, k, e, min_cap, expected",
    [
        (1.25, 100, 2, 8, 0, 32),  # 31.25 -> 32
        (1.0, 8, 2, 8, 0, 2),  # exact: no rounding up
        (2.0, 3, 1, 4, 0, 2),  # 1.5 -> 2
        (0.5, 4, 2, 3, 0, 2),  # 1.33 -> 2
        (1.0, 1, 1, 64, 0, 1),  # 1/64 -> 1
        (1.0, 1, 1, 64, 4, 4),  # min_capacity wins
        (1.25, 100, 2, 8, 32, 32),  # equal
        (1.25, 100, 2, 8, 10, 32),  # computed wins
        (0.0, 10, 2, 4, 3, 3),
        (0.0, 10, 2, 4, 0, 0),
    ],
)
def test_expert_capacity(cf, tokens, k, e, min_cap, expected):
    cfg = MoEConfig(num_experts=e, top_k=k, capacity_factor=cf, min_capacity=min_cap)
    assert expert_capacity(cfg, tokens) == expected


def test_expert_capacity_dropless_is_none():
    assert expert_capacity(MoEConfig(capacity_factor=None, min_capacity=5), 100) is None


# ----------------------------------------------------------------------------------------- meta build


def test_meta_build_materialize_init():
    cfg = MoEConfig(num_experts=4, top_k=2, d_ff=64)
    with torch.device("meta"):
        moe = MoE(32, 999, cfg, init_std=0.02, n_layers=2)
    assert all(p.is_meta for p in moe.parameters())
    assert moe.experts.w13.shape == (4, 32, 128) and moe.experts.w2.shape == (4, 64, 32)  # moe.d_ff overrides d_ff
    assert moe.router.weight.shape == (4, 32)
    moe.to_empty(device="cpu")
    torch.manual_seed(0)
    moe.init_weights()
    assert not any(p.is_meta for p in moe.parameters())
    w1, w3 = moe.experts.gate_up()
    assert 0.017 < w1.std() < 0.023 and 0.017 < w3.std() < 0.023
    assert 0.0085 < moe.experts.w2.std() < 0.0115  # init_std / sqrt(2 * n_layers) = 0.01
    assert 0.014 < moe.router.weight.std() < 0.026
    x = torch.randn(2, 6, 32, requires_grad=True)
    out, stats = moe(x)
    assert out.shape == x.shape and torch.isfinite(out).all() and out.abs().sum() > 0
    assert torch.isfinite(stats.aux_loss) and torch.isfinite(stats.z_loss)
    (out.sum() + stats.aux_loss + stats.z_loss).backward()
    assert all(torch.isfinite(p.grad).all() for p in moe.parameters())


def test_router_math_is_fp32_for_bf16_inputs():
    """Logits 1 and 1 + 2^-8 are equal in bf16 (7 mantissa bits) but distinct in fp32: the router must see them
    apart."""
    cfg = MoEConfig(num_experts=2, top_k=1, capacity_factor=None, renormalize=False)
    router = Router(2, cfg, init_std=0.02).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    x = torch.tensor([[1.0, 2.0**-8]], dtype=torch.bfloat16)  # both entries exact in bf16
    routing, stats = router(x)
    assert routing.weight_A.dtype == torch.float32
    assert per_expert_sets(routing) == [set(), {0}]  # expert 1 wins by 2^-8
    p1 = softmax_row([1.0, 1.0 + 2.0**-8])[1]
    assert routing.weight_A.item() == pytest.approx(p1, rel=1e-6)
    assert stats.z_loss.item() == pytest.approx(logsumexp_row([1.0, 1.0 + 2.0**-8]) ** 2, rel=1e-6)


def test_moe_float64_with_aligned_sizes_takes_the_fallback():
    """grouped_mm has no fp64 kernel: aligned fp64 shapes must not be sent to it."""
    torch.manual_seed(0)
    moe = MoE(16, 32, MoEConfig(num_experts=4, top_k=2), init_std=0.02, n_layers=2)
    moe.init_weights()
    moe = moe.double()
    x = torch.randn(5, 16, dtype=torch.float64)
    out, _ = moe(x)
    assert out.dtype == torch.float64 and out.shape == x.shape and torch.isfinite(out).all()
