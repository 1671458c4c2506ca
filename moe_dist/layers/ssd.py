"""Mamba-2's SSD scan for training in pure PyTorch: chunked, quadratic inside a chunk, recurrent across chunks.

The PyTorch path of the Mamba-2 scan (the CPU path; impl "torch" on any device); its oracle is
`moe_dist.kernels.reference.ssd_scan_ref`. The GPU kernel (impl "triton") is fla-core's: moe_dist/layers/fla_ops.py.
Invariants: document starts (`reset`) zero the state before their step, inside and across chunks; decays come
from a cumulative sum of masked log-decays, never a difference of cumulative sums, so underflow gives exact zeros
and no inf − inf; gradients are autograd's. The derivation: docs/kernels.md, section "The chunked Mamba-2 SSD";
proof: tests/layers/test_ssd.py (equal to the reference, outputs, final state and every gradient).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """Log-decays a (..., T) → (..., T, T) with [i, j] = Σ_{j<k≤i} a_k for j ≤ i and -inf above the diagonal."""
    T = a.shape[-1]
    ones = torch.ones(T, T, dtype=torch.bool, device=a.device)
    terms = a[..., :, None].expand(*a.shape, T).masked_fill(~ones.tril(-1), 0.0)  # [k, j] = a_k where k > j
    return terms.cumsum(-2).masked_fill(~ones.tril(), float("-inf"))


def _chunked(t: torch.Tensor, pad: int, T: int) -> torch.Tensor:
    """(batch, L, ...) → (batch, chunks, T, ...), zero-padded at the end of the time axis."""
    t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.view(t.shape[0], -1, T, *t.shape[2:])


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    reset: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 SSD scan with the semantics and argument layout of `ssd_scan_ref`.

    Shapes: x (batch, seqlen, heads, head_dim); dt (batch, seqlen, heads), already positive; A, D (heads,);
    B, C (batch, seqlen, groups, state), head h reading group h // (heads // groups); initial_state (batch, heads,
    head_dim, state) or None (zeros); reset (batch, seqlen) bool, True at document starts (the state is zeroed
    before that step). Returns y (batch, seqlen, heads, head_dim) in x's dtype and the final state (batch, heads,
    head_dim, state) in fp32 (fp64 for fp64 inputs), the dtype all math runs in. `chunk_size` is the number of
    steps per chunk (the quadratic block's side); the result does not depend on it and any seqlen works.
    """
    if chunk_size < 1:
        raise ValueError(f"ssd_scan: chunk_size must be positive, got {chunk_size}")
    batch, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    R = H // G  # heads per group
    compute = torch.promote_types(x.dtype, torch.float32)
    S = (x.new_zeros(batch, H, P, N, dtype=compute) if initial_state is None else initial_state.to(compute)).reshape(
        batch, G, R, P, N
    )
    if L == 0:
        return x.new_zeros(batch, 0, H, P), S.view(batch, H, P, N)
    T = min(chunk_size, L)
    pad = -L % T
    x_c, dt, A = x.to(compute), dt.to(compute), A.to(compute)
    # Padded steps have dt = 0: no input and a decay of exp(0) = 1, so the final state is the last real step's.
    dtx = _chunked((dt[..., None] * x_c).view(batch, L, G, R, P), pad, T)  # (B, c, T, G, R, P)
    B, C = (_chunked(t.to(compute), pad, T) for t in (B, C))  # (B, c, T, G, N)
    a = _chunked((dt * A).view(batch, L, G, R), pad, T).permute(0, 1, 3, 4, 2)  # (B, c, G, R, T): log-decays

    decay = torch.exp(_segment_sum(a))  # (B, c, G, R, T, T): [i, j] = Π_{j<k≤i} a_k, 0 above the diagonal
    into = torch.exp(a.cumsum(-1))  # (B, c, G, R, T): decay from the chunk's entering state to step i
    if reset is not None:
        starts = _chunked(reset.to(torch.int64)[..., None], pad, T)[..., 0]  # (B, c, T)
        segment = starts.cumsum(-1)  # documents started in the chunk up to step i
        decay = decay * (segment[..., :, None] == segment[..., None, :])[:, :, None, None]
        into = into * (segment == 0)[:, :, None, None]

    CB = torch.einsum("bclgn,bcsgn->bcgls", C, B)  # (B, c, G, T, T)
    y = torch.einsum("bcgls,bcgrls,bcsgrp->bclgrp", CB, decay, dtx)  # within-chunk part: (B, c, T, G, R, P)
    # Each chunk's contribution to its own end state: the last row of `decay` (padding keeps it the last real step's).
    own = torch.einsum("bcgrs,bcsgn,bcsgrp->bcgrpn", decay[..., -1, :], B, dtx)  # (B, c, G, R, P, N)
    entering = []
    for c in range(own.shape[1]):
        entering.append(S)
        S = into[:, c, :, :, -1, None, None] * S + own[:, c]
    entering = torch.stack(entering, dim=1)  # (B, c, G, R, P, N): the state before each chunk's first step
    y = y + torch.einsum("bclgn,bcgrpn,bcgrl->bclgrp", C, entering, into)
    y = y.reshape(batch, -1, H, P)[:, :L]  # (B, L, H, P)
    if D is not None:
        y = y + D.to(compute)[:, None] * x_c
    return y.to(x.dtype), S.reshape(batch, H, P, N)
