"""Dense SwiGLU feed-forward block (Shazeer 2020), the FFN of non-MoE layers."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """y = w2(silu(w1 x) * w3 x); names follow the Llama/Mixtral convention (w1 gate, w3 up, w2 down)."""

    def __init__(self, d_model: int, d_ff: int, init_std: float, n_layers: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.init_std = init_std
        self.out_std = init_std / math.sqrt(2 * n_layers)  # residual-branch outputs scaled down (GPT-2)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.w1.weight, std=self.init_std)
        nn.init.normal_(self.w3.weight, std=self.init_std)
        nn.init.normal_(self.w2.weight, std=self.out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
