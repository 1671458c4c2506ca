"""Selective scan for training in pure PyTorch: chunked, with a log-depth parallel scan inside each chunk.

This is the PyTorch path of the scan (the CPU path; impl "torch" on any device); the GPU kernel is
`moe_dist.kernels.selective_scan`. Invariants: it equals the sequential recurrence
(`moe_dist.kernels.reference.selective_scan_ref`, tests/layers/test_scan.py); nothing of size (B, L, N, D) is saved
for backward, only the state entering each chunk; chunk-sized work tensors live in reused buffers; decays are
multiplied directly, never divided (no log-space cumsum). Why, and where the CPU time goes: docs/kernels.md, section
"The chunked PyTorch scan". `initial_state_outputs` is what an initial state adds to the outputs (context
parallelism's correction for the state entering a piece: moe_dist/layers/state_passing.py).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _scan_steps(coef: torch.Tensor, x: torch.Tensor, reverse: bool, coef_work: Optional[torch.Tensor] = None):
    """The in-place ops that scan x along dim 1: x_t ← x_t + coef_t · x_{t-1}, or x_t ← x_t + coef_t · x_{t+1}
    if `reverse`; as zero-argument calls on fixed views, so that a chunk loop slices its buffers once and
    replays the calls for every chunk (on small chunks, slicing in Python costs as much as the arithmetic).

    Blelloch scan: each element that is second (in scan order) of a pair absorbs the first, the pairs are
    scanned recursively (same direction) on a stride-2 view, then each remaining element absorbs its now-final
    predecessor. A pair's decay is the product of its two decays; those products overwrite `coef` unless
    `coef_work` (dim 1 ≥ len // 2) is given to hold them, which leaves `coef` intact for another use. The first
    element's coefficient (it has no predecessor) never reaches x. For `reverse`, pairs are formed from the
    end so that the unpaired element of an odd length is time 0.
    """
    n = x.shape[1]
    if n < 2:
        return []
    p = n % 2 if reverse else 0
    # first/second of each pair in scan order; even/prev: the elements fixed up after the recursion and theirs
    first, second = (slice(p + 1, n, 2), slice(p, n - 1, 2)) if reverse else (slice(0, n - 1, 2), slice(1, n, 2))
    even, prev = (slice(1 - p, n - 2, 2), slice(2 - p, n - 1, 2)) if reverse else (slice(2, n, 2), slice(1, n - 1, 2))
    steps = [partial(x[:, second].addcmul_, coef[:, second], x[:, first])]
    if n >= 4:  # with fewer than 2 pairs the pair decays are never used
        if coef_work is None:
            pair_coef = coef[:, second]
            steps.append(partial(pair_coef.mul_, coef[:, first]))
        else:
            pair_coef = coef_work[:, : n // 2]
            steps.append(partial(torch.mul, coef[:, second], coef[:, first], out=pair_coef))
        steps += _scan_steps(pair_coef, x[:, second], reverse)
    steps.append(partial(x[:, even].addcmul_, coef[:, even], x[:, prev]))
    return steps


def _chunk_views(buf: torch.Tensor, batch: int, n: int, state: int, dim: int) -> torch.Tensor:
    """A contiguous (batch, n, state, dim) view of the start of a flat buffer (a short last chunk included)."""
    return buf[: batch * n * state * dim].view(batch, n, state, dim)


def _chunks(T: int, *tensors: torch.Tensor) -> list:
    """Per-chunk views (split along time, dim 1) of each tensor, zipped: one split call instead of slicing.
    No chunks for an empty sequence (where split would return one empty chunk)."""
    return list(zip(*(t.split(T, 1) for t in tensors))) if tensors[0].shape[1] else []


class _SelectiveScan(torch.autograd.Function):
    """y_t = <h_t, C_t> + D u_t with h_t = a_t h_{t-1} + Δ_t u_t B_t, a_t = exp(Δ_t A), on time-major (B, L, ·)
    inputs (D optional: inside, the skip term is computed in place instead of allocating three more tensors).

    Backward: the adjoint of a linear recurrence is the same recurrence run backwards over
    g_t = dy_t C_t: λ_t = g_t + a_{t+1} λ_{t+1}. With w_t = λ_t a_t h_{t-1} (the gradient reaching ΔA):
    du = Δ Σ_n λB + D dy, dΔ = u Σ_n λB + Σ_n wA, dA = Σ_{b,t} wΔ, dB = Σ_d λΔu, dC = Σ_d h dy, dD = Σ_{b,t} u dy.
    Chunk tensors are (B, n, N, D): dim innermost, so every broadcast and every reduction over the state axis
    runs along contiguous rows of D, and reductions over dim are (1, D) @ (D, N) matrix products.
    exp(ΔA) is computed as 2^(Δ · A log2 e): torch's CPU exp2 is about 3x faster than exp, and this
    exponential is the costliest op of the scan.

    `h_init` (B, N, D) or None: the state before the first step (it enters like any h_{t-1}: decayed by a_0, so a
    document start at t = 0 drops it). Outputs y and the final state h_{L-1} (B, N, D); the final state's gradient
    seeds λ at the last step, and the initial state's gradient is a_0 λ_0 (what λ passes to h_{-1}).
    """

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, chunk_size: int, keep=None, h_init=None):
        (batch, length, dim), state = u.shape, A.shape[1]
        T = max(1, min(chunk_size, length))
        A2 = A.t() * math.log2(math.e)  # (N, D)
        du = delta * u  # (B, L, D)
        y = u.new_empty(batch, length, dim)
        h0 = u.new_zeros(max(1, -(-length // T)), batch, state, dim)  # state entering each chunk: all backward keeps
        if h_init is not None:
            h0[0].copy_(h_init)
        a_buf, h_buf = (u.new_empty(batch * T * state * dim) for _ in range(2))
        work = {}  # chunk length → buffer views and the scan's steps on them
        for n in {T, length % T or T}:
            a, h = (_chunk_views(buf, batch, n, state, dim) for buf in (a_buf, h_buf))
            work[n] = a, h, _scan_steps(a, h, reverse=False)  # a is not needed after the scan: may overwrite
        keep_t = _keep_views(keep, u)
        chunks = _chunks(
            T, delta.unsqueeze(2), du.unsqueeze(2), B.unsqueeze(-1), C.unsqueeze(2), y.unsqueeze(2), keep_t
        )
        for c, (delta_c, du_c, B_c, C_c, y_c, keep_c) in enumerate(chunks):
            a, h, scan_steps = work[delta_c.shape[1]]
            torch.mul(delta_c, A2, out=a).exp2_()
            if keep is not None:
                a.mul_(keep_c)  # a_t = 0 at a document start: h_t forgets the previous document
            torch.mul(du_c, B_c, out=h)
            h[:, 0].addcmul_(a[:, 0], h0[c])
            for step in scan_steps:
                step()
            if c + 1 < len(h0):
                h0[c + 1].copy_(h[:, -1])
            torch.matmul(C_c, h, out=y_c)
        final = h[:, -1].clone() if chunks else h0[0].clone()
        if D is not None:
            y.addcmul_(u, D)
        ctx.save_for_backward(u, delta, du, A, B, C, D, h0, keep)
        ctx.chunk_size = T
        ctx.has_init = h_init is not None
        return y, final

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, d_final):
        u, delta, du, A, B, C, D, h0, keep = ctx.saved_tensors
        (batch, length, dim), state, T = u.shape, A.shape[1], ctx.chunk_size
        A_t = A.t().contiguous()  # (N, D)
        A2 = A_t * math.log2(math.e)
        # Per chunk, besides a: buffer x holds h, then λ, then w; buffer s holds the pair decays of h's scan,
        # then a_t h_{t-1} (the part of w that needs h, so that λ can take h's place), then scratch.
        # a has one spare time slot: a_ext[:, 1:] is λ's scan coefficient a_{t+1}; the slot past the chunk is
        # that scan's first coefficient, which never reaches the result (zero, or a stale decay, is fine).
        # λ's scan overwrites its coefficients with pair decays: by then only a[:, 0], outside them, is needed.
        a_buf = u.new_zeros(batch * (T + 1) * state * dim)
        x_buf, s_buf = (u.new_empty(batch * T * state * dim) for _ in range(2))
        work = {}  # chunk length → buffer views and the two scans' steps on them
        for n in {T, length % T or T}:
            a_ext = _chunk_views(a_buf, batch, n + 1, state, dim)
            x, s = (_chunk_views(buf, batch, n, state, dim) for buf in (x_buf, s_buf))
            work[n] = a_ext[:, :n], x, s, _scan_steps(a_ext[:, :n], x, False, s), _scan_steps(a_ext[:, 1:], x, True)
        # a_{t1} λ_{t1} flowing back from the chunk after this one; past the last chunk, the final state's gradient
        lam_in = u.new_zeros(batch, state, dim) if d_final is None else d_final.clone()
        d_u, d_delta, dB, dC = (torch.empty_like(t) for t in (u, u, B, C))
        dA_t = torch.zeros_like(A_t)
        chunks = _chunks(T, u, delta, du, B, C, dy, d_u, d_delta, dB, dC, _keep_views(keep, u))
        for c, (u_c, delta_c, du_c, B_c, C_c, dy_c, d_u_c, d_delta_c, dB_c, dC_c, keep_c) in reversed(
            list(enumerate(chunks))
        ):
            a, x, s, h_steps, lam_steps = work[u_c.shape[1]]
            torch.mul(delta_c.unsqueeze(2), A2, out=a).exp2_()
            if keep is not None:  # a constant 0 at document starts: no gradient reaches Δ or A through it
                a.mul_(keep_c)
            h = torch.mul(du_c.unsqueeze(2), B_c.unsqueeze(-1), out=x)
            h[:, 0].addcmul_(a[:, 0], h0[c])
            for step in h_steps:  # recompute the forward's states
                step()
            torch.matmul(dy_c.unsqueeze(2), h.transpose(-1, -2), out=dC_c.unsqueeze(2))
            a_h_prev = s
            torch.mul(a[:, 1:], h[:, :-1], out=a_h_prev[:, 1:])
            torch.mul(a[:, 0], h0[c], out=a_h_prev[:, 0])

            lam = torch.mul(dy_c.unsqueeze(2), C_c.unsqueeze(-1), out=x)
            lam[:, -1].add_(lam_in)
            for step in lam_steps:
                step()
            torch.mul(a[:, 0], lam[:, 0], out=lam_in)
            torch.matmul(du_c.unsqueeze(2), lam.transpose(-1, -2), out=dB_c.unsqueeze(2))
            lam_B = torch.matmul(B_c.unsqueeze(2), lam).squeeze(2)  # (B, n, D)
            torch.mul(lam_B, delta_c, out=d_u_c)

            w = lam.mul_(a_h_prev)
            dA_t += torch.mul(w, delta_c.unsqueeze(2), out=s).sum((0, 1))
            torch.addcmul(w.mul_(A_t).sum(2), lam_B, u_c, out=d_delta_c)
        dD = None
        if D is not None:
            d_u.addcmul_(dy, D)
            dD = torch.mul(dy, u).sum((0, 1))
        # After chunk 0, lam_in = a_0 λ_0: the gradient of h_{-1}, the initial state (d_final itself if L = 0).
        d_init = lam_in if ctx.has_init else None
        return d_u, d_delta, dA_t.t(), dB, dC, dD, None, None, d_init


def _keep_views(keep: Optional[torch.Tensor], u: torch.Tensor) -> torch.Tensor:
    """(B, L) keep factors → (B, L, 1, 1) to broadcast over a chunk's (state, dim); without resets, a (B, L, 1, 1)
    expand of nothing (never read) so the chunk loop keeps one shape."""
    if keep is None:
        return u.new_empty(1, 1, 1, 1).expand(u.shape[0], u.shape[1], 1, 1)
    return keep[:, :, None, None]


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
    reset: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    return_final_state: bool = False,
):
    """Mamba-1 selective scan with the semantics and argument layout of `selective_scan_ref`.

    Shapes: u, delta, z: (batch, dim, seqlen); A: (dim, state); B, C: (batch, state, seqlen);
    D, delta_bias: (dim,). Returns (batch, dim, seqlen) in u's dtype; math runs in fp32 (fp64 for fp64 inputs).
    `chunk_size` is the number of timesteps per chunk; it sets the size of the (batch, chunk, state, dim)
    buffers, and with it the trade between cache misses (large chunks) and Python overhead (many chunks).
    The result does not depend on it; any seqlen works. `reset` (batch, seqlen) bool: the state is zeroed before
    the steps where it is True (document starts of packed sequences). `initial_state` (batch, dim, state) or None
    (zeros): h before the first step. With `return_final_state`, returns (y, final state (batch, dim, state) in the
    compute dtype); gradients reach both the initial state and through the final state.
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

    # Time-major (B, L, ·) copies: cheap (no state axis) and free when the caller's tensors are transposed
    # views of time-major ones, as Mamba's Δ, B, C and z are. The z gate stays time-major too (mixing layouts
    # in one elementwise op reads one side strided), and y comes back as a (B, D, L) view of time-major
    # storage, the layout Mamba's out_proj wants.
    u_t, delta_t, B_t, C_t = (t.transpose(1, 2).contiguous() for t in (u, delta, B, C))
    D = D.to(compute) if D is not None else None
    z_t = None if z is None else z.transpose(1, 2).to(compute)  # (B, L, D)
    keep = None if reset is None else (~reset).to(compute).contiguous()  # (B, L)
    h_init = None if initial_state is None else initial_state.to(compute).transpose(1, 2)  # (B, N, D)
    y, final = _SelectiveScan.apply(u_t, delta_t, A.contiguous(), B_t, C_t, D, chunk_size, keep, h_init)
    if z_t is not None:
        y = y * F.silu(z_t)
    y = y.transpose(1, 2).to(out_dtype)  # (B, D, L)
    return (y, final.transpose(1, 2)) if return_final_state else y


class _InitialStateOutputs(torch.autograd.Function):
    """y_td = Σ_n C_tn E_tnd h0_nd with E_tnd = exp(A_dn s_td), s_t = Σ_{s'≤t} Δ_{s'} (the running sum of the steps):
    what an initial state h0 adds to the scan's outputs (the scan is linear in h0). Time-major, in blocks of T
    steps with (B, T, N, D) work buffers (dim innermost, as the scan's chunks), nothing of size (B, L, N, D) saved:
    backward recomputes E. With Q = G C E h0 (G = dy): dC = Σ_d G E h0, dh0 = Σ_t G C E, ds = Σ_n Q A, dA = Σ Q s.
    """

    @staticmethod
    def forward(ctx, C, s, A, h0, block: int):
        (batch, length, dim), state = s.shape, A.shape[1]
        T = max(1, min(block, length))
        A2, h0_t = (A.t() * math.log2(math.e)).contiguous(), h0.transpose(1, 2).contiguous()  # (N, D), (B, N, D)
        y = s.new_empty(batch, length, dim)
        buf = s.new_empty(batch * T * state * dim)
        for C_c, s_c, y_c in _chunks(T, C, s, y):
            E = _chunk_views(buf, batch, C_c.shape[1], state, dim)
            torch.mul(s_c.unsqueeze(2), A2, out=E).exp2_()
            E.mul_(h0_t.unsqueeze(1))
            torch.matmul(C_c.unsqueeze(2), E, out=y_c.unsqueeze(2))
        ctx.save_for_backward(C, s, A, h0_t)
        ctx.block = T
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        C, s, A, h0_t = ctx.saved_tensors
        (batch, _, dim), state, T = s.shape, A.shape[1], ctx.block
        A_t = A.t().contiguous()
        A2 = A_t * math.log2(math.e)
        dC, ds = torch.empty_like(C), torch.empty_like(s)
        dA_t, dh0_t = torch.zeros_like(A_t), torch.zeros_like(h0_t)
        bufs = [s.new_empty(batch * T * state * dim) for _ in range(2)]
        for C_c, s_c, dy_c, dC_c, ds_c in _chunks(T, C, s, dy.contiguous(), dC, ds):
            R, Q = (_chunk_views(b, batch, C_c.shape[1], state, dim) for b in bufs)
            torch.mul(s_c.unsqueeze(2), A2, out=R).exp2_()
            R.mul_(dy_c.unsqueeze(2))  # G E
            torch.mul(R, C_c.unsqueeze(-1), out=Q)  # G C E
            dh0_t += Q.sum(1)
            torch.sum(R.mul_(h0_t.unsqueeze(1)), -1, out=dC_c)  # Σ_d G E h0
            Q.mul_(h0_t.unsqueeze(1))  # Q = G C E h0 = dL/d(A s)
            dA_t += torch.mul(Q, s_c.unsqueeze(2), out=R).sum((0, 1))
            torch.sum(Q.mul_(A_t), 2, out=ds_c)
        return dC, ds, dA_t.t(), dh0_t.transpose(1, 2), None


def initial_state_outputs(
    C: torch.Tensor, delta_sum: torch.Tensor, A: torch.Tensor, h0: torch.Tensor, block: int = 16
) -> torch.Tensor:
    """What an initial state h0 (B, D, N) adds to the selective scan's outputs (before D, the z gate and any
    document start): y_td = Σ_n C_tn exp(A_dn Σ_{s≤t} Δ_sd) h0_dn, (B, L, D), from time-major C (B, L, N) and the
    running sums of the steps Δ (B, L, D). Context parallelism's correction for the state entering a piece;
    computed in the dtype of `delta_sum` (fp32 at least)."""
    compute = delta_sum.dtype
    return _InitialStateOutputs.apply(
        C.to(compute).contiguous(), delta_sum.contiguous(), A.to(compute).contiguous(), h0.to(compute), block
    )
