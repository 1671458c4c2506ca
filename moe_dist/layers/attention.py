"""Causal multi-head attention with grouped-query heads, RoPE (optionally partial) and an optional sliding window;
optionally gated (Qwen3-Next: a sigmoid gate from the query projection on every output channel).

The attention kernels are chosen once, when the layer is built for its device, one per mask kind (causal,
documents, prefix-LM, sliding window: `attention_kernels`, as `moe_dist.layers.kernel_choice.attention_choice` rules):
PyTorch SDPA under our masks (`moe_dist.layers.sdpa`; SDPA never materializes repeated k/v for grouped-query
heads) or the Triton flash-attention kernel (`moe_dist.kernels.flash_attention`). The inference path with a
`KVCache` takes SDPA with an explicit mask.
"""

import math
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.config.errors import require
from moe_dist.layers.kernel_choice import (
    Kernel,
    attention_choice,
    attention_cp_choice,
    attention_mask_kind,
    resolve,
    why_no_triton,
)
from moe_dist.layers.kind import LayerKind, TensorSplit, divides
from moe_dist.layers.norm import RMSNorm
from moe_dist.layers.rope import apply_rope, document_positions, rope_cos_sin
from moe_dist.layers.sdpa import sdpa, sdpa_offset, window_mask
from moe_dist.layers.sequence_shard import SeqShard


@dataclass
class AttentionConfig:
    n_heads: int = 8  # query heads
    n_kv_heads: int = 8  # key/value heads (grouped-query attention when < n_heads)
    head_dim: Optional[int] = None  # per-head size; null = d_model // n_heads
    rope: bool = True  # rotary position embeddings (Jamba's attention has none: its Mamba layers carry position)
    rope_theta: float = 10000.0  # RoPE base frequency
    sliding_window: Optional[int] = None  # attend only to the last N positions (Mistral/Mixtral); null = all
    impl: Literal["auto", "torch", "triton"] = (
        "auto"  # attention: torch = SDPA, triton = ours, auto = SDPA but ours for documents/prefix-LM on CUDA
    )
    mask: Literal["causal", "prefix"] = "causal"  # prefix = prefix-LM: a document's prompt tokens see each other
    qk_norm: Literal["none", "head", "full"] = "none"  # RMSNorm of q and k: per head (Qwen3), over all heads (OLMoE)
    qkv_bias: bool = False  # biases in the q, k and v projections (Qwen2)
    softmax_scale: Optional[float] = None  # multiplier of q·k before the softmax; null = 1/sqrt(head_dim) (Granite)
    output_gate: bool = False  # wq also gives a sigmoid gate per output channel, per head [q | gate] (Qwen3-Next)
    rope_fraction: float = 1.0  # RoPE rotates the first int(head_dim × this) dims of each head (Qwen3-Next: 0.25)


def attention_kernel(impl: str, device: torch.device | str = "cpu") -> Kernel:
    """`model.attention.impl` for a layer built for `device`, with `flash_attention`'s signature: SDPA ("torch",
    which "auto" takes everywhere: its flash / cuDNN backends on CUDA) or our Triton kernel ("triton")."""
    return resolve(
        impl, "model.attention.impl", device, sdpa, _triton_attention, "flash-attention kernel", auto_on_cuda="torch"
    )


def attention_kernels(impl: str, device: torch.device | str, head_dim: int) -> dict[str, Kernel]:
    """Mask kind → the kernel `model.attention.impl` takes for it on `device` (`attention_choice`), each with
    `sdpa`'s signature."""
    choice = attention_choice(impl, device, head_dim, why_no_triton(device))
    ours = attention_kernel("triton", device) if any(p.name == "triton" for p in choice.values()) else None
    return {kind: ours if path.name == "triton" else Kernel("torch", sdpa, path.slow) for kind, path in choice.items()}


def attention_cp_kernels(impl: str, device: torch.device | str, head_dim: int) -> dict[str, Kernel]:
    """Mask kind → the kernel the context-parallel path takes for it on `device` (`attention_cp_choice`), each
    with `sdpa_offset`'s signature: ours with a query offset, or SDPA one query block at a time."""
    choice = attention_cp_choice(impl, device, head_dim, why_no_triton(device))
    ours = attention_kernel("triton", device) if any(p.name == "triton" for p in choice.values()) else None
    return {
        kind: Kernel("triton", _flash_offset(ours.fn))
        if path.name == "triton"
        else Kernel("torch", sdpa_offset, path.slow)
        for kind, path in choice.items()
    }


