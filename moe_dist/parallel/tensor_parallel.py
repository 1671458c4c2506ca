"""apply_tp: Megatron-style tensor parallelism applied to an unchanged single-device model.

Every layer keeps its math; apply_tp replaces weights by this rank's shard and marks each TP region with comm.py's
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
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_dist.data.batches import IGNORE
from moe_dist.layers.attention import Attention
from moe_dist.layers.gdn import GatedDeltaNet
from moe_dist.layers.kernel_choice import Kernel
from moe_dist.layers.mamba import Mamba
from moe_dist.layers.mamba2 import GatedRMSNorm, Mamba2
from moe_dist.layers.mlp import SharedExperts, SwiGLU
from moe_dist.layers.moe import MoE
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


Parts = int | tuple[int, ...]  # a sharded dim's blocks: n equal ones, or their sizes (each block split alone)


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


# ------------------------------------------------------------------------------------------ layers


def _attention(attn: Attention, mesh: Mesh, b: _Boundaries) -> None:
    for lin in (attn.wq, attn.wk, attn.wv):
        _shard_param(lin, "weight", 0, mesh)  # heads are contiguous blocks of rows
        if lin.bias is not None:
            _shard_param(lin, "bias", 0, mesh)
    if attn.qk_norm == "head":  # one weight shared by every head: each rank's heads give part of its gradient
        for norm in (attn.q_norm, attn.k_norm):
            _sum_grad_over_tp(norm.weight)
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


def _mamba2(m: Mamba2, mesh: Mesh, b: _Boundaries) -> None:
    """Heads split over TP (config rule: n_heads divisible by tp; n_groups a multiple or a divisor of tp). Each
    component of in_proj (rows z, x, B, C, dt) and of the conv (channels x, B, C) is split alone; a rank's heads
    are contiguous and so are its groups' B/C rows. With groups >= tp every rank holds whole groups and the layer
    runs unchanged on them. With groups < tp each group spans tp / groups ranks: the B/C rows and conv channels are
    split along the group's flattened (group, state) block, so every parameter stays sharded (none partly
    replicated), the conv output's B/C slices are all-gathered before the scan, each rank keeping its heads' group,
    and the gated norm's per-group statistics are summed over the group's ranks."""
    tp, gn = mesh.tp, m.n_groups * m.d_state
    _shard_param(m.in_proj, "weight", 0, mesh, parts=(m.d_inner, m.d_inner, gn, gn, m.n_heads))
    for name in ("weight", "bias"):
        if getattr(m.conv1d, name) is not None:
            _shard_param(m.conv1d, name, 0, mesh, parts=(m.d_inner, gn, gn))
    for name in ("dt_bias", "A_log", "D"):
        _shard_param(m, name, 0, mesh)
    _shard_param(m.norm, "weight", 0, mesh)  # channels are head-major, like y
    _shard_param(m.out_proj, "weight", 1, mesh)
    if m.n_groups < tp:
        span = tp // m.n_groups  # ranks per group; this rank's heads all read group tp_rank // span
        own = mesh.tp_rank // span
        m.scan = Kernel(m.scan.name, functools.partial(_scan_own_group, m.scan, m.n_groups, own, mesh.tp_group))
        m.norm = _SpanningGroupNorm(m.norm, mesh.tp_group, span, own)
    m.n_heads //= tp
    m.d_inner //= tp
    m.conv_dim //= tp
    m.n_groups = max(m.n_groups // tp, 1)  # local: whole groups, or the one group this rank's heads read
    m.norm.groups = m.n_groups
    conv = m.conv1d
    conv.in_channels = conv.out_channels = conv.groups = m.conv_dim
    _region(m, b)


def _scan_own_group(scan: Kernel, n_groups: int, own: int, group: dist.ProcessGroup, x, dt, A, B, C, **kwargs):
    """B, C (batch, L, 1, n_groups·N / tp): this rank's slice of the flattened (group, state) block, all-gathered
    (backward: each slice's gradient summed over the ranks) and cut to group `own`, the one this rank's heads read."""
    B, C = (gather_sequence(t, 3, group) for t in (B, C))  # (batch, L, 1, n_groups·N)
    n = B.shape[3] // n_groups
    return scan(x, dt, A, B[..., own * n : (own + 1) * n], C[..., own * n : (own + 1) * n], **kwargs)


class _SpanningGroupNorm(GatedRMSNorm):
    """Mamba-2's gated RMSNorm where this rank holds 1/span of one group's channels: the group's mean square is the
    sum of its `span` ranks' sums of squares (all-gathered; backward sums each rank's part of the gradient)."""

    def __init__(self, norm: GatedRMSNorm, group: dist.ProcessGroup, span: int, own: int):
        nn.Module.__init__(self)
        self.groups, self.eps, self.weight = 1, norm.eps, norm.weight
        self.group, self.span, self.own = group, span, own

    def _mean_square(self, h: torch.Tensor) -> torch.Tensor:
        sums = gather_sequence(h.pow(2).sum(-1, keepdim=True), h.dim() - 1, self.group)  # (..., 1, tp)
        mine = sums.unflatten(-1, (-1, self.span))[..., self.own, :]  # (..., 1, span): this group's ranks
        return mine.sum(-1, keepdim=True) / (h.shape[-1] * self.span)


def _gdn(g: GatedDeltaNet, mesh: Mesh, b: _Boundaries) -> None:
    """Key heads split over TP, each with its n_v_heads / n_k_heads value heads (config rule: both counts divisible
    by tp). The fused projections are packed per key head, so a rank's rows are one contiguous block; the conv's
    q, k, v channels are split alone; the gated norm is per head (its weight, shared by the heads, is replicated)."""
    tp = mesh.tp
    _shard_param(g.in_proj_qkvz, "weight", 0, mesh)  # per key head [q, k, v, z]
    _shard_param(g.in_proj_ba, "weight", 0, mesh)  # per key head [b, a]
    _shard_param(g.conv1d, "weight", 0, mesh, parts=(g.key_dim, g.key_dim, g.value_dim))
    _shard_param(g, "dt_bias", 0, mesh)
    _shard_param(g, "A_log", 0, mesh)
    _shard_param(g.out_proj, "weight", 1, mesh)
    _sum_grad_over_tp(g.norm.weight)
    g.n_k_heads //= tp
    g.n_v_heads //= tp
    g.key_dim //= tp
    g.value_dim //= tp
    g.conv_dim //= tp
    conv = g.conv1d
    conv.in_channels = conv.out_channels = conv.groups = g.conv_dim
    _region(g, b)


def _shard_ffn(ffn: SwiGLU | SharedExperts, mesh: Mesh) -> None:
    """A dense FFN's hidden units split over TP: the up projections w1 (and w3, SwiGLU's second one) by rows, the
    down projection w2 by columns. The activation (silu(w1 x) · w3 x, or relu²'s relu(w1 x)² without w3) is
    elementwise per hidden unit, so each rank's units are exact and w2's partial sums add up over TP."""
    for lin in (ffn.w1, ffn.w3):
        if lin is not None:
            _shard_param(lin, "weight", 0, mesh)
    _shard_param(ffn.w2, "weight", 1, mesh)


def _swiglu(ffn: SwiGLU, mesh: Mesh, b: _Boundaries) -> None:
    _shard_ffn(ffn, mesh)
    _region(ffn, b)


def _moe(moe: MoE, mesh: Mesh, b: _Boundaries) -> None:
    experts = moe.experts
    up, down = experts.weight_names
    if mesh.experts_split:  # each expert's F hidden units split, as the dense FFN's
        # SwiGLU's w13 (E, D, 2F) = [w1 | w3]: each half's F split alone; relu²'s w1 (E, D, F): its F split
        _shard_param(experts, up, 2, mesh, parts=2 if experts.gated else 1)
        _shard_param(experts, down, 1, mesh)  # (E, F, D)
    else:  # whole experts, another EP rank's on each TP peer (or another ZeRO partition): each counted in the norm
        private_api.mark_model_parallel(getattr(experts, up))
        private_api.mark_model_parallel(getattr(experts, down))
    _region(moe, b)  # the dispatcher's token split is set where it is built (expert_parallel.build_dispatcher)
    group, scale = mesh.tp_group, 1.0 / mesh.tp
    moe.router.register_forward_pre_hook(lambda m, args: (_ScaleGrad.apply(args[0], scale), *args[1:]))
    if moe.shared is not None:  # sharded like the dense FFN, inside the MoE region (one all-reduce for both)
        _shard_ffn(moe.shared, mesh)
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
        elif isinstance(module, Mamba2):
            _mamba2(module, mesh, b)
        elif isinstance(module, GatedDeltaNet):
            _gdn(module, mesh, b)
        elif isinstance(module, SwiGLU):
            _swiglu(module, mesh, b)
        elif isinstance(module, MoE):
            _moe(module, mesh, b)
    if sequence_parallel:  # the norms outside the regions see only this rank's tokens
        blocks = held_blocks(model)
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
