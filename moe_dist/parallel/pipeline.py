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
schedule's order. Routing statistics are kept per stage (`Stage.stats`) and summed with the step's other statistics
(train/pipeline_step.py: one all-reduce over the world), so each layer is counted once.

DeepSpeed. One engine per rank wraps its `PipelinePart` (the stages' modules under the whole model's names). The
schedule runs the stages; each stage's backward is the engine's (`Pipeline.backward`), so ZeRO's hooks, its
reduction at the accumulation boundary (the rank's last backward of the step) and the step work as for one module.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.layers.router import RoutingStats
from moe_dist.models.decoder import Decoder
from moe_dist.parallel import private_api
from moe_dist.parallel.comm import all_reduce_sum


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
            return x.contiguous()  # sent as it is (sequence parallelism leaves a slice of the gathered sequence)
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight) if self.head is None else self.head(x)
        return logits / self.cfg.logits_scaling if self.cfg.logits_scaling != 1.0 else logits


def local_stages(model: Decoder, starts: list[int], pp: int, pp_rank: int) -> list[Stage]:
    """This pipeline rank's stages (indices pp_rank, pp_rank + pp, ...) of the cut `starts` (first layer of each
    stage, stage_cut.stage_starts), in schedule order."""
    bounds = [*starts, len(model.blocks)]
    return [Stage(model, bounds[s], bounds[s + 1]) for s in range(pp_rank, len(starts), pp)]


class PipelinePart(nn.Module):
    """This pipeline rank's share of a Decoder, under the Decoder's parameter names (so checkpoints and every
    name-based rule read it as a slice of the whole model): its stages' blocks (`blocks`, keyed by layer index),
    the embedding where it runs the first stage (or the last, under a tied head), the final norm and head where it
    runs the last. `stages` are the Stage views over these same modules in schedule order, their stage numbers
    `stage_indices`; the DeepSpeed engine wraps the part, the schedule runs the stages."""

    def __init__(self, model: Decoder, starts: list[int], pp: int, pp_rank: int):
        super().__init__()
        stages = local_stages(model, starts, pp, pp_rank)
        self.cfg = model.cfg
        self.embed = model.embed if any(s.embed is not None for s in stages) else None
        self.blocks = nn.ModuleDict({k: b for s in stages for k, b in s.blocks.items()})
        self.norm = model.norm if stages[-1].last else None
        self.head = model.head if stages[-1].last else None
        marker = getattr(model, "deepspeed_moe_marker", None)
        if marker is not None and any(b.ffn is not None and hasattr(b.ffn, "router") for b in self.blocks.values()):
            self.deepspeed_moe_marker = marker  # only a part that holds experts tells DeepSpeed it has MoE layers
        self.stage_indices = list(range(pp_rank, len(starts), pp))
        self.n_stages, self.starts = len(starts), list(starts)
        object.__setattr__(self, "stages", stages)  # views over the modules above: not registered twice

    def sync_views(self) -> None:
        """Point the stages at the part's embedding, norm and head again, after a split that replaced them (tensor
        parallelism's vocabulary-parallel embedding)."""
        for st in self.stages:
            st.embed = self.embed if st.embed is not None else None
            st.norm, st.head = (self.norm, self.head) if st.last else (None, None)

    implementations = Decoder.implementations  # what each operation of its layers runs (start-up report)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline part runs through its schedule (parallel/pipeline.py), not as one module")


def apply_pp(model: Decoder, mesh, cfg) -> nn.Module:
    """This rank's PipelinePart of the (meta) model under `parallel.pp`; the model itself without pipelining."""
    if mesh.pp == 1:
        return model
    from moe_dist.planning.stage_cut import stage_starts

    return PipelinePart(model, stage_starts(cfg), mesh.pp, mesh.pp_rank)


