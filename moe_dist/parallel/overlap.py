"""Chunked expert-parallel dispatch (`parallel.a2a_chunks` = C > 1): the all-to-all of one chunk of the routed rows
overlaps the expert GEMMs of another.

Shape legend as in dispatch.py (T tokens, D d_model, E experts, P EP ranks, L = E / P local experts, S TP ranks
that split the dispatch), plus C chunks and X = S·C token parts.

What is chunked, and why so:
- Routing is not. The router runs once on the whole micro-batch, so capacity, drops, the aux/z losses and the
  routing statistics are exactly those of the unchunked layer (DESIGN.md §5: per micro-batch per rank).
- The kept rows are cut by token ranges: part u of X covers the tokens t with ⌊t·X / T⌋ = u (`token_parts`). Under a
  token split (TP) part u belongs to slice ⌊u / C⌋ — the same slices `TokenSplit` takes, so the chunks are chunks
  *within* this rank's slice. With whole experts (`parallel.etp = 1`) the TP peers gather nothing: the chunks that
  meet on a rank are those its EP peers sent it. Each chunk is then a complete dispatch → experts → combine pipeline
  of its own rows; a row's output depends only on its token and expert, never on which chunk carried it, so the
  layer's outputs equal the unchunked ones (up to the row order inside the grouped GEMMs' sums in backward).
- One count exchange per layer, as before: the per-expert counts of all X parts travel in one fixed-size
  all-to-all, from which every rank knows every chunk's splits without another host synchronization.

Schedule (identical on every rank, including a rank that sends or receives nothing: an empty chunk still issues
its collectives with zero splits). Forward: the C dispatch all-to-alls are issued at once (asynchronous, on
gloo's or NCCL's own progress); then for each chunk c: wait for its rows, [TP gather], experts, [TP reduce-
scatter], issue its combine all-to-all; finally wait for the C combines and sum every token's rows once. Only the
first chunk's dispatch and the last chunk's combine are exposed; the rest overlap the expert GEMMs of other
chunks. Backward (autograd runs nodes one at a time, the most recently created ready node first): reaching the
combines' waits issues the C gradient all-to-alls back to the experts' ranks at once, each chunk's expert backward
waits only for its own, and the dispatch's gradient all-to-all of chunk c is issued when its backward reaches the
dispatch wait and waited for only after the expert backward of the chunks before it — so in backward too only
one chunk's all-to-all each way is exposed. The TP row gather and reduce-scatter stay synchronous (they ride
NVLink inside the node and are not what the overlap is for). The rows' gather into expert order and the weighted
sum back run once for all chunks (they are per token, not per chunk).

Collective order per layer and micro-batch, the same on every rank. Forward: the count all-to-all; C dispatch
all-to-alls; per chunk its TP gather and reduce-scatter (with a split) and its combine all-to-all; the C waits.
Backward: the C combine-gradient all-to-alls (last chunk first); then from the last chunk to the first: wait for
its combine gradient, its TP collectives, issue its dispatch gradient; then the C dispatch-gradient waits. That
order is autograd's scheduling of this graph, which every rank builds alike (the same nodes created in the same
order; the engine runs the most recently created ready node first), not a rank's choice.

The seam: `MoE` hands its experts to `dispatcher.run`; with a2a_chunks = 1 `apply_ep` installs the plain
`AllToAllDispatcher` and none of this runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_dist.layers.permutation import Permutation, reorder_rows
from moe_dist.layers.router import Routing
from moe_dist.parallel.comm import all_to_all_equal, all_to_all_rows_async, gather_rows, reduce_scatter_rows
from moe_dist.parallel.dispatch import AllToAllDispatcher, TokenSplit, segment_permutation


class ChunkedAllToAllDispatcher(AllToAllDispatcher):
    """`AllToAllDispatcher` whose `run` pipelines `chunks` token chunks (see the module docstring); `dispatch` and
    `combine` (the unchunked steps, for tools that call them one by one) are inherited unchanged."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        ep: int,
        ep_rank: int,
        num_experts: int,
        permutation: Permutation,
        split: TokenSplit | None = None,
        *,
        chunks: int,
    ):
        super().__init__(group, ep, ep_rank, num_experts, permutation, split)
        self.chunks = chunks

    def run(self, x_TD: torch.Tensor, routing: Routing, experts) -> tuple[torch.Tensor, int]:
        P, L, C = self.ep, self.num_local, self.chunks
        S, s = (self.split.size, self.split.rank) if self.split else (1, 0)
        counts_XE, by_part = self._part_counts(routing, S * C)
        mine = slice(s * C, (s + 1) * C)  # this rank's parts: chunks 0..C-1 of its slice
        # The slices whose rows meet here (G): every TP peer's when they gather, else this rank's own (etp = 1).
        G, own = (S, mine) if self._gathers else (1, slice(0, C))
        sent_XE = counts_XE if self._gathers else counts_XE[mine]
        recv_PXL = all_to_all_equal(sent_XE.view(G * C, P, L).transpose(0, 1), self.group)  # [source, part, l]
        host = torch.cat([counts_XE.flatten(), recv_PXL.flatten()]).cpu()  # one device-to-host transfer
        counts_XPL = host[: counts_XE.numel()].view(S * C, P, L)
        recv_PXL = host[counts_XE.numel() :].view(P, G * C, L)
        rows_R = self._rows_of_parts(routing, by_part, counts_XPL.view(S * C, P * L), mine)  # by chunk, then expert
        x_RD = self.permutation.permute(x_TD, rows_R, routing.top_k)

        send_CP = counts_XPL[mine].sum(2).tolist()  # rows to each EP rank, per chunk
        recv_CP = recv_PXL[:, own].sum(2).t().tolist()  # rows from each EP rank, per chunk
        dispatched = [
            all_to_all_rows_async(x_cD, recv_CP[c], send_CP[c], self.group)
            for c, x_cD in enumerate(torch.split(x_RD, [sum(n) for n in send_CP]))
        ]
        combined = []
        for c in range(C):
            counts_GPL = recv_PXL[:, c::C].transpose(0, 1)  # chunk c of each slice met here [peer, source, l]
            x_QD = dispatched[c].wait()
            peer_rows = counts_GPL.sum((1, 2)).tolist()
            if self._gathers:
                x_QD = gather_rows(x_QD, peer_rows, self.split.group)  # (peer, source, local expert) segments
            counts_YL = counts_GPL.reshape(G * P, L)
            to_expert = segment_permutation(counts_YL).to(x_TD.device)
            to_source = segment_permutation(counts_YL.t()).to(x_TD.device)
            y_QD = experts(reorder_rows(x_QD, to_expert, to_source), counts_YL.sum(0).to(x_TD.device))
            y_QD = reorder_rows(y_QD, to_source, to_expert)
            if self._gathers:  # partial outputs of every peer's rows, summed on the peer that received them
                y_QD = reduce_scatter_rows(y_QD, peer_rows, self.split.group)
            combined.append(all_to_all_rows_async(y_QD, send_CP[c], recv_CP[c], self.group))
        y_RD = torch.cat([pending.wait() for pending in combined])
        sent_rows = sum(sum(n) - n[self.ep_rank] for n in send_CP)
        out_TD = self.permutation.unpermute(y_RD, rows_R, routing.weight_A, routing.num_tokens)
        return out_TD, sent_rows * x_TD.shape[1] * x_TD.element_size()
