"""Plain-PyTorch reference versions of every kernel in `moe_dist.kernels`.

Each function here is the readable specification of a kernel, the oracle its tests compare against and the
path a CPU machine can always run. They favour clarity over speed (e.g. per-timestep loops) and must never
import triton. Computation happens in at least fp32; results come back in the input's dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def flash_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    document_ids: Optional[torch.Tensor] = None,
    prefix: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Softmax attention with grouped-query heads, written with an explicit (seq, seq) score matrix.

    Shapes: q (batch, q_heads, seq, head_dim); k, v (batch, kv_heads, seq, head_dim) with q_heads a multiple of
    kv_heads: query head h reads kv head h // (q_heads // kv_heads). Scores are scaled by `softmax_scale`
    (default 1/sqrt(head_dim)); with `causal`, query i sees keys j <= i only. `document_ids` (batch, seq) int:
    query i sees only keys of its own document; `prefix` (batch, seq) bool: with `causal`, i also sees j when both
    are prompt tokens (prefix-LM). Returns (batch, q_heads, seq, head_dim) in q's dtype; math in fp32 (fp64 for
    fp64 inputs).
    """
    assert q.shape[1] % k.shape[1] == 0 and k.shape == v.shape and q.shape[2] == k.shape[2], (q.shape, k.shape)
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    k = k.to(compute).repeat_interleave(group, dim=1)  # (B, Hq, S, Dh)
    v = v.to(compute).repeat_interleave(group, dim=1)  # (B, Hq, S, Dh)
    scores = (q.to(compute) @ k.transpose(-1, -2)) * scale  # (B, Hq, S, S)
    seq = q.shape[2]
    allowed = torch.ones(1, seq, seq, dtype=torch.bool, device=q.device)  # (B or 1, S, S)
    if causal:
        allowed = allowed.tril()
        if prefix is not None:
            allowed = allowed | (prefix[:, :, None] & prefix[:, None, :])
    if document_ids is not None:
        allowed = allowed & (document_ids[:, :, None] == document_ids[:, None, :])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(dim=-1) @ v).to(q.dtype)


def permute_tokens_ref(x_TD: torch.Tensor, rows_R: torch.Tensor, top_k: int) -> torch.Tensor:
    """Gather token rows into expert-sorted order: row r is token rows_R[r] % T (top-k replication, drops absent).

    Shapes: x_TD (T, D); rows_R (R,) int64 assignment indices a = k·T + t (slot-major, each at most once,
    a < top_k·T), already sorted by expert with dropped assignments left out. Returns (R, D) in x's dtype.
    `top_k` is not needed for the gather itself; it is part of the signature because the kernel's backward uses it.
    """
    return x_TD[rows_R % x_TD.shape[0]]


