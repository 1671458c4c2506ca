"""The hybrid decoder: embedding → blocks[mixer ; FFN] → RMSNorm → LM head.

Each block's optional mixer (attention, Mamba, Mamba-2 or Gated DeltaNet) and optional FFN (dense SwiGLU or MoE)
come from the config's layer list (`ModelConfig.layer_list`: `model.layers`, or the patterns tiled), so Mixtral
(attention + MoE everywhere), Jamba (1 attention : 7 Mamba, MoE every other layer) and Nemotron-H's
single-sublayer layers are all expressible. Build under `torch.device("meta")`, then `materialize_whole`
allocates and initializes.

Inference: `generate` decodes with an `InferenceCache` (a KV cache per attention layer, the conv and SSM state
per recurrent layer), so each new token costs one position's work; without the cache it recomputes the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from moe_dist.config import ConfigError, ModelConfig
from moe_dist.data.batches import IGNORE
from moe_dist.layers.norm import RMSNorm
from moe_dist.layers.registry import kind, kind_of
from moe_dist.layers.router import RoutingStats
from moe_dist.layers.sequence_shard import SeqShard, takes_shard


def held_blocks(model: nn.Module) -> list["Block"]:
    """The blocks a model holds, in layer order: a Decoder's, or a pipeline part's (keyed by layer index)."""
    blocks = getattr(model, "blocks", [])
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def layer_kinds(cfg: ModelConfig) -> list[tuple[Optional[str], Optional[str]]]:
    """(mixer, ffn) kinds per layer ("attention", "moe", ... or None where the layer has no such sublayer)."""
    return cfg.layer_kinds()


MixerState = Any  # a mixer kind's inference state (its `new_state`): a KV cache, a conv and recurrent state, ...


def check_context_parallel(cfg: ModelConfig, cp: int) -> None:
    """`parallel.cp` > 1 needs a shard-aware forward in every mixer kind of the model (one line naming the key)."""
    if cp == 1:
        return
    kinds = sorted({m for m, _ in cfg.layer_kinds() if m is not None})
    missing = [k for k in kinds if not takes_shard(kind(k).module)]
    if missing:
        raise ConfigError(
            f"parallel.cp: {cp} needs context-parallel support in every mixer of the model; "
            f"{', '.join(missing)} has none yet (use parallel.cp=1)"
        )


class Block(nn.Module):
    """Up to two pre-norm residual sublayers: a mixer, then an FFN. An absent one is None together with its norm,
    so the names of those present (`mixer`, `mixer_norm`, `ffn`, `ffn_norm`) do not depend on the other."""

    def __init__(self, cfg: ModelConfig, mixer: Optional[str], ffn: Optional[str], device: torch.device | str):
        super().__init__()
        self.mixer_norm = None if mixer is None else RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_zero_centered)
        self.mixer = None if mixer is None else kind(mixer).build(cfg, device)
        self.ffn_norm = None if ffn is None else RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_zero_centered)
        self.ffn = None if ffn is None else kind(ffn).build(cfg, device)
        self.residual_multiplier = cfg.residual_multiplier  # Granite's: each sublayer's output scaled before the add

    def parts(self) -> list[str]:
        """The names of the submodules present, in init order."""
        return [p for p in ("mixer_norm", "mixer", "ffn_norm", "ffn") if getattr(self, p) is not None]

    def init_weights(self) -> None:
        for part in self.parts():
            getattr(self, part).init_weights()

    def new_state(self, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> Optional[MixerState]:
        """The mixer's inference state (None without a mixer)."""
        new_state = None if self.mixer is None else kind_of(self.mixer).new_state
        return None if new_state is None else new_state(self.mixer, batch, max_len, device, dtype)

    def forward(
        self, x: torch.Tensor, cache: Optional[MixerState] = None, shard: Optional[SeqShard] = None, **documents
    ) -> tuple[torch.Tensor, RoutingStats | None]:
        """`shard` (context parallelism): x holds this rank's pieces of each sequence; the mixer and an MoE FFN get
        it (the mixer's exchanges, the router's per-micro-batch statistics); a dense FFN is per token."""
        m = self.residual_multiplier
        if self.mixer is not None:
            cp = {} if shard is None else {"shard": shard}
            h = self.mixer(self.mixer_norm(x), cache, **documents, **cp)
            x = x + (h if m == 1.0 else h * m)
        if self.ffn is None:
            return x, None
        moe_shard = {"shard": shard} if shard is not None and takes_shard(type(self.ffn)) else {}
        h, stats = self.ffn(self.ffn_norm(x), **moe_shard), None
        if isinstance(h, tuple):
            h, stats = h
        return x + (h if m == 1.0 else h * m), stats


