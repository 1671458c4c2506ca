"""Plain-PyTorch reference versions of every kernel in `moe_dist.kernels`.

Each function here is the readable specification of a kernel, the oracle its tests compare against and the
path a CPU machine can always run. They favour clarity over speed (e.g. per-timestep loops) and must never
import triton. Computation happens in at least fp32; results come back in the input's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


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
) -> torch.Tensor:
    """Mamba-1 selective scan, one timestep at a time (argument layout of mamba_ssm's `selective_scan_fn`).

    Shapes: u, delta, z: (batch, dim, seqlen); A: (dim, state); B, C: (batch, state, seqlen);
    D, delta_bias: (dim,). Returns y: (batch, dim, seqlen) in u's dtype.

    With Δ = softplus(delta + delta_bias) (each step optional), per channel d and state n:
        h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t,   y_t = <h_t, C_t> + D u_t,   y_t *= silu(z_t).
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

    h = u.new_zeros(batch, dim, A.shape[1])  # (B, D, N)
    ys = []
    for t in range(seqlen):
        h = deltaA[:, :, t] * h + deltaB_u[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))  # (B, D)
    y = torch.stack(ys, dim=2)  # (B, D, L)

    if D is not None:
        y = y + D.to(compute)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(compute))
    return y.to(out_dtype)
