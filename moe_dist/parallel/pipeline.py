"""Pipeline parallelism: the layer list cut into pp × pp_virtual contiguous stages (planning/stage_cut.py), stage s
run by pipeline rank s mod pp, under torch.distributed.pipelining's 1F1B schedule (interleaved 1F1B when
pp_virtual > 1).

Why torch.distributed.pipelining: it has both schedules (and the zero-bubble ones) over plain modules and process
groups, so each stage stays an ordinary module that EP, TP, ZeRO and activation checkpointing act on as they act
on the whole model. DeepSpeed's pipeline engine refuses ZeRO 2 and has no interleaved schedule.

MoE balancing losses through stages. In one process the step's loss is Σ_micro-batches (lm + α · mean_layers(aux)
+ β · mean_layers(z)) / m, so each MoE layer's aux loss of each micro-batch has gradient α / (n_moe · m). A stage
cannot add its layers' losses to a loss it does not compute (only the last stage has one), and carrying them as
extra stage outputs would change what travels. Instead each MoE layer's output passes through `inject_losses`, an
identity in the forward whose backward also hands the layer's aux and z losses their constant gradients: they
reach the router's weights inside the stage's own backward, exactly once per layer and micro-batch, whatever the
schedule's order. Routing statistics are kept per stage (`Stage.stats`) and summed over the pipeline group once per
step by whoever reads them, so each layer is counted once.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.layers.router import RoutingStats
from moe_dist.models.decoder import Decoder


class _InjectLosses(torch.autograd.Function):
    """x → x; backward: x's gradient unchanged, and `scale_aux`, `scale_z` as the gradients of aux and z."""

    @staticmethod
    def forward(ctx, x, aux, z, scale_aux: float, scale_z: float):
        ctx.scales = (scale_aux, scale_z)
        ctx.meta = (aux.shape, aux.dtype, z.shape, z.dtype)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        scale_aux, scale_z = ctx.scales
        aux_shape, aux_dtype, z_shape, z_dtype = ctx.meta
        g_aux = torch.full(aux_shape, scale_aux, dtype=aux_dtype, device=grad.device)
        g_z = torch.full(z_shape, scale_z, dtype=z_dtype, device=grad.device)
        return grad, g_aux, g_z, None, None


def inject_losses(x: torch.Tensor, aux: torch.Tensor, z: torch.Tensor, scale_aux: float, scale_z: float):
    """x unchanged; in x's backward, aux and z receive the gradients scale_aux and scale_z (as if
    scale_aux · aux + scale_z · z were added to the loss). Nothing is injected when neither requires a gradient."""
    if not (aux.requires_grad or z.requires_grad) or not x.requires_grad:
        return x
    return _InjectLosses.apply(x, aux, z, scale_aux, scale_z)


class Stage(nn.Module):
    """Layers [start, end) of a Decoder, with the embedding on the first stage and the final norm and LM head on the
    last. Parameter names are the Decoder's (`embed.weight`, `blocks.7.ffn...`, `norm.weight`, `head.weight`), so
    the union of the stages' state dicts is the whole model's. A tied head (`tie_embeddings`) reads the embedding:
    the last stage then holds its own copy, whose gradient the pipeline sums with the first stage's.

    forward(x, document_ids=None, prefix=None): x is the tokens (B, S) on the first stage, else the previous
    stage's hidden state (B, S, D); returns the hidden state, or the logits (B, S, V) on the last stage. Each MoE
    layer's routing statistics go to `stats` (one list per forward, in layer order) and its balancing losses are
    injected into the backward with `aux_scale`, `z_scale` (set per step: α / (n_moe · m), β / (n_moe · m))."""

    def __init__(self, model: Decoder, start: int, end: int):
        super().__init__()
        cfg = model.cfg
        self.cfg, self.start, self.end = cfg, start, end
        self.first, self.last = start == 0, end == len(model.blocks)
        self.embed = model.embed if self.first or (self.last and model.head is None) else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, end)})
        self.norm = model.norm if self.last else None
        self.head = model.head if self.last else None
        self.aux_scale = self.z_scale = 0.0
        self.stats: list[list[RoutingStats]] = []

    def forward(
        self, x: torch.Tensor, document_ids: Optional[torch.Tensor] = None, prefix: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        documents = {} if document_ids is None else {"document_ids": document_ids, "prefix": prefix}
        if self.first:
            x = self.embed(x)
            if self.cfg.embedding_multiplier != 1.0:
                x = x * self.cfg.embedding_multiplier
        stats: list[RoutingStats] = []
        for block in self.blocks.values():
            x, s = block(x, None, **documents)
            if s is not None:
                stats.append(s)
                x = inject_losses(x, s.aux_loss, s.z_loss, self.aux_scale, self.z_scale)
        self.stats.append(stats)
        if not self.last:
            return x
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight) if self.head is None else self.head(x)
        return logits / self.cfg.logits_scaling if self.cfg.logits_scaling != 1.0 else logits


def local_stages(model: Decoder, starts: list[int], pp: int, pp_rank: int) -> list[Stage]:
    """This pipeline rank's stages (indices pp_rank, pp_rank + pp, ...) of the cut `starts` (first layer of each
    stage, stage_cut.stage_starts), in schedule order."""
    bounds = [*starts, len(model.blocks)]
    return [Stage(model, bounds[s], bounds[s + 1]) for s in range(pp_rank, len(starts), pp)]


def build_schedule(
    stages: list[Stage],
    indices: list[int],
    n_stages: int,
    micro_batches: int,
    loss_fn: Callable,
    group,
    micro_shape: tuple[int, int],
):
    """torch.distributed.pipelining's schedule over this rank's stages (`indices`: their stage numbers): 1F1B for
    one stage per rank, interleaved 1F1B for several. Gradients are not rescaled by the schedule: `loss_fn`
    returns each micro-batch's loss already divided by the micro-batch count, as one process accumulates it.

    Every stage states its input and output shapes for a micro-batch of `micro_shape` (rows, positions): the
    schedule then sends tensors of known shapes and runs no shape-inference forward (which would route garbage
    through the MoE layers and count it)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    weight = next(stages[0].parameters())
    pipes = []
    for st, i in zip(stages, indices, strict=True):
        # requires_grad marks what carries a gradient between stages (the hidden states; not the tokens)
        hidden = torch.empty(*micro_shape, st.cfg.d_model, dtype=weight.dtype, device="meta", requires_grad=True)
        tokens = torch.empty(micro_shape, dtype=torch.long, device="meta")
        logits = torch.empty(*micro_shape, st.cfg.vocab_size, dtype=weight.dtype, device="meta", requires_grad=True)
        x, y = tokens if st.first else hidden, logits if st.last else hidden
        pipes.append(PipelineStage(st, i, n_stages, weight.device, input_args=x, output_args=y, group=group))
    if len(pipes) == 1:
        return Schedule1F1B(pipes[0], micro_batches, loss_fn=loss_fn, scale_grads=False)
    return ScheduleInterleaved1F1B(pipes, micro_batches, loss_fn=loss_fn, scale_grads=False)
