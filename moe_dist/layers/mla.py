"""Multi-head Latent Attention (DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1): keys and values of every head come from one
low-rank latent per token, plus one small RoPE key shared by all heads.

Per token, with H heads, query/key head size dq = dn + dr (a no-RoPE part dn and a RoPE part dr) and value head
size dv (which may differ from dq):
    query   q = wq(x), or wq_b(q_norm(wq_a(x))) through a rank-`q_lora_rank` bottleneck        (H·dq)
    latent  [c | k_r] = wkv_a(x); c = kv_norm(c) (`kv_lora_rank` = C values); k_r rotated        (C + dr)
    keys    k_h = [wkv_b(c)_h's first dn | k_r] (k_r the same for every head); values wkv_b(c)_h's last dv
    out     wo(softmax(q_h · k_h · scale) v_h, heads concatenated)
Generation caches only [c | k_r] per token (C + dr values, 576 for DeepSeek-V3, against H·(dq + dv) = 40,960 for
per-head K/V) and up-projects it at every step (`MLACache`); context parallelism gathers the same C + dr values per
position over the CP group and up-projects them on each rank (`_attend_shard`). The RoPE slice may be stored
interleaved (pairs (x0, x1), (x2, x3), ...: the DeepSeek checkpoints' `rope_interleave`): it is then de-interleaved
to the half-split layout before the rotation, in q and k alike, so the scores are those of the interleaved rotation
(a dot product does not see a permutation applied to both sides). Kimi Linear's MLA layers apply no RoPE (`rope`
false): the dr part is then a plain key part.

Attention runs on PyTorch SDPA on every device (sdpa.py's masked SDPA: causal, documents, prefix-LM), chosen
once through kernel_choice (`model.mla.impl`): SDPA takes a value head size other than the query/key one, which our
Triton flash-attention kernel does not, so "triton" is refused by name until a kernel takes dv != dq.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.config.errors import require
from moe_dist.layers.kernel_choice import resolve
from moe_dist.layers.kind import LayerKind, TensorSplit, divides
from moe_dist.layers.norm import RMSNorm
from moe_dist.layers.rope import (
    RopeScaling,
    apply_rope,
    check_rope_scaling,
    document_positions,
    rope_cos_sin,
    yarn_mscale,
)
from moe_dist.layers.sdpa import sdpa, sdpa_offset, window_mask
from moe_dist.layers.sequence_shard import SeqShard


@dataclass
class MLAConfig:
    n_heads: int = 8  # attention heads
    q_lora_rank: Optional[int] = None  # query bottleneck rank (DeepSeek-V3: 1536); null = full-rank query (Moonlight)
    kv_lora_rank: int = 64  # the latent's size C: keys and values are up-projected from it (DeepSeek-V3: 512)
    qk_nope_head_dim: int = 32  # per-head query/key part without RoPE (DeepSeek-V3: 128)
    qk_rope_head_dim: int = 16  # query part with RoPE, and the RoPE key shared by all heads (DeepSeek-V3: 64)
    v_head_dim: int = 32  # per-head value size (DeepSeek-V3: 128)
    rope: bool = True  # rotate the qk_rope_head_dim part (Kimi Linear's MLA layers: false, no position signal)
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_interleave: bool = False  # the RoPE part is stored in interleaved pairs (DeepSeek checkpoints: true)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # RoPE frequency scaling (YaRN)
    softmax_scale: Optional[float] = (
        None  # multiplier of q·k; null = 1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)² under YaRN
    )
    norm_eps: float = 1e-6  # epsilon of the query and latent RMSNorms (transformers' DeepSeek-V3 fixes 1e-6)
    mask: Literal["causal", "prefix"] = "causal"  # prefix = prefix-LM: a document's prompt tokens see each other
    impl: Literal["auto", "torch", "triton"] = (
        "auto"  # attention: torch = SDPA (auto takes it everywhere); no triton yet
    )

    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def scale(self) -> float:
        """The softmax scale: as given, or 1/sqrt(dq) with DeepSeek's YaRN temperature squared (it scales q and k)."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        s, scale = self.rope_scaling, self.qk_head_dim() ** -0.5
        if s.type == "yarn" and s.mscale_all_dim:
            scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return scale


