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

With whole experts (parallel.etp = 1, `TokenSplit.gather` false) the EP group spans TP ranks (mesh.py): each rank
still dispatches its own slice, but its rows meet whole experts through the all-to-all alone, so there is no TP
gather or reduce-scatter and each rank exchanges only its own slice's counts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_dist.layers.moe import Dispatcher
from moe_dist.layers.permutation import Permutation, reorder_rows
from moe_dist.layers.router import Routing, count_per_expert
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


def token_parts(index_N: torch.Tensor, num_tokens: int, parts: int) -> torch.Tensor:
    """(N,) part of each row (or assignment) index: its token t = index % T falls in part ⌊t · parts / T⌋ (balanced
    contiguous token ranges). With parts = S·C, ⌊part / C⌋ is TokenSplit's slice ⌊t · S / T⌋ (⌊⌊y⌋ / C⌋ = ⌊y / C⌋),
    so a split's chunks nest inside its slices."""
    T = max(num_tokens, 1)
    return (index_N % T) * parts // T


@dataclass(frozen=True)
class TokenSplit:
    """TP rank `rank` of `size` peers dispatches the `rank`-th contiguous slice of the micro-batch's tokens;
    `gather`: the experts are split over TP, so the peers' received rows are gathered (false: whole experts)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    gather: bool = True


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


class AllToAllDispatcher(Dispatcher):
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
        """This dispatcher (of whichever class, with all its settings) with the token split set."""
        twin = copy.copy(self)
        twin.split = split
        return twin

    @property
    def _gathers(self) -> bool:
        """Whether the TP peers gather each other's received rows (experts split over TP)."""
        return self.split is not None and self.split.gather

    def _part_counts(self, routing: Routing, parts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Kept rows per (token part, expert) (parts, E), on the routing's device, and the positions in
        `routing.order_A` of the kept rows ordered by part, expert order inside each (None for a single part).
        Parts are `token_parts`' contiguous token ranges: TP slices, or chunks of them. Fixed-size index math over
        all A assignments (a dropped one counts in a spare bin and sorts last): nothing reads the device."""
        E, counts_E = self.num_experts, routing.tokens_per_expert_E
        if parts == 1:
            return counts_E.view(1, E), None
        order_A = routing.order_A
        expert_A = torch.repeat_interleave(
            torch.arange(E, device=order_A.device), routing.counts_E, output_size=order_A.numel()
        )
        part_A = token_parts(order_A, routing.num_tokens, parts)
        if routing.kept_A is not None:
            part_A = part_A.masked_fill(~routing.kept_A, parts)
        counts_XE = count_per_expert(part_A * E + expert_A, (parts + 1) * E)[: parts * E].view(parts, E)
        return counts_XE, torch.argsort(part_A, stable=True)  # a stable sort keeps expert order in each part

    @staticmethod
    def _rows_of_parts(routing: Routing, by_part: torch.Tensor | None, counts_XE: torch.Tensor, mine: slice):
        """The kept rows of the parts `mine` (consecutive), in (part, expert) order; `counts_XE` on the host."""
        if by_part is None:
            return routing.kept_rows(counts_XE[0])
        rows_X = counts_XE.sum(1)
        lo = int(rows_X[: mine.start].sum())
        return routing.order_A[by_part[lo : lo + int(rows_X[mine].sum())]]

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, _A2AState]:
        P, L = self.ep, self.num_local
        S, s = (self.split.size, self.split.rank) if self.split else (1, 0)
        counts_SE, by_slice = self._part_counts(routing, S)
        # The slices whose rows meet here: every TP peer's when they gather (X = S), else this rank's own (X = 1).
        X, x = (S, s) if self._gathers else (1, 0)
        sent_XE = counts_SE if self._gathers else counts_SE[s : s + 1]
        recv_PXL = all_to_all_equal(sent_XE.view(X, P, L).transpose(0, 1), self.group)  # [source, slice, l]
        # The uneven all-to-all needs both split lists on the host: one device-to-host transfer for the two.
        host = torch.cat([counts_SE.flatten(), recv_PXL.flatten()]).cpu()
        counts_SE, recv_PXL = host[: counts_SE.numel()].view(S, P * L), host[counts_SE.numel() :].view(P, X, L)
        rows_R = self._rows_of_parts(routing, by_slice, counts_SE, slice(s, s + 1))
        x_RD = self.permutation.permute(x_TD, rows_R, routing.top_k)
        send_splits = counts_SE[s].view(P, L).sum(1).tolist()
        recv_splits = recv_PXL[:, x].sum(1).tolist()
        x_QD = all_to_all_rows(x_RD, recv_splits, send_splits, self.group)
        peer_rows = recv_PXL.sum((0, 2)).tolist()
        if self._gathers:
            x_QD = gather_rows(x_QD, peer_rows, self.split.group)  # (peer, source, local expert) segments
        counts_XL = recv_PXL.transpose(0, 1).reshape(X * P, L)
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
        if self._gathers:  # partial outputs of every peer's rows, summed on the peer that received them
            y_XD = reduce_scatter_rows(y_XD, state.peer_rows, self.split.group)
        y_RD = all_to_all_rows(y_XD, state.send_splits, state.recv_splits, self.group)
        r = state.routing
        return self.permutation.unpermute(y_RD, state.rows_R, r.weight_A, r.num_tokens)