@dataclass
class DecoderOutput:
    logits: torch.Tensor  # (B, S, V)
    aux_loss: torch.Tensor  # mean over MoE layers of the load-balancing loss (0 without MoE layers)
    z_loss: torch.Tensor  # mean over MoE layers of the router z-loss
    moe_stats: list[RoutingStats]  # one per MoE layer, in layer order


@dataclass
class InferenceCache:
    """Mixer state of every block for incremental decoding (see `Decoder.new_cache`)."""

    layers: list[Optional[MixerState]]  # one per block: KVCache for attention, the recurrent state otherwise
    length: int = 0  # positions processed so far


class Decoder(nn.Module):
    """The model; `device` is the device it is built to run on, for which each layer chooses its kernels (its
    parameters are allocated by whoever builds it: `build_model` builds on the meta device)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, m, f, device) for m, f in layer_kinds(cfg))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_zero_centered)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def implementations(self) -> dict[str, str]:
        """What each operation runs, over all layers: e.g. {"attention": "sdpa", "scan": "triton", ...}."""
        found: dict[str, str] = {}
        for module in self.modules():
            if module is not self and hasattr(module, "implementations"):
                found.update(module.implementations)
        return found

    def init_units(self) -> list[tuple[str, Callable[[nn.Module], None]]]:
        """(submodule path, its initializer) in the order `init_weights` draws from the RNG. Shard-aware
        materialization (parallel/parallelize.py) initializes one unit at a time in this order, so values do not
        depend on whether the model is built whole or unit by unit."""

        def normal(module: nn.Module) -> None:
            nn.init.normal_(module.weight, std=self.cfg.init_std)

        units: list[tuple[str, Callable[[nn.Module], None]]] = [("embed", normal)]
        if self.head is not None:
            units.append(("head", normal))
        for i, block in enumerate(self.blocks):
            for part in block.parts():
                units.append((f"blocks.{i}.{part}", lambda module: module.init_weights()))
        units.append(("norm", lambda module: module.init_weights()))
        return units

    @torch.no_grad()
    def init_weights(self) -> None:
        for path, init in self.init_units():
            init(self.get_submodule(path))

    def new_cache(self, batch: int, max_len: int) -> InferenceCache:
        """An empty cache for `batch` sequences of up to `max_len` positions, on the model's device and dtype."""
        w = self.embed.weight
        return InferenceCache([b.new_state(batch, max_len, w.device, w.dtype) for b in self.blocks])

    def forward(
        self,
        tokens: torch.Tensor,
        cache: Optional[InferenceCache] = None,
        document_ids: Optional[torch.Tensor] = None,
        prefix: Optional[torch.Tensor] = None,
        shard: Optional[SeqShard] = None,
    ) -> DecoderOutput:
        """tokens (B, S) → logits (B, S, V). With a cache, tokens continue the sequences it holds (inference).
        Packed documents (training): `document_ids` (B, S) int, equal within a document, keep documents apart
        in attention (mask, RoPE positions) and the recurrent mixers (conv, state); `prefix` (B, S) bool marks
        prompt tokens that attention layers let see each other (prefix-LM).

        Context parallelism (`shard`, layers/sequence_shard.py): tokens are this rank's S / cp positions of
        each sequence (`shard.local`), logits likewise, while `document_ids` and `prefix` stay the WHOLE (B, S)
        sequences'. Every mixer must be shard-aware (a ValueError otherwise: run on its local pieces alone it
        would be silently wrong); no inference cache."""
        if shard is not None:
            if cache is not None:
                raise ValueError("context parallelism: no inference cache (generate runs with parallel.cp=1)")
            if tokens.shape[1] * shard.size != shard.seq_len:
                expected = shard.seq_len // shard.size
                raise ValueError(f"context parallelism: {expected} local positions expected, got {tokens.shape[1]}")
            for block in self.blocks:
                if block.mixer is not None and not takes_shard(type(block.mixer)):
                    raise ValueError(f"context parallelism: {type(block.mixer).__name__} has no shard-aware forward")
        documents = {} if document_ids is None else {"document_ids": document_ids, "prefix": prefix}
        if shard is not None:
            documents["shard"] = shard
        x = self.embed(tokens)  # (B, S, D)
        if self.cfg.embedding_multiplier != 1.0:
            x = x * self.cfg.embedding_multiplier
        stats: list[RoutingStats] = []
        for i, block in enumerate(self.blocks):
            x, s = block(x, None if cache is None else cache.layers[i], **documents)
            if s is not None:
                stats.append(s)
        if cache is not None:
            cache.length += tokens.shape[1]
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight) if self.head is None else self.head(x)
        if self.cfg.logits_scaling != 1.0:
            logits = logits / self.cfg.logits_scaling
        zero = logits.new_zeros((), dtype=torch.float32)
        aux = torch.stack([s.aux_loss for s in stats]).mean() if stats else zero
        z = torch.stack([s.z_loss for s in stats]).mean() if stats else zero
        return DecoderOutput(logits=logits, aux_loss=aux, z_loss=z, moe_stats=stats)


