"""Router recipes beyond softmax top-k, each against values worked out here by hand (math.exp / math.log, never
moe.py): sigmoid scores with normalized and scaled weights, the loss-free balancing bias (choice only, sign
update), sequence and global-batch aux losses, group-limited routing, tie-breaking, and a micro-batch without
tokens. The router weight is the identity, so the input rows are the router logits."""

import math

import pytest
import torch

from moe_dist.config import ConfigError, MoEConfig, load_config
from moe_dist.layers.moe import MoE
from moe_dist.layers.router import Router, limit_to_groups, top_k_lower_index_first

F64 = torch.float64
LN3, LN9 = math.log(3.0), math.log(9.0)


def sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def softmax_row(row):
    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


def router_for(logits, **cfg_kw):
    """A router over E = len(logits[0]) experts whose logits are the input rows; (router, x_TD)."""
    E = len(logits[0])
    router = Router(E, MoEConfig(num_experts=E, capacity_factor=None, **{"top_k": 2, **cfg_kw}), init_std=0.02)
    router.init_weights()
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    return router, torch.tensor(logits, dtype=torch.float32)


def choices(routing):
    """Per token, {expert: combine weight} of its assignments (kept or not), from the slot-major weight_A."""
    T, K = routing.num_tokens, routing.top_k
    return routing.weight_A.view(K, T).t().tolist()


def experts_of(routing, stats_unused=None):
    """Per token, the experts its K assignments went to (slot order), recovered from rows_R (dropless)."""
    T, K = routing.num_tokens, routing.top_k
    expert_of_row = torch.repeat_interleave(torch.arange(len(routing.tokens_per_expert_E)), routing.tokens_per_expert_E)
    out = [[None] * K for _ in range(T)]
    for row, a in enumerate(routing.rows_R.tolist()):
        out[a % T][a // T] = int(expert_of_row[row])
    return out


# Sigmoid scores: t0 = [0.5, 0.75, 0.25, 0.9] -> experts 3, 1; t1 = [0.9, 0.5, 0.75, 0.25] -> 0, 2;
# t2 = [0.25, 0.9, 0.75, 0.5] -> 1, 2.
SIG_LOGITS = [[0.0, LN3, -LN3, LN9], [LN9, 0.0, LN3, -LN3], [-LN3, LN9, LN3, 0.0]]
SIG_SCORES = [[0.5, 0.75, 0.25, 0.9], [0.9, 0.5, 0.75, 0.25], [0.25, 0.9, 0.75, 0.5]]
SIG_CHOICE = [[3, 1], [0, 2], [1, 2]]


def test_sigmoid_scores_are_as_the_comment_says():
    for row, scores in zip(SIG_LOGITS, SIG_SCORES):
        assert [sigmoid(v) for v in row] == pytest.approx(scores)


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_weights_normalized_and_scaled(renormalize):
    router, x = router_for(SIG_LOGITS, score="sigmoid", renormalize=renormalize, route_scale=2.5)
    routing, stats = router(x)
    assert experts_of(routing) == SIG_CHOICE
    for t, (a, b) in enumerate(SIG_CHOICE):
        sa, sb = SIG_SCORES[t][a], SIG_SCORES[t][b]
        norm = sa + sb if renormalize else 1.0
        assert choices(routing)[t] == pytest.approx([2.5 * sa / norm, 2.5 * sb / norm], rel=1e-6)
    # aux: P_i over the per-token normalized scores s / Σ s; f_i = counts / (K T) = [1, 2, 2, 1] / 6
    p = [[s / sum(row) for s in row] for row in SIG_SCORES]
    P = [sum(p[t][e] for t in range(3)) / 3 for e in range(4)]
    f = [1 / 6, 2 / 6, 2 / 6, 1 / 6]
    assert stats.aux_loss.item() == pytest.approx(4 * sum(fi * Pi for fi, Pi in zip(f, P)), rel=1e-6)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in SIG_LOGITS) / 3
    assert stats.z_loss.item() == pytest.approx(z, rel=1e-6)
    entropy = -sum(pi * math.log(pi) for row in p for pi in row) / 3
    assert stats.entropy.item() == pytest.approx(entropy, rel=1e-6)


