"""The GPU kernels of the Mamba-2 SSD and the gated delta rule: fla-core's chunked Triton kernels, behind our
oracles' signatures (`ssd_scan_ref`, `gated_delta_rule_ref` in moe_dist.kernels.reference).

Why a library's kernels: fla-core (flash-linear-attention's core ops, the optional extra `fla`) is pure Python
plus Triton, installs on a CPU-only machine without touching torch, and its chunked kernels already take what our
layers need: per-document offsets (`cu_seqlens`), initial and final states, forward and backward. Writing and
tuning two chunked kernels of our own would duplicate that. Imported only when "triton" is chosen for these layers
(kernel_choice.resolve), so Triton reads TRITON_INTERPRET at the right time; tests/kernels/test_fla_ops.py checks
both, outputs and every gradient, against the oracles under the Triton interpreter.

Document masking: fla resets the state at each offset of `cu_seqlens`, which needs batch size 1, so the (B, L)
batch is flattened into one row with an offset at every row start and every document start. The number of
offsets depends on the data, and fla's chunk indexing reads them on the host (`cu_seqlens_cpu`), so the reset mask
is read from the device once per call (B·L bools); a fixed upper bound on the count would still need the real
offsets for the kernel grid. Without documents nothing is read back.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

# The largest head size (keys: dk of the delta rule, the state size N of the SSD) we let the kernels take: fla's
# state kernels hold up to four 64-wide key blocks of the state on chip.
MAX_KEY_DIM = 256


def _offsets(reset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """reset (B, L) bool → cu_seqlens on reset's device and on the host (N + 1,), and the index of each row's first
    and last segment (B,) in 0..N-1. A segment starts at every row start and every document start."""
    starts = reset.detach().to("cpu", torch.bool).clone()
    starts[:, 0] = True
    batch, seqlen = starts.shape
    cu_cpu = torch.cat([starts.flatten().nonzero().squeeze(1), torch.tensor([batch * seqlen])])
    per_row = starts.sum(1)
    last = per_row.cumsum(0) - 1
    first = last - per_row + 1
    dev = reset.device
    return cu_cpu.to(dev), cu_cpu, first.to(dev), last.to(dev)


def _run(
    fn: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: Optional[torch.Tensor],
    reset: Optional[torch.Tensor],
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(q, k, v, ...) over (B, L, H, ·) inputs, with reset (B, L) turned into segments of one flattened row and
    initial_state (B, H, K, V) given to each row's first segment (zeros when the row starts with a reset).
    Returns o (B, L, H, V) and the final state (B, H, K, V) in fp32: each row's last segment's."""
    batch, seqlen = q.shape[:2]
    if reset is None:
        h0 = None if initial_state is None else initial_state.float()
        o, state = fn(q, k, v, initial_state=h0, output_final_state=True, **kwargs)
        return o, state.float()
    cu, cu_cpu, first, last = _offsets(reset)
    n = cu_cpu.numel() - 1
    h0 = None
    if initial_state is not None:
        kept = initial_state.float() * (~reset[:, 0]).to(torch.float32)[:, None, None, None]
        h0 = kept.new_zeros(n, *kept.shape[1:]).index_copy(0, first, kept)
    flat = [t.flatten(0, 1).unsqueeze(0) for t in (q, k, v)]
    kw = {key: t.flatten(0, 1).unsqueeze(0) for key, t in kwargs.items() if isinstance(t, torch.Tensor)}
    kw.update({key: t for key, t in kwargs.items() if not isinstance(t, torch.Tensor)})
    o, state = fn(*flat, initial_state=h0, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **kw)
    return o.view(batch, seqlen, *o.shape[2:]), state.float().index_select(0, last)


def fla_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    reset: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule_ref` on fla's `chunk_gated_delta_rule`: q, k (B, L, H, dk), v (B, L, H, dv), g, beta
    (B, L, H), initial_state (B, H, dk, dv), reset (B, L). q, k, v and beta run in v's dtype (the kernel
    accumulates in fp32), g in fp32; o comes back in v's dtype, the state in fp32."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    dtype = v.dtype
    o, state = _run(
        chunk_gated_delta_rule,
        q.to(dtype),
        k.to(dtype),
        v,
        initial_state,
        reset,
        g=g.float(),
        beta=beta.to(dtype),
        scale=k.shape[-1] ** -0.5 if scale is None else scale,
    )
    return o.to(dtype), state


def fla_ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    reset: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssd_scan_ref` on fla's `chunk_simple_gla`, whose recurrence S_t = exp(g_t) S_{t-1} + k_t v_tᵀ, o_t =
    scale · S_tᵀ q_t is the SSD's with q = C, k = B (groups expanded to their heads), v = dt·x, g = dt·A and
    scale 1; the D skip is added here. Its state is (N, P) per head, ours (P, N): transposed on the way in and
    out. x (B, L, H, P) and B, C (B, L, G, N) run in x's dtype, g in fp32; y comes back in x's dtype."""
    from fla.ops.simple_gla import chunk_simple_gla

    dtype = x.dtype
    heads, groups = x.shape[2], B.shape[2]
    q, k = (t.to(dtype).repeat_interleave(heads // groups, dim=2) for t in (C, B))  # (B, L, H, N)
    v = (x.float() * dt.float()[..., None]).to(dtype)  # (B, L, H, P)
    h0 = None if initial_state is None else initial_state.transpose(-1, -2)
    y, state = _run(chunk_simple_gla, q, k, v, h0, reset, g=dt.float() * A.float(), scale=1.0)
    if D is not None:
        y = y.float() + x.float() * D.float()[:, None]
    return y.to(dtype), state.transpose(-1, -2)
