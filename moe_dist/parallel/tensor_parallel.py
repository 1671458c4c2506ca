"""apply_tp: Megatron-style tensor parallelism applied to an unchanged single-device model.

Every layer keeps its math; each layer kind's TP rule (its `LayerKind.tp_rule`, beside its math) receives the
`TensorSplit` seam built here, replaces weights by this rank's shard and marks each TP region with comm.py's
autograd functions, placed by hooks so parameter names stay global: `copy_to_region` (f) where a replicated
activation enters, `reduce_from_region` (g) where partial outputs leave (all-gather / reduce-scatter along the
sequence with sequence parallelism). Invariants: TP peers route MoE tokens identically (the router is replicated
inside the region); every sharded parameter carries `tp_dim` (and `tp_parts`, the dim's blocks split on their own)
and DeepSpeed's model-parallel mark, so checkpoints gather it and the gradient norm counts it once; a replicated
parameter whose gradient each rank has part of is marked `tp_sum_grad`; initial values do not depend on the layout.
The per-layer sharding table and its collectives: docs/parallelism.md, section "Tensor and sequence parallelism";
initialization: docs/memory.md, section "Initialization without a full copy"; proof: tests/parallel/test_tp_e2e.py
(every layout equals one process).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_dist.data.batches import IGNORE
from moe_dist.layers.kind import Parts, TensorSplit
from moe_dist.layers.registry import kind_of
from moe_dist.models.decoder import held_blocks
from moe_dist.parallel import private_api
from moe_dist.parallel.comm import (
    all_gather_list,
    all_reduce_max,
    all_reduce_sum,
    copy_to_region,
    gather_sequence,
    reduce_from_region,
    scatter_sequence,
)
from moe_dist.parallel.mesh import Mesh

# ------------------------------------------------------------------------------------------ shard math


def _blocks(size: int, parts: Parts) -> list[int]:
    if isinstance(parts, int):
        return [size // parts] * parts
    if sum(parts) != size:
        raise ValueError(f"blocks {parts} do not add up to the dim's size {size}")
    return list(parts)


def shard_ranges(size: int, rank: int, tp: int, parts: Parts = 1) -> list[tuple[int, int]]:
    """The [start, stop) ranges of a full dim of `size` that rank `rank`'s shard holds, in order: the rank's
    1/tp of each block (`parts`: n equal blocks, or the blocks' sizes, e.g. Mamba-2's in_proj rows z, x, B, C, dt)."""
    out, start = [], 0
    for n in _blocks(size, parts):
        piece = n // tp
        out.append((start + rank * piece, start + (rank + 1) * piece))
        start += n
    return out


def shard(full: torch.Tensor, dim: int, rank: int, tp: int, parts: Parts = 1) -> torch.Tensor:
    """Rank `rank`'s slice along `dim` (a new tensor); with `parts` the dim holds blocks, each split alone."""
    return torch.cat([full.narrow(dim, a, b - a) for a, b in shard_ranges(full.shape[dim], rank, tp, parts)], dim)


