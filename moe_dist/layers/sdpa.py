"""Attention of given queries, keys and values under our masks, by PyTorch SDPA: the masks (causal, documents,
prefix-LM, sliding window) in global positions, the whole-sequence call (`sdpa`) and a context-parallel piece's
call at a query offset against the keys before it (`sdpa_offset`). Every attention mixer's PyTorch path, and the
signatures its GPU kernel takes (`moe_dist.layers.attention.attention_kernels`).
"""

from typing import Optional

import torch
import torch.nn.functional as F


def document_mask(
    document_ids: torch.Tensor, prefix: Optional[torch.Tensor] = None, window: Optional[int] = None
) -> torch.Tensor:
    """(B, S) document index (and optional (B, S) bool prefix: the prompt tokens of prefix-LM) → (B, 1, S, S) bool,
    True where query i may see key j: same document, and j <= i, or both i and j in the prefix (bidirectional
    among a document's prompt tokens, as in UniLM); with a sliding `window`, also j > i - window."""
    S = document_ids.shape[1]
    causal = window_mask(S, S, 0, window, document_ids.device)
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, S, S)
    if prefix is not None:
        causal = causal | (prefix[:, :, None] & prefix[:, None, :])
    return (same & causal)[:, None]


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    document_ids: Optional[torch.Tensor] = None,
    prefix: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """q (B, Hq, S, Dh), k/v (B, Hkv, S, Dh) -> (B, Hq, S, Dh); `document_ids` (B, S) (and `prefix` (B, S) bool)
    restrict each query to its own document (`document_mask`), a sliding `window` to its last keys, with an
    explicit mask (causal then)."""
    gqa = q.shape[1] != k.shape[1]
    if document_ids is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=gqa)
    if document_ids is None:
        mask = window_mask(q.shape[2], k.shape[2], 0, window, q.device)
    else:
        mask = document_mask(document_ids, prefix, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale, enable_gqa=gqa)


def window_mask(q_len: int, k_len: int, offset: int, window: Optional[int], device: torch.device) -> torch.Tensor:
    """(q_len, k_len) bool, True where query i (at position offset + i) may see key j: j ≤ offset + i, and
    with a window, j > offset + i - window (the last `window` positions, itself included, as in Mistral)."""
    q_pos = torch.arange(offset, offset + q_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    return allowed if window is None else allowed & (k_pos > q_pos - window)


# Scores of one query block of the CP path on SDPA stay under this many elements (64 MB in fp32), whatever S.
BLOCK_SCORES = 1 << 24


def allowed_mask(q_pos, k_pos, document_ids=None, prefix=None, window=None) -> torch.Tensor:
    """The mask in global positions of queries at `q_pos` (M,) against keys at `k_pos` (N,): (M, N) bool, or
    (B, 1, M, N) with whole-sequence `document_ids` (B, S) (and `prefix` (B, S) bool); the rule of
    `document_mask` and `window_mask`, for any subset of query and key positions."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
    if document_ids is None:
        return allowed
    if prefix is not None:
        allowed = allowed | (prefix[:, q_pos, None] & prefix[:, None, k_pos])
    return (allowed & (document_ids[:, q_pos, None] == document_ids[:, None, k_pos]))[:, None]


def sdpa_offset(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int,
    softmax_scale: Optional[float] = None,
    document_ids: Optional[torch.Tensor] = None,
    prefix: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of queries at global positions q_offset .. q_offset + M − 1 (q (B, Hq, M, Dh)) to the
    keys at positions 0 .. N − 1 (k/v (B, Hkv, N, Dh), N ≥ q_offset + M): a context-parallel piece against the
    gathered sequence. `document_ids` / `prefix` are the whole sequence's (B, ≥ N). → (B, Hq, M, Dh).

    SDPA with an explicit mask, one query block at a time: a block's mask and scores stay under BLOCK_SCORES
    elements, and each block reads only the keys its mask can let through (up to its last query without a
    prefix; from its first query's window start with a window), so no (M × N) mask ever exists."""
    B, Hq, M, _ = q.shape
    N = k.shape[2]
    gqa = Hq != k.shape[1]
    bidirectional = prefix is not None and document_ids is not None  # prompt keys can lie after the query
    block = max(1, min(M, BLOCK_SCORES // max(1, B * Hq * N)))
    out = []
    for b0 in range(0, M, block):
        first, end = q_offset + b0, q_offset + min(M, b0 + block)  # global positions [first, end)
        hi = N if bidirectional else end
        lo = 0 if bidirectional or window is None else max(0, first - window + 1)
        q_pos = torch.arange(first, end, device=q.device)
        k_pos = torch.arange(lo, hi, device=q.device)
        mask = allowed_mask(q_pos, k_pos, document_ids, prefix if bidirectional else None, window)
        out.append(
            F.scaled_dot_product_attention(
                q[:, :, b0 : b0 + block],
                k[:, :, lo:hi],
                v[:, :, lo:hi],
                attn_mask=mask,
                scale=softmax_scale,
                enable_gqa=gqa,
            )
        )
    return torch.cat(out, dim=2)
