"""Flash attention (Dao et al., FlashAttention-2) in Triton: causal or not, grouped-query heads, any length.

Forward: each program owns BLOCK_M query rows of one head and streams key/value tiles through an online softmax,
so no (seq, seq) matrix ever exists; it saves the log-sum-exp per row. Backward recomputes the probabilities from
that log-sum-exp in two kernels: one per key tile (dK, dV, summed over the query heads that share the kv head,
so grouped-query attention needs neither repeated k/v nor atomics) and one per query tile (dQ).
All accumulation is fp32; fp32 inputs use IEEE fp32 dots (not TF32) so they match PyTorch's fp32 path.
Scores are kept in base 2 (scale · log2(e)) so the kernels use exp2.

The plain-PyTorch specification is `moe_dist.kernels.reference.flash_attention_ref`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _keep(DOC, PFX, b, rows, cols, seqlen, CAUSAL: tl.constexpr, DOCS: tl.constexpr, PREFIX: tl.constexpr):
    """(len(rows), len(cols)) mask of the keys each query sees: in range; with DOCS, same document; with CAUSAL,
    j <= i, or (PREFIX) both in the document's prompt. DOC/PFX are (B, S) int32 document ids / prompt flags."""
    keep = (rows[:, None] < seqlen) & (cols[None, :] < seqlen)
    if DOCS:
        doc_q = tl.load(DOC + b * seqlen + rows, mask=rows < seqlen, other=-1)
        doc_k = tl.load(DOC + b * seqlen + cols, mask=cols < seqlen, other=-2)
        keep = keep & (doc_q[:, None] == doc_k[None, :])
    if CAUSAL:
        seen = rows[:, None] >= cols[None, :]
        if PREFIX:
            pfx_q = tl.load(PFX + b * seqlen + rows, mask=rows < seqlen, other=0)
            pfx_k = tl.load(PFX + b * seqlen + cols, mask=cols < seqlen, other=0)
            seen = seen | ((pfx_q[:, None] != 0) & (pfx_k[None, :] != 0))
        keep = keep & seen
    return keep


