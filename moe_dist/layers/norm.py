"""RMSNorm (Zhang & Sennrich, 2019), the normalization used throughout the decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in fp32 (at least) and cast back to the input dtype.

    The fp32 upcast matters under bf16: the mean of squares loses most of its precision otherwise.
    `zero_centered` (Qwen3-Next's norms): the stored weight is an offset from one, the scale is 1 + weight, and it
    initializes to zeros (so weight decay pulls the scale towards one, not zero).
    """

    def __init__(self, dim: int, eps: float = 1e-5, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        scale = self.weight.to(compute)
        if self.zero_centered:
            scale = 1.0 + scale
        y = F.rms_norm(x.to(compute), self.weight.shape, scale, self.eps)
        return y.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm gated by silu(gate), as mamba_ssm's `RMSNormGated`: with `gate_first` (Mamba-2's
    norm_before_gate=False, as transformers' Mamba2, NemotronH and GraniteMoeHybrid) x · silu(gate) is normalised;
    without (Qwen3-Next's RMSNormGated, fla's FusedRMSNormGated) x is normalised, then gated. The mean square is
    taken over each of `groups` equal slices of the last dim (Mamba-2's n_groups; 1: the whole last dim, which is
    one head for Gated DeltaNet); the scale `weight` covers the whole last dim. fp32 (at least) inside, cast back
    to x's dtype once at the end.
    """

    def __init__(self, dim: int, eps: float, gate_first: bool, groups: int = 1):
        super().__init__()
        self.eps, self.gate_first, self.groups = eps, gate_first, groups
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate (..., dim) → (..., dim) in x's dtype."""
        compute = torch.promote_types(x.dtype, torch.float32)
        h, g = x.to(compute), F.silu(gate.to(compute))
        if self.gate_first:
            h = h * g
        h = h.unflatten(-1, (self.groups, -1))  # (..., G, dim / G)
        h = (h * torch.rsqrt(self._mean_square(h) + self.eps)).flatten(-2) * self.weight.to(compute)
        if not self.gate_first:
            h = h * g
        return h.to(x.dtype)

    def _mean_square(self, h: torch.Tensor) -> torch.Tensor:
        """Each group's mean square (..., G, 1): the statistics apply_tp sums over ranks when a group spans them."""
        return h.pow(2).mean(-1, keepdim=True)
