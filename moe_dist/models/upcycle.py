"""Sparse upcycling (Komatsuzaki et al., 2023): a dense model becomes an MoE model whose experts start as copies
of each layer's dense SwiGLU, with a freshly initialized router.

Every dense FFN layer becomes an MoE layer of `num_experts` copies; everything else (embeddings, mixers, norms,
head) is carried over unchanged. With zero noise, renormalized top-k weights (they sum to 1 over the k identical
experts) and no dropped assignment, each MoE layer computes exactly its dense FFN, so the upcycled model's logits
at step 0 equal the dense model's whatever the router does. `noise` > 0 adds N(0, (noise · std(w))²) to each copy
of each weight w, independently per expert, so that experts can diverge from the start.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_dist.config import ConfigError, ModelConfig, MoEConfig
from moe_dist.layers.mlp import SwiGLU
from moe_dist.layers.moe import MoE
from moe_dist.models.decoder import Decoder, build_model, materialize_whole


def upcycled_config(dense: ModelConfig, moe: MoEConfig) -> ModelConfig:
    """`dense` with every dense FFN ("D") turned into an MoE layer ("E") described by `moe` (experts of d_ff)."""
    if not dense.has_kind("mlp"):
        key = "model.ffn_pattern" if dense.layers is None else "model.layers"
        raise ConfigError(f"{key}: the source model has no dense FFN layer to upcycle")
    moe = dataclasses.replace(moe, d_ff=None)
    if dense.layers is not None:
        layers = [e[: -len("mlp")] + "moe" if e.split("+")[-1] == "mlp" else e for e in dense.layers]
        return dataclasses.replace(dense, layers=layers, moe=moe)
    return dataclasses.replace(dense, ffn_pattern=dense.ffn_pattern.replace("D", "E"), moe=moe)


@torch.no_grad()
def upcycle(dense: Decoder, cfg: ModelConfig, noise: float = 0.0, seed: int = 0) -> Decoder:
    """The MoE model of `cfg` holding `dense`'s weights; routers drawn from `seed` (and the noise from `seed` + 1).
    `cfg` is `upcycled_config(dense.cfg, moe)`, possibly with settings changed that keep every parameter shape
    (kernels, loss coefficients: what hf/overrides.py lets `--set` change). Source MoE layers, if any, are copied
    as they are."""
    if noise < 0:
        raise ConfigError(f"--noise: must be >= 0, got {noise}")
    model = materialize_whole(build_model(cfg), "cpu", seed)
    source = dict(dense.named_parameters())
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name in source:
            p.copy_(source[name])
    for src, dst in zip(dense.blocks, model.blocks):
        if not (isinstance(src.ffn, SwiGLU) and isinstance(dst.ffn, MoE)):
            continue
        E = dst.ffn.experts.w13.shape[0]
        w13 = torch.cat([src.ffn.w1.weight.t(), src.ffn.w3.weight.t()], dim=1)  # (D, 2F): [gate | up]
        w2 = src.ffn.w2.weight.t()  # (F, D)
        for w, target in ((w13, dst.ffn.experts.w13), (w2, dst.ffn.experts.w2)):
            copies = w.float().expand(E, *w.shape).clone()
            if noise > 0:
                std = w.float().std().item()
                copies += noise * std * torch.randn(copies.shape, generator=gen)
            target.copy_(copies.to(target.dtype))
    return model
