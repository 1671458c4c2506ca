"""The experts: E SwiGLU (or squared-ReLU) experts with stacked weights, run as grouped GEMMs over expert-sorted
rows.

Shape legend as in moe.py: R routed rows sorted by expert, D d_model, F expert hidden size (2F: gate and up
fused), E experts; I and O a GEMM's input and output widths. `model.moe.backend` picks the expert computation
once ("native": torch's grouped GEMM; "megablocks": megablocks_backend.py).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.config.errors import ConfigError
from moe_dist.layers.mlp import gated_silu, relu2


def grouped_mm_unfit(
    device_type: str, has_grouped_mm: bool, dtype: torch.dtype, widths: tuple[int, ...]
) -> Optional[str]:
    """Why torch's grouped GEMM cannot take expert GEMMs in `dtype` whose input and output widths are `widths` on
    a device of `device_type` (None: it can); `has_grouped_mm` is whether this torch has F.grouped_mm. It needs
    16-byte aligned rows and a supported dtype (bf16 on CUDA; fp32/bf16/fp16 on CPU)."""
    if not has_grouped_mm:
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    dtypes = (torch.bfloat16,) if device_type == "cuda" else (torch.float32, torch.bfloat16, torch.float16)
    if dtype not in dtypes:
        name = str(dtype).removeprefix("torch.")
        return f"its {device_type} kernel takes {', '.join(str(d).removeprefix('torch.') for d in dtypes)}, not {name}"
    odd = sorted({n for n in widths if (n * dtype.itemsize) % 16})
    return f"widths {odd} are not multiples of 16 bytes" if odd else None


def _why_not_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> Optional[str]:
    if x.dtype != w.dtype or not (x.is_contiguous() and w.is_contiguous()):
        return "its inputs are not contiguous tensors of one dtype"
    return grouped_mm_unfit(x.device.type, hasattr(F, "grouped_mm"), x.dtype, (x.shape[1], w.shape[2]))


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    return _why_not_grouped_mm(x, w) is None


def grouped_mm(x_RI: torch.Tensor, w_EIO: torch.Tensor, rows_per_expert_E: torch.Tensor) -> torch.Tensor:
    """(R, I) rows sorted by expert × (E, I, O) stacked weights → (R, O): row r uses its expert's weight.
    torch's grouped GEMM (the vendor kernel on CUDA, oneDNN/BLAS on CPU) where it takes the tensors."""
    if _grouped_mm_ok(x_RI, w_EIO):
        offs_E = torch.cumsum(rows_per_expert_E, 0).to(torch.int32)
        y = F.grouped_mm(x_RI, w_EIO, offs=offs_E)
        if y.requires_grad:
            y.register_hook(lambda g: g.contiguous())  # its CPU backward rejects broadcast (stride-0) grads
        return y
    # Unaligned sizes and other dtypes: one matmul per expert over contiguous slices (no masks, no per-token work).
    # On CUDA that is a slow path (a host sync for the slices, E small GEMMs): said once per reason (Python's
    # default warning filter shows a message once per place), and at start-up where the config predicts it.
    if x_RI.is_cuda:
        why_not = _why_not_grouped_mm(x_RI, w_EIO)
        warnings.warn(f"grouped GEMM: {why_not}; the experts run one matmul per expert (slow)", stacklevel=2)
    chunks = torch.split(x_RI, rows_per_expert_E.tolist())
    return torch.cat([c @ w_EIO[e] for e, c in enumerate(chunks)]) if len(chunks) else x_RI.new_zeros(0, w_EIO.shape[2])


