"""apply_tp: Megatron-style tensor parallelism applied to an unchanged single-device model.

Every layer keeps its math; apply_tp replaces weights by this rank's shard and marks each TP region with comm.py's
autograd functions, placed by hooks so parameter names stay global: `copy_to_region` (f) where a replicated
activation enters, `reduce_from_region` (g) where partial outputs leave (all-gather / reduce-scatter along the
sequence with sequence parallelism). Invariants: TP peers route MoE tokens identically (the router is replicated
inside the region); every sharded parameter carries `tp_dim` (and `tp_parts` for in_proj's halves) and DeepSpeed's
model-parallel mark, so checkpoints gather it and the gradient norm counts it once; initial values do not depend on
the layout. The per-layer sharding table and its collectives: docs/parallelism.md, section "Tensor and sequence
parallelism"; initialization: docs/memory.md, section "Initialization without a full copy"; proof:
tests/parallel/test_tp_e2e.py (every layout equals one process).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_dist.data.batches import IGNORE
from moe_dist.layers.attention import Attention
from moe_dist.layers.mamba import Mamba
from moe_dist.layers.mlp import SwiGLU
from moe_dist.layers.moe import MoE
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


def shard(full: torch.Tensor, dim: int, rank: int, tp: int, parts: int = 1) -> torch.Tensor:
    """Rank `rank`'s slice along `dim`; with parts > 1 the dim holds `parts` equal blocks, each split alone."""
    blocks = full.chunk(parts, dim)
    return torch.cat([b.chunk(tp, dim)[rank] for b in blocks], dim)