def unpermute_tokens_ref(
    y_RD: torch.Tensor, rows_R: torch.Tensor, weight_A: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Weighted scatter-add of expert outputs back to their tokens: out[t] = Σ_{kept a of t} weight_A[a] · y[row(a)].

    Shapes: y_RD (R, D) rows in the order of rows_R (R,) int64 assignment indices a = k·T + t; weight_A (K·T,)
    combine weights of every assignment (dropped ones are simply absent from rows_R); num_tokens T.
    Returns (T, D) in y's dtype, accumulated in fp32 (fp64 for fp64 inputs); a token with no kept assignment is 0.
    """
    compute = torch.promote_types(y_RD.dtype, torch.float32)
    weighted_RD = y_RD.to(compute) * weight_A.to(compute)[rows_R, None]
    out_TD = weighted_RD.new_zeros(num_tokens, y_RD.shape[1]).index_add(0, rows_R % num_tokens, weighted_RD)
    return out_TD.to(y_RD.dtype)


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    reset: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    return_final_state: bool = False,
):
    """Mamba-1 selective scan, one timestep at a time (argument layout of mamba_ssm's `selective_scan_fn`).

    Shapes: u, delta, z: (batch, dim, seqlen); A: (dim, state); B, C: (batch, state, seqlen);
    D, delta_bias: (dim,). Returns y: (batch, dim, seqlen) in u's dtype.

    With Δ = softplus(delta + delta_bias) (each step optional), per channel d and state n:
        h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t,   y_t = <h_t, C_t> + D u_t,   y_t *= silu(z_t).
    `reset` (batch, seqlen) bool: where True, h_{t-1} is taken as 0 (a packed document starts at t).
    `initial_state` (batch, dim, state) or None (zeros): h_{-1} (a reset at t = 0 drops it too). With
    `return_final_state`, returns (y, h_{L-1} (batch, dim, state) in the compute dtype).
    Math runs in fp32, or fp64 when the inputs are fp64 (so tests can compare tightly).
    """
    out_dtype = u.dtype
    compute = torch.promote_types(u.dtype, torch.float32)
    u, delta, A, B, C = (t.to(compute) for t in (u, delta, A, B, C))
    if delta_bias is not None:
        delta = delta + delta_bias.to(compute)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)

    batch, dim, seqlen = u.shape
    deltaA = torch.exp(delta.unsqueeze(-1) * A[:, None, :])  # (B, D, L, N)
    deltaB_u = (delta * u).unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1)  # (B, D, L, N)

    h = u.new_zeros(batch, dim, A.shape[1]) if initial_state is None else initial_state.to(compute)  # (B, D, N)
    ys = []
    for t in range(seqlen):
        if reset is not None:
            h = h * (~reset[:, t]).to(compute)[:, None, None]
        h = deltaA[:, :, t] * h + deltaB_u[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))  # (B, D)
    y = torch.stack(ys, dim=2)  # (B, D, L)

    if D is not None:
        y = y + D.to(compute)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(compute))
    return (y.to(out_dtype), h) if return_final_state else y.to(out_dtype)


def ssd_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    reset: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 state-space duality (SSD) scan, one timestep at a time (layout of mamba_ssm's
    `mamba_chunk_scan_combined`, with Δ already positive: softplus, bias and limits are the caller's).

    Shapes: x (batch, seqlen, heads, head_dim); dt (batch, seqlen, heads); A, D (heads,); B, C (batch, seqlen,
    groups, state) with groups dividing heads: head h reads group h // (heads // groups); initial_state (batch,
    heads, head_dim, state), zeros when None. Per head h, with a scalar decay per step:
        S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t ⊗ B_t,   y_t = S_t C_t + D_h x_t.
    `reset` (batch, seqlen) bool: where True, S_{t-1} is taken as 0 (a packed document starts at t), as in
    `selective_scan_ref`; a reset at t = 0 drops the initial state too.
    Returns y (batch, seqlen, heads, head_dim) in x's dtype and the final state S_L (batch, heads, head_dim,
    state) in fp32, or fp64 when the inputs are fp64 (math runs in that dtype, so tests can compare tightly).
    """
    batch, seqlen, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    assert heads % groups == 0 and dt.shape == (batch, seqlen, heads), (x.shape, dt.shape, B.shape)
    compute = torch.promote_types(x.dtype, torch.float32)
    x_c, dt, A = x.to(compute), dt.to(compute), A.to(compute)
    B, C = (t.to(compute).repeat_interleave(heads // groups, dim=2) for t in (B, C))  # (B, L, H, N)
    S = x_c.new_zeros(batch, heads, head_dim, state) if initial_state is None else initial_state.to(compute)
    ys = []
    for t in range(seqlen):
        if reset is not None:
            S = S * (~reset[:, t]).to(compute)[:, None, None, None]
        dA = torch.exp(dt[:, t] * A)  # (B, H)
        S = dA[:, :, None, None] * S + (dt[:, t, :, None] * x_c[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, C[:, t]))  # (B, H, P)
    y = torch.stack(ys, dim=1) if ys else x_c.new_zeros(batch, 0, heads, head_dim)  # (B, L, H, P)
    if D is not None:
        y = y + D.to(compute)[:, None] * x_c
    return y.to(x.dtype), S


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    reset: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule (Gated DeltaNet, Yang et al. 2024), one timestep at a time (fla's argument layout).

    Shapes: q, k: (batch, seqlen, heads, dk); v: (batch, seqlen, heads, dv); g (log decay, <= 0), beta:
    (batch, seqlen, heads); initial_state: (batch, heads, dk, dv). Returns o (batch, seqlen, heads, dv) in v's
    dtype and the final state (batch, heads, dk, dv) in the compute dtype.

    Per head, with the state S (dk, dv) read as o = Sᵀ q: first the decay S ← exp(g_t) S, then the delta rule
    S ← S + k_t β_t (v_t − Sᵀ k_t)ᵀ, i.e. S_t = exp(g_t)(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ;
    o_t = S_tᵀ q_t · scale, scale = dk^-0.5 by default. `reset` (batch, seqlen) bool: where True, S_{t−1} is
    taken as 0 (a packed document starts at t; the initial state too, at t = 0), as in `selective_scan_ref`.
    Math runs in fp32, or fp64 when the inputs are fp64; the state never drops below fp32.
    """
    out_dtype = v.dtype
    compute = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (t.to(compute) for t in (q, k, v, g, beta))
    batch, seqlen, heads, dk = k.shape
    q = q * (dk**-0.5 if scale is None else scale)
    S = q.new_zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state.to(compute)
    outs = []
    for t in range(seqlen):
        if reset is not None:
            S = S * (~reset[:, t]).to(compute)[:, None, None, None]
        S = torch.exp(g[:, t])[..., None, None] * S
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])  # (B, H, dv): what S predicts for k_t, missed
        S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * err)[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))  # (B, H, dv)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)  # (B, L, H, dv)
    return o.to(out_dtype), S