def native_swiglu(
    x_RD: torch.Tensor, w13_ED2F: torch.Tensor, w2_EFD: torch.Tensor, rows_per_expert_E: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts over expert-sorted rows with grouped GEMMs. (R, D) → (R, D). The gate and up projections are
    one GEMM over [w1 | w3], with the gated SiLU over its (R, 2F) output."""
    h_RF = gated_silu(grouped_mm(x_RD, w13_ED2F, rows_per_expert_E))
    return grouped_mm(h_RF, w2_EFD, rows_per_expert_E)


def native_relu2(
    x_RD: torch.Tensor, w1_EDF: torch.Tensor, w2_EFD: torch.Tensor, rows_per_expert_E: torch.Tensor
) -> torch.Tensor:
    """Squared-ReLU experts (Nemotron-H): relu(x w1)² w2 per expert over expert-sorted rows. (R, D) → (R, D)."""
    return grouped_mm(relu2(grouped_mm(x_RD, w1_EDF, rows_per_expert_E)), w2_EFD, rows_per_expert_E)


def expert_swiglu(backend: str) -> Callable[..., torch.Tensor]:
    """The expert computation of `model.moe.backend`, chosen once; "megablocks" raises a ConfigError naming the
    key where MegaBlocks cannot run (not installed, no CUDA)."""
    if backend == "native":
        return native_swiglu
    if backend == "megablocks":
        from moe_dist.layers.megablocks_backend import check_megablocks, megablocks_swiglu

        check_megablocks()
        return megablocks_swiglu
    raise ConfigError(f"model.moe.backend: expected 'native' or 'megablocks', got {backend!r}")


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights, run as grouped GEMMs over expert-sorted rows. The gate (w1) and up
    (w3) projections are stored side by side as w13 = [w1 | w3] (E, D, 2F), as Megatron's grouped MLP does, so
    that one GEMM computes both; `gate_up` names the halves where they are taken apart (checkpoints stay whole).
    With activation "relu2" the experts are relu(x w1)² w2: an up projection w1 (E, D, F) in place of w13 (a
    distinct name, so that nothing that splits w13 into halves can take it for one)."""

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ff: int,
        init_std: float,
        n_layers: int,
        backend: str = "native",
        activation: str = "swiglu",
    ):
        super().__init__()
        self.backend = backend
        self.gated = activation == "swiglu"
        if self.gated:
            self.compute = expert_swiglu(backend)
            self.w13 = nn.Parameter(torch.empty(num_experts, d_model, 2 * d_ff))  # [gate | up] (E, D, 2F)
        else:
            if backend != "native":
                raise ConfigError(f"model.moe.backend: {backend!r} runs SwiGLU experts only, not {activation!r}")
            self.compute = native_relu2
            self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))  # up (E, D, F)
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))  # down (E, F, D)
        self.init_std = init_std
        self.out_std = init_std / math.sqrt(2 * n_layers)
        self.expert_offset = 0  # global index of the first expert held here (apply_ep holds a slice)

    def slow_path(self, device_type: str, dtype: torch.dtype) -> Optional[str]:
        """Why these experts would run one matmul per expert on `device_type` in `dtype` (`grouped_mm_unfit` for
        the widths held here, a tensor-parallel shard's included); None where torch's grouped GEMM takes them or
        another backend runs them."""
        if self.backend != "native":
            return None
        up = getattr(self, self.weight_names[0])
        widths = (up.shape[1], up.shape[2], self.w2.shape[1])  # D, 2F (F for squared-ReLU), F
        return grouped_mm_unfit(device_type, hasattr(F, "grouped_mm"), dtype, widths)

    @property
    def weight_names(self) -> tuple[str, str]:
        """The stacked (E, ...) parameters: ("w13", "w2"), or ("w1", "w2") for squared-ReLU experts."""
        return ("w13", "w2") if self.gated else ("w1", "w2")

    def gate_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of w1 (gate) and w3 (up) in w13, each (E, D, F)."""
        return self.w13.chunk(2, dim=2)

    @torch.no_grad()
    def init_weights(self) -> None:
        # One generator per global expert, seeded from the global RNG: expert e gets the same values whichever
        # rank holds it, and the draws of the rest of the model do not depend on the expert-parallel layout.
        base = int(torch.randint(0, 2**62, (1,)).item())
        ins = self.gate_up() if self.gated else (self.w1,)
        for j in range(self.w2.shape[0]):
            gen = torch.Generator(device=self.w2.device).manual_seed(base + self.expert_offset + j)
            for w, std in [*((w[j], self.init_std) for w in ins), (self.w2[j], self.out_std)]:
                w.copy_(torch.randn(w.shape, generator=gen, device=w.device, dtype=w.dtype) * std)

    def forward(self, x_RD: torch.Tensor, rows_per_expert_E: torch.Tensor) -> torch.Tensor:
        w_in = self.w13 if self.gated else self.w1
        return self.compute(x_RD, w_in, self.w2, rows_per_expert_E)
