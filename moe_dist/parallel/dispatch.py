"""Expert-parallel token dispatch: the all-to-all implementation of the MoE layer's dispatcher seam.

Shape legend: T tokens, D d_model, E experts, P = ep ranks in the EP group, L = E / P local experts,
S = TP ranks that split the dispatch (1 without tensor parallelism), R rows routed from this rank (sorted by
global expert), Q rows received here.

dispatch: the router's kept rows are already sorted by global expert, and rank p owns experts [p·L, (p+1)·L),
so the rows for each destination rank are contiguous. Per-expert counts are exchanged first (one fixed-size
all-to-all that every rank issues even when it routes nothing), then the rows (uneven splits). Received rows
arrive grouped by (source rank, local expert) and are regrouped by (local expert, source rank) for the grouped
GEMM, by a gather whose backward is the inverse gather. combine undoes both steps and applies the router
weights on the token's own rank.

Under tensor parallelism (experts split over TP along their hidden dimension, `TokenSplit`): the TP peers
route the same tokens identically, and TP rank s dispatches only the kept rows of the s-th contiguous slice of
them, so each all-to-all carries 1/S of the rows. The rows the S peers received are then all-gathered inside
the TP group (every peer holds a slice of every local expert's hidden dimension and must see them all), and the
partial expert outputs are reduce-scattered back to the peer that received each row. Each peer's combine
yields its slice's tokens only (zeros elsewhere); the sum over TP where the MoE's output leaves the TP region
assembles the whole micro-batch. The count all-to-all carries the counts of all S slices (each rank knows them:
its routing is its TP peers' routing), so it stays the one count exchange of the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_dist.layers.moe import Routing, count_per_expert
from moe_dist.layers.permutation import Permutation, reorder_rows
from moe_dist.parallel.comm import all_to_all_equal, all_to_all_rows, gather_rows, reduce_scatter_rows


def segment_permutation(counts_XY: torch.Tensor) -> torch.Tensor:
    """Indices that read a buffer laid out as segments in (x, y) order back in (y, x) order.

    counts_XY[x, y] is the length of segment (x, y). Pure index math, linear in the buffer length.
    """
    X, Y = counts_XY.shape
    src_start_XY = (torch.cumsum(counts_XY.flatten(), 0) - counts_XY.flatten()).view(X, Y)
    counts_YX = counts_XY.t().flatten()
    dst_start_YX = torch.cumsum(counts_YX, 0) - counts_YX
    shift = torch.repeat_interleave(src_start_XY.t().flatten() - dst_start_YX, counts_YX)
    return torch.arange(int(counts_YX.sum()), device=counts_XY.device) + shift


@dataclass(frozen=True)
class TokenSplit:
    """TP rank `rank` of `size` peers dispatches the `rank`-th contiguous slice of the micro-batch's tokens."""

    group: dist.ProcessGroup
    size: int
    rank: int


@dataclass
class _A2AState:
    routing: Routing
    rows_R: torch.Tensor  # the kept rows this rank dispatched (its slice's, under a token split)
    send_splits: list[int]
    recv_splits: list[int]
    peer_rows: list[int]  # rows each TP peer received (a single entry without a token split)
    to_expert_order: torch.Tensor  # (peer, source, local expert) segments → (local expert, peer, source)
    to_source_order: torch.Tensor  # its inverse
    sent_bytes: int  # bytes of rows this rank sent to other ranks in the dispatch all-to-all


