"""Selective scan for training in pure PyTorch: chunked, with a log-depth parallel scan inside each chunk.

The sequential recurrence (`moe_dist.kernels.reference.selective_scan_ref`) runs one tiny op per timestep,
which is slow and builds a huge autograd graph. Here a chunk of T timesteps is scanned in ⌈log2 T⌉ elementwise
steps (Hillis–Steele doubling) and only the chunks are looped over in Python, carrying the state between them.

The scan works on products of decays exp(Δ A) ∈ (0, 1] directly instead of the log-space cumsum trick
(exp(cumsum) / exp(cumsum)), which would divide by decays that underflow to zero over long chunks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _linear_scan(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan of h_t = a_t h_{t-1} + b_t along dim 2, in ⌈log2 T⌉ doubling steps.

    a, b: (B, D, T, N). Returns (a_cum, b_cum) with h_t = a_cum_t h_{-1} + b_cum_t for any initial state h_{-1}.
    Each step composes position t with position t - offset, an earlier segment (a1, b1) followed by a later one
    (a2, b2) being (a2 a1, a2 b1 + b2). Every step builds new tensors (no in-place writes) so autograd can
    differentiate through it.
    """
    length = a.shape[2]
    offset = 1
    while offset < length:
        a_early, b_early = a[:, :, :-offset], b[:, :, :-offset]  # (B, D, T - offset, N)
        a_late, b_late = a[:, :, offset:], b[:, :, offset:]  # (B, D, T - offset, N)
        a = torch.cat([a[:, :, :offset], a_late * a_early], dim=2)
        b = torch.cat([b[:, :, :offset], a_late * b_early + b_late], dim=2)
        offset *= 2
    return a, b


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Mamba-1 selective scan with the semantics and argument layout of `selective_scan_ref`.

    Shapes: u, delta, z: (batch, dim, seqlen); A: (dim, state); B, C: (batch, state, seqlen);
    D, delta_bias: (dim,). Returns (batch, dim, seqlen) in u's dtype; math runs in fp32 (fp64 for fp64 inputs).
    `chunk_size` bounds the per-chunk (batch, dim, chunk, state) tensors; any seqlen works.
    """
    if chunk_size < 1:
        raise ValueError(f"selective_scan: chunk_size must be positive, got {chunk_size}")
    out_dtype = u.dtype
    compute = torch.promote_types(u.dtype, torch.float32)
    u, delta, A, B, C = (t.to(compute) for t in (u, delta, A, B, C))
    if delta_bias is not None:
        delta = delta + delta_bias.to(compute)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)

    batch, dim, seqlen = u.shape
    h = u.new_zeros(batch, dim, A.shape[1])  # (B, D, N) state carried across chunks
    ys = []
    for start in range(0, seqlen, chunk_size):
        chunk = slice(start, start + chunk_size)
        delta_c = delta[:, :, chunk]  # (B, D, T)
        decay = torch.exp(delta_c.unsqueeze(-1) * A[:, None, :])  # (B, D, T, N)
        inject = (delta_c * u[:, :, chunk]).unsqueeze(-1) * B[:, :, chunk].transpose(1, 2).unsqueeze(1)  # (B, D, T, N)
        decay_cum, inject_cum = _linear_scan(decay, inject)
        states = decay_cum * h.unsqueeze(2) + inject_cum  # (B, D, T, N)
        ys.append(torch.einsum("bdtn,bnt->bdt", states, C[:, :, chunk]))  # (B, D, T)
        h = states[:, :, -1]
    y = torch.cat(ys, dim=2)  # (B, D, L)

    if D is not None:
        y = y + D.to(compute)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(compute))
    return y.to(out_dtype)
