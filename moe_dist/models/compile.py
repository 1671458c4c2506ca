"""`train.compile`: which parts of the model torch.compile takes (beside activation_checkpointing.py, the other
wrapper the trainer applies to the built model; tests/models/test_compile.py)."""

from __future__ import annotations

from moe_dist.config import JobConfig
from moe_dist.layers.attention import Attention
from moe_dist.layers.mlp import SwiGLU
from moe_dist.models.decoder import held_blocks


def maybe_compile(model, cfg: JobConfig):
    """train.compile: torch.compile, in place, the parts of the model with static shapes (norms, attention mixers,
    dense FFNs). MoE layers (data-dependent row counts) and the Mamba scan (a hand-written autograd Function over
    chunks) stay eager. Compiling in place keeps parameter names, so checkpoints are unchanged. Returns `model`."""
    if cfg.train.compile:
        for block in held_blocks(model):
            for norm in (block.mixer_norm, block.ffn_norm):
                if norm is not None:
                    norm.compile()
            if isinstance(block.mixer, Attention):
                block.mixer.compile()
            if isinstance(block.ffn, SwiGLU):
                block.ffn.compile()
        if model.norm is not None:  # a pipeline part without the last stage has none
            model.norm.compile()
    return model
