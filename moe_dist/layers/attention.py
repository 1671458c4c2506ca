"""Causal multi-head attention with grouped-query heads and RoPE.

The attention kernel is chosen once, in `attention_kernel` (resolved by `moe_dist.layers.impl`): PyTorch SDPA
(which never materializes repeated k/v for grouped-query heads) or the Triton flash-attention kernel
(`moe_dist.kernels.flash_attention`), which "auto" takes for CUDA tensors.
"""

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.config import AttentionConfig
from moe_dist.layers.impl import resolve
from moe_dist.layers.rope import apply_rope, rope_cos_sin

AttnFn = Callable[..., torch.Tensor]  # (q, k, v, causal=True, softmax_scale=None) -> out


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, softmax_scale: Optional[float] = None
) -> torch.Tensor:
    """q (B, Hq, S, Dh), k/v (B, Hkv, S, Dh) -> (B, Hq, S, Dh)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def attention_kernel(impl: str) -> AttnFn:
    """The attention function for `model.attention.impl`, with `flash_attention`'s signature."""
    return resolve(impl, "model.attention.impl", "flash-attention kernel", _sdpa, "flash_attention.flash_attention")


class Attention(nn.Module):
    def __init__(self, d_model: int, cfg: AttentionConfig, init_std: float, n_layers: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_dim or d_model // cfg.n_heads
        self.rope, self.rope_theta = cfg.rope, cfg.rope_theta
        self.wq = nn.Linear(d_model, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, d_model, bias=False)
        self.kernel = attention_kernel(cfg.impl)
        self.init_std = init_std
        self.out_std = init_std / math.sqrt(2 * n_layers)

    @torch.no_grad()
    def init_weights(self) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, std=self.init_std)
        nn.init.normal_(self.wo.weight, std=self.out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, Hq, S, Dh)
        k = self.wk(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        v = self.wv(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        if self.rope:
            cos, sin = rope_cos_sin(S, self.head_dim, self.rope_theta, x.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.kernel(q, k, v, causal=True)  # (B, Hq, S, Dh)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))