def test_bias_changes_the_choice_never_the_weights():
    # softmax([2, 1, 0, -1]) = [0.644, 0.237, 0.087, 0.032]: top-2 {0, 1}; a bias of 0.5 on expert 2 lifts its
    # choice score to 0.587 > 0.237, so {0, 2} are chosen, weighted by their probabilities alone.
    logits = [[2.0, 1.0, 0.0, -1.0]]
    p = softmax_row(logits[0])
    for renormalize in (True, False):
        router, x = router_for(logits, bias_update_rate=0.1, renormalize=renormalize)
        routing, _ = router(x)
        assert experts_of(routing) == [[0, 1]]
        with torch.no_grad():
            router.bias_E.copy_(torch.tensor([0.0, 0.0, 0.5, 0.0]))
        routing, _ = router(x)
        assert experts_of(routing) == [[0, 2]]
        norm = p[0] + p[2] if renormalize else 1.0
        assert choices(routing)[0] == pytest.approx([p[0] / norm, p[2] / norm], rel=1e-6)


def test_bias_update_is_the_sign_of_the_load_gap_and_a_buffer():
    router, _ = router_for([[0.0] * 4], bias_update_rate=0.01)
    assert [n for n, _ in router.named_parameters()] == ["weight"]  # not a parameter: no optimizer, no clipping
    assert "bias_E" in router.state_dict()  # persistent: checkpoints carry it
    router.end_step(torch.tensor([10.0, 2.0, 4.0, 4.0]))  # mean 5: overloaded expert 0 goes down, others up
    assert router.bias_E.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    router.end_step(torch.tensor([5.0, 5.0, 1.0, 9.0]))  # balanced experts keep their bias (sign 0)
    assert router.bias_E.tolist() == pytest.approx([-0.01, 0.01, 0.02, 0.0])
    router.bfloat16()  # a module cast by bf16 training: the update returns the bias to fp32
    router.end_step(torch.tensor([9.0, 1.0, 5.0, 5.0]))
    assert router.bias_E.dtype == torch.float32
    assert router.bias_E.tolist() == pytest.approx([-0.02, 0.02, 0.02, 0.0], abs=1e-4)


def test_a_frozen_choice_bias_chooses_and_never_moves():
    """`choice_bias` at bias_update_rate 0 (an imported correction bias, fine-tuned frozen): the buffer exists, is
    checkpointed and decides choices, and end_step leaves it as it is."""
    router, x = router_for([[2.0, 1.0, 0.0, -1.0]], choice_bias=True)
    assert "bias_E" in router.state_dict()
    with torch.no_grad():
        router.bias_E.copy_(torch.tensor([0.0, 0.0, 0.5, 0.0]))
    router.end_step(torch.tensor([10.0, 2.0, 4.0, 4.0]))
    assert router.bias_E.tolist() == [0.0, 0.0, 0.5, 0.0]
    assert experts_of(router(x)[0]) == [[0, 2]]


def test_no_bias_buffer_without_the_option():
    router, _ = router_for([[0.0] * 4])
    assert router.bias_E is None and router.load_E is None and list(router.state_dict()) == ["weight"]


# Softmax, two sequences of two tokens (B = 2, S = 2), top-1 for readable counts.
SEQ_LOGITS = [[1.0, 0.0, 0.0], [2.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]]


def test_sequence_aux_loss_hand_worked():
    router, x = router_for(SEQ_LOGITS, top_k=1, aux_loss_scope="sequence")
    _, stats = router(x, seq_len=2)
    p = [softmax_row(r) for r in SEQ_LOGITS]
    # sequence 0: tokens 0, 1 both to expert 0 -> f = [1, 0, 0]; sequence 1: experts 1, 2 -> f = [0, .5, .5]
    seq_aux = []
    for tokens, f in (([0, 1], [1.0, 0.0, 0.0]), ([2, 3], [0.0, 0.5, 0.5])):
        P = [sum(p[t][e] for t in tokens) / 2 for e in range(3)]
        seq_aux.append(3 * sum(fi * Pi for fi, Pi in zip(f, P)))
    assert stats.aux_loss.item() == pytest.approx(sum(seq_aux) / 2, rel=1e-6)
    # one sequence of four tokens: the micro-batch value
    _, whole = router(x, seq_len=4)
    _, micro = router_for(SEQ_LOGITS, top_k=1)[0](x)
    assert whole.aux_loss.item() == pytest.approx(micro.aux_loss.item(), rel=1e-6)
    assert whole.aux_loss.item() != pytest.approx(stats.aux_loss.item(), rel=1e-3)


