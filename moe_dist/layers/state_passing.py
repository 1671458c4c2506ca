"""Context parallelism for the recurrent mixers (Mamba-1, Mamba-2, Gated DeltaNet) by passing states.

A recurrent layer needs from the pieces before its own only the state entering it (and the causal conv's last
d_conv − 1 inputs). Each rank runs each of its pieces from a zero state, all ranks at once; a piece's effect on the
state is affine, h_end = T h_start + F, so a summary (F, T) per piece is all the others need: F is the piece's final
state from zero, T its transition (a decay product for the diagonal SSMs, zero from a document start inside the
piece on; a (dk, dk) operator for the delta rule). One all-gather of the summaries (`SeqShard.gather_pieces`) and
every rank composes the summaries of the pieces before each of its own, in global order, into that piece's true
initial state; the mixer then corrects its outputs for it. Nothing is relayed from rank to rank, and the bytes
exchanged are O(state) per piece whatever the sequence length. Gradients flow back through the gather.

Local pieces run batched: `to_pieces` stacks a rank's two pieces (head, tail) along the batch axis, so a mixer runs
one (2B, S / (2·cp)) sequence batch and every per-piece tensor has 2B rows, head pieces first.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from moe_dist.layers.sequence_shard import SeqShard, piece_chunks


def to_pieces(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """A local sequence (B, 2·chunk, ...) along `dim` → its two pieces stacked on the batch axis: (2B, chunk, ...)."""
    return torch.cat(x.chunk(2, dim=dim), dim=0)


def from_pieces(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of `to_pieces`: (2B, chunk, ...) → (B, 2·chunk, ...)."""
    return torch.cat(x.chunk(2, dim=0), dim=dim)


def piece_resets(shard: SeqShard, document_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """(2B, chunk) bool, True at each document start of the local pieces (from the WHOLE (B, S) document ids: a
    piece whose first position starts a document resets there, which also drops the state passed into it)."""
    if document_ids is None:
        return None
    reset = torch.zeros_like(document_ids, dtype=torch.bool)
    reset[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return to_pieces(shard.local(reset))


def conv_window(
    shard: SeqShard, x: torch.Tensor, width: int, document_ids: Optional[torch.Tensor]
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The causal conv's input for each local piece, with its halo: x (2B, C, chunk) → (2B, C, width + chunk), the
    `width` (= d_conv − 1) conv inputs before each piece in global order prepended (zeros before the sequence
    start, where a conv pads with zeros), and the window's document ids (2B, width + chunk) or None.

    One all-gather of each piece's last min(width, chunk) inputs: a piece shorter than `width` sends all of it,
    and the halo is then read across several earlier pieces. A valid (unpadded) conv of the window gives the
    piece's outputs; document masking needs no more than the window's ids, sliced from the whole sequence's."""
    chunk = shard.chunk
    if width > 0:
        tail = min(width, chunk)
        every = shard.gather_pieces(x[..., chunk - tail :].unflatten(0, (2, -1)))  # (2cp, B, C, tail), global
        halos = []
        for c in piece_chunks(shard.size, shard.rank):
            before = every[max(0, c - -(-width // tail)) : c].unbind(0)
            halo = torch.cat(before, dim=-1)[..., -width:] if before else x.new_zeros(*every.shape[1:-1], 0)
            halos.append(F.pad(halo, (width - halo.shape[-1], 0)))
        x = torch.cat([torch.cat(halos, dim=0), x], dim=-1)
    if document_ids is None:
        return x, None
    # Positions before 0 hold zero inputs: any id works there (clamped to position 0's).
    windows = [
        document_ids[:, torch.arange(start - width, start + n, device=document_ids.device).clamp(min=0)]
        for start, n in shard.pieces
    ]
    return x, torch.cat(windows, dim=0)


def exchange(shard: SeqShard, *summaries: torch.Tensor) -> list[torch.Tensor]:
    """All-gather per-piece summaries in ONE collective: each (2B, ...) (rows as `to_pieces`) → (2·cp, B, ...), every
    piece of the sequence in global order. They travel packed in the dtype of the first (fp32 states)."""
    batch = summaries[0].shape[0] // 2
    flat = [s.reshape(2, batch, -1).to(summaries[0].dtype) for s in summaries]
    every = shard.gather_pieces(torch.cat(flat, dim=-1))  # (2cp, B, Σ sizes)
    parts = every.split([f.shape[-1] for f in flat], dim=-1)
    return [p.reshape(p.shape[0], batch, *s.shape[1:]).to(s.dtype) for p, s in zip(parts, summaries)]


def diagonal(transition: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """A diagonal transition (decays broadcastable to the state) applied to a state."""
    return transition * state


def matrix(transition: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """A (…, dk, dk) transition operator applied to a (…, dk, dv) state (the delta rule's)."""
    return transition @ state


def initial_states(
    shard: SeqShard,
    final: torch.Tensor,
    transition: torch.Tensor,
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The true state entering each local piece, (2B, ...) as `to_pieces`, from every piece's summary in global
    order (`exchange`'s output): final (2cp, B, ...) states from zero, transition (2cp, B, ...). The state entering
    piece c is h_c with h_0 = 0 and h_{c+1} = apply(T_c, h_c) + F_c. Every rank composes the same prefix (2·cp
    small steps) instead of waiting for its neighbour's state."""
    mine = piece_chunks(shard.size, shard.rank)
    h = torch.zeros_like(final[0])
    entering = [h]
    for c in range(max(mine)):
        h = apply(transition[c], h) + final[c]
        entering.append(h)
    return torch.cat([entering[c] for c in mine], dim=0)