def _pipeline_stages(stages, indices, n_stages, shapes: tuple, group, stage_class=None) -> list:
    """torch.distributed.pipelining stages over `stages` (numbers `indices`) with static shapes: `shapes` is (rows,
    positions, positions of a hidden state, vocabulary of the logits) of a micro-batch on this rank (tensor
    parallelism: the hidden states' positions split under sequence parallelism, the logits' vocabulary always).
    The schedule then sends tensors of known shapes and runs no shape-inference forward (which would route garbage
    through the MoE layers and count it)."""
    from torch.distributed.pipelining import PipelineStage

    rows, positions, hidden_positions, vocab = shapes
    weight = next(stages[0].parameters())
    pipes = []
    for st, i in zip(stages, indices, strict=True):
        # requires_grad marks what carries a gradient between stages (the hidden states; not the tokens)
        kw = dict(dtype=weight.dtype, device="meta", requires_grad=True)
        hidden = torch.empty(rows, hidden_positions, st.cfg.d_model, **kw)
        tokens = torch.empty(rows, positions, dtype=torch.long, device="meta")
        logits = torch.empty(rows, positions, vocab, **kw)
        x, y = tokens if st.first else hidden, logits if st.last else hidden
        kw = dict(input_args=x, output_args=y, group=group)
        pipes.append((stage_class or PipelineStage)(st, i, n_stages, weight.device, **kw))
    return pipes


