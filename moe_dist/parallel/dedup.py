"""Deduplicated expert-parallel dispatch (`parallel.a2a_dedup`): a token crosses to each node (or rank) once,
however many of its experts live there, and comes back once, as the weighted sum of those experts' outputs.

Shape legend as in dispatch.py (T tokens, D d_model, K top_k, E experts), plus: the EP group is N blocks of G
consecutive EP ranks (one node's ranks for "node"; single ranks for "rank", G = 1), block n holding the B = E / N
experts [n·B, (n+1)·B); U (block, token) pairs this rank sends, V pairs it receives (the rail's rows).

Stage 1 (here): each (block, token) pair travels once over the rail group to the rank at this rank's position in
the block, with K slots of metadata (block-local expert or -1, combine weight). Stage 2: the receiver routes its
V rows over the block's B experts (`block_routing`) and hands them to its inner dispatcher (composed: the
all-to-all one over the block, or the local one for G = 1), whose combine applies the weights. The output is the
plain dispatcher's up to the order of the sum (tests/parallel/test_ep_dedup.py); every rank issues every
collective, with or without rows. The stages in full: docs/parallelism.md, "Deduplicated dispatch".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_dist.layers.moe import Dispatcher
from moe_dist.layers.permutation import Permutation
from moe_dist.layers.router import Routing, count_per_expert
from moe_dist.parallel.comm import all_to_all_equal, all_to_all_rows
from moe_dist.parallel.dispatch import TokenSplit, token_parts
from moe_dist.parallel.mesh import DedupGroups


def block_routing(expert_VK: torch.Tensor, weight_VK: torch.Tensor, num_experts: int, kept: int) -> Routing:
    """The routing of a block's received rows over its `num_experts` experts: slot (v, k) goes to block-local
    expert expert_VK[v, k] with weight weight_VK[v, k]; -1 marks an empty slot, `kept` (known on the host) counts
    the others. Empty slots sort after the last expert's rows and count as its dropped assignments, so `Routing`'s
    contract (kept rows a prefix of each expert's, counts summing to K·V) holds, and the kept rows are the first
    `kept` of the order: fixed-size index math and a slice of known size, no sync."""
    V, K = expert_VK.shape
    B = num_experts
    expert_A = expert_VK.t().reshape(-1)  # slot-major a = k·V + v, as the router's
    key_A = torch.where(expert_A >= 0, expert_A, B)
    order_A = torch.argsort(key_A, stable=True)
    per_key = count_per_expert(key_A, B + 1)
    kept_E = per_key[:B]
    counts_E = torch.cat([kept_E[:-1], kept_E[-1:] + per_key[B:]])
    weight_A = weight_VK.t().reshape(-1)
    return Routing.with_kept_prefix(order_A, counts_E, key_A[order_A] < B, kept_E, weight_A, V, K, kept)


@dataclass
class _DedupState:
    routing: Routing
    pairs_U: torch.Tensor  # the (block, token) pairs sent, as n·T + t, sorted (block-major)
    send_splits: list[int]  # pairs to each block
    recv_splits: list[int]  # pairs from each block
    inner: object  # stage 2's dispatcher state
    sent_bytes: int


class DedupAllToAllDispatcher(Dispatcher):
    """The two-stage dispatch of the module docstring: stage 1 over `groups.rail` here, stage 2 by `inner` (the
    all-to-all dispatcher over the block, or the local one). `split`: folded TP's token split, each rank sending
    its own slice; the experts must be whole (a split with `gather` is refused by the config check)."""

    def __init__(
        self,
        num_experts: int,
        permutation: Permutation,
        groups: DedupGroups,
        inner: Dispatcher,
        split: TokenSplit | None = None,
    ):
        self.num_experts, self.permutation = num_experts, permutation
        self.groups, self.inner, self.split = groups, inner, split

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, _DedupState]:
        assert self.split is None or not self.split.gather, "parallel.a2a_dedup needs whole experts (config check)"
        T, K, E, N = routing.num_tokens, routing.top_k, self.num_experts, self.groups.blocks
        B, A, dev = E // N, routing.order_A.numel(), x_TD.device
        order_A = routing.order_A
        expert_A = torch.repeat_interleave(torch.arange(E, device=dev), routing.counts_E, output_size=A)
        block_A = expert_A // B
        send_A = torch.ones(A, dtype=torch.bool, device=dev) if routing.kept_A is None else routing.kept_A
        if self.split is not None:  # folded TP: this rank sends its slice's tokens only
            send_A = send_A & (token_parts(order_A, T, self.split.size) == self.split.rank)
        # Each sent assignment's (block, token) pair n·T + t; unsent ones go to a spare pair N·T.
        pair_A = torch.where(send_A, block_A * T + order_A % T, N * T)
        present_P = torch.zeros(N * T + 1, dtype=torch.bool, device=dev).index_fill_(0, pair_A, True)[: N * T]
        # Per block: the pairs sent there and their assignments (the receiver's kept slots).
        sent_N2 = torch.stack(
            [present_P.view(N, T).sum(1), count_per_expert(torch.where(send_A, block_A, N), N + 1)[:N]], 1
        )
        recv_N2 = all_to_all_equal(sent_N2, self.groups.rail)
        host = torch.cat([sent_N2, recv_N2]).cpu()  # every split list and count in one device-to-host transfer
        send_splits, recv_splits, kept = host[:N, 0].tolist(), host[N:, 0].tolist(), int(host[N:, 1].sum())
        U = sum(send_splits)
        # The present pairs in order, cut with the host count (a scatter to their ranks among the present: no mask).
        slot_P = torch.where(present_P, torch.cumsum(present_P, 0) - 1, U)
        pairs_U = torch.zeros(U + 1, dtype=torch.long, device=dev).scatter_(0, slot_P, torch.arange(N * T, device=dev))
        pairs_U = pairs_U[:U]
        # K slots of metadata per pair: block-local expert (-1: none) and weight (differentiable), from choice k.
        slot_A = order_A // max(T, 1)
        expert_PK = torch.full((N * T + 1, K), -1, dtype=torch.long, device=dev)
        expert_PK = expert_PK.index_put_((pair_A, slot_A), expert_A - block_A * B)
        weight_PK = torch.zeros(N * T + 1, K, dtype=routing.weight_A.dtype, device=dev)
        weight_PK = weight_PK.index_put(
            (pair_A, slot_A), routing.weight_A.index_select(0, order_A)
        )  # spare pair: discarded
        # fp32 carries the expert ids exactly (< 2^24): one all-to-all for weights and ids; the ids' gradient is 0
        meta_UK2 = torch.cat(
            [weight_PK.index_select(0, pairs_U), expert_PK.index_select(0, pairs_U).to(weight_PK.dtype)], 1
        )

        x_UD = self.permutation.permute(x_TD, pairs_U, N)  # pair n·T + t reads token t: a gather with N "slots"
        x_VD = all_to_all_rows(x_UD, recv_splits, send_splits, self.groups.rail)
        meta_VK2 = all_to_all_rows(meta_UK2, recv_splits, send_splits, self.groups.rail)
        inner_routing = block_routing(meta_VK2[:, K:].detach().long(), meta_VK2[:, :K], B, kept)
        x_RD, rows_per_expert, inner_state = self.inner.dispatch(x_VD, inner_routing)

        remote = U - send_splits[self.groups.index]
        sent_bytes = remote * (x_TD.shape[1] * x_TD.element_size() + 2 * K * meta_UK2.element_size())
        state = _DedupState(
            routing, pairs_U, send_splits, recv_splits, inner_state, sent_bytes + inner_state.sent_bytes
        )
        return x_RD, rows_per_expert, state

    def combine(self, y_RD: torch.Tensor, state: _DedupState) -> torch.Tensor:
        y_VD = self.inner.combine(y_RD, state.inner)  # weighted sum over the token's experts in this block
        y_UD = all_to_all_rows(y_VD, state.send_splits, state.recv_splits, self.groups.rail)
        T = state.routing.num_tokens
        ones_P = torch.ones(self.groups.blocks * T, dtype=torch.float32, device=y_UD.device)
        return self.permutation.unpermute(y_UD, state.pairs_U, ones_P, T)  # sum of the token's blocks
