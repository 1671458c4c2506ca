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


def _scan_no_grad(a: torch.Tensor, b: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """h_t = a_t h_{t-1} + b_t with h_{-1} = 0 along dim 2 of (B, D, L, N) tensors; returns h (B, D, L, N).

    Inside a chunk: ⌈log2 chunk⌉ Hillis–Steele doubling steps, an earlier segment (a1, b1) followed by a later one
    (a2, b2) composing to (a2 a1, a2 b1 + b2). Across chunks: the carried state enters through the chunk's
    cumulative decay. Runs without autograd: `_LinearScan` supplies the backward as a reverse scan.
    """
    length = a.shape[2]
    h = torch.empty_like(b)
    carry = None  # (B, D, N)
    for start in range(0, length, chunk_size):
        a_c = a[:, :, start:start + chunk_size].clone()  # (B, D, T, N) cumulative decay
        b_c = b[:, :, start:start + chunk_size].clone()  # (B, D, T, N) state from zero initial state
        offset = 1
        while offset < a_c.shape[2]:
            # Right-hand sides are computed in full before the slice is written, so reads see the old values.
            b_c[:, :, offset:] = torch.addcmul(b_c[:, :, offset:], a_c[:, :, offset:], b_c[:, :, :-offset])
            a_c[:, :, offset:] = a_c[:, :, offset:] * a_c[:, :, :-offset]
            offset *= 2
        if carry is not None:
            b_c.addcmul_(a_c, carry.unsqueeze(2))
        h[:, :, start:start + chunk_size] = b_c
        carry = b_c[:, :, -1]
    return h


class _LinearScan(torch.autograd.Function):
    """Differentiable h = scan(a, b). The adjoint of a linear recurrence is the same recurrence run backwards:
    λ_t = g_t + a_{t+1} λ_{t+1}, so db = λ and da_t = λ_t h_{t-1}. Hand-written because autograd through the
    sliced doubling steps spends most of its time materializing zero-padded slice gradients."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, chunk_size: int) -> torch.Tensor:
        h = _scan_no_grad(a, b, chunk_size)
        ctx.save_for_backward(a, h)
        ctx.chunk_size = chunk_size
        return h

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        a, h = ctx.saved_tensors
        a_next = torch.zeros_like(a)
        a_next[:, :, :-1] = a[:, :, 1:]
        lam = _scan_no_grad(a_next.flip(2), grad_h.flip(2), ctx.chunk_size).flip(2)  # (B, D, L, N)
        h_prev = torch.zeros_like(h)
        h_prev[:, :, 1:] = h[:, :, :-1]
        return lam * h_prev, lam, None


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

    decay = torch.exp(delta.unsqueeze(-1) * A[:, None, :])  # (B, D, L, N)
    inject = (delta * u).unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1)  # (B, D, L, N)
    states = _LinearScan.apply(decay, inject, chunk_size)  # (B, D, L, N)
    y = torch.einsum("bdln,bnl->bdl", states, C)  # (B, D, L)

    if D is not None:
        y = y + D.to(compute)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(compute))
    return y.to(out_dtype)
