"""Dense SwiGLU feed-forward block (Shazeer 2020), the FFN of non-MoE layers, and the gated activation over a
fused [gate | up] projection that the experts use."""

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.kernels import gated_silu_cpu
from moe_dist.layers.impl import IMPLS_WITH_CPU, CpuKernel, resolve


class _GatedSiLU(torch.autograd.Function):
    """silu(a) · b over the halves of one (rows, 2F) tensor [a | b]. Saves what autograd would (the input and
    silu(a)), but the backward writes both halves' gradients into one (rows, 2F) tensor, where autograd's chunk
    backward would concatenate two (a whole extra pass over the GEMM output)."""

    @staticmethod
    def forward(ctx, ab: torch.Tensor) -> torch.Tensor:
        half = ab.shape[-1] // 2
        silu_a = F.silu(ab[..., :half])
        ctx.save_for_backward(ab, silu_a)
        return silu_a * ab[..., half:]

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor) -> torch.Tensor:
        ab, silu_a = ctx.saved_tensors
        half = ab.shape[-1] // 2
        a, b = ab[..., :half], ab[..., half:]
        grad_ab = torch.empty_like(ab)
        torch.mul(grad_h, silu_a, out=grad_ab[..., half:])
        torch.ops.aten.silu_backward.grad_input(grad_h * b, a, grad_input=grad_ab[..., :half])
        return grad_ab


def gated_silu(ab: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of a fused (..., 2F) projection [gate | up] → (..., F)."""
    return _GatedSiLU.apply(ab)


def select_gated_silu(impl: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated SiLU for `model.moe.impl`: this PyTorch one, or the compiled CPU kernel
    (`moe_dist.kernels.gated_silu_cpu`, which "auto" takes for fp32 and bf16 CPU tensors). No Triton kernel: on CUDA
    it is three elementwise kernels that the GPU runs at memory speed."""
    cpu = CpuKernel(gated_silu_cpu.gated_silu, gated_silu_cpu.gated_silu_unsupported, gated_silu_cpu.unavailable)
    return resolve(impl, "model.moe.impl", "gated SiLU", gated_silu, None, cpu, IMPLS_WITH_CPU)


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
