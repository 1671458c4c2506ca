"""Rotary position embeddings (RoFormer), in the half-split layout used by Llama/Mixtral/Jamba checkpoints.

cos/sin are recomputed per forward from the sequence length rather than cached in buffers: it is
a (S, Dh) computation, and buffers would break the build-on-meta-then-materialize flow.
"""

import torch


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (S, Dh) in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (S, Dh/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, Dh)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, S, Dh) by position; computed in fp32, returned in x's dtype. cos/sin of a last dim R < Dh
    (partial rotary embedding, `rope_cos_sin(..., R, ...)`) rotate the first R dims and pass the rest through."""
    rotary = cos.shape[-1]
    xf = x.float()
    x_rot = xf[..., :rotary]
    x1, x2 = x_rot.chunk(2, dim=-1)
    out = x_rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    if rotary < x.shape[-1]:
        out = torch.cat([out, xf[..., rotary:]], dim=-1)
    return out.to(x.dtype)


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) int document index per token (equal within a document, documents contiguous) → (B, S) int64
    position of each token inside its own document: RoPE restarts at 0 at every document start."""
    idx = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return idx - torch.cummax(torch.where(starts, idx, 0), dim=1).values
