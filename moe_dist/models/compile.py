"""`train.compile`: which parts of the model torch.compile takes (beside activation_checkpointing.py, the other
wrapper the trainer applies to the built model; tests/models/test_compile.py)."""

from __future__ import annotations

from moe_dist.config import JobConfig
from moe_dist.layers.registry import kind_of
from moe_dist.models.decoder import held_blocks


def maybe_compile(model, cfg: JobConfig):
    """train.compile: torch.compile, in place, the parts of the model with static shapes (norms, and the sublayers
    whose kind is `compilable`: attention, dense FFNs). MoE layers (data-dependent row counts) and the recurrent
    scans (hand-written autograd Functions over chunks) stay eager. Compiling in place keeps parameter names, so
    checkpoints are unchanged. Returns `model`."""
    if cfg.train.compile:
        for block in held_blocks(model):
            for norm in (block.mixer_norm, block.ffn_norm):
                if norm is not None:
                    norm.compile()
            for sublayer in (block.mixer, block.ffn):
                if sublayer is not None and kind_of(sublayer).compilable:
                    sublayer.compile()
        if model.norm is not None:  # a pipeline part without the last stage has none
            model.norm.compile()
    return model