@dataclass
class MLACache:
    """The normalised latent and the rotated RoPE key of the positions processed so far (inference), preallocated
    for `max_len` positions: C + dr values per token, whatever the number of heads."""

    latent: torch.Tensor  # (B, max_len, C)
    k_rope: torch.Tensor  # (B, 1, max_len, dr)
    length: int = 0  # positions filled

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store latent (B, S, C) and k_rope (B, 1, S, dr) after the filled positions; return views of all so far."""
        end = self.length + latent.shape[1]
        if end > self.latent.shape[1]:
            raise ValueError(f"MLACache: {end} positions exceed the cache's max_len {self.latent.shape[1]}")
        self.latent[:, self.length : end] = latent
        self.k_rope[:, :, self.length : end] = k_rope
        self.length = end
        return self.latent[:, :end], self.k_rope[:, :, :end]


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., dr) in interleaved pairs (x0, x1, x2, x3, ...) → half-split (x0, x2, ..., x1, x3, ...)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLA(nn.Module):
    def __init__(
        self, d_model: int, cfg: MLAConfig, init_std: float, n_layers: int, device: torch.device | str = "cpu"
    ):
        super().__init__()
        self.cfg = cfg
        self.n_heads = cfg.n_heads
        self.dn, self.dr, self.dv, self.dq = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.qk_head_dim(),
        )
        self.kv_lora_rank = cfg.kv_lora_rank
        # Rows of wq / wq_b are per head [nope (dn) | rope (dr)], of wkv_b per head [k nope (dn) | v (dv)]: heads are
        # contiguous blocks of rows, which the tensor-parallel split relies on.
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(d_model, self.n_heads * self.dq, bias=False)
        else:
            self.wq_a = nn.Linear(d_model, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.dq, bias=False)
        self.wkv_a = nn.Linear(d_model, cfg.kv_lora_rank + self.dr, bias=False)  # [latent (C) | RoPE key (dr)]
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, self.n_heads * (self.dn + self.dv), bias=False)
        self.wo = nn.Linear(self.n_heads * self.dv, d_model, bias=False)
        self.scale = cfg.scale()
        # SDPA's signature (sdpa.py); our flash-attention kernel takes one head size for q, k and v
        self.kernel = resolve(cfg.impl, "model.mla.impl", device, sdpa, None, "MLA attention", auto_on_cuda="torch")
        # the same under context parallelism, with a query offset (sdpa.py's sdpa_offset: query blocks)
        self.cp_kernel = resolve(
            cfg.impl, "model.mla.impl", device, sdpa_offset, None, "MLA attention", auto_on_cuda="torch"
        )
        self.init_std = init_std
        self.out_std = init_std / math.sqrt(2 * n_layers)

    @property
    def implementations(self) -> dict[str, str]:
        return {"mla": "sdpa"}

    @torch.no_grad()
    def init_weights(self) -> None:
        projections = [self.wkv_a, self.wkv_b] + ([self.wq] if self.cfg.q_lora_rank is None else [self.wq_a, self.wq_b])
        for lin in projections:
            nn.init.normal_(lin.weight, std=self.init_std)
        nn.init.normal_(self.wo.weight, std=self.out_std)
        self.kv_norm.init_weights()
        if self.cfg.q_lora_rank is not None:
            self.q_norm.init_weights()

    def new_cache(self, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> MLACache:
        return MLACache(
            torch.zeros(batch, max_len, self.kv_lora_rank, device=device, dtype=dtype),
            torch.zeros(batch, 1, max_len, self.dr, device=device, dtype=dtype),
        )

    def _rope(self, q_rope, k_rope, positions: torch.Tensor, length: int):
        """Rotate q_rope (B, H, S, dr) and k_rope (B, 1, S, dr) by `positions`, (S,) or per row (B, S) (each
        document's own), all below `length`."""
        if self.cfg.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        if not self.cfg.rope:
            return q_rope, k_rope
        cos, sin = rope_cos_sin(length, self.dr, self.cfg.rope_theta, q_rope.device, self.cfg.rope_scaling)
        cos, sin = cos[positions], sin[positions]  # (S, dr) or (B, S, dr)
        if positions.ndim == 2:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, S, dr)
        return apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)

    def _keys_values(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent (B, T, C) and the rotated k_rope (B, 1, T, dr) → keys (B, H, T, dq) and values (B, H, T, dv)."""
        B, T, _ = latent.shape
        H, dn, dv = self.n_heads, self.dn, self.dv
        k_nope, v = self.wkv_b(latent).view(B, T, H, dn + dv).transpose(1, 2).split([dn, dv], dim=-1)
        return torch.cat([k_nope, k_rope.expand(B, H, T, self.dr)], dim=-1), v

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[MLACache] = None,
        document_ids: Optional[torch.Tensor] = None,
        prefix: Optional[torch.Tensor] = None,
        shard: Optional[SeqShard] = None,
    ) -> torch.Tensor:
        """x (B, S, D) → (B, S, D). With a cache (inference), x holds the S positions after the cached ones.
        `document_ids` (B, S) int (packed documents, training): a query sees only keys of its own document and RoPE
        positions restart at each document; `prefix` (B, S) bool with them: prompt tokens see each other. With a
        `shard` (context parallelism), x holds this rank's S / cp positions (its pieces, in local order) while
        `document_ids` and `prefix` are the whole sequence's (B, shard.seq_len)."""
        if document_ids is not None and cache is not None:
            raise ValueError("mla: document_ids are for training, without a cache")
        if shard is not None and cache is not None:
            raise ValueError("mla: context parallelism (a SeqShard) is for training, without a cache")
        B, S, _ = x.shape
        H, dn, dv = self.n_heads, self.dn, self.dv
        q = self.wq(x) if self.cfg.q_lora_rank is None else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(B, S, H, self.dq).transpose(1, 2).split([dn, self.dr], dim=-1)  # (B, H, S, dn | dr)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.dr], dim=-1)  # (B, S, C), (B, S, dr)
        latent = self.kv_norm(latent)
        if shard is not None:
            out = self._attend_shard(q_nope, q_rope, latent, k_rope[:, None], shard, document_ids, prefix)
            return self.wo(out.transpose(1, 2).reshape(B, S, H * dv))
        pos = 0 if cache is None else cache.length
        positions = torch.arange(pos, pos + S, device=x.device)
        if document_ids is not None:
            positions = document_positions(document_ids)  # (B, S): RoPE restarts at each document
        q_rope, k_rope = self._rope(q_rope, k_rope[:, None], positions, pos + S)  # (B, H, S, dr), (B, 1, S, dr)
        if cache is not None:
            latent, k_rope = cache.append(latent, k_rope)  # (B, T, C), (B, 1, T, dr) with T = pos + S
        k, v = self._keys_values(latent, k_rope)  # (B, H, T, dq), (B, H, T, dv)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, S, dq)
        if cache is None:
            masks = {} if document_ids is None else {"document_ids": document_ids, "prefix": prefix}
            out = self.kernel(q, k, v, causal=True, softmax_scale=self.scale, **masks)  # (B, H, S, dv)
        else:
            mask = window_mask(S, k.shape[2], pos, None, x.device)  # (S, T): causal from position pos on
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(B, S, H * dv))

    def _attend_shard(self, q_nope, q_rope, latent, k_rope, shard: SeqShard, document_ids=None, prefix=None):
        """Context parallelism by the latent: this rank's queries (B, H, S/cp, dn | dr) against the whole sequence's
        keys and values, up-projected here from the gathered latent and RoPE key: one all-gather of C + dr values per
        position (576 for DeepSeek-V3) instead of per-head keys and values (H·(dq + dv): 40,960 for DeepSeek-V3), at
        the price of every CP rank running wkv_b over the whole sequence. Its backward (a reduce-scatter) returns each
        position's latent gradient to the rank that owns it. Positions, masks and RoPE angles are global; all-gather
        rather than a ring for attention.py's reasons (any mask). → (B, H, S/cp, dv)."""
        S = shard.seq_len
        B = q_nope.shape[0]
        if document_ids is not None and document_ids.shape != (B, S):
            raise ValueError(
                f"mla: under context parallelism document_ids are the whole sequence's (B, S) = {(B, S)}, "
                f"got {tuple(document_ids.shape)}"
            )
        prefix = prefix if document_ids is not None else None  # as without CP: prefix-LM is per document
        positions = shard.positions(q_nope.device)  # (S/cp,) global position of each local one
        if document_ids is not None:
            positions = document_positions(document_ids)[:, positions]  # (B, S/cp): RoPE restarts at each document
        q_rope, k_rope = self._rope(q_rope, k_rope, positions, S)
        whole = shard.gather(torch.cat([latent, k_rope[:, 0]], dim=-1), dim=1)  # (B, S, C + dr), global order
        latent, k_rope = whole.split([self.kv_lora_rank, self.dr], dim=-1)
        k, v = self._keys_values(latent, k_rope[:, None])  # (B, H, S, dq), (B, H, S, dv)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, S/cp, dq)
        out, local = [], 0
        for start, n in shard.pieces:  # each piece's queries sit at global positions start .. start + n − 1
            keys = S if prefix is not None else start + n  # causal: no key after the piece's last query
            masks = {"document_ids": document_ids, "prefix": prefix}
            out.append(
                self.cp_kernel(q[:, :, local : local + n], k[:, :, :keys], v[:, :, :keys], start, self.scale, **masks)
            )
            local += n
        return torch.cat(out, dim=2)


