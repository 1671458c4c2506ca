"""The layer kinds, by the name the layer list gives them: one line per kind (its `KIND`, layers/kind.py).

The decoder, activation checkpointing, tensor parallelism, the memory plan, the performance model and the config
checks ask here, and name no kind. A new mixer is its layer file and one line below.
"""

from __future__ import annotations

from torch import nn

from moe_dist.layers import attention, gdn, mamba, mamba2, mla, mlp, moe
from moe_dist.layers.kind import LayerKind

KINDS: dict[str, LayerKind] = {
    k.name: k
    for k in (
        attention.KIND,
        mla.KIND,
        mamba.KIND,
        mamba2.KIND,
        gdn.KIND,
        mlp.KIND,
        moe.KIND,
    )
}


def kind(name: str) -> LayerKind:
    """The kind called `name`; a ValueError of one line listing the known ones otherwise."""
    if name not in KINDS:
        raise ValueError(f"unknown layer kind {name!r}: known kinds are {', '.join(KINDS)}")
    return KINDS[name]


def kinds(role: str) -> list[LayerKind]:
    """The mixer or the FFN kinds, in registry order."""
    return [k for k in KINDS.values() if k.role == role]


def kind_of(module: nn.Module) -> LayerKind | None:
    """The kind a built sublayer is (by its class; None for a module that is no kind's)."""
    for k in KINDS.values():
        if type(module) is k.module:
            return k
    return None
