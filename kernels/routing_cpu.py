"""The MoE router's compiled CPU selections (`routing_cpu.cpp`): top-k experts per token, stable sort by expert.

`topk` has `torch.topk(probs, k, dim=-1)`'s signature and result (values differentiable, as torch's), with ties
to the lower index; `argsort_by_expert` is `torch.argsort(expert, stable=True)` for ids in [0, E). Built on first
use and cached (`cpu_build`); the PyTorch functions are their reference (tests/kernels/test_routing_cpu.py).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from moe_dist.kernels import cpu_build

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = (("route_topk", (_I64, _I64, _I64, _PTR, _PTR, ctypes.c_int)),
               ("route_sort", (_I64, _I64, _PTR, _PTR), ctypes.c_int))


def _library() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    return cpu_build.library("routing_cpu", _SIGNATURES)


def unavailable() -> Optional[str]:
    """Why the kernels cannot run in this process (no compiler, a failed build), or None; builds them on first call."""
    return _library()[1]


def topk_unsupported(probs_TE: torch.Tensor, k: int) -> Optional[str]:
    if probs_TE.device.type != "cpu" or probs_TE.dtype != torch.float32 or probs_TE.dim() != 2:
        return f"the compiled top-k takes (T, E) fp32 CPU tensors, got {tuple(probs_TE.shape)} {probs_TE.dtype} " \
               f"on {probs_TE.device}"
    if not 1 <= k <= probs_TE.shape[1]:
        return f"top-k needs 1 <= k <= E = {probs_TE.shape[1]}, got k = {k}"
    return None


def topk(probs_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest of each row, in descending order; (T, k) each. Values are gathered from
    `probs_TE` (so gradients flow to it as through torch.topk)."""
    idx_TK = torch.empty(probs_TE.shape[0], k, dtype=torch.long)
    p = probs_TE.detach().contiguous()
    _library()[0].route_topk(p.shape[0], p.shape[1], k, p.data_ptr(), idx_TK.data_ptr(), torch.get_num_threads())
    return probs_TE.gather(1, idx_TK), idx_TK


def argsort_by_expert_unsupported(expert_A: torch.Tensor, num_experts: int) -> Optional[str]:
    if expert_A.device.type != "cpu" or expert_A.dtype != torch.long or expert_A.dim() != 1:
        return f"the compiled expert sort takes (A,) int64 CPU tensors, got {tuple(expert_A.shape)} {expert_A.dtype} " \
               f"on {expert_A.device}"
    return None


def argsort_by_expert(expert_A: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The stable argsort of expert ids in [0, num_experts): a counting sort. (A,) int64."""
    e = expert_A.contiguous()
    order_A = torch.empty_like(e)
    if _library()[0].route_sort(e.shape[0], num_experts, e.data_ptr(), order_A.data_ptr()) != 0:
        raise ValueError(f"argsort_by_expert: expert ids must lie in [0, {num_experts})")
    return order_A
