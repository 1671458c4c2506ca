"""Expert-parallel index math without any process group: layout, counts/splits, permutation and its inverse."""

import pytest
import torch

from moe_dist.config import MoEConfig
from moe_dist.layers.router import Router
from moe_dist.parallel.dispatch import segment_permutation, token_parts
from moe_dist.parallel.mesh import ep_layout, ep_rank_of, layout_groups


def test_ep_groups_are_consecutive_and_edp_groups_strided():
    assert ep_layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert ep_layout(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert ep_layout(8, 2)[1] == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("dp, ep, tp", [(2, 2, 2), (2, 4, 2), (1, 4, 4), (1, 2, 4), (4, 2, 2), (4, 8, 2)])
def test_folded_groups_span_tp_and_cover_every_expert_once(dp, ep, tp):
    """etp = 1: EP groups are `ep` consecutive ranks (one node's first), EDP groups the ranks at the same EP
    position; every rank is in exactly one group of each kind, the dense (tp, dp) groups are unchanged, and each
    EP group holds every expert slice once."""
    folded, split = layout_groups(dp, ep, tp, etp=1), layout_groups(dp, 1, tp)
    world = list(range(dp * tp))
    assert folded["tp"] == split["tp"] and folded["dp"] == split["dp"]
    for kind, size in (("ep", ep), ("edp", dp * tp // ep)):
        assert sorted(r for g in folded[kind] for r in g) == world and {len(g) for g in folded[kind]} == {size}
    assert all(g == list(range(g[0], g[0] + ep)) for g in folded["ep"])
    for g in folded["ep"]:
        assert sorted(ep_rank_of(r, ep, tp, 1) for r in g) == list(range(ep))
    for g in folded["edp"]:
        assert len({ep_rank_of(r, ep, tp, 1) for r in g}) == 1


def test_folded_layout_examples():
    assert layout_groups(2, 2, 2, etp=1) == {
        "tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "ep": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]]
    }  # fmt: skip
    assert layout_groups(2, 4, 2, etp=1)["edp"] == [[0], [1], [2], [3]]
    assert layout_groups(2, 2, 2, etp=2)["ep"] == [[0, 2], [1, 3]]  # experts split over TP: EP inside a tp_rank
    assert [ep_rank_of(r, 2, 2, 2) for r in range(4)] == [0, 0, 1, 1]
    assert [ep_rank_of(r, 2, 2, 1) for r in range(4)] == [0, 1, 0, 1]


def _brute_force(counts):
    """Buffer of segments in (x, y) order; labels say which segment each element came from."""
    X, Y = counts.shape
    labels = [(x, y, i) for x in range(X) for y in range(Y) for i in range(int(counts[x, y]))]
    wanted = sorted(labels, key=lambda t: (t[1], t[0], t[2]))
    return [labels.index(w) for w in wanted]


@pytest.mark.parametrize(
    "counts",
    [
        [[2, 0, 1], [1, 3, 0]],
        [[0, 0], [0, 0]],  # nothing routed anywhere
        [[5], [0], [2]],
        [[0, 4, 0, 0]],  # one source sends everything to one expert
    ],
)
def test_segment_permutation_regroups_by_second_index(counts):
    c = torch.tensor(counts)
    perm = segment_permutation(c)
    assert perm.tolist() == _brute_force(c)


def test_permutation_and_its_transpose_are_inverses():
    torch.manual_seed(0)
    c = torch.randint(0, 5, (4, 3))
    to_expert = segment_permutation(c)  # (source, expert) -> (expert, source)
    to_source = segment_permutation(c.t())  # (expert, source) -> (source, expert)
    buf = torch.arange(int(c.sum()))
    assert torch.equal(buf[to_expert][to_source], buf)
    assert torch.equal(torch.sort(to_expert).values, buf)


def test_send_splits_follow_expert_ownership():
    """What the all-to-all dispatcher relies on: the router's kept rows are sorted by global expert, its kept
    counts are those rows' per-expert counts, so rank p's rows (experts [p·L, (p+1)·L)) are one contiguous block
    of `tokens_per_expert.view(P, L).sum(1)[p]` rows. Each row's expert is recomputed here from the logits."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0)
    router = Router(16, cfg, init_std=1.0)
    router.init_weights()
    x = torch.randn(20, 16)
    routing, stats = router(x)
    P, L = 4, 2
    expert_TK = (x @ router.weight.detach().t()).topk(2, dim=-1).indices
    expert_of_row = expert_TK.t().reshape(-1)[routing.rows_R]  # assignments are slot-major: a = k·T + t
    assert torch.equal(expert_of_row, torch.sort(expert_of_row).values)  # sorted by global expert
    assert torch.equal(torch.bincount(expert_of_row, minlength=8), routing.tokens_per_expert_E)
    owner = expert_of_row // L
    splits = routing.tokens_per_expert_E.view(P, L).sum(1)  # the dispatcher's send splits
    assert torch.equal(torch.bincount(owner, minlength=P), splits)
    assert int(splits.sum()) == len(routing.rows_R) == 40 - int(stats.dropped) and int(stats.dropped) > 0


@pytest.mark.parametrize("tp", [2, 3])
def test_token_split_partitions_the_kept_rows_by_token_slice(tp):
    """Under TP each peer dispatches the kept rows of its contiguous token slice only: the peers' rows are a
    partition of the router's kept rows, each in expert order, and their per-(slice, expert) counts are what the
    count all-to-all carries."""
    from moe_dist.parallel.dispatch import AllToAllDispatcher, TokenSplit

    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0)
    router = Router(16, cfg, init_std=1.0)
    router.init_weights()
    T = 21
    routing, _ = router(torch.randn(T, 16))
    expert_of_a = torch.empty(2 * T, dtype=torch.long)
    expert_of_a[routing.rows_R] = torch.repeat_interleave(torch.arange(8), routing.tokens_per_expert_E)
    parts = []
    for s in range(tp):
        d = AllToAllDispatcher(None, 2, 0, 8, permutation=None, split=TokenSplit(None, tp, s))
        counts_SE, by_slice = d._part_counts(routing, tp)
        rows = d._rows_of_parts(routing, by_slice, counts_SE, slice(s, s + 1))
        tokens = rows % T
        assert bool(((tokens * tp // T) == s).all())  # only this peer's slice
        assert torch.equal(expert_of_a[rows], torch.sort(expert_of_a[rows]).values)  # still in expert order
        assert torch.equal(torch.bincount(expert_of_a[rows], minlength=8), counts_SE[s])
        parts.append(rows)
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.sort(routing.rows_R).values)
    assert torch.equal(counts_SE.sum(0), routing.tokens_per_expert_E)


@pytest.mark.parametrize(
    "num_tokens, slices, chunks", [(6, 1, 4), (6, 1, 8), (7, 2, 3), (16, 2, 2), (5, 4, 3), (1, 2, 3)]
)
def test_token_parts_are_contiguous_balanced_and_nest_in_the_tp_slices(num_tokens, slices, chunks):
    """The chunks of the overlapped dispatch: X = slices · chunks contiguous token ranges whose sizes differ by at
    most one token, every top-k slot of a token in the same part, and part // chunks = TokenSplit's slice."""
    top_k, X = 2, slices * chunks
    rows_R = torch.randperm(top_k * num_tokens, generator=torch.Generator().manual_seed(0))
    part_R = token_parts(rows_R, num_tokens, X)
    token_R = rows_R % num_tokens
    part_T = torch.empty(num_tokens, dtype=torch.long).index_put_((token_R,), part_R)
    assert torch.equal(part_R, part_T[token_R])  # a token's slots go together
    assert torch.all(part_T[1:] >= part_T[:-1]) and int(part_T.max()) < X  # contiguous ranges, in order
    sizes = torch.bincount(part_T, minlength=X)
    assert int(sizes.max()) - int(sizes.min()) <= 1 and int(sizes.sum()) == num_tokens
    assert torch.equal(part_R // chunks, token_R * slices // num_tokens)  # AllToAllDispatcher's slice_R
    assert token_parts(rows_R[:0], 0, X).numel() == 0  # a micro-batch without tokens has no parts