# ------------------------------------------------------------------------------------------ the kind


def _split_tp(mla: MLA, tp: TensorSplit) -> None:
    """Heads split over TP: the query (or its up-projection wq_b) and wkv_b by row blocks of whole heads, wo by
    columns. The down-projections wq_a and wkv_a and their norms stay replicated: they are small (D × (q_lora_rank +
    kv_lora_rank + dr): 15.1M of DeepSeek-V3's 187M attention weights per layer, 8%), every head needs the whole
    latent (the RMSNorm is over all C of it) and the shared RoPE key, and splitting them would add an all-reduce per
    projection where replication adds none. Each rank's heads give part of their gradient: summed over the group."""
    up = mla.wq if mla.cfg.q_lora_rank is None else mla.wq_b
    tp.shard(up, "weight", 0)
    tp.shard(mla.wkv_b, "weight", 0)
    tp.shard(mla.wo, "weight", 1)
    replicated = [mla.wkv_a.weight, mla.kv_norm.weight]
    if mla.cfg.q_lora_rank is not None:
        replicated += [mla.wq_a.weight, mla.q_norm.weight]
    for p in replicated:
        tp.sum_grad(p)
    mla.n_heads //= tp.tp
    tp.region(mla)


def _check(cfg, placed: bool) -> None:
    """The section's rules (checked whether or not a layer places MLA: its defaults pass them)."""
    a = cfg.model.mla
    for key in ("n_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        require(getattr(a, key) > 0, f"model.mla.{key}: must be positive, got {getattr(a, key)}")
    require(
        a.q_lora_rank is None or a.q_lora_rank > 0,
        f"model.mla.q_lora_rank: must be positive or null, got {a.q_lora_rank}",
    )
    require(
        a.qk_rope_head_dim > 0 and a.qk_rope_head_dim % 2 == 0,
        f"model.mla.qk_rope_head_dim: RoPE rotates pairs, must be positive and even, got {a.qk_rope_head_dim}",
    )
    require(a.norm_eps > 0, f"model.mla.norm_eps: must be positive, got {a.norm_eps}")
    require(
        a.softmax_scale is None or a.softmax_scale > 0,
        f"model.mla.softmax_scale: must be positive or null, got {a.softmax_scale}",
    )
    require(
        a.mask == "causal" or cfg.data.document_masking,
        "model.mla.mask: 'prefix' needs data.document_masking=true (the prompt is found per document)",
    )
    check_rope_scaling(a.rope_scaling, "model.mla.rope_scaling")


def _activation_bytes(cfg, tp: int, cp: int, a: int) -> float:
    """Per token: the replicated down-projections' outputs and norm outputs (query bottleneck, latent, RoPE key
    before and after rotation); per head on this rank the query before and after RoPE (2·dq), the output and its
    (B, S, H·dv) copy for wo (2·dv); the keys and values kept for the backward, wkv_b's output (dn + dv) and the key
    (dq), of the whole sequence under CP (cp times the local), with the gathered latent and RoPE key (C + dr per
    position, cp times the local); fp32 softmax statistics."""
    m = cfg.model.mla
    h, dq, dn, dv = m.n_heads // tp, m.qk_head_dim(), m.qk_nope_head_dim, m.v_head_dim
    latent = 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + 2 * m.qk_rope_head_dim
    gathered = cp * (m.kv_lora_rank + m.qk_rope_head_dim) if cp > 1 else 0
    return (latent + gathered + h * (2 * dq + 2 * dv + cp * (dn + dv + dq))) * a + 4 * h


def _cp_gathered_bytes(m, tp: int, a: int) -> float:
    """Per position of the whole sequence under CP: the gathered latent and RoPE key (replicated over TP), and the
    keys and values this rank's heads up-project from it and keep for the backward."""
    x = m.mla
    return a * (
        x.kv_lora_rank + x.qk_rope_head_dim + x.n_heads // tp * (x.qk_nope_head_dim + x.v_head_dim + x.qk_head_dim())
    )


def _collectives(cfg, tp: int, cp: int, tokens: int, a: int):
    """Under CP the whole sequence's latent and RoPE key (C + dr per position) all-gathered in forward; their
    gradient reduce-scattered in backward."""
    m, t = cfg.model.mla, cfg.train
    whole = t.micro_batch_size * t.seq_len * (m.kv_lora_rank + m.qk_rope_head_dim) * a
    return [("all_gather", "cp_latent", "cp", whole, 1, 0), ("reduce_scatter", "cp_latent", "cp", whole, 0, 1)]


KIND = LayerKind(
    config=MLAConfig,
    name="mla",
    role="mixer",
    module=MLA,
    build=lambda m, device: MLA(m.d_model, m.mla, m.init_std, m.n_layers, device),
    part="attention",
    section="mla",
    letter="L",
    doc="Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2, Moonlight)",
    check=_check,
    check_tp=lambda cfg: divides(cfg.model.mla.n_heads, "model.mla.n_heads", "MLA heads", cfg.parallel.tp),
    tp_rule=_split_tp,
    prefix_lm=lambda m: m.mla.mask == "prefix",
    new_state=lambda mla, batch, max_len, device, dtype: mla.new_cache(batch, max_len, device, dtype),
    # QKᵀ over dq and AV over dv per head, causal: half of 2·S·H·(dq + dv)
    flops_per_token=lambda m, S: 1.0 * S * m.mla.n_heads * (m.mla.qk_head_dim() + m.mla.v_head_dim),
    activation_bytes=_activation_bytes,
    collectives=_collectives,
    cp_gathered_bytes=_cp_gathered_bytes,
)
