"""Mamba-1 selective scan in Triton (argument layout of mamba_ssm's `selective_scan_fn`), forward and backward.

Each program owns BLOCK_D channels of one sequence and walks it in chunks of BLOCK_L timesteps with its SSM state on
chip; inside a chunk a `tl.associative_scan`, the carried state folded into the chunk's first b. The forward saves
only the state at each chunk start; the backward recomputes h_{t-1} from it and runs the adjoint recurrence as a
reverse scan. An initial state (context parallelism: the state a sequence piece starts from) is the state entering
chunk 0; the final state is the state the forward carries out of the last step (past the end a step is the
identity), and its gradient seeds the reverse scan the same way (λ is carried unchanged through the padding
steps, where it is then zeroed); the initial state's gradient is a_0 λ_0. Invariants: all math is fp32 whatever
the input dtype; B and C gradients add into fp32 buffers atomically, per-batch rows of dA, dD, d(delta_bias) are
summed by PyTorch. The specification is
`moe_dist.kernels.reference.selective_scan_ref` (tests/kernels/test_selective_scan.py); the walk in full:
docs/kernels.md, section "The Triton selective scan".
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _linear_combine(a1, b1, a2, b2):
    # Segment (a1, b1) followed by (a2, b2): h ↦ a2 (a1 h + b1) + b2.
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _softplus(x):
    # log(1 + e^x) as torch computes it (x itself above 20). log1p is not in every supported Triton version, so
    # Kahan's identity log1p(e) = log(w) · e / (w - 1), w = 1 + e, keeps it accurate for small e^x.
    e = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + e
    log1p_e = tl.where(w == 1.0, e, tl.log(w) * e / (w - 1.0))
    return tl.where(x > 20.0, x, log1p_e)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _load_delta(DELTA, offs, mask, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """Δ = softplus(delta + bias) as configured, fp32 (BLOCK_D, BLOCK_L); also returns the pre-softplus value."""
    x = tl.load(DELTA + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x = x + bias[:, None]
    dt = x
    if SOFTPLUS:
        dt = _softplus(x)
    return dt, x


@triton.jit
def _keep_at(KEEP, b, seqlen, t, HAS_RESET: tl.constexpr):
    """(BL,) factor of the state carried into step t: 0.0 where a packed document starts (KEEP (B, L) fp32), else
    1.0 (also outside the sequence, where the masked loads make it irrelevant)."""
    if HAS_RESET:
        return tl.load(KEEP + b * seqlen + t, mask=(t >= 0) & (t < seqlen), other=1.0)
    return tl.full(t.shape, 1.0, tl.float32)


@triton.jit
def _scan_fwd_kernel(
    U, DELTA, A, Bm, Cm, Dskip, Z, BIAS, OUT, STATES, KEEP, INIT, FINAL, dim, seqlen, dstate, n_chunks,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_RESET: tl.constexpr, HAS_INIT: tl.constexpr, SAVE_STATES: tl.constexpr, SAVE_FINAL: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    d_ok = offs_d < dim
    n_ok = offs_n < dstate
    dn_ok = d_ok[:, None] & n_ok[None, :]

    a_dn = tl.load(A + offs_d[:, None] * dstate + offs_n[None, :], mask=dn_ok, other=0.0).to(tl.float32)
    zeros_d = tl.zeros([BLOCK_D], dtype=tl.float32)  # stands in for an absent delta_bias / D
    bias = tl.load(BIAS + offs_d, mask=d_ok, other=0.0).to(tl.float32) if HAS_BIAS else zeros_d
    d_skip = tl.load(Dskip + offs_d, mask=d_ok, other=0.0).to(tl.float32) if HAS_D else zeros_d
    row_d = (b * dim + offs_d) * seqlen  # (BD,) offset of (b, d, 0) in u, delta, z, out
    row_n = (b * dstate + offs_n) * seqlen  # (BN,) offset of (b, n, 0) in B, C
    state_ptrs = STATES + ((b * dim + offs_d[:, None]) * n_chunks) * dstate + offs_n[None, :]
    first = offs_l[None, None, :] == 0
    last = offs_l[None, None, :] == BLOCK_L - 1

    dn = (b * dim + offs_d[:, None]) * dstate + offs_n[None, :]  # (BD, BN) offset of (b, d, n) in INIT, FINAL
    if HAS_INIT:
        h = tl.load(INIT + dn, mask=dn_ok, other=0.0)  # state entering the chunk
    else:
        h = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    for c in range(0, n_chunks):
        if SAVE_STATES:
            tl.store(state_ptrs + c * dstate, h, mask=dn_ok)
        t = c * BLOCK_L + offs_l
        t_ok = t < seqlen
        dl_ok = d_ok[:, None] & t_ok[None, :]
        nl_ok = n_ok[:, None] & t_ok[None, :]
        dl = row_d[:, None] + t[None, :]
        u = tl.load(U + dl, mask=dl_ok, other=0.0).to(tl.float32)  # (BD, BL)
        dt, _ = _load_delta(DELTA, dl, dl_ok, bias, HAS_BIAS, SOFTPLUS)  # (BD, BL)
        b_nl = tl.load(Bm + row_n[:, None] + t[None, :], mask=nl_ok, other=0.0).to(tl.float32)  # (BN, BL)
        c_nl = tl.load(Cm + row_n[:, None] + t[None, :], mask=nl_ok, other=0.0).to(tl.float32)  # (BN, BL)

        # a step past the end is the identity (decay 1, inject 0: u and B load as 0), so the last lane holds h_{L-1}
        decay = tl.where(t_ok[None, None, :], tl.exp(dt[:, None, :] * a_dn[:, :, None]), 1.0)  # (BD, BN, BL)
        if HAS_RESET:  # a_t = 0 at a document start: the state forgets the previous document
            decay = decay * _keep_at(KEEP, b, seqlen, t, HAS_RESET)[None, None, :]
        inject = (dt * u)[:, None, :] * b_nl[None, :, :]  # (BD, BN, BL)
        inject = tl.where(first, inject + decay * h[:, :, None], inject)
        _, hs = tl.associative_scan((decay, inject), 2, _linear_combine)  # h_t for every t of the chunk
        h = tl.sum(tl.where(last, hs, 0.0), 2)

        y = tl.sum(hs * c_nl[None, :, :], 1)  # (BD, BL)
        if HAS_D:
            y += d_skip[:, None] * u
        if HAS_Z:
            z = tl.load(Z + dl, mask=dl_ok, other=0.0).to(tl.float32)
            y *= z * _sigmoid(z)
        tl.store(OUT + dl, y.to(OUT.dtype.element_ty), mask=dl_ok)
    if SAVE_FINAL:
        tl.store(FINAL + dn, h, mask=dn_ok)


@triton.jit
def _scan_bwd_kernel(
    U, DELTA, A, Bm, Cm, Dskip, Z, BIAS, STATES, DOUT, DU, DDELTA, DZ, DB, DC, DA_PART, DD_PART, DBIAS_PART, KEEP,
    DFINAL, DINIT, dim, seqlen, dstate, n_chunks, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, HAS_RESET: tl.constexpr, HAS_DFINAL: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    d_ok = offs_d < dim
    n_ok = offs_n < dstate
    dn_ok = d_ok[:, None] & n_ok[None, :]

    a_dn = tl.load(A + offs_d[:, None] * dstate + offs_n[None, :], mask=dn_ok, other=0.0).to(tl.float32)
    zeros_d = tl.zeros([BLOCK_D], dtype=tl.float32)  # stands in for an absent delta_bias / D
    bias = tl.load(BIAS + offs_d, mask=d_ok, other=0.0).to(tl.float32) if HAS_BIAS else zeros_d
    d_skip = tl.load(Dskip + offs_d, mask=d_ok, other=0.0).to(tl.float32) if HAS_D else zeros_d
    row_d = (b * dim + offs_d) * seqlen
    row_n = (b * dstate + offs_n) * seqlen
    state_ptrs = STATES + ((b * dim + offs_d[:, None]) * n_chunks) * dstate + offs_n[None, :]
    first = offs_l[None, None, :] == 0
    last = offs_l[None, None, :] == BLOCK_L - 1

    dn = (b * dim + offs_d[:, None]) * dstate + offs_n[None, :]  # (BD, BN) offset of (b, d, n) in DFINAL, DINIT
    if HAS_DFINAL:  # the final state's gradient enters λ past the last step (carried by identity steps to it)
        lam_carry = tl.load(DFINAL + dn, mask=dn_ok, other=0.0)
    else:
        lam_carry = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)  # λ at the first step of the later chunk
    da_acc = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    dd_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    dbias_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        t = c * BLOCK_L + offs_l
        t_ok = t < seqlen
        dl_ok = d_ok[:, None] & t_ok[None, :]
        nl_ok = n_ok[:, None] & t_ok[None, :]
        dl = row_d[:, None] + t[None, :]
        nl = row_n[:, None] + t[None, :]
        u = tl.load(U + dl, mask=dl_ok, other=0.0).to(tl.float32)
        dt, dt_in = _load_delta(DELTA, dl, dl_ok, bias, HAS_BIAS, SOFTPLUS)
        b_nl = tl.load(Bm + nl, mask=nl_ok, other=0.0).to(tl.float32)
        c_nl = tl.load(Cm + nl, mask=nl_ok, other=0.0).to(tl.float32)

        # h_{t-1}: scan the step-before inputs (a_{t-1}, b_{t-1}), with the chunk-start state as first element.
        tp_ok = (t >= 1) & (t <= seqlen)
        dlp_ok = d_ok[:, None] & tp_ok[None, :]
        u_p = tl.load(U + dl - 1, mask=dlp_ok, other=0.0).to(tl.float32)
        dt_p, _ = _load_delta(DELTA, dl - 1, dlp_ok, bias, HAS_BIAS, SOFTPLUS)
        b_p = tl.load(Bm + nl - 1, mask=n_ok[:, None] & tp_ok[None, :], other=0.0).to(tl.float32)
        h0 = tl.load(state_ptrs + c * dstate, mask=dn_ok, other=0.0)
        decay_p = tl.exp(dt_p[:, None, :] * a_dn[:, :, None])
        if HAS_RESET:  # every decay a_s below is masked like the forward's: a_{t-1}, a_t, a_{t+1}
            decay_p = decay_p * _keep_at(KEEP, b, seqlen, t - 1, HAS_RESET)[None, None, :]
        inject_p = tl.where(first, h0[:, :, None], (dt_p * u_p)[:, None, :] * b_p[None, :, :])
        _, h_prev = tl.associative_scan((decay_p, inject_p), 2, _linear_combine)  # (BD, BN, BL)

        decay = tl.exp(dt[:, None, :] * a_dn[:, :, None])
        if HAS_RESET:
            decay = decay * _keep_at(KEEP, b, seqlen, t, HAS_RESET)[None, None, :]
        ah = decay * h_prev  # a_t h_{t-1}
        h = ah + (dt * u)[:, None, :] * b_nl[None, :, :]
        y = tl.sum(h * c_nl[None, :, :], 1)  # before the skip and the gate
        if HAS_D:
            y += d_skip[:, None] * u
        dout = tl.load(DOUT + dl, mask=dl_ok, other=0.0).to(tl.float32)
        dy = dout
        if HAS_Z:
            z = tl.load(Z + dl, mask=dl_ok, other=0.0).to(tl.float32)
            sz = _sigmoid(z)
            dy = dout * z * sz
            dz = dout * y * sz * (1.0 + z * (1.0 - sz))  # d silu(z) / dz
            tl.store(DZ + dl, dz.to(DZ.dtype.element_ty), mask=dl_ok)

        # λ_t = dy_t C_t + a_{t+1} λ_{t+1}: a reverse scan over (a_{t+1}, dy_t C_t), λ of the later chunk folded in.
        tn_ok = (t + 1) < seqlen
        dt_n, _ = _load_delta(DELTA, dl + 1, d_ok[:, None] & tn_ok[None, :], bias, HAS_BIAS, SOFTPLUS)
        # past the last step the forward's identity steps: a = 1 carries the final state's gradient back to it
        decay_n = tl.where(tn_ok[None, None, :], tl.exp(dt_n[:, None, :] * a_dn[:, :, None]), 1.0)
        if HAS_RESET:
            decay_n = decay_n * _keep_at(KEEP, b, seqlen, t + 1, HAS_RESET)[None, None, :]
        g = dy[:, None, :] * c_nl[None, :, :]
        g = tl.where(last, g + decay_n * lam_carry[:, :, None], g)
        _, lam = tl.associative_scan((decay_n, g), 2, _linear_combine, reverse=True)  # (BD, BN, BL)
        lam = tl.where(t_ok[None, None, :], lam, 0.0)  # padding steps contribute no gradient
        lam_carry = tl.sum(tl.where(first, lam, 0.0), 2)

        lam_b = lam * b_nl[None, :, :]
        du = tl.sum(lam_b, 1) * dt
        ddt = tl.sum(lam * ah * a_dn[:, :, None], 1) + tl.sum(lam_b, 1) * u
        if HAS_D:
            du += dy * d_skip[:, None]
            dd_acc += tl.sum(dy * u, 1)
        if SOFTPLUS:
            ddt = ddt * _sigmoid(dt_in)
        ddt = tl.where(dl_ok, ddt, 0.0)
        dbias_acc += tl.sum(ddt, 1)
        da_acc += tl.sum(lam * ah * dt[:, None, :], 2)
        tl.store(DU + dl, du.to(DU.dtype.element_ty), mask=dl_ok)
        tl.store(DDELTA + dl, ddt.to(DDELTA.dtype.element_ty), mask=dl_ok)
        tl.atomic_add(DB + nl, tl.sum(lam * (dt * u)[:, None, :], 0), mask=nl_ok)
        tl.atomic_add(DC + nl, tl.sum(dy[:, None, :] * h, 0), mask=nl_ok)

    tl.store(DA_PART + ((b * dim + offs_d[:, None]) * dstate + offs_n[None, :]), da_acc, mask=dn_ok)
    if HAS_INIT:  # d h_{-1} = a_0 λ_0 (lam_carry: λ at step 0 after the last chunk walked, chunk 0)
        dt0, _ = _load_delta(DELTA, row_d[:, None], d_ok[:, None], bias, HAS_BIAS, SOFTPLUS)  # (BD, 1)
        decay0 = tl.exp(dt0 * a_dn)
        if HAS_RESET:
            decay0 = decay0 * tl.load(KEEP + b * seqlen)
        tl.store(DINIT + dn, decay0 * lam_carry, mask=dn_ok)
    if HAS_D:
        tl.store(DD_PART + b * dim + offs_d, dd_acc, mask=d_ok)
    if HAS_BIAS:
        tl.store(DBIAS_PART + b * dim + offs_d, dbias_acc, mask=d_ok)


# ------------------------------------------------------------------------------------------------ launchers

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_STATE = 256


def _check_inputs(u, delta, A, B, C, D, z, delta_bias) -> None:
    """The kernel's preconditions, each a one-line ValueError naming what it got."""
    if u.dim() != 3 or delta.shape != u.shape or (z is not None and z.shape != u.shape):
        raise ValueError(
            f"selective_scan: u, delta, z must be (batch, dim, seqlen) alike, got {tuple(u.shape)}, "
            f"{tuple(delta.shape)}"
        )
    batch, dim, seqlen = u.shape
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"selective_scan: A must be (dim={dim}, state), got {tuple(A.shape)}")
    dstate = A.shape[1]
    if B.shape != (batch, dstate, seqlen) or C.shape != (batch, dstate, seqlen):
        raise ValueError(
            f"selective_scan: B and C must be (batch, state, seqlen) = {(batch, dstate, seqlen)}, "
            f"got {tuple(B.shape)}, {tuple(C.shape)}"
        )
    if any(t is not None and t.shape != (dim,) for t in (D, delta_bias)):
        raise ValueError(f"selective_scan: D and delta_bias must be (dim={dim},)")
    if not 1 <= dstate <= _MAX_STATE:
        raise ValueError(f"selective_scan: state size must be in 1..{_MAX_STATE}, got {dstate}")
    tensors = [t for t in (u, delta, A, B, C, D, z, delta_bias) if t is not None]
    if any(t.dtype not in _DTYPES for t in tensors):
        raise ValueError(
            f"selective_scan: inputs must be fp16, bf16 or fp32, got {sorted({str(t.dtype) for t in tensors})}"
        )
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"selective_scan: inputs are on different devices {sorted({str(t.device) for t in tensors})}")


