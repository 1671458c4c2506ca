"""A training step's micro-batches and the evaluation under pipeline parallelism (parallel/pipeline.py's Pipeline):
the loop's `_train_step` and `evaluate` hand their batches here when `parallel.pp` > 1.

What each rank counts: the last stage's ranks hold every micro-batch's LM loss; each stage holds its MoE layers'
routing statistics and their share of the layer-mean aux and z losses. `StepAccumulator.add_share` adds each
where it lives, so the step's all-reduce over the world gives what one process computes, every layer and
micro-batch counted once.
"""

from __future__ import annotations

import torch

from moe_dist.data.batches import Batch
from moe_dist.parallel.pipeline import Pipeline
from moe_dist.train.metrics import StepAccumulator


def _stacked(batches: list[Batch], prefix_lm: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(tokens, targets, documents) of the micro-batches stacked by rows, as the schedule splits them again."""
    tokens = torch.cat([b.tokens[:, :-1] for b in batches])
    targets = torch.cat([b.targets() for b in batches])
    documents = {}
    if batches[0].document_ids is not None:
        documents["document_ids"] = torch.cat([b.document_ids[:, :-1] for b in batches])
        if prefix_lm and batches[0].loss_mask is not None:
            documents["prefix"] = torch.cat([b.prefix() for b in batches])
    return tokens, targets, documents


def moe_layer_index(cfg) -> dict[int, int]:
    """{layer index: its index among the model's MoE layers}."""
    layers = [i for i, (_, ffn) in enumerate(cfg.layer_kinds()) if ffn == "moe"]
    return {layer: j for j, layer in enumerate(layers)}


def pipeline_micro_batches(pipeline: Pipeline, batches: list[Batch], acc: StepAccumulator, cfg) -> torch.Tensor:
    """Forward and backward of the step's micro-batches through the schedule, their values added to `acc`;
    returns this rank's losses (the last stage's LM losses; a zero elsewhere) for the non-finite check."""
    tokens, targets, documents = _stacked(batches, cfg.model.prefix_lm())
    lms = pipeline.step(tokens, targets, **documents)
    pipeline.sum_tied_gradients()
    moe = cfg.model.moe
    index = moe_layer_index(cfg.model)
    n_moe = max(1, len(index))
    # Everything stays on the device (no host sync per layer or micro-batch): the accumulator moves the step's sums
    # to the host once, in `reduce`.
    zero = torch.zeros((), dtype=torch.float32, device=next(pipeline.part.parameters()).device)
    held = [(st, [j for j in range(st.start, st.end) if j in index]) for st in pipeline.part.stages]
    for i in range(len(batches)):
        stats, aux, z = {}, zero, zero
        for st, layers in held:
            for layer, s in zip(layers, st.stats[i], strict=True):
                stats[index[layer]] = s
                aux, z = aux + s.aux_loss.detach().float(), z + s.z_loss.detach().float()
        aux, z = aux / n_moe, z / n_moe
        lm = lms[i].float() if lms else zero
        loss = lm + moe.aux_loss_coef * aux + moe.z_loss_coef * z
        acc.add_share(loss, lm, aux, z, stats, micro=1.0 if pipeline.last else 0.0)
    return torch.stack(lms) if lms else zero


def pipeline_evaluate(pipeline: Pipeline, batches: list[Batch], cfg) -> torch.Tensor:
    """(Σ LM loss, micro-batches) of the evaluation batches on this rank (zeros except on the last stage)."""
    tokens, targets, documents = _stacked(batches, cfg.model.prefix_lm())
    lms = pipeline.evaluate(tokens, targets, len(batches), **documents)
    if not lms:
        return torch.zeros(2, dtype=torch.float64)
    return torch.tensor([sum(lm.item() for lm in lms), float(len(lms))], dtype=torch.float64)
