"""Expert-parallel token dispatch: the all-to-all implementation of the MoE layer's dispatcher seam.

Shape legend: T tokens, D d_model, E experts, P = ep ranks in the EP group, L = E / P local experts,
R rows routed from this rank (sorted by global expert), Q rows received here.

dispatch: the router's kept rows are already sorted by global expert, and rank p owns experts [p·L, (p+1)·L),
so the rows for each destination rank are contiguous. Per-expert counts are exchanged first (a fixed-size
all-to-all that every rank issues even when it routes nothing), then the rows (uneven splits). Received rows
arrive grouped by (source rank, local expert) and are regrouped by (local expert, source rank) for the grouped
GEMM. combine undoes both steps and applies the router weights on the token's own rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_dist.layers.moe import Routing
from moe_dist.layers.permutation import Permutation
from moe_dist.parallel.comm import all_to_all_equal, all_to_all_rows


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


@dataclass
class _A2AState:
    routing: Routing
    send_splits: list[int]
    recv_splits: list[int]
    recv_counts_PL: torch.Tensor
    to_expert_order_Q: torch.Tensor
    sent_bytes: int  # bytes of rows this rank sent to other ranks in the dispatch all-to-all


class AllToAllDispatcher:
    """Moves routed rows to the EP rank that owns their expert and back (swapped in by `apply_ep`)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, ep_rank: int, num_experts: int, permutation: Permutation):
        self.group, self.ep, self.ep_rank = group, ep, ep_rank
        self.num_local = num_experts // ep
        self.permutation = permutation

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, _A2AState]:
        P, L = self.ep, self.num_local
        x_RD = self.permutation.permute(x_TD, routing.rows_R, routing.top_k)
        send_counts_PL = routing.tokens_per_expert_E.view(P, L)
        recv_counts_PL = all_to_all_equal(send_counts_PL, self.group)  # row s: what rank s sends here
        # The uneven all-to-all needs both split lists on the host: one device-to-host transfer for the two.
        send_recv_2PL = torch.stack([send_counts_PL, recv_counts_PL]).cpu()
        recv_counts_PL = send_recv_2PL[1]
        send_splits = send_recv_2PL[0].sum(1).tolist()
        recv_splits = recv_counts_PL.sum(1).tolist()
        x_QD = all_to_all_rows(x_RD, recv_splits, send_splits, self.group)
        to_expert_order_Q = segment_permutation(recv_counts_PL).to(x_TD.device)
        sent_rows = sum(send_splits) - send_splits[self.ep_rank]
        state = _A2AState(
            routing,
            send_splits,
            recv_splits,
            recv_counts_PL,
            to_expert_order_Q,
            sent_rows * x_TD.shape[1] * x_TD.element_size(),
        )
        return x_QD[to_expert_order_Q], recv_counts_PL.sum(0).to(x_TD.device), state

    def combine(self, y_QD: torch.Tensor, state: _A2AState) -> torch.Tensor:
        to_source_order_Q = segment_permutation(state.recv_counts_PL.t()).to(y_QD.device)
        y_RD = all_to_all_rows(y_QD[to_source_order_Q], state.send_splits, state.recv_splits, self.group)
        r = state.routing
        return self.permutation.unpermute(y_RD, r.rows_R, r.weight_A, r.num_tokens)