def test_global_batch_aux_loss_uses_the_previous_steps_global_load():
    router, x = router_for(SEQ_LOGITS, top_k=1, aux_loss_scope="global_batch", global_batch_load="previous_step")
    p = [softmax_row(r) for r in SEQ_LOGITS]
    P = [sum(p[t][e] for t in range(4)) / 4 for e in range(3)]
    _, stats = router(x)
    assert stats.aux_loss.item() == pytest.approx(3 * sum(P) / 3, rel=1e-6)  # step 1: uniform f -> Σ P = 1
    router.end_step(torch.tensor([6.0, 1.0, 1.0]))  # last step's global assignments over all ranks/micro-batches
    _, stats = router(x)
    f = [6 / 8, 1 / 8, 1 / 8]
    assert stats.aux_loss.item() == pytest.approx(3 * sum(fi * Pi for fi, Pi in zip(f, P)), rel=1e-6)
    stats.aux_loss.backward()  # P's gradient reaches the router weight; f is a constant
    assert router.weight.grad.abs().sum() > 0


def test_group_limited_choice_hand_worked():
    # sigmoid scores [0.75, 0.75, 0.9, 0.25]: group 0 = {0, 1} scores 1.5, group 1 = {2, 3} 1.15. With one group
    # allowed the token takes 0 and 1 although expert 2 has the best score; with two, {2, 0} (ties: lower first).
    logits = [[LN3, LN3, LN9, -LN3]]
    router, x = router_for(logits, score="sigmoid", n_groups=2, topk_groups=1)
    routing, _ = router(x)
    assert experts_of(routing) == [[0, 1]] and choices(routing)[0] == pytest.approx([0.5, 0.5])
    router, x = router_for(logits, score="sigmoid", n_groups=2, topk_groups=2)
    assert experts_of(router(x)[0]) == [[2, 0]]
    # groups of three score their best two: [.9, .1, .1 | .5, .5, .5] -> 1.0 vs 1.0 tie -> group 0 (lower);
    # [.9, .1, .1 | .6, .5, .5] -> 1.0 vs 1.1 -> group 1
    choice = torch.tensor([[0.9, 0.1, 0.1, 0.5, 0.5, 0.5], [0.9, 0.1, 0.1, 0.6, 0.5, 0.5]])
    masked = limit_to_groups(choice, 2, 1)
    assert torch.isinf(masked[0, 3:]).all() and torch.equal(masked[0, :3], choice[0, :3])
    assert torch.isinf(masked[1, :3]).all() and torch.equal(masked[1, 3:], choice[1, 3:])


