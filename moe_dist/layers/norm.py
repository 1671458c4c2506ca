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