@triton.jit
def _query_tile_span(
    START, END, b, pid_m, seqlen, CAUSAL: tl.constexpr, DOCS: tl.constexpr, PREFIX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """[lo, hi) of the keys a query tile can see, lo a multiple of BLOCK_N: key tiles outside are skipped.
    Causal: up to the tile's last row; with documents, from the start of its first row's document (START, END:
    (B, S) int32 first position / end of each token's document); a prefix can see up to its document's end."""
    first = pid_m * BLOCK_M
    last = tl.minimum(seqlen, first + BLOCK_M) - 1
    lo = 0
    hi = seqlen
    if CAUSAL:
        hi = last + 1
    if DOCS:
        lo = (tl.load(START + b * seqlen + first) // BLOCK_N) * BLOCK_N
        if PREFIX or not CAUSAL:
            hi = tl.load(END + b * seqlen + last)
    return lo, hi


@triton.jit
def _key_tile_span(
    START, END, b, start_n, seqlen, CAUSAL: tl.constexpr, DOCS: tl.constexpr, PREFIX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """[lo, hi) of the queries that can see a key tile, lo a multiple of BLOCK_M (see `_query_tile_span`)."""
    last = tl.minimum(seqlen, start_n + BLOCK_N) - 1
    lo = 0
    hi = seqlen
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
    if DOCS:
        hi = tl.load(END + b * seqlen + last)
        if PREFIX or not CAUSAL:
            lo = (tl.load(START + b * seqlen + start_n) // BLOCK_M) * BLOCK_M
    return lo, hi


@triton.jit
def _attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    DOC,
    PFX,
    START,
    END,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_os,
    n_q_heads,
    group,
    seqlen,
    head_dim,
    qk_scale,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    PREFIX: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_q_heads).to(tl.int64)
    h = (pid_bh % n_q_heads).to(tl.int64)
    hk = h // group  # the kv head this query head reads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim

    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        mask=(offs_m[:, None] < seqlen) & d_ok,
        other=0.0,
    )  # (BM, BD)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh

    # A finite start for the running max: a row whose first tile is fully masked stays NaN-free.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = _query_tile_span(START, END, b, pid_m, seqlen, CAUSAL, DOCS, PREFIX, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < seqlen) & d_ok
        k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, BD)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, BD)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BM, BN), base-2 scores
        keep = _keep(DOC, PFX, b, offs_m, cols, seqlen, CAUSAL, DOCS, PREFIX)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    row_ok = offs_m < seqlen
    tl.store(
        O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
        acc.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok,
    )
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen + offs_m, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _attn_bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_os,
    stride_dob,
    stride_doh,
    stride_dos,
    n_q_heads,
    seqlen,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """delta_i = Σ_d O_id dO_id: the row term of the softmax backward, dS = P ∘ (dP - delta)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_q_heads).to(tl.int64)
    h = (pid_bh % n_q_heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen) & (offs_d[None, :] < head_dim)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :], mask=mask, other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * seqlen + offs_m, delta, mask=offs_m < seqlen)


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DOC,
    PFX,
    START,
    END,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_dob,
    stride_doh,
    stride_dos,
    stride_dkb,
    stride_dkh,
    stride_dks,
    stride_dvb,
    stride_dvh,
    stride_dvs,
    n_q_heads,
    n_kv_heads,
    group,
    seqlen,
    head_dim,
    qk_scale,
    sm_scale,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    PREFIX: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One key tile of one kv head: dV = Σ Pᵀ dO and dK = scale · Σ dSᵀ Q over every query head of its group."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    hk = (pid_bh % n_kv_heads).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    kv_mask = (offs_n[:, None] < seqlen) & d_ok
    k = tl.load(
        K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0
    )  # (BN, BD)
    v = tl.load(
        V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0
    )  # (BN, BD)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Under the causal mask, query tiles that end before this key tile see none of it (nor, with documents,
    # those after its last key's document).
    lo, hi = _key_tile_span(START, END, b, start_n, seqlen, CAUSAL, DOCS, PREFIX, BLOCK_M, BLOCK_N)
    for j in range(0, group):
        h = hk * group + j
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_base = (b * n_q_heads + h) * seqlen
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m < seqlen
            q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dos + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
            lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (BN, BM) = Sᵀ in base 2
            keep = tl.trans(_keep(DOC, PFX, b, offs_m, offs_n, seqlen, CAUSAL, DOCS, PREFIX))
            p_t = tl.exp2(tl.where(keep, s_t - lse[None, :], float("-inf")))  # (BN, BM); masked → exactly 0
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BN, BM)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    tl.store(
        DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit
def _attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    DOC,
    PFX,
    START,
    END,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_dob,
    stride_doh,
    stride_dos,
    stride_dqb,
    stride_dqh,
    stride_dqs,
    n_q_heads,
    group,
    seqlen,
    head_dim,
    qk_scale,
    sm_scale,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    PREFIX: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One query tile of one head: dQ = scale · Σ dS K over the key tiles it sees."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_q_heads).to(tl.int64)
    h = (pid_bh % n_q_heads).to(tl.int64)
    hk = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    m_ok = offs_m < seqlen
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        mask=m_ok[:, None] & d_ok,
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :],
        mask=m_ok[:, None] & d_ok,
        other=0.0,
    )
    lse = tl.load(LSE + pid_bh.to(tl.int64) * seqlen + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * seqlen + offs_m, mask=m_ok, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = _query_tile_span(START, END, b, pid_m, seqlen, CAUSAL, DOCS, PREFIX, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n0
        kv_mask = (cols[:, None] < seqlen) & d_ok
        k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BM, BN)
        keep = _keep(DOC, PFX, b, offs_m, cols, seqlen, CAUSAL, DOCS, PREFIX)
        p = tl.exp2(tl.where(keep, s - lse[:, None], float("-inf")))  # masked → exactly 0
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    tl.store(
        DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=m_ok[:, None] & d_ok,
    )


# ------------------------------------------------------------------------------------------------ launchers

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The kernel's preconditions, each a one-line ValueError naming what it got."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "flash_attention: expected 4-d (batch, heads, seq, head_dim) q, k, v, "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"flash_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} differ in batch, seq "
            "or head_dim"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"flash_attention: q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})")
    if not 16 <= q.shape[3] <= 128:
        raise ValueError(f"flash_attention: head_dim must be in 16..128, got {q.shape[3]}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"flash_attention: q, k, v must share one dtype of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v are on different devices ({q.device}, {k.device}, {v.device})")


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 dots: TF32 would be ~1e-3 off PyTorch's fp32 result. 16-bit inputs ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def _fwd_config(head_dim: int, dtype: torch.dtype) -> dict:
    if dtype == torch.float32:  # fp32 tiles take twice the shared memory
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4 if head_dim <= 64 else 8, num_stages=3)


def _bwd_config(dtype: torch.dtype) -> tuple[dict, dict]:
    """(dK/dV kernel, dQ kernel): short query tiles against long key tiles for dK/dV, the reverse for dQ."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2), dict(
            BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2
        )
    return dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=2), dict(
        BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2
    )


