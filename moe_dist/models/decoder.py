"""The hybrid decoder: embedding → blocks[mixer ; FFN] → RMSNorm → LM head.

Each block's mixer (attention or Mamba) and FFN (dense SwiGLU or MoE) come from the config's layer patterns,
so Mixtral (attention + MoE everywhere) and Jamba (1 attention : 7 Mamba, MoE every other layer) are both
expressible. Build under `torch.device("meta")`, then `materialize` allocates and initializes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.config import ModelConfig
from moe_dist.layers.attention import Attention
from moe_dist.layers.mamba import Mamba
from moe_dist.layers.mlp import SwiGLU
from moe_dist.layers.moe import MoE, RoutingStats
from moe_dist.layers.norm import RMSNorm


def layer_kinds(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(mixer, ffn) letters per layer, each pattern tiled over n_layers."""
    mp, fp = cfg.mixer_pattern, cfg.ffn_pattern
    return [(mp[i % len(mp)], fp[i % len(fp)]) for i in range(cfg.n_layers)]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: str, ffn: str):
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = (Attention(cfg.d_model, cfg.attention, cfg.init_std, cfg.n_layers) if mixer == "A"
                      else Mamba(cfg.d_model, cfg.mamba, cfg.norm_eps, cfg.init_std))
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = (MoE(cfg.d_model, cfg.d_ff, cfg.moe, cfg.init_std, cfg.n_layers) if ffn == "E"
                    else SwiGLU(cfg.d_model, cfg.d_ff, cfg.init_std, cfg.n_layers))

    def init_weights(self) -> None:
        for module in (self.mixer_norm, self.mixer, self.ffn_norm, self.ffn):
            module.init_weights()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats | None]:
        x = x + self.mixer(self.mixer_norm(x))
        h = self.ffn(self.ffn_norm(x))
        if isinstance(h, tuple):
            h, stats = h
            return x + h, stats
        return x + h, None


@dataclass
class DecoderOutput:
    logits: torch.Tensor  # (B, S, V)
    aux_loss: torch.Tensor  # mean over MoE layers of the load-balancing loss (0 without MoE layers)
    z_loss: torch.Tensor  # mean over MoE layers of the router z-loss
    moe_stats: list[RoutingStats]  # one per MoE layer, in layer order


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, m, f) for m, f in layer_kinds(cfg))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.embed.weight, std=self.cfg.init_std)
        if self.head is not None:
            nn.init.normal_(self.head.weight, std=self.cfg.init_std)
        for block in self.blocks:
            block.init_weights()
        self.norm.init_weights()

    def forward(self, tokens: torch.Tensor) -> DecoderOutput:
        x = self.embed(tokens)  # (B, S, D)
        stats: list[RoutingStats] = []
        for block in self.blocks:
            x, s = block(x)
            if s is not None:
                stats.append(s)
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight) if self.head is None else self.head(x)
        zero = logits.new_zeros((), dtype=torch.float32)
        aux = torch.stack([s.aux_loss for s in stats]).mean() if stats else zero
        z = torch.stack([s.z_loss for s in stats]).mean() if stats else zero
        return DecoderOutput(logits=logits, aux_loss=aux, z_loss=z, moe_stats=stats)


def build_model(cfg: ModelConfig, device: torch.device | str = "meta") -> Decoder:
    """Construct on `device` without allocating real storage when it is "meta"."""
    with torch.device(device):
        return Decoder(cfg)


def materialize(model: Decoder, device: torch.device | str, seed: int) -> Decoder:
    """Allocate storage for a meta-built model and initialize it deterministically from `seed`.

    Python attributes set on the meta parameters (apply_ep's expert-group marks) are carried over: to_empty
    replaces each Parameter object when it changes device type.
    """
    annotations = {name: dict(vars(p)) for name, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        p.__dict__.update(annotations[name])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.init_weights()
    return model


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total parameters, and active ones per token (shared weights + top_k of each MoE layer's experts)."""
    model = build_model(cfg, "meta")
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for block in model.blocks:
        if isinstance(block.ffn, MoE):
            per_expert = sum(p.numel() for p in block.ffn.experts.parameters()) // cfg.moe.num_experts
            inactive += per_expert * (cfg.moe.num_experts - cfg.moe.top_k)
    return {"params_total": total, "params_active": total - inactive}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; logits (B, S, V), targets (B, S)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