def unshard(shards: list[torch.Tensor], dim: int, parts: Parts = 1) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's slice, in rank order."""
    tp = len(shards)
    sizes = [n // tp for n in _blocks(shards[0].shape[dim] * tp, parts)]
    per_rank = [s.split(sizes, dim) for s in shards]
    return torch.cat([per_rank[r][b] for b in range(len(sizes)) for r in range(tp)], dim)


def gather_shards(t: torch.Tensor, group: dist.ProcessGroup, dim: int, parts: Parts = 1) -> torch.Tensor:
    """Collective over the TP group: the full tensor from each rank's slice (not differentiable)."""
    return unshard(all_gather_list(t, group), dim, parts)


def _shard_param(module: nn.Module, name: str, dim: int, mesh: Mesh, parts: Parts = 1) -> None:
    """Replace module.<name> by this rank's slice, keeping the parameter's marks (apply_ep's expert group)."""
    full = getattr(module, name)
    p = nn.Parameter(shard(full.detach(), dim, mesh.tp_rank, mesh.tp, parts).clone(), requires_grad=full.requires_grad)
    p.__dict__.update(vars(full))
    p.tp_dim, p.tp_parts = dim, parts
    private_api.mark_model_parallel(p)
    setattr(module, name, p)


@dataclasses.dataclass(frozen=True)
class _Boundaries:
    """How activations enter (f) and leave (g) a TP region: all-reduces, or sequence all-gather/reduce-scatter."""

    group: dist.ProcessGroup
    sequence_parallel: bool

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return gather_sequence(x, 1, self.group) if self.sequence_parallel else copy_to_region(x, self.group)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_sequence(x, 1, self.group) if self.sequence_parallel else reduce_from_region(x, self.group)


def _region(module: nn.Module, b: _Boundaries) -> None:
    """The module's first input (batch, seq, d_model) enters the region and its output leaves it (an MoE layer's
    output is (tensor, routing stats))."""
    module.register_forward_pre_hook(lambda m, args: (b.enter(args[0]), *args[1:]))

    def leave(m, args, out):
        return (b.leave(out[0]), *out[1:]) if isinstance(out, tuple) else b.leave(out)

    module.register_forward_hook(leave)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


# ------------------------------------------------------------------------------------------ the layers' seam


class _Split:
    """layers/kind.py's `TensorSplit` over this mesh's TP group: what each kind's TP rule receives."""

    def __init__(self, mesh: Mesh, boundaries: _Boundaries):
        self.mesh, self.boundaries = mesh, boundaries
        self.tp, self.rank, self.experts_split = mesh.tp, mesh.tp_rank, mesh.experts_split

    def shard(self, module: nn.Module, name: str, dim: int, parts: Parts = 1) -> None:
        _shard_param(module, name, dim, self.mesh, parts)

    def region(self, module: nn.Module) -> None:
        _region(module, self.boundaries)

    def sum_grad(self, param: nn.Parameter) -> None:
        _sum_grad_over_tp(param)

    def model_parallel(self, param: nn.Parameter) -> None:
        private_api.mark_model_parallel(param)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_region(x, self.mesh.tp_group)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_region(x, self.mesh.tp_group)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return gather_sequence(x, dim, self.mesh.tp_group)

    def scale_grad(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return _ScaleGrad.apply(x, factor)


class VocabParallelEmbedding(nn.Module):
    """Rows [tp_rank·V/tp, (tp_rank+1)·V/tp) of the embedding; other ids give zeros here, summed over TP."""

    def __init__(self, weight: nn.Parameter, start: int, boundaries: _Boundaries):
        super().__init__()
        self.weight, self.start, self.boundaries = weight, start, boundaries

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.boundaries.leave(out.masked_fill(outside[..., None], 0.0))


def _vocabulary(model: nn.Module, mesh: Mesh, b: _Boundaries) -> None:
    """The embedding and the head, where the model holds them (a pipeline part holds them on its first and last
    stages only)."""
    if model.embed is not None:
        _shard_param(model.embed, "weight", 0, mesh)
        rows = model.embed.weight.shape[0]
        model.embed = VocabParallelEmbedding(model.embed.weight, mesh.tp_rank * rows, b)
    if model.head is not None:
        _shard_param(model.head, "weight", 0, mesh)
    if model.norm is not None:  # its output feeds only the LM head (tied or not): enter the region there
        model.norm.register_forward_hook(lambda m, args, out: b.enter(out))


def _sum_grad_over_tp(p: nn.Parameter) -> None:
    """Mark a parameter replicated over TP whose gradient each rank only has part of (a norm weight shared by heads
    split over TP; with sequence parallelism, a norm outside the regions, which sees only this rank's tokens): its
    gradient is summed over TP by `register_grad_sums`, once the parameter is allocated."""
    p.tp_sum_grad = True


def register_grad_sums(model: nn.Module, mesh: Mesh) -> None:
    """Sum the gradient of every marked parameter over TP, on allocated parameters: a tensor hook belongs to the
    Parameter object, which allocating a meta parameter replaces (the mark, a Python attribute, is carried over).
    A tensor hook runs before the gradient is accumulated, so DeepSpeed sees the sum."""
    for p in model.parameters():
        if getattr(p, "tp_sum_grad", False):
            p.register_hook(lambda g: all_reduce_sum(g.contiguous().clone(), mesh.tp_group))


def split_sublayer(sublayer: nn.Module, split: TensorSplit) -> None:
    """Shard one mixer or FFN by its kind's TP rule (`LayerKind.tp_rule`)."""
    kind = kind_of(sublayer)
    if kind is None or kind.tp_rule is None:  # the config checks refuse tp > 1 for such a kind
        raise ValueError(f"apply_tp: {type(sublayer).__name__} has no tensor-parallel rule")
    kind.tp_rule(sublayer, split)


def tensor_split(mesh: Mesh, sequence_parallel: bool = False) -> TensorSplit:
    """The TP seam the layer kinds' rules receive, over `mesh`'s TP group."""
    return _Split(mesh, _Boundaries(mesh.tp_group, sequence_parallel))


def apply_tp(model: nn.Module, mesh: Mesh, sequence_parallel: bool = False) -> nn.Module:
    """Shard a materialized model over the TP group (after apply_ep, which shards experts over EP)."""
    if mesh.tp == 1:
        return model
    b = _Boundaries(mesh.tp_group, sequence_parallel)
    _vocabulary(model, mesh, b)
    split = _Split(mesh, b)
    blocks = held_blocks(model)
    for sublayer in (s for blk in blocks for s in (blk.mixer, blk.ffn) if s is not None):
        split_sublayer(sublayer, split)
    if sequence_parallel:  # the norms outside the regions see only this rank's tokens
        for norm in [model.norm, *(n for blk in blocks for n in (blk.mixer_norm, blk.ffn_norm) if n is not None)]:
            for p in norm.parameters() if norm is not None else ():
                _sum_grad_over_tp(p)
    if not next(model.parameters()).is_meta:  # on meta: parallelize registers them once allocated
        register_grad_sums(model, mesh)
    return model


# ------------------------------------------------------------------------------------------ loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logit shards (N, V/tp) in fp32; only (N,) vectors cross ranks."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, group: dist.ProcessGroup):
        n, v = logits.shape
        top = all_reduce_max(logits.max(dim=-1).values, group)
        shifted = logits - top[:, None]
        exp = shifted.exp()
        sum_exp = all_reduce_sum(exp.sum(dim=-1), group)
        local = targets - start
        inside = (local >= 0) & (local < v)
        local = local.clamp(0, v - 1)
        target_logit = all_reduce_sum(shifted.gather(1, local[:, None]).squeeze(1) * inside, group)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local, inside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(g.shape[0], device=g.device), local] -= inside.to(g.dtype)
        return g * grad[:, None], None, None, None


def vocab_parallel_lm_loss(
    logits: torch.Tensor, targets: torch.Tensor, mesh: Mesh, n_targets: float | None = None
) -> torch.Tensor:
    """`lm_loss` for vocabulary-sharded logits (B, S, V/tp): mean next-token cross-entropy, replicated on TP
    (`n_targets`: the divisor instead of the count of targets, as `lm_loss`'s)."""
    start = mesh.tp_rank * logits.shape[-1]
    per_token = _VocabParallelCrossEntropy.apply(logits.float().flatten(0, 1), targets.flatten(), start, mesh.tp_group)
    valid = targets.flatten() != IGNORE  # no loss at these positions (lm_loss's rule)
    return (per_token * valid).sum() / (n_targets if n_targets is not None else valid.sum().clamp(min=1))