def _blocks(dim: int, dstate: int, budget: int) -> dict:
    """Tile sizes: (channels × state × time) per program bounded by `budget` elements (registers). The chunk
    length depends on the state size only, so the forward and backward cut the sequence at the same steps."""
    block_n = triton.next_power_of_2(dstate)
    block_l = max(8, min(32, 2048 // block_n))
    block_d = max(1, min(16, triton.next_power_of_2(dim), budget // (block_n * block_l)))
    return dict(BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_L=block_l)


def _flags(D, z, delta_bias, delta_softplus, keep, h_init) -> dict:
    return dict(
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus),
        HAS_RESET=keep is not None,
        HAS_INIT=h_init is not None,
    )


def _scan_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, keep, h_init, save_states: bool, final: bool):
    """Contiguous inputs (`h_init` (batch, dim, state) fp32 or None) → out (batch, dim, seqlen) in u's dtype,
    chunk-start states (or None) and the final state (batch, dim, state) fp32 (or None)."""
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    blocks = _blocks(dim, dstate, budget=4096)
    n_chunks = triton.cdiv(seqlen, blocks["BLOCK_L"])
    out = torch.empty_like(u)
    states = (
        torch.empty(batch, dim, n_chunks, dstate, device=u.device, dtype=torch.float32) if save_states else out
    )  # a placeholder pointer when not saving
    h_final = torch.empty(batch, dim, dstate, device=u.device, dtype=torch.float32) if final else None
    grid = (triton.cdiv(dim, blocks["BLOCK_D"]), batch)
    _scan_fwd_kernel[grid](
        u,
        delta,
        A,
        B,
        C,
        u if D is None else D,
        u if z is None else z,
        u if delta_bias is None else delta_bias,
        out,
        states,
        u if keep is None else keep,
        out if h_init is None else h_init,
        out if h_final is None else h_final,
        dim,
        seqlen,
        dstate,
        n_chunks,
        SAVE_STATES=save_states,
        SAVE_FINAL=final,
        **_flags(D, z, delta_bias, delta_softplus, keep, h_init),
        **blocks,
        num_warps=4,
    )
    return out, (states if save_states else None), h_final


def _scan_bwd(dout, u, delta, A, B, C, D, z, delta_bias, delta_softplus, keep, states, h_init, d_final):
    """Gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias), each in its input's dtype (None for absent inputs),
    and the initial state's (fp32; None without one). `d_final`: the final state's gradient (fp32) or None."""
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    blocks = _blocks(dim, dstate, budget=2048)
    n_chunks = states.shape[2]
    assert n_chunks == triton.cdiv(seqlen, blocks["BLOCK_L"]), "backward chunks must match the saved states"
    f32 = dict(device=u.device, dtype=torch.float32)
    du, ddelta = torch.empty_like(u), torch.empty_like(delta)
    dz = torch.empty_like(z) if z is not None else None
    dB, dC = torch.zeros(batch, dstate, seqlen, **f32), torch.zeros(batch, dstate, seqlen, **f32)
    dA_part = torch.empty(batch, dim, dstate, **f32)
    dD_part = torch.empty(batch, dim, **f32) if D is not None else None
    dbias_part = torch.empty(batch, dim, **f32) if delta_bias is not None else None
    d_init = torch.empty(batch, dim, dstate, **f32) if h_init is not None else None
    grid = (triton.cdiv(dim, blocks["BLOCK_D"]), batch)
    _scan_bwd_kernel[grid](
        u,
        delta,
        A,
        B,
        C,
        u if D is None else D,
        u if z is None else z,
        u if delta_bias is None else delta_bias,
        states,
        dout,
        du,
        ddelta,
        du if dz is None else dz,
        dB,
        dC,
        dA_part,
        dA_part if dD_part is None else dD_part,
        dA_part if dbias_part is None else dbias_part,
        u if keep is None else keep,
        dA_part if d_final is None else d_final,
        dA_part if d_init is None else d_init,
        dim,
        seqlen,
        dstate,
        n_chunks,
        HAS_DFINAL=d_final is not None,
        **_flags(D, z, delta_bias, delta_softplus, keep, h_init),
        **blocks,
        num_warps=4,
    )
    return (
        du,
        ddelta,
        dA_part.sum(0).to(A.dtype),
        dB.to(B.dtype),
        dC.to(C.dtype),
        None if D is None else dD_part.sum(0).to(D.dtype),
        dz,
        None if delta_bias is None else dbias_part.sum(0).to(delta_bias.dtype),
        d_init,
    )


# ------------------------------------------------------------------------------------------------ autograd


class _SelectiveScan(torch.autograd.Function):
    """Outputs (y, final state); the final state is computed always (one (batch, dim, state) store)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus: bool, keep, h_init):
        out, states, final = _scan_fwd(
            u, delta, A, B, C, D, z, delta_bias, delta_softplus, keep, h_init, save_states=True, final=True
        )
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, keep, states, h_init)
        ctx.delta_softplus = delta_softplus
        return out, final

    @staticmethod
    def backward(ctx, dout, d_final):
        u, delta, A, B, C, D, z, delta_bias, keep, states, h_init = ctx.saved_tensors
        d_final = None if d_final is None else d_final.float().contiguous()
        *grads, d_init = _scan_bwd(
            dout.contiguous(), u, delta, A, B, C, D, z, delta_bias, ctx.delta_softplus, keep, states, h_init, d_final
        )
        return (*grads, None, None, d_init)


# ------------------------------------------------------------------------------------------------ public


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
    reset: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    return_final_state: bool = False,
):
    """Mamba-1 selective scan (semantics of `selective_scan_ref`), differentiable in every tensor argument.

    Shapes: u, delta, z: (batch, dim, seqlen); A: (dim, state), state ≤ 256; B, C: (batch, state, seqlen);
    D, delta_bias: (dim,); reset (batch, seqlen) bool: the state is zeroed before the steps where it is True
    (document starts of packed sequences). Dtypes: fp16, bf16 or fp32 (each tensor may differ); math in fp32.
    `initial_state` (batch, dim, state) or None (zeros): h before the first step (decayed by the first step, so a
    reset there drops it). Returns (batch, dim, seqlen) in u's dtype; with `return_final_state`,
    (y, final state h_{L-1} (batch, dim, state) fp32), as the PyTorch path (moe_dist.layers.scan.selective_scan).
    Gradients come back in each input's dtype, to the initial state and through the final state too.
    Inputs that are not contiguous are copied. Tensors must be CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
    """
    _check_inputs(u, delta, A, B, C, D, z, delta_bias)
    args = [None if t is None else t.contiguous() for t in (u, delta, A, B, C, D, z, delta_bias)]
    if reset is not None and reset.shape != (u.shape[0], u.shape[2]):
        raise ValueError(
            f"selective_scan: reset must be (batch, seqlen) {(u.shape[0], u.shape[2])}, got {tuple(reset.shape)}"
        )
    keep = None if reset is None else (~reset.to(device=u.device, dtype=torch.bool)).float().contiguous()
    shape = (u.shape[0], u.shape[1], A.shape[1])
    if initial_state is not None and initial_state.shape != shape:
        raise ValueError(
            f"selective_scan: initial_state must be (batch, dim, state) {shape}, got {tuple(initial_state.shape)}"
        )
    h_init = None if initial_state is None else initial_state.to(device=u.device, dtype=torch.float32).contiguous()
    if u.numel() == 0:  # an empty batch, channel set or sequence: nothing to launch; the state passes through
        final = u.new_zeros(shape, dtype=torch.float32) if h_init is None else h_init.clone()
        return (u * 0, final) if return_final_state else u * 0
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*args, h_init)):
        out, final = _SelectiveScan.apply(*args, bool(delta_softplus), keep, h_init)
    else:
        out, _, final = _scan_fwd(
            *args, bool(delta_softplus), keep, h_init, save_states=False, final=return_final_state
        )
    return (out, final) if return_final_state else out