class AllToAllDispatcher:
    """Moves routed rows to the EP rank that owns their expert and back (swapped in by `apply_ep`; `apply_tp`
    adds the token split)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        ep: int,
        ep_rank: int,
        num_experts: int,
        permutation: Permutation,
        split: TokenSplit | None = None,
    ):
        self.group, self.ep, self.ep_rank = group, ep, ep_rank
        self.num_experts, self.num_local = num_experts, num_experts // ep
        self.permutation = permutation
        self.split = split

    def with_split(self, split: TokenSplit) -> "AllToAllDispatcher":
        return AllToAllDispatcher(self.group, self.ep, self.ep_rank, self.num_experts, self.permutation, split)

    def _slice_counts(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Kept rows per (token slice, expert) (S, E), on the routing's device, and the positions in
        `routing.order_A` of the kept rows ordered by slice (None without a token split). Fixed-size index math
        over all A assignments (a dropped one counts in a spare bin and sorts last): nothing reads the device."""
        E, counts_E = self.num_experts, routing.tokens_per_expert_E
        if self.split is None:
            return counts_E.view(1, E), None
        S, T, order_A = self.split.size, max(routing.num_tokens, 1), routing.order_A
        A = order_A.numel()
        expert_A = torch.repeat_interleave(torch.arange(E, device=order_A.device), routing.counts_E, output_size=A)
        slice_A = (order_A % T) * S // T  # balanced contiguous token slices
        if routing.kept_A is not None:
            slice_A = slice_A.masked_fill(~routing.kept_A, S)
        counts_SE = count_per_expert(slice_A * E + expert_A, (S + 1) * E)[: S * E].view(S, E)
        return counts_SE, torch.argsort(slice_A, stable=True)  # a stable sort keeps expert order in each slice

    def _own_rows(self, routing: Routing, by_slice: torch.Tensor | None, counts_SE: torch.Tensor) -> torch.Tensor:
        """This rank's kept rows, in expert order: all of them, or its token slice's (`counts_SE` on the host)."""
        if by_slice is None:
            return routing.kept_rows(counts_SE[0])
        rows_S = counts_SE.sum(1)
        lo = int(rows_S[: self.split.rank].sum())
        return routing.order_A[by_slice[lo : lo + int(rows_S[self.split.rank])]]

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, _A2AState]:
        P, L = self.ep, self.num_local
        S, s = (self.split.size, self.split.rank) if self.split else (1, 0)
        counts_SE, by_slice = self._slice_counts(routing)
        recv_PSL = all_to_all_equal(counts_SE.view(S, P, L).transpose(0, 1), self.group)  # [source, slice, l]
        # The uneven all-to-all needs both split lists on the host: one device-to-host transfer for the two.
        host = torch.cat([counts_SE.flatten(), recv_PSL.flatten()]).cpu()
        counts_SE, recv_PSL = host[: counts_SE.numel()].view(S, P * L), host[counts_SE.numel() :].view(P, S, L)
        rows_R = self._own_rows(routing, by_slice, counts_SE)
        x_RD = self.permutation.permute(x_TD, rows_R, routing.top_k)
        send_splits = counts_SE[s].view(P, L).sum(1).tolist()
        recv_splits = recv_PSL[:, s].sum(1).tolist()
        x_QD = all_to_all_rows(x_RD, recv_splits, send_splits, self.group)
        peer_rows = recv_PSL.sum((0, 2)).tolist()
        if self.split is not None:
            x_QD = gather_rows(x_QD, peer_rows, self.split.group)  # (peer, source, local expert) segments
        counts_XL = recv_PSL.transpose(0, 1).reshape(S * P, L)
        to_expert = segment_permutation(counts_XL).to(x_TD.device)
        to_source = segment_permutation(counts_XL.t()).to(x_TD.device)
        sent_rows = sum(send_splits) - send_splits[self.ep_rank]
        state = _A2AState(
            routing,
            rows_R,
            send_splits,
            recv_splits,
            peer_rows,
            to_expert,
            to_source,
            sent_rows * x_TD.shape[1] * x_TD.element_size(),
        )
        return reorder_rows(x_QD, to_expert, to_source), counts_XL.sum(0).to(x_TD.device), state

    def combine(self, y_QD: torch.Tensor, state: _A2AState) -> torch.Tensor:
        y_XD = reorder_rows(y_QD, state.to_source_order, state.to_expert_order)
        if self.split is not None:  # partial outputs of every peer's rows, summed on the peer that received them
            y_XD = reduce_scatter_rows(y_XD, state.peer_rows, self.split.group)
        y_RD = all_to_all_rows(y_XD, state.send_splits, state.recv_splits, self.group)
        r = state.routing
        return self.permutation.unpermute(y_RD, state.rows_R, r.weight_A, r.num_tokens)