def unshard(shards: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's slice, in rank order."""
    per_rank = [s.chunk(parts, dim) for s in shards]
    return torch.cat([per_rank[r][b] for b in range(parts) for r in range(len(shards))], dim)


def gather_shards(t: torch.Tensor, group: dist.ProcessGroup, dim: int, parts: int = 1) -> torch.Tensor:
    """Collective over the TP group: the full tensor from each rank's slice (not differentiable)."""
    return unshard(all_gather_list(t, group), dim, parts)


def _shard_param(module: nn.Module, name: str, dim: int, mesh: Mesh, parts: int = 1) -> None:
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


# ------------------------------------------------------------------------------------------ layers


def _attention(attn: Attention, mesh: Mesh, b: _Boundaries) -> None:
    for lin in (attn.wq, attn.wk, attn.wv):
        _shard_param(lin, "weight", 0, mesh)  # heads are contiguous blocks of rows
        if lin.bias is not None:
            _shard_param(lin, "bias", 0, mesh)
    if attn.qk_norm == "head":  # one weight shared by every head: each rank's heads give part of its gradient
        for norm in (attn.q_norm, attn.k_norm):
            _sum_grad_over_tp(norm.weight, mesh.tp_group)
    _shard_param(attn.wo, "weight", 1, mesh)
    attn.n_heads //= mesh.tp
    attn.n_kv_heads //= mesh.tp
    _region(attn, b)


def _mamba(mamba: Mamba, mesh: Mesh, b: _Boundaries) -> None:
    group = mesh.tp_group
    _shard_param(mamba.in_proj, "weight", 0, mesh, parts=2)  # rows: [x channels; z channels]
    for name in ("weight", "bias"):
        if getattr(mamba.conv1d, name) is not None:
            _shard_param(mamba.conv1d, name, 0, mesh)
    _shard_param(mamba.x_proj, "weight", 1, mesh)
    _shard_param(mamba.dt_proj, "weight", 0, mesh)
    _shard_param(mamba.dt_proj, "bias", 0, mesh)
    _shard_param(mamba, "A_log", 0, mesh)
    _shard_param(mamba, "D", 0, mesh)
    _shard_param(mamba.out_proj, "weight", 1, mesh)
    mamba.d_inner //= mesh.tp
    conv = mamba.conv1d
    conv.in_channels = conv.out_channels = conv.groups = mamba.d_inner
    _region(mamba, b)
    # x_proj sums over all channels: its partial (Δ, B, C) are all-reduced (g); every rank's channels then use
    # them, so their gradient is summed again (f) -- after Jamba's norms, whose weights need the full gradient.
    if mamba.inner_norms:
        mamba.x_proj.register_forward_hook(lambda m, args, out: reduce_from_region(out, group))
        for norm in (mamba.dt_norm, mamba.b_norm, mamba.c_norm):
            norm.register_forward_hook(lambda m, args, out: copy_to_region(out, group))
    else:
        mamba.x_proj.register_forward_hook(lambda m, args, out: copy_to_region(reduce_from_region(out, group), group))


def _swiglu(ffn: SwiGLU, mesh: Mesh, b: _Boundaries) -> None:
    _shard_param(ffn.w1, "weight", 0, mesh)
    _shard_param(ffn.w3, "weight", 0, mesh)
    _shard_param(ffn.w2, "weight", 1, mesh)
    _region(ffn, b)


def _moe(moe: MoE, mesh: Mesh, b: _Boundaries) -> None:
    experts = moe.experts
    if mesh.experts_split:
        _shard_param(experts, "w13", 2, mesh, parts=2)  # (E, D, 2F) = [w1 | w3]: each half's F split
        _shard_param(experts, "w2", 1, mesh)  # (E, F, D)
    else:  # whole experts, another EP rank's on each TP peer (or another ZeRO partition): each counted in the norm
        private_api.mark_model_parallel(experts.w13)
        private_api.mark_model_parallel(experts.w2)
    _region(moe, b)  # the dispatcher's token split is set where it is built (expert_parallel.build_dispatcher)
    group, scale = mesh.tp_group, 1.0 / mesh.tp
    moe.router.register_forward_pre_hook(lambda m, args: (_ScaleGrad.apply(args[0], scale), *args[1:]))
    if moe.shared is not None:  # sharded like the dense FFN, inside the MoE region (one all-reduce for both)
        _shard_param(moe.shared.w1, "weight", 0, mesh)
        _shard_param(moe.shared.w3, "weight", 0, mesh)
        _shard_param(moe.shared.w2, "weight", 1, mesh)
        if moe.shared.gate is not None:  # replicated, as the router: full gradient in, input gradient / tp
            moe.shared.gate.register_forward_pre_hook(lambda m, args: (_ScaleGrad.apply(args[0], scale),))
            moe.shared.gate.register_forward_hook(lambda m, args, out: copy_to_region(out, group))

    def weights_enter(m, args, out):
        routing, stats = out
        return dataclasses.replace(routing, weight_A=copy_to_region(routing.weight_A, group)), stats

    moe.router.register_forward_hook(weights_enter)


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
    _shard_param(model.embed, "weight", 0, mesh)
    rows = model.embed.weight.shape[0]
    model.embed = VocabParallelEmbedding(model.embed.weight, mesh.tp_rank * rows, b)
    if model.head is not None:
        _shard_param(model.head, "weight", 0, mesh)
    # The final norm's output feeds only the LM head (tied or not): enter the region there.
    model.norm.register_forward_hook(lambda m, args, out: b.enter(out))


def _sum_grad_over_tp(p: nn.Parameter, group: dist.ProcessGroup) -> None:
    """Sequence parallelism: a norm outside the regions sees only this rank's tokens; sum its weight's gradient
    over TP (a tensor hook runs before the gradient is accumulated, so DeepSpeed sees the sum)."""
    p.register_hook(lambda g: all_reduce_sum(g.contiguous().clone(), group))


def apply_tp(model: nn.Module, mesh: Mesh, sequence_parallel: bool = False) -> nn.Module:
    """Shard a materialized model over the TP group (after apply_ep, which shards experts over EP)."""
    if mesh.tp == 1:
        return model
    b = _Boundaries(mesh.tp_group, sequence_parallel)
    _vocabulary(model, mesh, b)
    for module in list(model.modules()):
        if isinstance(module, Attention):
            _attention(module, mesh, b)
        elif isinstance(module, Mamba):
            _mamba(module, mesh, b)
        elif isinstance(module, SwiGLU):
            _swiglu(module, mesh, b)
        elif isinstance(module, MoE):
            _moe(module, mesh, b)
    if sequence_parallel and not model.norm.weight.is_meta:  # on meta: parallelize registers them once allocated
        sum_norm_grads_over_tp(model, mesh)
    return model


def sum_norm_grads_over_tp(model: nn.Module, mesh: Mesh) -> None:
    """Sequence parallelism's gradient sums for the norms outside the regions, on allocated parameters (a tensor
    hook belongs to the Parameter object, which allocating a meta parameter replaces)."""
    for norm in [model.norm, *(n for blk in model.blocks for n in (blk.mixer_norm, blk.ffn_norm) if n is not None)]:
        for p in norm.parameters():
            _sum_grad_over_tp(p, mesh.tp_group)


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


def vocab_parallel_lm_loss(logits: torch.Tensor, targets: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """`lm_loss` for vocabulary-sharded logits (B, S, V/tp): mean next-token cross-entropy, replicated on TP."""
    start = mesh.tp_rank * logits.shape[-1]
    per_token = _VocabParallelCrossEntropy.apply(logits.float().flatten(0, 1), targets.flatten(), start, mesh.tp_group)
    valid = targets.flatten() != IGNORE  # no loss at these positions (lm_loss's rule)
    return (per_token * valid).sum() / valid.sum().clamp(min=1)
