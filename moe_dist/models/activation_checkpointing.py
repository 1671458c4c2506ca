"""Activation checkpointing (`train.activation_checkpointing`, `train.checkpoint_parts`): chosen sublayers keep only
their input in the forward and recompute their interior in the backward (torch.utils.checkpoint, non-reentrant).

    part           recomputed region                                   what it no longer keeps, per micro-batch
    "attention"    Attention.forward: q/k/v/o projections, RoPE, SDPA   q, k, v, the attention output, its stats
    "mamba"        Mamba.forward: in_proj, conv, x_proj, scan, out_proj  the (B, L, 2·Di) projection, conv output,
                                                                        Δ/B/C and the scan's saved chunk states
    "mlp"          SwiGLU.forward (dense FFN)                           the (B, S, F) gate/up activations
    "moe_experts"  Experts.forward: the grouped expert GEMMs            the (R, 2F) and (R, F) expert activations

"full" recomputes all four in every block; "selective" the listed parts. The norms' outputs and the residual
stream stay saved (they are O(B·S·D) per block, the interiors are many times that).

MoE: the router, the dispatch all-to-all and the combine are never recomputed; only the experts are, from the
dispatched rows they were given. Why: (1) the all-to-all is the MoE layer's costliest operation at scale (it leaves
the node once ep spans nodes), and recomputing it would add a third and fourth one per layer per micro-batch;
(2) recomputing the router on a GPU whose kernels are not bitwise reproducible could flip a top-k choice, change the
rows per expert, and so the all-to-all's split sizes, which the other ranks of the EP group would not agree with
(a hang or wrong gradients) -- with the routing kept, the recompute is purely local, the same on every rank, and
issues no collective; (3) routing statistics, aux/z losses, drop counts and all-to-all byte counts come from the
one forward of the router and dispatcher, so they are counted exactly once per micro-batch by construction. The
dispatched rows (R, D) stay saved: the price is O(K·T·D) per MoE layer, against O(K·T·F) for the experts' interior.

Tensor parallelism: each recomputed region is its module's own `forward`, inside the TP region hooks (which run in
`__call__`), so the region's entry and exit collectives are not repeated; Mamba's x_proj all-reduce is inside its
forward and is repeated, by every TP rank in the same (backward) order. Parameter names do not change: the
module's `forward` is wrapped on the instance.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_dist.config import TrainConfig
from moe_dist.layers.attention import Attention
from moe_dist.layers.mamba import Mamba
from moe_dist.layers.mlp import SwiGLU
from moe_dist.layers.moe import MoE

PARTS = ("attention", "mamba", "moe_experts", "mlp")


def checkpointed_parts(t: TrainConfig) -> set[str]:
    """The parts `train.activation_checkpointing` / `train.checkpoint_parts` recompute."""
    if t.activation_checkpointing == "full":
        return set(PARTS)
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
    parts = checkpointed_parts(t)
    for block in getattr(model, "blocks", []):
        mixer, ffn = block.mixer, block.ffn
        if (isinstance(mixer, Attention) and "attention" in parts) or (isinstance(mixer, Mamba) and "mamba" in parts):
            _recompute(mixer, takes_cache=True)
        if isinstance(ffn, SwiGLU) and "mlp" in parts:
            _recompute(ffn)
        if isinstance(ffn, MoE) and "moe_experts" in parts:
            _recompute(ffn.experts)
    return model
