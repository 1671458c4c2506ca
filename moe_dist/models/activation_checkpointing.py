"""Activation checkpointing (`train.activation_checkpointing`, `train.checkpoint_parts`): chosen sublayers keep only
their input in the forward and recompute their interior in the backward (torch.utils.checkpoint, non-reentrant).

Parts: each layer kind's (`LayerKind.part`: its name, "mamba" for Mamba-1, "moe_experts" for an MoE layer's
experts); "full" recomputes all of them in every block.
Invariants: in MoE layers only the experts are recomputed, from their saved dispatched rows, never the router, the
dispatch all-to-all or the combine, so a recompute issues no collective and routing statistics are counted once; each
recomputed region is its module's own `forward`, inside the TP region hooks, so region collectives are not repeated
(Mamba's x_proj all-reduce is, in the same order on every TP rank); parameter names do not change (the `forward`
is wrapped on the instance). The parts table and the reasons: docs/memory.md, section "Activation checkpointing";
proof: tests/models/test_activation_checkpointing.py (bitwise equal to no recompute).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_dist.config import TrainConfig
from moe_dist.layers.registry import KINDS, kind_of
from moe_dist.models.decoder import held_blocks


def parts() -> tuple[str, ...]:
    """Every kind's part name (train.checkpoint_parts takes a subset)."""
    return tuple(k.part for k in KINDS.values())


def checkpointed_parts(t: TrainConfig) -> set[str]:
    """The parts `train.activation_checkpointing` / `train.checkpoint_parts` recompute."""
    if t.activation_checkpointing == "full":
        return set(parts())
    if t.activation_checkpointing == "selective":
        return set(t.checkpoint_parts)
    return set()


def _recompute(module: nn.Module, takes_cache: bool = False) -> None:
    """Wrap `module.forward` on the instance: in training with autograd on (and, for a mixer, no inference cache:
    its second argument), run it under a non-reentrant checkpoint; otherwise as it is."""
    inner = module.forward

    def forward(*args, **kwargs):
        cache = (args[1] if len(args) > 1 else kwargs.get("cache")) if takes_cache else None
        if not (module.training and torch.is_grad_enabled()) or cache is not None:
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_activation_checkpointing(model: nn.Module, t: TrainConfig) -> nn.Module:
    """Mark the configured sublayers of every block for recompute; returns `model` (changed in place)."""
    chosen = checkpointed_parts(t)
    for block in held_blocks(model):
        for sublayer in (block.mixer, block.ffn):
            k = None if sublayer is None else kind_of(sublayer)
            if k is None or k.part not in chosen:
                continue
            if k.role == "mixer":
                _recompute(sublayer, takes_cache=True)
            else:  # an MoE layer recomputes only its experts, from their saved dispatched rows
                _recompute(getattr(sublayer, "experts", sublayer))
    return model