class _NoDrawsOnMeta(TorchFunctionMode):
    """Skips `normal_` on meta tensors while a model is built: a meta tensor holds no values to draw, and torch's
    meta `normal_` is a Python reference whose first call imports torch._dynamo: 1.5 of the 3.0 s a `--dry-run` of the
    default job took on a 2-core CPU (training imports it anyway, with its optimizer). Values are drawn later, by
    `init_weights` on real storage."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.init.normal_ or func is torch.Tensor.normal_:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> Decoder:
    """Construct on the meta device (no storage: any size builds anywhere), with kernels chosen for `device`,
    where `materialize_whole` then allocates it."""
    with _NoDrawsOnMeta(), torch.device("meta"):
        return Decoder(cfg, device)


def materialize_whole(model: Decoder, device: torch.device | str, seed: int) -> Decoder:
    """Allocate storage for the whole of a meta-built model on one device and initialize it deterministically from
    `seed` (a rank's shard of a parallel layout: parallelize.materialize_shards, which gives the same values).

    Values are drawn on the CPU and then moved to `device`, so a seed gives the same model on every device (CUDA's
    generator draws other numbers than the CPU's). Python attributes set on the meta parameters (apply_ep's
    expert-group marks) are carried over: to_empty replaces each Parameter object when it changes device type.
    """
    annotations = {name: dict(vars(p)) for name, p in model.named_parameters()}
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        p.__dict__.update(annotations[name])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.init_weights()
    return model.to(device)  # moves parameter data in place: the Parameter objects and their marks stay


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total parameters, and active ones per token (shared weights + top_k of each MoE layer's experts)."""
    model = build_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for block in model.blocks:
        experts = getattr(block.ffn, "experts", None)  # routed experts: top_k of num_experts active per token
        if experts is not None:
            per_expert = sum(p.numel() for p in experts.parameters()) // cfg.moe.num_experts
            inactive += per_expert * (cfg.moe.num_experts - cfg.moe.top_k)
    return {"params_total": total, "params_active": total - inactive}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, n_targets: Optional[float] = None) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 over the targets that are not IGNORE (prompt tokens, document starts);
    logits (B, S, V), targets (B, S). A micro-batch without any target has loss 0 (not NaN). `n_targets`: the
    divisor instead of the count of these targets (context parallelism: the whole micro-batch's count / cp)."""
    per_token = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none"
    )  # 0 at IGNORE
    return per_token.sum() / (n_targets if n_targets is not None else (targets != IGNORE).sum().clamp(min=1))


def sample_next(
    logits_BV: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Next token per row (B,) from last-position logits (B, V): greedy when temperature is 0, else sampled
    from softmax(logits / temperature) restricted to the top_k tokens and to the smallest set whose
    probability reaches top_p (nucleus sampling; the most likely token always stays)."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits = logits_BV.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before a token already reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Decoder,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """Extend prompt (B, S) int64 by `max_new_tokens` tokens → (B, S + max_new_tokens).

    With `use_cache` the prompt is run once to fill the cache and each new token is one position's forward;
    without it every step recomputes the whole sequence (the reference the cached path must equal).
    The model must be dropless (`moe.capacity_factor` null): with capacity drops a token's output depends on
    how many other tokens share its forward, so cached and recomputed decoding could not agree.
    """
    if model.cfg.moe.capacity_factor is not None and model.cfg.has_kind("moe"):
        raise ValueError("generate: build the model with model.moe.capacity_factor=null (dropless) for inference")
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"generate: prompt must be (batch, seq) with seq >= 1, got shape {tuple(prompt.shape)}")
    was_training = model.training
    model.eval()
    tokens = prompt
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + max_new_tokens) if use_cache else None
    step_input = prompt
    for _ in range(max_new_tokens):
        logits = model(step_input, cache).logits[:, -1]  # (B, V)
        nxt = sample_next(logits, temperature, top_k, top_p, generator)[:, None]  # (B, 1)
        tokens = torch.cat([tokens, nxt], dim=1)
        step_input = nxt if use_cache else tokens
    model.train(was_training)
    return tokens
