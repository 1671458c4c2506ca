"""RMSNorm (Zhang & Sennrich, 2019), the normalization used throughout the decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in fp32 (at least) and cast back to the input dtype.

    The fp32 upcast matters under bf16: the mean of squares loses most of its precision otherwise.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        y = F.rms_norm(x.to(compute), self.weight.shape, self.weight.to(compute), self.eps)
        return y.to(x.dtype)
