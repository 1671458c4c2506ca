"""Gated delta rule for training in pure PyTorch: chunked, in the WY/UT form (the CPU path; impl "torch";
the GPU kernel, impl "triton", is fla-core's: moe_dist/layers/fla_ops.py).

The oracle is `moe_dist.kernels.reference.gated_delta_rule_ref` (one rank-one update per timestep). Invariants:
only the state passes from chunk to chunk (the UT systems of every chunk are solved at once); decays enter only
as e^{γ_t − γ_s} with s ≤ t, masked to −∞ before the exp, so no inf reaches a product; a document start zeroes the
state before its step, inside and across chunks; gradients are autograd's. The derivation: docs/kernels.md,
section "The chunked gated delta rule"; proof: tests/layers/test_delta_rule.py (equal to the reference, outputs,
final state and every gradient).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _masked_exp(diff: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp(diff) where `keep`, else exactly 0 (also in the gradient): the masked diffs may be huge positives."""
    return torch.exp(torch.where(keep, diff, torch.full_like(diff, float("-inf"))))


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    reset: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule with the semantics and argument layout of `gated_delta_rule_ref`.

    Shapes: q, k: (batch, seqlen, heads, dk); v: (batch, seqlen, heads, dv); g, beta: (batch, seqlen, heads);
    initial_state: (batch, heads, dk, dv); reset: (batch, seqlen) bool, True at a document start. Returns o in
    v's dtype and the final state in fp32 (fp64 for fp64 inputs) whatever the activation dtype. The result does
    not depend on `chunk_size` (the positions per chunk: the (C, C) systems against the chunk loop's length).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_gated_delta_rule: chunk_size must be positive, got {chunk_size}")
    out_dtype = v.dtype
    compute = torch.promote_types(v.dtype, torch.float32)
    batch, seqlen, heads, dk = k.shape
    dv = v.shape[-1]
    if seqlen == 0:
        state = k.new_zeros(batch, heads, dk, dv) if initial_state is None else initial_state
        return v.new_zeros(v.shape), state.to(compute)
    C = min(chunk_size, seqlen)
    n = -(-seqlen // C)
    pad = n * C - seqlen

    # Head-major (B, H, N, C, ·). Padded positions have k = 0 and g = 0: they neither write nor decay the state.
    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = t.to(compute)
        if t.dim() == 3:
            t = t.unsqueeze(-1)
        t = F.pad(t.transpose(1, 2), (0, 0, 0, pad))  # (B, H, N·C, ·)
        return t.reshape(batch, heads, n, C, t.shape[-1])

    q, k, v = chunks(q) * (dk**-0.5 if scale is None else scale), chunks(k), chunks(v)
    gamma = chunks(g).squeeze(-1).cumsum(-1)  # (B, H, N, C)
    beta = chunks(beta)  # (B, H, N, C, 1)
    if reset is None:
        seg = torch.zeros(batch, 1, n, C, dtype=torch.long, device=v.device)
    else:  # segment number inside the chunk: 0 until its first document start
        seg = F.pad(reset.long(), (0, pad)).reshape(batch, 1, n, C).cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    same = seg[..., :, None] == seg[..., None, :]  # (B, 1, N, C, C)
    decay = _masked_exp(gamma[..., :, None] - gamma[..., None, :], same & causal)  # M: (B, H, N, C, C), t ≥ s
    from_start = _masked_exp(gamma, seg == 0).unsqueeze(-1)  # e^γ where S₀ still counts: (B, H, N, C, 1)
    to_end = _masked_exp(gamma[..., -1:] - gamma, seg == seg[..., -1:]).unsqueeze(-1)  # (B, H, N, C, 1)

    A = (beta * decay * (k @ k.transpose(-1, -2))).tril(-1)  # (B, H, N, C, C), strictly lower
    I_plus_A = A + torch.eye(C, dtype=compute, device=v.device)
    rhs = torch.cat([beta * v, beta * from_start * k], dim=-1)  # (B, H, N, C, dv + dk)
    u_w = torch.linalg.solve_triangular(I_plus_A, rhs, upper=False, unitriangular=True)
    u_tilde, w = u_w.split([dv, dk], dim=-1)  # Ũ (B, H, N, C, dv), W (B, H, N, C, dk)
    qk = decay * (q @ k.transpose(-1, -2))  # (B, H, N, C, C)
    q_start = from_start * q  # (B, H, N, C, dk)
    k_end = to_end * k  # (B, H, N, C, dk)
    carry = from_start[..., -1, :, None]  # (B, H, N, 1, 1): e^{γ_C}, 0 if a document starts in the chunk

    S = q.new_zeros(batch, heads, dk, dv) if initial_state is None else initial_state.to(compute)
    outs = []
    for c in range(n):
        u = u_tilde[:, :, c] - w[:, :, c] @ S  # (B, H, C, dv)
        outs.append(q_start[:, :, c] @ S + qk[:, :, c] @ u)  # (B, H, C, dv)
        S = carry[:, :, c] * S + k_end[:, :, c].transpose(-1, -2) @ u  # (B, H, dk, dv)
    o = torch.stack(outs, dim=2).reshape(batch, heads, n * C, dv)[:, :, :seqlen]  # (B, H, L, dv)
    return o.transpose(1, 2).to(out_dtype), S
