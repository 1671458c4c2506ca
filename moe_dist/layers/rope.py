"""Rotary position embeddings (RoFormer), in the half-split layout used by Llama/Mixtral/Jamba checkpoints, and
YaRN's context extension of them (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
Models"), the one home of that scaling for every kind that uses it (MLA; gpt-oss's attention).

cos/sin are recomputed per forward from the sequence length rather than cached in buffers: it is
a (S, Dh) computation, and buffers would break the build-on-meta-then-materialize flow.
"""

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from moe_dist.config.errors import require


@dataclass
class RopeScaling:
    type: Literal["none", "yarn"] = "none"  # RoPE frequency scaling: none, or YaRN (transformers' rope_type "yarn")
    factor: float = 1.0  # YaRN: context extension factor (long-wavelength frequencies divided by it)
    original_max_position_embeddings: int = 4096  # YaRN: the context length the model was pretrained with
    beta_fast: float = 32.0  # YaRN: rotations over the original context above which a frequency is kept as is
    beta_slow: float = 1.0  # YaRN: rotations below which a frequency is fully interpolated (divided by factor)
    mscale: Optional[float] = None  # YaRN: numerator coefficient of cos/sin's scale 0.1·m·ln(factor)+1; null = 1
    mscale_all_dim: Optional[float] = None  # YaRN: its denominator (DeepSeek also squares it into the softmax scale)
    attention_factor: Optional[float] = None  # YaRN: cos/sin multiplier given outright; null = from the mscales
    truncate: bool = True  # YaRN: round the ramp's correction range outward to whole dims (transformers' default)


def check_rope_scaling(s: RopeScaling, key: str) -> None:
    """One-line ConfigErrors naming `key`.<field> (`key` is the section's dotted path to its RopeScaling)."""
    if s.type == "none":
        return
    require(s.factor >= 1.0, f"{key}.factor: YaRN's factor must be >= 1, got {s.factor}")
    require(
        s.original_max_position_embeddings > 0,
        f"{key}.original_max_position_embeddings: must be positive, got {s.original_max_position_embeddings}",
    )
    require(s.beta_slow > 0, f"{key}.beta_slow: must be positive, got {s.beta_slow}")
    require(s.beta_fast >= s.beta_slow, f"{key}.beta_fast: must be >= beta_slow={s.beta_slow}, got {s.beta_fast}")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 · mscale · ln(factor) + 1 (1 where the factor does not extend)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _inv_freq(head_dim: int, theta: float, device, scaling: Optional[RopeScaling]) -> tuple[torch.Tensor, float]:
    """(Dh/2,) fp32 inverse frequencies and the cos/sin multiplier. YaRN keeps the frequencies that turn more than
    beta_fast times over the original context (local order, high frequency), divides those turning fewer than
    beta_slow times by `factor` (position interpolation), and blends linearly by dim in between."""
    pos_freq = theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None or scaling.type == "none":
        return 1.0 / pos_freq, 1.0
    s = scaling

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times over the original length
        return (
            head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    span = (high - low) if high != low else 0.001  # one dim wide: a step, not a division by zero
    ramp = ((torch.arange(head_dim // 2, device=device, dtype=torch.float32) - low) / span).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate (divided by factor)
    inv_freq = (1.0 / (s.factor * pos_freq)) * (1 - keep) + (1.0 / pos_freq) * keep
    if s.attention_factor is not None:
        factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        factor = yarn_mscale(s.factor)
    return inv_freq, float(factor)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device, scaling: Optional[RopeScaling] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (S, Dh) in fp32; with YaRN `scaling`, of its frequencies and times its attention factor."""
    inv_freq, factor = _inv_freq(head_dim, theta, device, scaling)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (S, Dh/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, Dh)
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


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