def _flash_offset(flash_attention: Callable) -> Callable:
    """Our Triton kernel with `sdpa_offset`'s signature (it takes the query offset and longer keys itself)."""

    def attend(q, k, v, q_offset, softmax_scale=None, document_ids=None, prefix=None, window=None):
        return flash_attention(q, k, v, True, softmax_scale, document_ids, prefix, window, q_offset=q_offset)

    return attend


def _triton_attention():
    from moe_dist.kernels.flash_attention import flash_attention  # lazy: imports triton (kernel_choice.py)

    return flash_attention


@dataclass
class KVCache:
    """Keys and values of the positions processed so far, preallocated for `max_len` positions (inference)."""

    k: torch.Tensor  # (B, Hkv, max_len, Dh)
    v: torch.Tensor  # (B, Hkv, max_len, Dh)
    length: int = 0  # positions filled

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v (B, Hkv, S, Dh) after the filled positions; return views of all keys and values so far."""
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KVCache: {end} positions exceed the cache's max_len {self.k.shape[2]}")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(
        self,
        d_model: int,
        cfg: AttentionConfig,
        init_std: float,
        n_layers: int,
        device: torch.device | str = "cpu",
        norm_eps: float = 1e-5,
        norm_zero_centered: bool = False,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_dim or d_model // cfg.n_heads
        self.rope, self.rope_theta = cfg.rope, cfg.rope_theta
        self.rotary_dim = int(self.head_dim * cfg.rope_fraction)  # partial RoPE: the first rotary_dim dims per head
        if cfg.sliding_window is not None and cfg.sliding_window < 1:
            raise ValueError(f"model.attention.sliding_window: must be positive or null, got {cfg.sliding_window}")
        self.sliding_window = cfg.sliding_window
        # Gated attention (Qwen3-Next): wq's rows are per head [q (Dh) | gate (Dh)], so splitting them by heads
        # (tensor parallelism) keeps each head's gate with its query.
        self.output_gate = cfg.output_gate
        self.wq = nn.Linear(d_model, self.n_heads * self.head_dim * (2 if cfg.output_gate else 1), bias=cfg.qkv_bias)
        self.wk = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        # q/k RMSNorm before RoPE: over each head's Dh (Qwen3) or over the whole projection (OLMoE)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            full = cfg.qk_norm == "full"
            self.q_norm = RMSNorm(self.head_dim * (self.n_heads if full else 1), norm_eps, norm_zero_centered)
            self.k_norm = RMSNorm(self.head_dim * (self.n_kv_heads if full else 1), norm_eps, norm_zero_centered)
        self.wo = nn.Linear(self.n_heads * self.head_dim, d_model, bias=False)
        # softmax_scale (Granite's attention multiplier) in place of the kernels' 1/sqrt(Dh): q is pre-scaled
        self.q_scale = None if cfg.softmax_scale is None else cfg.softmax_scale * math.sqrt(self.head_dim)
        self.kernels = attention_kernels(cfg.impl, device, self.head_dim)  # mask kind → Kernel
        self.cp_kernels = attention_cp_kernels(cfg.impl, device, self.head_dim)  # the same, for query offsets
        self.mask = cfg.mask  # "causal" | "prefix": whether prefix-LM calls can come
        self.init_std = init_std
        self.out_std = init_std / math.sqrt(2 * n_layers)

    @property
    def implementations(self) -> dict[str, str]:
        """The causal kernel as "attention"; each masked kind this layer can meet that takes another kernel as
        "attention_<kind>" (e.g. "attention_documents": "triton" on CUDA)."""
        kinds = ["documents"] + ["prefix"] * (self.mask == "prefix") + ["window"] * (self.sliding_window is not None)
        names = {kind: "sdpa" if self.kernels[kind].name == "torch" else "triton" for kind in ["causal", *kinds]}
        return {"attention": names["causal"]} | {
            f"attention_{kind}": name for kind, name in names.items() if name != names["causal"]
        }

    def _attend(self, q, k, v, document_ids=None, prefix=None) -> torch.Tensor:
        """Training attention without a cache, by the kernel of the call's mask kind. (B, Hq, S, Dh)."""
        S = q.shape[2]
        window = self.sliding_window if self.sliding_window is not None and S > self.sliding_window else None
        kind = attention_mask_kind(document_ids is not None, prefix is not None, window is not None)
        masks = {} if kind == "causal" else {"document_ids": document_ids, "prefix": prefix, "window": window}
        return self.kernels[kind](q, k, v, causal=True, **masks)

    def _attend_shard(self, q, k, v, shard: SeqShard, document_ids=None, prefix=None) -> torch.Tensor:
        """Context parallelism: this rank's queries q (B, Hq, S/cp, Dh) (before RoPE) against the whole
        sequence's keys and values, gathered from the CP group; every position, mask and RoPE angle is global.

        All-gather, not a ring: with packed documents, prefix-LM and windows, which key pieces a query piece needs
        depends on the data, so a ring's fixed schedule would send and mask whole pieces for nothing, while one
        all-gather of K/V (only the KV heads: small under grouped-query attention) is a single collective whose
        backward (a reduce-scatter) returns each K/V gradient to the rank that owns the position. Llama 3 chose
        all-gather context parallelism for the same two reasons: any mask (document masks) is easy, and under
        grouped-query attention K and V are much smaller than Q (The Llama 3 Herd of Models, section 3.3.2)."""
        S = shard.seq_len
        if document_ids is not None and document_ids.shape != (q.shape[0], S):
            raise ValueError(
                f"attention: under context parallelism document_ids are the whole sequence's (B, S) = "
                f"{(q.shape[0], S)}, got {tuple(document_ids.shape)}"
            )
        prefix = prefix if document_ids is not None else None  # as without CP: prefix-LM is per document
        if self.rope:
            cos, sin = rope_cos_sin(S, self.rotary_dim, self.rope_theta, q.device)
            pos = shard.positions(q.device)  # (S/cp,) global position of each local one
            if document_ids is not None:
                pos = document_positions(document_ids)[:, pos]  # (B, S/cp): RoPE restarts at each document
                cos, sin = cos[pos][:, None], sin[pos][:, None]  # (B, 1, S/cp, R)
            else:
                cos, sin = cos[pos], sin[pos]  # (S/cp, R)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = shard.gather(k, dim=2), shard.gather(v, dim=2)  # (B, Hkv, S, Dh), global order
        window = self.sliding_window if self.sliding_window is not None and S > self.sliding_window else None
        kind = attention_mask_kind(document_ids is not None, prefix is not None, window is not None)
        kernel = self.cp_kernels[kind]
        out, local = [], 0
        for start, n in shard.pieces:  # each piece's queries sit at global positions start .. start + n − 1
            keys = S if prefix is not None else start + n  # causal: no key after the piece's last query
            piece = q[:, :, local : local + n]
            masks = {"document_ids": document_ids, "prefix": prefix, "window": window}
            out.append(kernel(piece, k[:, :, :keys], v[:, :, :keys], start, **masks))
            local += n
        return torch.cat(out, dim=2)

    @torch.no_grad()
    def init_weights(self) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, std=self.init_std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        nn.init.normal_(self.wo.weight, std=self.out_std)
        if self.qk_norm != "none":
            self.q_norm.init_weights()
            self.k_norm.init_weights()

    def new_cache(self, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> KVCache:
        shape = (batch, self.n_kv_heads, max_len, self.head_dim)
        return KVCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[KVCache] = None,
        document_ids: Optional[torch.Tensor] = None,
        prefix: Optional[torch.Tensor] = None,
        shard: Optional[SeqShard] = None,
    ) -> torch.Tensor:
        """x (B, S, D) → (B, S, D). With a cache (inference), x holds the S positions after the cached ones.
        `document_ids` (B, S) int (packed documents, training): a query sees only keys of its own document and
        RoPE positions restart at each document; `prefix` (B, S) bool with them: prompt tokens see each other.
        With a `shard` (context parallelism), x holds this rank's S / cp positions of the sequence (its pieces, in
        local order) while `document_ids` and `prefix` are the whole sequence's (B, shard.seq_len)."""
        if shard is not None and cache is not None:
            raise ValueError("attention: context parallelism (a SeqShard) is for training, without a KV cache")
        B, S, _ = x.shape
        pos = 0 if cache is None else cache.length
        q, k = self.wq(x), self.wk(x)  # (B, S, Hq·Dh) (Hq·2Dh with the output gate), (B, S, Hkv·Dh)
        gate = None
        if self.output_gate:
            q, gate = q.view(B, S, -1, 2 * self.head_dim).chunk(2, dim=-1)  # per head [q | gate]
            q, gate = q.reshape(B, S, -1), gate.reshape(B, S, -1)  # (B, S, Hq·Dh) each
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, Hq, S, Dh)
        k = k.view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        v = self.wv(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_scale is not None:
            q = q * self.q_scale
        if shard is not None:
            return self._output(self._attend_shard(q, k, v, shard, document_ids, prefix), gate)
        if document_ids is not None:
            if cache is not None:
                raise ValueError("attention: document_ids are for training, without a KV cache")
            if self.rope:
                cos, sin = rope_cos_sin(S, self.rotary_dim, self.rope_theta, x.device)
                p = document_positions(document_ids)  # (B, S)
                cos, sin = cos[p][:, None], sin[p][:, None]  # (B, 1, S, Dh)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = self._attend(q, k, v, document_ids, prefix)  # (B, Hq, S, Dh)
            return self._output(out, gate)
        if self.rope:
            cos, sin = rope_cos_sin(pos + S, self.rotary_dim, self.rope_theta, x.device)
            q, k = apply_rope(q, cos[pos:], sin[pos:]), apply_rope(k, cos[pos:], sin[pos:])
        if cache is not None:
            k, v = cache.append(k, v)  # (B, Hkv, pos + S, Dh)
        if cache is None:
            out = self._attend(q, k, v)  # (B, Hq, S, Dh)
        else:
            mask = window_mask(S, pos + S, pos, self.sliding_window, x.device)  # (S, pos + S)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        return self._output(out, gate)

    def _output(self, out: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        """Heads out (B, Hq, S, Dh) → wo(concatenated heads), each channel times sigmoid(gate) first if gated."""
        B, _, S, _ = out.shape
        out = out.transpose(1, 2).reshape(B, S, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.wo(out)


# ------------------------------------------------------------------------------------------ the kind


def _head_dim(m) -> int:
    return m.attention.head_dim or m.d_model // m.attention.n_heads


def _split_tp(attn: Attention, tp: TensorSplit) -> None:
    """Heads split over TP (config rule: both head counts divisible by tp): q/k/v rows and wo columns by head."""
    for lin in (attn.wq, attn.wk, attn.wv):
        tp.shard(lin, "weight", 0)  # heads are contiguous blocks of rows
        if lin.bias is not None:
            tp.shard(lin, "bias", 0)
    if attn.qk_norm == "head":  # one weight shared by every head: each rank's heads give part of its gradient
        for norm in (attn.q_norm, attn.k_norm):
            tp.sum_grad(norm.weight)
    tp.shard(attn.wo, "weight", 1)
    attn.n_heads //= tp.tp
    attn.n_kv_heads //= tp.tp
    tp.region(attn)


def _check(cfg, placed: bool) -> None:
    """The section's rules (checked whether or not a layer places attention: its defaults pass them)."""
    m, a = cfg.model, cfg.model.attention
    require(
        a.mask == "causal" or cfg.data.document_masking,
        "model.attention.mask: 'prefix' needs data.document_masking=true (the prompt is found per document)",
    )
    require(
        a.softmax_scale is None or a.softmax_scale > 0,
        f"model.attention.softmax_scale: must be positive or null, got {a.softmax_scale}",
    )
    require(
        a.n_heads > 0 and a.n_kv_heads > 0 and a.n_heads % a.n_kv_heads == 0,
        f"model.attention.n_kv_heads: must divide n_heads={a.n_heads}, got {a.n_kv_heads}",
    )
    if a.head_dim is None:
        require(
            m.d_model % a.n_heads == 0,
            f"model.attention.n_heads: must divide d_model={m.d_model} when head_dim is null, got {a.n_heads}",
        )
    rotary = int((a.head_dim or m.d_model // max(a.n_heads, 1)) * a.rope_fraction)
    require(
        0 < a.rope_fraction <= 1 and rotary % 2 == 0 and rotary > 0,
        f"model.attention.rope_fraction: must be in (0, 1] and rotate an even number of head dims, "
        f"got {a.rope_fraction} ({rotary} dims)",
    )


def _slow_paths(cfg, attn: Attention, device: torch.device) -> list[str]:
    """The run's mask kind on CUDA without a fast kernel: what the layer chose for it when it was built (under
    context parallelism the query-offset kernels, `cp_kernels`, run instead), not chosen again here."""
    if device.type != "cuda":
        return []
    a, documents = cfg.model.attention, cfg.data.document_masking
    window = a.sliding_window is not None and cfg.train.seq_len > a.sliding_window
    kind = attention_mask_kind(documents, documents and a.mask == "prefix", window)
    slow = (attn.cp_kernels if cfg.parallel.cp > 1 else attn.kernels)[kind].slow
    return [slow] if slow else []


def _check_tp(cfg) -> None:
    a, tp = cfg.model.attention, cfg.parallel.tp
    require(
        a.qk_norm != "full",
        "model.attention.qk_norm: 'full' (one norm over all heads) is not supported with parallel.tp > 1",
    )
    divides(a.n_heads, "model.attention.n_heads", "query heads", tp)
    divides(a.n_kv_heads, "model.attention.n_kv_heads", "key/value heads", tp)


def _activation_bytes(cfg, tp: int, cp: int, a: int) -> float:
    """Per token: q, the whole sequence's gathered K/V under CP (cp times the local), the output and its fp32
    softmax statistics; the gate and its sigmoid; the q/k norms' tensors, or partial RoPE's unrotated copy."""
    m = cfg.model
    hd, hq, hkv = _head_dim(m), m.attention.n_heads // tp, m.attention.n_kv_heads // tp
    inner = (2 * hq + 2 * cp * hkv) * hd * a + 4 * hq
    if m.attention.output_gate:  # the gate and its sigmoid, for the product's backward
        inner += 2 * hq * hd * a
    qk = (hq + hkv) * hd * a  # one copy of this rank's q and k
    if m.attention.qk_norm != "none":  # the norms' input, normalised and output (head) / two (full), rstd
        inner += (3 if m.attention.qk_norm == "head" else 2) * qk + 4 * (hq + hkv)
    elif m.attention.rope_fraction < 1:  # partial RoPE keeps a copy of the unrotated channels (with a q/k
        inner += (1 - m.attention.rope_fraction) * qk  # norm, its output kept above is that copy)
    return inner


def _collectives(cfg, tp: int, cp: int, tokens: int, a: int):
    """Under CP the whole sequence's K and V (this rank's KV heads) all-gathered; backward reduce-scatters them."""
    m, t = cfg.model, cfg.train
    kv = t.micro_batch_size * t.seq_len * (m.attention.n_kv_heads // tp) * _head_dim(m) * a  # K or V, whole
    return [("all_gather", "cp_kv", "cp", kv, 2, 0), ("reduce_scatter", "cp_kv", "cp", kv, 0, 2)]


KIND = LayerKind(
    config=AttentionConfig,
    name="attention",
    role="mixer",
    module=Attention,
    build=lambda m, device: Attention(
        m.d_model, m.attention, m.init_std, m.n_layers, device, m.norm_eps, m.norm_zero_centered
    ),
    part="attention",
    section="attention",
    letter="A",
    doc="causal attention with grouped-query heads",
    check=_check,
    check_tp=_check_tp,
    tp_rule=_split_tp,
    compilable=True,
    prefix_lm=lambda m: m.attention.mask == "prefix",
    slow_paths=_slow_paths,
    new_state=lambda attn, batch, max_len, device, dtype: attn.new_cache(batch, max_len, device, dtype),
    flops_per_token=lambda m, S: 2.0 * S * m.attention.n_heads * _head_dim(m),  # QKᵀ and AV, causal: half of 4·S·H·Dh
    activation_bytes=_activation_bytes,
    collectives=_collectives,
    cp_gathered_bytes=lambda m, tp, a: 2 * a * m.attention.n_kv_heads * _head_dim(m) / tp,
)
