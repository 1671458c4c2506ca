"""Expert-parallel token dispatch: the all-to-all dispatcher, plain or pipelined over `chunks` token chunks.

Shape legend: T tokens, D d_model, E experts, P = ep ranks in the EP group, L = E / P local experts, S = TP ranks
that split the dispatch (1 without tensor parallelism), C chunks (`parallel.a2a_chunks`), X = S·C token parts,
R rows routed from this rank (by chunk, then global expert), Q rows received here.

Rank p owns experts [p·L, (p+1)·L), so the kept rows, sorted by expert, are contiguous per destination. One step
(`_plan`) settles a layer's dispatch for both paths: the one count all-to-all (the counts of every part), the one
device-to-host transfer, the split lists and the segment permutations that regroup received rows by local expert.
`chunks` = 1 then moves all rows at once (`dispatch` → experts → `combine`); `chunks` = C > 1 pipelines C chunks so
that one chunk's all-to-all overlaps another's expert GEMMs (`run`). Every rank issues the same collectives in the
same order, with zero splits where it has no rows. The TP token split, whole experts (`parallel.etp` = 1) and the
chunked schedule with its collective order: docs/parallelism.md. Proofs: the outputs equal one process's
(tests/parallel/test_ep_dispatch.py, chunked and folded too), one device-to-host transfer per layer and no
host-to-device copy (tests/train/test_host_syncs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_dist.layers.moe import Dispatcher
from moe_dist.layers.permutation import Permutation, reorder_rows
from moe_dist.layers.router import Routing, count_per_expert
from moe_dist.parallel.comm import (
    all_to_all_equal,
    all_to_all_rows,
    all_to_all_rows_async,
    gather_rows,
    reduce_scatter_rows,
)


def segment_permutation(counts_XY: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Indices that read a buffer laid out as segments in (x, y) order back in (y, x) order.

    counts_XY[x, y] is the length of segment (x, y); `total` their sum, known on the host (None: read from
    `counts_XY`, a sync when it is on a GPU). Pure index math on counts_XY's device, linear in the buffer length.
    """
    X, Y = counts_XY.shape
    total = int(counts_XY.sum()) if total is None else total
    src_start_XY = (torch.cumsum(counts_XY.flatten(), 0) - counts_XY.flatten()).view(X, Y)
    counts_YX = counts_XY.t().flatten()
    dst_start_YX = torch.cumsum(counts_YX, 0) - counts_YX
    shift = torch.repeat_interleave(src_start_XY.t().flatten() - dst_start_YX, counts_YX, output_size=total)
    return torch.arange(total, device=counts_XY.device) + shift


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
class _Received:
    """One chunk's rows as they meet here: (peer, source rank, local expert) segments."""

    peer_rows: list[int]  # rows each TP peer received (a single entry without a gather)
    to_expert_order: torch.Tensor  # (peer, source, local expert) segments → (local expert, peer, source)
    to_source_order: torch.Tensor  # its inverse
    rows_per_expert_L: torch.Tensor  # on the device: the grouped GEMM's group sizes


@dataclass
class _Plan:
    """A layer's dispatch as settled by the one count exchange: everything the row collectives need."""

    rows_R: torch.Tensor  # the kept rows this rank dispatches (its slice's, under a token split)
    send_CP: list[list[int]]  # rows to each EP rank, per chunk
    recv_CP: list[list[int]]  # rows from each EP rank, per chunk
    received: list[_Received]  # per chunk
    sent_bytes: int  # bytes of rows this rank sends to other ranks (all chunks)


@dataclass
class _A2AState:
    routing: Routing
    plan: _Plan
    sent_bytes: int


