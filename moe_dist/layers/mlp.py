"""Dense feed-forward blocks, the FFN of non-MoE layers and the shared experts: SwiGLU (Shazeer 2020), or the
non-gated squared ReLU relu(x)² (So et al. 2021; Nemotron-H) under `model.ffn_activation` "relu2"; and the gated
activation over a fused [gate | up] projection that the experts use."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.layers.kind import LayerKind, TensorSplit, divides


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
    """silu(gate) · up of a fused (..., 2F) projection [gate | up] → (..., F). One implementation on every device:
    on CUDA it is a few elementwise kernels that run at memory speed, with no kernel of ours to earn a place."""
    return _GatedSiLU.apply(ab)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)², the non-gated activation of `model.ffn_activation` "relu2"."""
    return F.relu(x).square()


class SwiGLU(nn.Module):
    """The dense FFN: y = w2(silu(w1 x) * w3 x), names as Llama/Mixtral (w1 gate, w3 up, w2 down); with
    activation "relu2" y = w2(relu(w1 x)²) and no w3 (w1 is then the up projection)."""

    def __init__(self, d_model: int, d_ff: int, init_std: float, n_layers: int, activation: str = "swiglu"):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False) if activation == "swiglu" else None
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.init_std = init_std
        self.out_std = init_std / math.sqrt(2 * n_layers)  # residual-branch outputs scaled down (GPT-2)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.w1.weight, std=self.init_std)
        if self.w3 is not None:
            nn.init.normal_(self.w3.weight, std=self.init_std)
        nn.init.normal_(self.w2.weight, std=self.out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(relu2(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SharedExperts(nn.Module):
    """Shared experts (DeepSeek-MoE, Qwen2-MoE): one dense SwiGLU that every token goes through beside the routed
    experts (n shared experts of width F are one SwiGLU of width n·F), its output optionally scaled per token by
    sigmoid(gate · x) (Qwen2-MoE's shared-expert gate). Not a SwiGLU: apply_tp shards it inside the MoE layer's
    tensor-parallel region, where its partial output is summed with the routed experts' in one all-reduce.
    With activation "relu2" it is relu(w1 x)² without w3, as the dense FFN (Nemotron-H's shared expert)."""

    def __init__(
        self, d_model: int, d_ff: int, gated: bool, init_std: float, n_layers: int, activation: str = "swiglu"
    ):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False) if activation == "swiglu" else None
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.gate = nn.Linear(d_model, 1, bias=False) if gated else None
        self.init_std = init_std
        self.out_std = init_std / math.sqrt(2 * n_layers)

    @torch.no_grad()
    def init_weights(self) -> None:
        for lin, std in ((self.w1, self.init_std), (self.w3, self.init_std), (self.w2, self.out_std)):
            if lin is not None:
                nn.init.normal_(lin.weight, std=std)
        if self.gate is not None:
            nn.init.normal_(self.gate.weight, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = relu2(self.w1(x)) if self.w3 is None else F.silu(self.w1(x)) * self.w3(x)
        y = self.w2(h)
        return y if self.gate is None else y * torch.sigmoid(self.gate(x))


# ------------------------------------------------------------------------------------------ the kind


def split_ffn_tp(ffn: nn.Module, tp: TensorSplit) -> None:
    """A dense FFN (SwiGLU or relu², and the shared experts, which an MoE layer holds) split over TP by its hidden
    units: the up (and gate) projections' rows, the down projection's columns."""
    tp.shard(ffn.w1, "weight", 0)
    if ffn.w3 is not None:
        tp.shard(ffn.w3, "weight", 0)
    tp.shard(ffn.w2, "weight", 1)


def _split_tp(ffn: SwiGLU, tp: TensorSplit) -> None:
    split_ffn_tp(ffn, tp)
    tp.region(ffn)


def _activation_bytes(cfg, tp: int, cp: int, a: int) -> float:
    """Per hidden unit: SwiGLU the gate and up outputs, SiLU(gate) and their product (4); relu(x)² the ReLU's output
    (its own backward and the square's) and the square, the down projection's input (2)."""
    return hidden_kept(cfg.model.ffn_activation) * (cfg.model.d_ff // tp) * a


def hidden_kept(activation: str) -> int:
    """Tensors per hidden unit autograd keeps in an FFN of `activation` (see `_activation_bytes`)."""
    return 2 if activation == "relu2" else 4


KIND = LayerKind(
    config=None,
    name="mlp",
    role="ffn",
    module=SwiGLU,
    build=lambda m, device: SwiGLU(m.d_model, m.d_ff, m.init_std, m.n_layers, m.ffn_activation),
    part="mlp",
    letter="D",
    doc="dense FFN (SwiGLU, or relu² with model.ffn_activation)",
    check_tp=lambda cfg: divides(cfg.model.d_ff, "model.d_ff", "the dense FFN hidden size", cfg.parallel.tp),
    tp_rule=_split_tp,
    compilable=True,
    activation_bytes=_activation_bytes,
)