def _schedule(pipes: list, micro_batches: int, loss_fn: Callable):
    """1F1B for one stage per rank, interleaved 1F1B for several. Gradients are not rescaled by the schedule:
    `loss_fn` returns each micro-batch's loss already divided by the micro-batch count, as one process does."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    if len(pipes) == 1:
        return Schedule1F1B(pipes[0], micro_batches, loss_fn=loss_fn, scale_grads=False)
    return ScheduleInterleaved1F1B(pipes, micro_batches, loss_fn=loss_fn, scale_grads=False)


def build_schedule(stages, indices, n_stages, micro_batches: int, loss_fn: Callable, group, micro_shape):
    """The schedule over this rank's stages (`indices`: their stage numbers), autograd run by the schedule itself
    (no DeepSpeed engine: `Pipeline` drives one)."""
    shapes = (*micro_shape, micro_shape[1], stages[0].cfg.vocab_size)
    return _schedule(_pipeline_stages(stages, indices, n_stages, shapes, group), micro_batches, loss_fn)


def _engine_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class EngineStage(PipelineStage):
        """A pipeline stage whose backward is its DeepSpeed engine's (`Pipeline.backward`): the engine's ZeRO
        hooks, reduction at the boundary and bookkeeping run as for one module, once per micro-batch and stage."""

        def __init__(self, pipeline: "Pipeline", *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.pipeline = pipeline

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
            if backward_type != "full":
                raise RuntimeError(f"pipeline: backward {backward_type!r} is not supported (full backward only)")
            outputs, grads = bwd_kwargs["stage_output"], bwd_kwargs["output_grads"]
            outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
            if grads is None:  # the last stage: the micro-batch's loss
                surrogate = outputs[0]
            else:
                grads = list(grads) if isinstance(grads, (tuple, list)) else [grads]
                # Σ output · gradient: its gradient with respect to the stage's inputs and weights is the stage's
                # vector-Jacobian product, exactly (the multiply's backward hands each output its gradient)
                surrogate = sum((o * g).sum() for o, g in zip(outputs, grads, strict=True) if g is not None)
            self.pipeline.backward(surrogate)
            inputs = []
            for value in bwd_kwargs["input_values"]:
                inputs.append(value.grad if isinstance(value, torch.Tensor) else None)
                if isinstance(value, torch.Tensor):
                    value.grad = None  # sent on, not accumulated
            return tuple(inputs), None

    return EngineStage


class Pipeline:
    """One optimizer step of this rank's micro-batches through its stages under the schedule, the DeepSpeed engine
    that wraps the rank's PipelinePart doing what it does for one module: ZeRO's hooks and reductions, the
    accumulation boundary at this rank's last backward of the step; the caller steps it.

    `step` returns the last stage's LM losses (one per micro-batch; empty elsewhere); each stage's routing
    statistics are in `stage.stats`, one list per micro-batch."""

    def __init__(
        self,
        part: PipelinePart,
        engine,
        micro_batches: int,
        shapes: tuple,
        group,
        lm_loss_fn: Callable,
        embed_group=None,
    ):
        cfg = part.cfg
        n_moe = max(1, sum(f == "moe" for _, f in cfg.layer_kinds()))
        self.part, self.engine, self.m = part, engine, micro_batches
        for st in part.stages:
            st.aux_scale = cfg.moe.aux_loss_coef / n_moe / micro_batches
            st.z_scale = cfg.moe.z_loss_coef / n_moe / micro_batches
            st.register_forward_pre_hook(lambda *_: private_api.engine_before_forward(engine))
        self.lm_loss_fn, self.lms = lm_loss_fn, []
        self.backwards, self.done = micro_batches * len(part.stages), 0
        cls = _engine_stage_class()
        pipes = _pipeline_stages(
            part.stages, part.stage_indices, part.n_stages, shapes, group, lambda *a, **kw: cls(self, *a, **kw)
        )
        self.schedule = _schedule(pipes, micro_batches, self._loss)
        self.shapes, self.group = shapes, group
        # A tied embedding lives on the first stage (the lookup) and the last (the head): both copies take the sum
        # of their gradients (`sum_tied_gradients`), so they stay equal; the norm counts the last stage's copy not.
        self.embed_group = embed_group if part.cfg.tie_embeddings else None
        if self.embed_group is not None and not self.first:
            private_api.count_once_in_grad_norm(part.embed.weight)
        self._eval: dict[int, object] = {}

    @property
    def first(self) -> bool:
        return self.part.stages[0].first

    @property
    def last(self) -> bool:
        return self.part.stages[-1].last

    def _loss(self, logits, target):
        lm = self.lm_loss_fn(logits, target)
        self.lms.append(lm.detach())
        return lm / self.m

    def backward(self, surrogate: torch.Tensor) -> None:
        self.done += 1
        private_api.engine_backward(self.engine, surrogate, boundary=self.done == self.backwards)

    def _reset(self) -> None:
        self.lms, self.done = [], 0
        for st in self.part.stages:
            st.stats = []

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, **documents) -> list[torch.Tensor]:
        """Forward and backward of the step's micro-batches: tokens and targets (m · rows, positions), split into m
        micro-batches by rows; `documents` (document_ids, prefix) likewise, given to every stage."""
        self._reset()
        args = (tokens,) if self.first else ()
        self.schedule.step(*args, target=targets if self.last else None, **documents)
        if self.done != self.backwards:
            raise RuntimeError(f"pipeline: {self.done} stage backwards ran, {self.backwards} expected")
        return self.lms

    def sum_tied_gradients(self) -> None:
        """After the step's backwards (the data-parallel reduction done), before the optimizer step, on the ranks of
        the first and last stage: a tied embedding's gradient is the sum of the lookup's and the head's, as in one
        process. The full gradient is assembled from ZeRO's partitions and written back (deepspeed.utils'
        safe_get_full_grad / safe_set_full_grad: collectives over the stage's data-parallel group)."""
        if self.embed_group is None:
            return
        from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

        w = self.part.embed.weight
        grad = safe_get_full_grad(w)
        grad = all_reduce_sum(grad.clone(), self.embed_group)
        safe_set_full_grad(w, grad)

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor, micro_batches: int, **documents):
        """Forward only, through a schedule of `micro_batches` micro-batches (one built per count) over the same
        stages: the last stage's LM losses."""
        if micro_batches not in self._eval:
            from torch.distributed.pipelining import PipelineStage

            p = self.part
            pipes = _pipeline_stages(p.stages, p.stage_indices, p.n_stages, self.shapes, self.group, PipelineStage)
            self._eval[micro_batches] = _schedule(pipes, micro_batches, self._loss)
        self._reset()
        args = (tokens,) if self.first else ()
        self._eval[micro_batches].eval(*args, target=targets if self.last else None, **documents)
        return self.lms
