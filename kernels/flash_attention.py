"""Flash attention (Dao et al., FlashAttention-2) in Triton: causal or not, grouped-query heads, any length.

Forward: each program owns BLOCK_M query rows of one head and streams key/value tiles through an online softmax,
so no (seq, seq) matrix ever exists; it saves the log-sum-exp per row. Backward recomputes the probabilities from
that log-sum-exp in two kernels: one per key tile (dK, dV, summed over the query heads that share the kv head,
so grouped-query attention needs neither repeated k/v nor atomics) and one per query tile (dQ).
All accumulation is fp32; fp32 inputs use IEEE fp32 dots (not TF32) so they match PyTorch's fp32 path.
Scores are kept in base 2 (scale · log2(e)) so the kernels use exp2.

The kernels themselves are in flash_attention_jit.py; the plain-PyTorch specification is
`moe_dist.kernels.reference.flash_attention_ref`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
from moe_dist.kernels.flash_attention_jit import (
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _attn_bwd_preprocess_kernel,
    _attn_fwd_kernel,
)

LOG2E = 1.4426950408889634


# ------------------------------------------------------------------------------------------------ launchers

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The kernel's preconditions, each a one-line ValueError naming what it got."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "flash_attention: expected 4-d (batch, heads, seq, head_dim) q, k, v, "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"flash_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} differ in batch or head_dim"
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


def _seq_args(q, k, q_offset: int, docs: tuple) -> tuple[int, int, int, int]:
    """(q_offset, seqlen_q, seqlen_k, doc_len): the kernels' sequence arguments (flash_attention_jit.py)."""
    doc_len = docs[0].shape[1] if docs[0].dim() == 2 else max(q_offset + q.shape[2], k.shape[2])
    return q_offset, q.shape[2], k.shape[2], doc_len


def _flash_fwd(q, k, v, causal: bool, sm_scale: float, docs: tuple, has_docs: bool, prefix: bool, q_offset: int):
    """q (B, Hq, M, Dh) at positions q_offset .., k/v (B, Hkv, N, Dh) → out (B, Hq, M, Dh) and base-2
    log-sum-exp (B, Hq, M) fp32; `docs` from `_document_tensors`."""
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
        *_seq_args(q, k, q_offset, docs),
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


def _flash_bwd(
    do, q, k, v, out, lse, causal: bool, sm_scale: float, docs: tuple, has_docs: bool, prefix: bool, q_offset: int
):
    """Gradients (dq, dk, dv) in the input dtypes, recomputing probabilities from the saved log-sum-exp."""
    batch, n_q_heads, seqlen, head_dim = q.shape
    seq_args = _seq_args(q, k, q_offset, docs)
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
    _attn_bwd_dkdv_kernel[(triton.cdiv(k.shape[2], kv_cfg["BLOCK_N"]), batch * n_kv_heads)](
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
        *seq_args,
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
        *seq_args,
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
    def forward(ctx, q, k, v, causal: bool, sm_scale: float, document_ids=None, prefix=None, q_offset: int = 0):
        q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
        docs = _document_tensors(document_ids, prefix, q)
        has_docs, has_prefix = document_ids is not None, prefix is not None
        out, lse = _flash_fwd(q, k, v, causal, sm_scale, docs, has_docs, has_prefix, q_offset)
        ctx.save_for_backward(q, k, v, out, lse, *docs)
        ctx.causal, ctx.sm_scale, ctx.has_docs, ctx.has_prefix = causal, sm_scale, has_docs, has_prefix
        ctx.q_offset = q_offset
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, *docs = ctx.saved_tensors
        dq, dk, dv = _flash_bwd(
            _unit_last_stride(do),
            q,
            k,
            v,
            out,
            lse,
            ctx.causal,
            ctx.sm_scale,
            docs,
            ctx.has_docs,
            ctx.has_prefix,
            ctx.q_offset,
        )
        return dq, dk, dv, None, None, None, None, None


# ------------------------------------------------------------------------------------------------ public


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    document_ids: Optional[torch.Tensor] = None,
    prefix: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    q_offset: int = 0,
) -> torch.Tensor:
    """Softmax attention, tiled with an online softmax; differentiable in q, k and v.

    Shapes: q (batch, q_heads, seq, head_dim); k, v (batch, kv_heads, seq, head_dim) with q_heads a multiple of
    kv_heads (query head h reads kv head h // (q_heads // kv_heads); k/v are never repeated in memory).
    A slice of queries (context parallelism): q (batch, q_heads, M, head_dim) holds the queries at positions
    q_offset .. q_offset + M − 1 of a sequence whose keys k, v (batch, kv_heads, N, head_dim) are at positions
    0 .. N − 1; masks are in those positions, and `document_ids` / `prefix` then cover the whole sequence
    (batch, L), L ≥ max(q_offset + M, N).
    head_dim 16..128 (any value; padded to a power of two inside), any seq. Dtypes: fp16, bf16 or fp32, all three
    the same; accumulation in fp32. `softmax_scale` defaults to 1/sqrt(head_dim); `causal` lets query i see keys
    j <= i. Packed documents: `document_ids` (batch, seq) int, contiguous runs per document, restrict each query to
    its own document (key tiles outside the query tile's documents are skipped); `prefix` (batch, seq) bool with
    them lets a document's prompt tokens see each other (prefix-LM). No sliding `window` (a ValueError: the kernel
    choice never sends one here, moe_dist/layers/kernel_choice.py). Returns (batch, q_heads, seq, head_dim) in q's
    dtype (memory laid out as (batch, seq, heads, dim)). Tensors must be CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1.
    """
    _check_inputs(q, k, v)
    if window is not None:
        raise ValueError(f"flash_attention: no sliding window (got window={window}); SDPA takes one")
    if q_offset < 0:
        raise ValueError(f"flash_attention: q_offset must be >= 0, got {q_offset}")
    seq = max(q_offset + q.shape[2], k.shape[2])  # positions the masks read
    if document_ids is not None and not (
        document_ids.dim() == 2 and document_ids.shape[0] == q.shape[0] and document_ids.shape[1] >= seq
    ):
        raise ValueError(
            f"flash_attention: document_ids must be (batch, seq) {(q.shape[0], seq)} or longer, "
            f"got {tuple(document_ids.shape)}"
        )
    if prefix is not None and document_ids is not None and prefix.shape != document_ids.shape:
        raise ValueError(
            f"flash_attention: prefix {tuple(prefix.shape)} must have document_ids' shape {tuple(document_ids.shape)}"
        )
    if prefix is not None and document_ids is None:
        raise ValueError("flash_attention: prefix needs document_ids")
    sm_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.numel() == 0 or k.shape[2] == 0:  # an empty batch or sequence: nothing to launch
        return q * 0
    return _FlashAttention.apply(q, k, v, bool(causal), float(sm_scale), document_ids, prefix, int(q_offset))
