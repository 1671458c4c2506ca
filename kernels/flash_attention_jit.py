"""The Triton kernels of flash attention (flash_attention.py launches them and holds the autograd Function).

`_keep` is the one mask predicate (causal, document, prefix-LM); the tile spans bound each program's loop to the
tiles that mask can keep. Queries may be a slice of the sequence (context parallelism): query row r sits at global
position q_offset + r, key column j at position j (seqlen_q queries, seqlen_k keys); the document tensors DOC, PFX,
START, END are (B, doc_len) over global positions, doc_len ≥ both ends. Without a slice, q_offset = 0 and
seqlen_q = seqlen_k = doc_len. Forward: one program per (query tile, batch·head), an online softmax in base 2 that
saves the log-sum-exp per row. Backward: a preprocess kernel (delta = rowsum(dO · O)), one program per key tile
for dK and dV (summed over the query heads sharing a kv head, so no atomics), one per query tile for dQ.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _keep(
    DOC, PFX, b, rows, cols, q_end, seqlen_k, doc_len, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
    PREFIX: tl.constexpr,
):  # fmt: skip
    """(len(rows), len(cols)) mask of the keys each query sees, rows and cols in global positions: in range (rows
    below q_end, cols below seqlen_k); with DOCS, same document; with CAUSAL, j <= i, or (PREFIX) both in the
    document's prompt. DOC/PFX are (B, doc_len) int32 document ids / prompt flags."""
    row_ok = rows < q_end
    col_ok = cols < seqlen_k
    keep = row_ok[:, None] & col_ok[None, :]
    if DOCS:
        doc_q = tl.load(DOC + b * doc_len + rows, mask=row_ok, other=-1)
        doc_k = tl.load(DOC + b * doc_len + cols, mask=col_ok, other=-2)
        keep = keep & (doc_q[:, None] == doc_k[None, :])
    if CAUSAL:
        seen = rows[:, None] >= cols[None, :]
        if PREFIX:
            pfx_q = tl.load(PFX + b * doc_len + rows, mask=row_ok, other=0)
            pfx_k = tl.load(PFX + b * doc_len + cols, mask=col_ok, other=0)
            seen = seen | ((pfx_q[:, None] != 0) & (pfx_k[None, :] != 0))
        keep = keep & seen
    return keep


@triton.jit
def _query_tile_span(
    START, END, b, pid_m, q_offset, seqlen_q, seqlen_k, doc_len, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
    PREFIX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """[lo, hi) of the keys (global positions) a query tile can see, lo a multiple of BLOCK_N: key tiles outside
    are skipped. Causal: up to the tile's last row; with documents, from the start of its first row's document
    (START, END: (B, doc_len) int32 first position / end of each token's document); a prefix can see up to its
    document's end."""
    first = q_offset + pid_m * BLOCK_M
    last = q_offset + tl.minimum(seqlen_q, pid_m * BLOCK_M + BLOCK_M) - 1
    lo = 0
    hi = seqlen_k
    if CAUSAL:
        hi = tl.minimum(last + 1, seqlen_k)
    if DOCS:
        lo = (tl.load(START + b * doc_len + first) // BLOCK_N) * BLOCK_N
        if PREFIX or not CAUSAL:
            hi = tl.minimum(tl.load(END + b * doc_len + last), seqlen_k)
    return lo, hi


@triton.jit
def _key_tile_span(
    START, END, b, start_n, q_offset, seqlen_q, seqlen_k, doc_len, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
    PREFIX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """[lo, hi) of the query rows (local: 0 .. seqlen_q) that can see a key tile, lo a multiple of BLOCK_M (see
    `_query_tile_span`); empty (hi <= lo) when none can."""
    last = tl.minimum(seqlen_k, start_n + BLOCK_N) - 1
    lo = 0  # global positions first, then made local
    hi = q_offset + seqlen_q
    if CAUSAL:
        lo = start_n
    if DOCS:
        hi = tl.minimum(tl.load(END + b * doc_len + last), hi)
        if PREFIX or not CAUSAL:
            lo = tl.load(START + b * doc_len + start_n)
    lo = (tl.maximum(lo - q_offset, 0) // BLOCK_M) * BLOCK_M
    return lo, hi - q_offset


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
    q_offset,
    seqlen_q,
    seqlen_k,
    doc_len,
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

    rows = q_offset + offs_m  # global positions
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        mask=(offs_m[:, None] < seqlen_q) & d_ok,
        other=0.0,
    )  # (BM, BD)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh

    # A finite start for the running max: a row whose first tile is fully masked stays NaN-free.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = _query_tile_span(
        START, END, b, pid_m, q_offset, seqlen_q, seqlen_k, doc_len, CAUSAL, DOCS, PREFIX, BLOCK_M, BLOCK_N
    )
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < seqlen_k) & d_ok
        k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, BD)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, BD)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BM, BN), base-2 scores
        keep = _keep(DOC, PFX, b, rows, cols, q_offset + seqlen_q, seqlen_k, doc_len, CAUSAL, DOCS, PREFIX)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    row_ok = offs_m < seqlen_q
    tl.store(
        O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
        acc.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok,
    )
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m, m_i + tl.log2(l_i), mask=row_ok)


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
    seqlen_q,
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
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :], mask=mask, other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)


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
    q_offset,
    seqlen_q,
    seqlen_k,
    doc_len,
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
    kv_mask = (offs_n[:, None] < seqlen_k) & d_ok
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
    lo, hi = _key_tile_span(
        START, END, b, start_n, q_offset, seqlen_q, seqlen_k, doc_len, CAUSAL, DOCS, PREFIX, BLOCK_M, BLOCK_N
    )
    for j in range(0, group):
        h = hk * group + j
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_base = (b * n_q_heads + h) * seqlen_q
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m < seqlen_q
            q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dos + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
            lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (BN, BM) = Sᵀ in base 2
            keep = _keep(
                DOC, PFX, b, q_offset + offs_m, offs_n, q_offset + seqlen_q, seqlen_k, doc_len, CAUSAL, DOCS, PREFIX
            )
            keep = tl.trans(keep)
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
    q_offset,
    seqlen_q,
    seqlen_k,
    doc_len,
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
    m_ok = offs_m < seqlen_q
    rows = q_offset + offs_m  # global positions
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
    lse = tl.load(LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * seqlen_q + offs_m, mask=m_ok, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = _query_tile_span(
        START, END, b, pid_m, q_offset, seqlen_q, seqlen_k, doc_len, CAUSAL, DOCS, PREFIX, BLOCK_M, BLOCK_N
    )
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n0
        kv_mask = (cols[:, None] < seqlen_k) & d_ok
        k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BM, BN)
        keep = _keep(DOC, PFX, b, rows, cols, q_offset + seqlen_q, seqlen_k, doc_len, CAUSAL, DOCS, PREFIX)
        p = tl.exp2(tl.where(keep, s - lse[:, None], float("-inf")))  # masked → exactly 0
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    tl.store(
        DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=m_ok[:, None] & d_ok,
    )