def test_group_limited_routing_bounds_the_groups_a_token_reaches():
    torch.manual_seed(0)
    E, G = 8, 4
    router = Router(16, MoEConfig(num_experts=E, top_k=4, n_groups=G, topk_groups=2, capacity_factor=None), 1.0)
    router.init_weights()
    routing, _ = router(torch.randn(64, 16))
    groups = {t: {e // (E // G) for e in es} for t, es in enumerate(experts_of(routing))}
    assert max(len(g) for g in groups.values()) == 2


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_exact_ties_go_to_the_lower_expert_index(score):
    router, x = router_for([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]], score=score)
    assert experts_of(router(x)[0]) == [[0, 1], [0, 1], [1, 2]]
    assert top_k_lower_index_first(torch.tensor([[3.0, 5.0, 5.0, 5.0, 3.0]]), 4).tolist() == [[1, 2, 3, 0]]


def stable_sort_top_k(choice_TE, k):
    """The tie-break's definition: the first k of a stable descending sort (equal values keep index order)."""
    return torch.sort(choice_TE, dim=-1, descending=True, stable=True).indices[:, :k]


def tie_cases(dtype):
    """(T, E) score rows full of exact ties: all equal, ties across the k-th place, ties among the chosen, a grid of
    few distinct values (so most rows tie somewhere), signed zeros, infinities (masked groups) and NaN."""
    E, inf, nan = 16, float("inf"), float("nan")
    g = torch.Generator().manual_seed(0)
    rows = [
        [0.5] * E,  # all equal: experts 0..k-1
        [0.0] * E,
        [0.1] * 5 + [0.9] + [0.3] * 10,  # one winner, then ties across every boundary
        [0.9, 0.9, 0.9] + [0.2] * 13,  # ties among the chosen
        [0.2] * 12 + [0.7] * 4,  # the tied winners at the highest indices
        [-0.0, 0.0] * 8,  # -0.0 == +0.0
        [-inf] * 8 + [0.25] * 8,  # a masked group
        [inf, -inf, 1.0, inf] + [-1.0] * 12,
        [nan, 1.0, nan] + [0.5] * 13,  # NaN sorts first
    ]
    grid = torch.randint(0, 4, (200, E), generator=g).float() / 4 - 0.25  # 4 values: ties everywhere
    near = torch.rand(200, E, generator=g) * 1e-3 + 0.3  # distinct in fp32, many ties once rounded to 16 bits
    return torch.cat([torch.tensor(rows), grid, near]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("k", [1, 2, 6, 16])
def test_top_k_equals_the_stable_sort_on_ties(dtype, k):
    scores = tie_cases(dtype)
    got = top_k_lower_index_first(scores, k)
    assert torch.equal(got, stable_sort_top_k(scores, k))  # the same experts, in the same order
    assert got.dtype == torch.int64 and got.shape == (scores.shape[0], k)
    # and where there are no ties it is torch.topk's selection (values descending)
    distinct = torch.randperm(64, generator=torch.Generator().manual_seed(1)).float().view(4, 16).to(dtype)
    assert torch.equal(top_k_lower_index_first(distinct, k), distinct.topk(k, dim=-1).indices)


def test_group_limited_choice_on_ties_equals_the_stable_sort_reference():
    # limit_to_groups picks its groups with the same tie-break; on a grid of few values the group scores tie
    # often, and the experts chosen inside the kept groups must equal a sort-based reference end to end.
    T, E, G, M, K = 300, 16, 4, 2, 4
    choice = torch.randint(0, 3, (T, E), generator=torch.Generator().manual_seed(2)).float() / 2
    best_TG = choice.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)
    keep_TG = torch.zeros(T, G, dtype=torch.bool).scatter_(1, stable_sort_top_k(best_TG, M), True)
    ref = choice.view(T, G, E // G).masked_fill(~keep_TG[..., None], float("-inf")).view(T, E)
    masked = limit_to_groups(choice, G, M)
    assert torch.equal(masked, ref)
    assert torch.equal(top_k_lower_index_first(masked, K), stable_sort_top_k(ref, K))
    assert (best_TG.sort(dim=-1).values.diff(dim=-1) == 0).any(-1).float().mean() > 0.5  # ties were the rule


@pytest.mark.parametrize(
    "cfg_kw",
    [
        {},
        {"score": "sigmoid", "bias_update_rate": 0.01, "n_groups": 2, "topk_groups": 1},
        {"aux_loss_scope": "sequence"},
        {"aux_loss_scope": "global_batch", "n_shared_experts": 1, "shared_gate": True},
        {"capacity_factor": 1.0, "drop_policy": "probability"},
    ],
    ids=["softmax", "sigmoid-bias-groups", "sequence", "global-shared", "capacity"],
)
def test_micro_batch_without_tokens_routes_nothing(cfg_kw):
    moe = MoE(8, 16, MoEConfig(num_experts=4, top_k=2, **{"capacity_factor": None, **cfg_kw}), 0.02, 2)
    moe.to_empty(device="cpu")
    moe.init_weights()
    x = torch.zeros(2, 0, 8, requires_grad=True)  # (B, S, D) with S = 0
    y, stats = moe(x)
    assert y.shape == (2, 0, 8)
    assert stats.tokens_per_expert_E.tolist() == [0.0] * 4 and stats.dropped.item() == 0 and stats.assignments == 0
    for value in (stats.aux_loss, stats.z_loss, stats.entropy):
        assert value.item() == 0.0
    (y.sum() + stats.aux_loss + stats.z_loss).backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in moe.parameters())


def test_recipe_options_are_validated_with_the_key():
    bad = {
        "model.moe.n_groups=3": "model.moe.n_groups",
        "model.moe.topk_groups=2": "model.moe.topk_groups",
        "model.moe.route_scale=0": "model.moe.route_scale",
        "model.moe.bias_update_rate=-1": "model.moe.bias_update_rate",
        "model.moe.score=tanh": "model.moe.score",
        "model.moe.dead_expert_window=0": "model.moe.dead_expert_window",
    }
    for override, key in bad.items():
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config("configs/debug.json", [override])
    with pytest.raises(ConfigError, match="model.moe.top_k"):  # top-2 from one group of one expert
        load_config("configs/debug.json", ["model.moe.n_groups=4", "model.moe.topk_groups=1"])


@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_add_a_dense_swiglu_on_every_token(gated):
    cfg = dict(num_experts=4, top_k=2, capacity_factor=1.0)
    plain = MoE(8, 16, MoEConfig(**cfg), 0.02, 2)
    shared = MoE(8, 16, MoEConfig(**cfg, n_shared_experts=2, shared_gate=gated), 0.02, 2)
    for m in (plain, shared):
        m.to_empty(device="cpu")
    torch.manual_seed(0)
    shared.init_weights()
    plain.load_state_dict({k: v for k, v in shared.state_dict().items() if not k.startswith("shared.")})
    s = shared.shared
    assert s.w1.weight.shape == (2 * 16, 8)  # two shared experts of the experts' width: one SwiGLU of twice it
    x = torch.randn(2, 5, 8)
    dense = (torch.nn.functional.silu(x @ s.w1.weight.T) * (x @ s.w3.weight.T)) @ s.w2.weight.T
    if gated:
        dense = dense * torch.sigmoid(x @ s.gate.weight.T)
    torch.testing.assert_close(shared(x)[0], plain(x)[0] + dense)


def test_shared_experts_count_as_active_parameters():
    from moe_dist.models.decoder import param_counts

    base = load_config("configs/debug.json").model
    with_shared = load_config(
        "configs/debug.json", ["model.moe.n_shared_experts=1", "model.moe.shared_d_ff=48", "model.moe.shared_gate=true"]
    ).model
    a, b = param_counts(base), param_counts(with_shared)
    per_layer = 3 * 64 * 48 + 64  # w1, w3, w2 of d_model 64 × 48, and the gate's 64
    assert b["params_total"] - a["params_total"] == 2 * per_layer  # debug.json's two MoE layers
    assert b["params_active"] - a["params_active"] == 2 * per_layer


def test_node_groups_must_be_the_nodes_of_the_ep_group():
    from moe_dist.parallel.expert_parallel import check_node_groups
    from moe_dist.parallel.mesh import Mesh

    def mesh(rank, local_world, dp, ep, tp=1):
        dp_rank = rank // tp
        return Mesh(rank, dp * tp, rank % local_world, local_world, torch.device("cpu"), dp, dp_rank, ep, dp_rank % ep,
                    None, None, f"ep_size_{ep}", tp, rank % tp)  # fmt: skip

    check_node_groups(2, mesh(0, 4, dp=8, ep=8))  # EP group of 8 ranks on 2 nodes of 4
    check_node_groups(1, mesh(5, 8, dp=8, ep=4))  # EP group {4..7}: one node
    check_node_groups(2, mesh(3, 4, dp=4, ep=4, tp=2))  # ranks {1, 3, 5, 7}: nodes 0 and 1
    with pytest.raises(ConfigError, match="model.moe.n_groups: group_by 'node'.*2 nodes"):
        check_node_groups(4, mesh(0, 4, dp=8, ep=8))


def test_ep_rank_groups_must_be_the_ep_ranks():
    from moe_dist.config.parallel_checks import check_layout

    groups = ["model.moe.group_by=ep_rank", "model.moe.top_k=1", "parallel.ep=2"]
    assert check_layout(load_config("configs/debug.json", [*groups, "model.moe.n_groups=2"]), 2) == 2
    with pytest.raises(ConfigError, match="model.moe.n_groups: group_by 'ep_rank' needs one group per EP rank"):
        check_layout(load_config("configs/debug.json", [*groups, "model.moe.n_groups=4"]), 2)
    check_layout(load_config("configs/debug.json", [groups[0], "model.moe.n_groups=4", "model.moe.top_k=1"]), 1)