class AllToAllDispatcher(Dispatcher):
    """Moves routed rows to the EP rank that owns their expert and back, in `chunks` pipelined token chunks
    (1: all at once). Built by `build_dispatcher` (parallel/expert_parallel.py), with the token split under TP.
    `dispatch` and `combine` are the unchunked steps (for tools that call them one by one); `run` is what the
    layer calls."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        ep: int,
        ep_rank: int,
        num_experts: int,
        permutation: Permutation,
        split: TokenSplit | None = None,
        chunks: int = 1,
    ):
        self.group, self.ep, self.ep_rank = group, ep, ep_rank
        self.num_experts, self.num_local = num_experts, num_experts // ep
        self.permutation = permutation
        self.split = split
        self.chunks = chunks

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

    def _plan(self, routing: Routing, x_TD: torch.Tensor, chunks: int) -> _Plan:
        """The count exchange and everything derived from it, for `chunks` chunks of this rank's token slice."""
        P, L, C = self.ep, self.num_local, chunks
        S, s = (self.split.size, self.split.rank) if self.split else (1, 0)
        counts_XE, by_part = self._part_counts(routing, S * C)
        mine = slice(s * C, (s + 1) * C)  # this rank's parts: chunks 0..C-1 of its slice
        # The slices whose rows meet here (G): every TP peer's when they gather, else this rank's own (etp = 1).
        G, own = (S, mine) if self._gathers else (1, slice(0, C))
        sent_XE = counts_XE if self._gathers else counts_XE[mine]
        recv_PXL = all_to_all_equal(sent_XE.view(G * C, P, L).transpose(0, 1), self.group)  # [source, part, l]
        # The uneven all-to-alls need the split lists on the host: one device-to-host transfer for all of them.
        # The index tensors are built from the device's own copy of the counts, their sizes from the host's copy:
        # nothing is copied back to the device (a copy from pageable host memory would wait for the stream).
        host = torch.cat([counts_XE.flatten(), recv_PXL.flatten()]).cpu()
        counts_XPL = host[: counts_XE.numel()].view(S * C, P, L)
        recv_dev_PXL, recv_PXL = recv_PXL, host[counts_XE.numel() :].view(P, G * C, L)
        rows_R = self._rows_of_parts(routing, by_part, counts_XPL.view(S * C, P * L), mine)  # by chunk, then expert
        send_CP = counts_XPL[mine].sum(2).tolist()  # rows to each EP rank, per chunk
        recv_CP = recv_PXL[:, own].sum(2).t().tolist()  # rows from each EP rank, per chunk
        received = []
        for c in range(C):
            counts_GPL = recv_PXL[:, c::C].transpose(0, 1)  # chunk c of each slice met here [peer, source, l]
            rows = int(counts_GPL.sum())
            counts_YL = recv_dev_PXL[:, c::C].transpose(0, 1).reshape(G * P, L)  # the same counts, on the device
            to_expert = segment_permutation(counts_YL, rows)
            to_source = segment_permutation(counts_YL.t(), rows)
            received.append(_Received(counts_GPL.sum((1, 2)).tolist(), to_expert, to_source, counts_YL.sum(0)))
        sent_rows = sum(sum(n) - n[self.ep_rank] for n in send_CP)
        return _Plan(rows_R, send_CP, recv_CP, received, sent_rows * x_TD.shape[1] * x_TD.element_size())

    def _to_experts(self, x_QD: torch.Tensor, got: _Received) -> torch.Tensor:
        """Rows received by the all-to-all → every peer's rows (under a gather), regrouped by local expert."""
        if self._gathers:
            x_QD = gather_rows(x_QD, got.peer_rows, self.split.group)  # (peer, source, local expert) segments
        return reorder_rows(x_QD, got.to_expert_order, got.to_source_order)

    def _from_experts(self, y_QD: torch.Tensor, got: _Received) -> torch.Tensor:
        """Inverse of `_to_experts`: expert outputs back in arrival order, partial sums reduced over the peers."""
        y_QD = reorder_rows(y_QD, got.to_source_order, got.to_expert_order)
        if self._gathers:  # partial outputs of every peer's rows, summed on the peer that received them
            y_QD = reduce_scatter_rows(y_QD, got.peer_rows, self.split.group)
        return y_QD

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, _A2AState]:
        plan = self._plan(routing, x_TD, chunks=1)
        x_RD = self.permutation.permute(x_TD, plan.rows_R, routing.top_k)
        x_QD = all_to_all_rows(x_RD, plan.recv_CP[0], plan.send_CP[0], self.group)
        got = plan.received[0]
        return self._to_experts(x_QD, got), got.rows_per_expert_L, _A2AState(routing, plan, plan.sent_bytes)

    def combine(self, y_QD: torch.Tensor, state: _A2AState) -> torch.Tensor:
        plan, r = state.plan, state.routing
        y_RD = all_to_all_rows(self._from_experts(y_QD, plan.received[0]), plan.send_CP[0], plan.recv_CP[0], self.group)
        return self.permutation.unpermute(y_RD, plan.rows_R, r.weight_A, r.num_tokens)

    def run(self, x_TD: torch.Tensor, routing: Routing, experts) -> tuple[torch.Tensor, int]:
        """dispatch → experts → combine; with `chunks` > 1 the C dispatch all-to-alls are issued at once, then per
        chunk: wait for its rows, experts, issue its combine all-to-all; finally the C combines are awaited and
        every token's rows summed once (docs/parallelism.md, "Dispatch in chunks")."""
        if self.chunks == 1:
            return Dispatcher.run(self, x_TD, routing, experts)
        plan = self._plan(routing, x_TD, self.chunks)
        x_RD = self.permutation.permute(x_TD, plan.rows_R, routing.top_k)
        dispatched = [
            all_to_all_rows_async(x_cD, plan.recv_CP[c], plan.send_CP[c], self.group)
            for c, x_cD in enumerate(torch.split(x_RD, [sum(n) for n in plan.send_CP]))
        ]
        combined = []
        for c, got in enumerate(plan.received):
            y_QD = experts(self._to_experts(dispatched[c].wait(), got), got.rows_per_expert_L)
            combined.append(
                all_to_all_rows_async(self._from_experts(y_QD, got), plan.send_CP[c], plan.recv_CP[c], self.group)
            )
        y_RD = torch.cat([pending.wait() for pending in combined])
        return self.permutation.unpermute(y_RD, plan.rows_R, routing.weight_A, routing.num_tokens), plan.sent_bytes