def _document_tensors(document_ids, prefix, q: torch.Tensor) -> tuple:
    """(DOC, PFX, START, END) int32 (B, S) for the kernels: document ids, prompt flags, and the first position
    and end of each token's document; placeholders when absent (the kernels then read none of them)."""
    if document_ids is None:
        dummy = torch.zeros(1, device=q.device, dtype=torch.int32)
        return dummy, dummy, dummy, dummy
    doc = document_ids.to(device=q.device, dtype=torch.int32).contiguous()
    idx = torch.arange(doc.shape[1], device=q.device, dtype=torch.int32).expand_as(doc)
    new = torch.ones_like(doc, dtype=torch.bool)
    new[:, 1:] = doc[:, 1:] != doc[:, :-1]
    start = torch.cummax(torch.where(new, idx, 0), dim=1).values
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    end = torch.cummin(torch.where(last, idx + 1, doc.shape[1]).flip(1), dim=1).values.flip(1)
    pfx = prefix.to(device=q.device, dtype=torch.int32).contiguous() if prefix is not None else doc
    return doc, pfx, start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def _flash_fwd(q, k, v, causal: bool, sm_scale: float, docs: tuple, has_docs: bool, prefix: bool):
    """q (B, Hq, S, Dh), k/v (B, Hkv, S, Dh) → out (B, Hq, S, Dh) and base-2 log-sum-exp (B, Hq, S) fp32;
    `docs` from `_document_tensors`."""
    batch, n_q_heads, seqlen, head_dim = q.shape
    # Laid out (B, S, Hq, Dh) in memory: the caller's transpose(1, 2).reshape(B, S, Hq·Dh) is then free.
    out = torch.empty(batch, seqlen, n_q_heads, head_dim, device=q.device, dtype=q.dtype).transpose(1, 2)
    lse = torch.empty(batch, n_q_heads, seqlen, device=q.device, dtype=torch.float32)
    cfg = _fwd_config(head_dim, q.dtype)
    grid = (triton.cdiv(seqlen, cfg["BLOCK_M"]), batch * n_q_heads)
    _attn_fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        *docs,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        n_q_heads,
        n_q_heads // k.shape[1],
        seqlen,
        head_dim,
        sm_scale * LOG2E,
        CAUSAL=causal,
        DOCS=has_docs,
        PREFIX=prefix,
        PRECISION=_precision(q.dtype),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        **cfg,
    )
    return out, lse


def _flash_bwd(do, q, k, v, out, lse, causal: bool, sm_scale: float, docs: tuple, has_docs: bool, prefix: bool):
    """Gradients (dq, dk, dv) in the input dtypes, recomputing probabilities from the saved log-sum-exp."""
    batch, n_q_heads, seqlen, head_dim = q.shape
    n_kv_heads = k.shape[1]
    group = n_q_heads // n_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    precision = _precision(q.dtype)

    delta = torch.empty_like(lse)
    pre_block = 64
    _attn_bwd_preprocess_kernel[(triton.cdiv(seqlen, pre_block), batch * n_q_heads)](
        out,
        do,
        delta,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        n_q_heads,
        seqlen,
        head_dim,
        BLOCK_M=pre_block,
        BLOCK_D=block_d,
    )

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    kv_cfg, q_cfg = _bwd_config(q.dtype)
    _attn_bwd_dkdv_kernel[(triton.cdiv(seqlen, kv_cfg["BLOCK_N"]), batch * n_kv_heads)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        *docs,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        dk.stride(0),
        dk.stride(1),
        dk.stride(2),
        dv.stride(0),
        dv.stride(1),
        dv.stride(2),
        n_q_heads,
        n_kv_heads,
        group,
        seqlen,
        head_dim,
        sm_scale * LOG2E,
        sm_scale,
        CAUSAL=causal,
        DOCS=has_docs,
        PREFIX=prefix,
        PRECISION=precision,
        BLOCK_D=block_d,
        **kv_cfg,
    )
    _attn_bwd_dq_kernel[(triton.cdiv(seqlen, q_cfg["BLOCK_M"]), batch * n_q_heads)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
        *docs,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        dq.stride(0),
        dq.stride(1),
        dq.stride(2),
        n_q_heads,
        group,
        seqlen,
        head_dim,
        sm_scale * LOG2E,
        sm_scale,
        CAUSAL=causal,
        DOCS=has_docs,
        PREFIX=prefix,
        PRECISION=precision,
        BLOCK_D=block_d,
        **q_cfg,
    )
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------ autograd


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, sm_scale: float, document_ids=None, prefix=None):
        q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
        docs = _document_tensors(document_ids, prefix, q)
        has_docs, has_prefix = document_ids is not None, prefix is not None
        out, lse = _flash_fwd(q, k, v, causal, sm_scale, docs, has_docs, has_prefix)
        ctx.save_for_backward(q, k, v, out, lse, *docs)
        ctx.causal, ctx.sm_scale, ctx.has_docs, ctx.has_prefix = causal, sm_scale, has_docs, has_prefix
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, *docs = ctx.saved_tensors
        dq, dk, dv = _flash_bwd(
            _unit_last_stride(do), q, k, v, out, lse, ctx.causal, ctx.sm_scale, docs, ctx.has_docs, ctx.has_prefix
        )
        return dq, dk, dv, None, None, None, None


# ------------------------------------------------------------------------------------------------ public


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    document_ids: Optional[torch.Tensor] = None,
    prefix: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Softmax attention, tiled with an online softmax; differentiable in q, k and v.

    Shapes: q (batch, q_heads, seq, head_dim); k, v (batch, kv_heads, seq, head_dim) with q_heads a multiple of
    kv_heads (query head h reads kv head h // (q_heads // kv_heads); k/v are never repeated in memory).
    head_dim 16..128 (any value; padded to a power of two inside), any seq. Dtypes: fp16, bf16 or fp32, all three
    the same; accumulation in fp32. `softmax_scale` defaults to 1/sqrt(head_dim); `causal` lets query i see keys
    j <= i. Packed documents: `document_ids` (batch, seq) int, contiguous runs per document, restrict each query to
    its own document (key tiles outside the query tile's documents are skipped); `prefix` (batch, seq) bool with
    them lets a document's prompt tokens see each other (prefix-LM). Returns (batch, q_heads, seq, head_dim) in q's
    dtype (memory laid out as (batch, seq, heads, dim)). Tensors must be CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1.
    """
    _check_inputs(q, k, v)
    if document_ids is not None and document_ids.shape != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"flash_attention: document_ids must be (batch, seq) {tuple(q.shape[::2])}, got {tuple(document_ids.shape)}"
        )
    if prefix is not None and document_ids is None:
        raise ValueError("flash_attention: prefix needs document_ids")
    sm_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.numel() == 0:  # an empty batch or sequence: nothing to launch
        return q * 0
    return _FlashAttention.apply(q, k, v, bool(causal), float(sm_scale), document_ids, prefix)
