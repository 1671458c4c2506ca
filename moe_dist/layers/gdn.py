"""Gated DeltaNet mixer (Yang, Kautz & Hatamizadeh, 2024), the linear-attention layer of Qwen3-Next.

Parameter names and the packing of the fused projections follow the Hugging Face Qwen3-Next checkpoints
(in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm, out_proj), so an importer maps them 1:1.
Single-device math; `apply_tp` (moe_dist/parallel/tensor_parallel.py) splits the heads over TP ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.config.errors import require
from moe_dist.layers import state_passing as sp
from moe_dist.layers.causal_conv import causal_conv, causal_conv_step
from moe_dist.layers.delta_rule import chunk_gated_delta_rule
from moe_dist.layers.kernel_choice import Kernel, recurrent_kernel
from moe_dist.layers.kind import LayerKind, TensorSplit, divides, piece_collectives
from moe_dist.layers.norm import GatedRMSNorm
from moe_dist.layers.sequence_shard import SeqShard
from moe_dist.layers.step_size import inverse_softplus_step_sizes


@dataclass
class GDNConfig:
    n_k_heads: int = 2  # query/key heads (Qwen3-Next: linear_num_key_heads)
    n_v_heads: int = 4  # value heads, a multiple of n_k_heads; each key head serves n_v_heads / n_k_heads of them
    head_k_dim: int = 64  # per-head query/key size (the state is head_k_dim × head_v_dim per value head)
    head_v_dim: int = 64  # per-head value size
    conv_size: int = 4  # width of the causal depthwise conv over q, k and v
    chunk_size: int = 64  # chunk length of the chunked PyTorch delta rule (a power of two); the result is the same
    impl: Literal["auto", "torch", "triton"] = "auto"  # delta rule: torch = chunked; triton = fla-core's (extra `fla`)


# The range of A = exp(A_log) at init (Qwen3-Next: U(0.01, 16), kept away from 0 so log A is finite); the step
# size's is step_size.py's (fla's GatedDeltaNet, as Mamba's).
_A_MIN, _A_MAX = 0.01, 16.0
_L2_EPS = 1e-6  # q, k ← x / sqrt(Σx² + eps), as Qwen3-Next and fla normalise them


def delta_rule_kernel(
    impl: str, device: torch.device | str = "cpu", chunk_size: int = 64, head_k_dim: int = 128
) -> Kernel:
    """`model.gdn.impl` for a layer built for `device`, with `gated_delta_rule_ref`'s signature: the chunked
    PyTorch path (`moe_dist.layers.delta_rule`), or fla-core's chunked Triton kernels (`moe_dist.layers.fla_ops`;
    see there why)."""
    fla_key_dim = ("model.gdn.head_k_dim", head_k_dim)
    return recurrent_kernel(
        impl, "model.gdn.impl", device, chunk_gated_delta_rule, chunk_size, _fla_rule, "gated delta rule", fla_key_dim
    )


def _fla_rule():
    from moe_dist.layers.fla_ops import fla_gated_delta_rule  # lazy: imported only when chosen (resolve)

    return fla_gated_delta_rule


@dataclass
class GDNState:
    """The recurrent state of one Gated DeltaNet layer between inference calls (zeros before the first position)."""

    conv: torch.Tensor  # (B, conv_dim, conv_size - 1): the conv's last inputs (q, k, v channels), oldest first
    recurrent: torch.Tensor  # (B, n_v_heads, head_k_dim, head_v_dim): the delta-rule state S, in fp32 (at least)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    x = x.to(compute)
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + _L2_EPS)


class GatedDeltaNet(nn.Module):
    """x → in_proj_qkvz → (q, k, v, z), in_proj_ba → (b, a); q, k, v → causal depthwise conv → SiLU; q, k
    L2-normalised; β = sigmoid(b), g = −exp(A_log) · softplus(a + dt_bias); o = gated delta rule(q, k, v, g, β);
    out_proj(gated RMSNorm(o, z)). Input and output are (batch, seq, d_model).

    Each key head serves n_v_heads / n_k_heads consecutive value heads. `__init__` only declares parameters so
    the layer can be built on the meta device; `init_weights` fills them.
    """

    def __init__(
        self, d_model: int, cfg: GDNConfig, norm_eps: float, init_std: float, device: torch.device | str = "cpu"
    ):
        super().__init__()
        if cfg.n_v_heads % cfg.n_k_heads:
            raise ValueError(f"model.gdn.n_k_heads: must divide n_v_heads={cfg.n_v_heads}, got {cfg.n_k_heads}")
        self.n_k_heads, self.n_v_heads = cfg.n_k_heads, cfg.n_v_heads
        self.head_k_dim, self.head_v_dim = cfg.head_k_dim, cfg.head_v_dim
        self.key_dim, self.value_dim = cfg.n_k_heads * cfg.head_k_dim, cfg.n_v_heads * cfg.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.init_std = init_std
        self.rule = delta_rule_kernel(cfg.impl, device, cfg.chunk_size, cfg.head_k_dim)

        # Packed per key head (Qwen3-Next's layout): [q (dk), k (dk), v (r·dv), z (r·dv)] and [b (r), a (r)],
        # r = n_v_heads / n_k_heads.
        self.in_proj_qkvz = nn.Linear(d_model, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(d_model, 2 * self.n_v_heads, bias=False)
        # Channels [q, k, v], each head-major.
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, cfg.conv_size, groups=self.conv_dim, padding=cfg.conv_size - 1, bias=False
        )
        self.dt_bias = nn.Parameter(torch.empty(self.n_v_heads))  # inside the softplus of the decay
        self.A_log = nn.Parameter(torch.empty(self.n_v_heads))  # g = −exp(A_log)·Δ < 0: the state only decays
        self.norm = GatedRMSNorm(self.head_v_dim, norm_eps, gate_first=False)  # per head
        self.out_proj = nn.Linear(self.value_dim, d_model, bias=False)

    @property
    def implementations(self) -> dict[str, str]:
        return {"delta_rule": self.rule.name}

    def init_weights(self) -> None:
        """In place, from the global RNG: projections N(0, init_std), the conv as nn.Conv1d's own default, A as
        Qwen3-Next, Δ = softplus(dt_bias) log-uniform in [dt_min, dt_max] as fla's GatedDeltaNet."""
        with torch.no_grad():
            for linear in (self.in_proj_qkvz, self.in_proj_ba, self.out_proj):
                nn.init.normal_(linear.weight, mean=0.0, std=self.init_std)
            nn.init.kaiming_uniform_(self.conv1d.weight, a=math.sqrt(5))
            a = torch.empty_like(self.A_log, dtype=torch.float32).uniform_(_A_MIN, _A_MAX)
            self.A_log.copy_(torch.log(a))
            self.dt_bias.copy_(inverse_softplus_step_sizes(self.n_v_heads, self.dt_bias.device))
            self.norm.init_weights()

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> GDNState:
        return GDNState(
            torch.zeros(batch, self.conv_dim, self.conv1d.kernel_size[0] - 1, device=device, dtype=dtype),
            torch.zeros(
                batch,
                self.n_v_heads,
                self.head_k_dim,
                self.head_v_dim,
                device=device,
                dtype=torch.promote_types(dtype, torch.float32),
            ),
        )

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, L, d_model) → conv input (B, conv_dim, L), z (B, L, Hv, dv), b and a (B, L, Hv)."""
        batch, seqlen, _ = x.shape
        hk, dk, dv, r = self.n_k_heads, self.head_k_dim, self.head_v_dim, self.n_v_heads // self.n_k_heads
        qkvz = self.in_proj_qkvz(x).view(batch, seqlen, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)  # per key head
        b, a = self.in_proj_ba(x).view(batch, seqlen, hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([t.reshape(batch, seqlen, -1) for t in (q, k, v)], dim=-1)  # (B, L, conv_dim)
        z = z.reshape(batch, seqlen, self.n_v_heads, dv)
        return qkv.transpose(1, 2), z, b.reshape(batch, seqlen, -1), a.reshape(batch, seqlen, -1)

    def _mix(self, qkv, z, b, a, initial_state=None, reset=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Conv output qkv (B, conv_dim, L) after SiLU → (out (B, L, d_model), final state)."""
        q, k, v, g, beta = self._rule_inputs(qkv, b, a)
        o, state = self.rule(q, k, v, g, beta, initial_state=initial_state, reset=reset)  # (B, L, Hv, dv)
        return self._output(o, z), state

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The rule's output o (B, L, Hv, dv) → gated norm with z → out_proj: (B, L, d_model)."""
        return self.out_proj(self.norm(o, z).reshape(*o.shape[:2], self.value_dim))

    def _rule_inputs(self, qkv, b, a):
        """Conv output qkv (B, conv_dim, L) after SiLU, b and a (B, L, Hv) → the rule's q, k, v, g, β."""
        batch, seqlen = b.shape[:2]
        q, k, v = qkv.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = self.n_v_heads // self.n_k_heads
        q, k = (_l2norm(t.reshape(batch, seqlen, self.n_k_heads, self.head_k_dim)) for t in (q, k))
        if r > 1:  # key head h serves value heads h·r … h·r + r − 1
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)  # (B, L, Hv, dk)
        v = v.reshape(batch, seqlen, self.n_v_heads, self.head_v_dim)  # (B, L, Hv, dv)
        # In fp32 at least: under bf16, −exp(A_log) would lose its spread and the decay its precision.
        compute = torch.promote_types(a.dtype, torch.float32)
        beta = torch.sigmoid(b.to(compute))  # (B, L, Hv)
        g = -torch.exp(self.A_log.to(compute)) * F.softplus(a.to(compute) + self.dt_bias.to(compute))
        return q, k, v, g, beta

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[GDNState] = None,
        document_ids: Optional[torch.Tensor] = None,
        shard: Optional[SeqShard] = None,
        **_,
    ) -> torch.Tensor:
        """x (B, L, d_model) → (B, L, d_model). With a state (inference), x continues the sequence it holds.
        `document_ids` (B, L) int (packed documents): the conv window and the delta-rule state restart at each
        document start. With a `shard` (context parallelism), x is this rank's local pieces and document_ids the
        WHOLE sequence's. Other keywords (attention's prefix mask) do not apply: the layer stays causal."""
        if shard is not None:
            if cache is not None:
                raise ValueError("GatedDeltaNet: a context-parallel shard and an inference cache do not combine")
            return self._forward_cp(x, shard, document_ids)
        if cache is not None:
            return self._forward_cached(x, cache)
        qkv, z, b, a = self._project(x)
        qkv = causal_conv(qkv, self.conv1d.weight, None, document_ids)  # (B, conv_dim, L)
        reset = None
        if document_ids is not None:
            reset = torch.zeros_like(document_ids, dtype=torch.bool)  # (B, L): True at a document start
            reset[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        out, _ = self._mix(F.silu(qkv), z, b, a, reset=reset)
        return out

    def _forward_cp(self, x: torch.Tensor, shard: SeqShard, document_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """Context parallelism by state passing (moe_dist/layers/state_passing.py). The rule is linear in (v, S0):
        o = o(v, 0) + o(0, S0) and S_end = F + T S0, T = Π α_t (I − β_t k_t k_tᵀ) (dk × dk, zero once a document
        starts). One pass per piece computes all of it: v widened by dk zero columns and the state started at
        [0 | I], so the extra columns carry T (final state) and qᵀ T_{≤t} (output) at the cost of dk more value
        channels. The summaries [F | T] cross the CP group in one all-gather; each piece's true initial state S0
        adds (qᵀ T_{≤t}) S0 to its outputs."""
        K = self.conv1d.kernel_size[0]
        qkv, z, b, a = self._project(sp.to_pieces(x))  # (2B, conv_dim, c), ...
        window, window_ids = sp.conv_window(shard, qkv, K - 1, document_ids)
        qkv = causal_conv(window, self.conv1d.weight, None, window_ids, primed=True)  # (2B, conv_dim, c)
        q, k, v, g, beta = self._rule_inputs(F.silu(qkv), b, a)
        batch, seqlen, heads, dv = v.shape
        dk = k.shape[-1]
        compute = torch.promote_types(v.dtype, torch.float32)
        eye = torch.eye(dk, dtype=compute, device=v.device).expand(batch, heads, dk, dk)
        start = torch.cat([eye.new_zeros(batch, heads, dk, dv), eye], dim=-1)  # [0 | I]
        wide = torch.cat([v, v.new_zeros(batch, seqlen, heads, dk)], dim=-1)
        o, final = self.rule(q, k, wide, g, beta, initial_state=start, reset=sp.piece_resets(shard, document_ids))
        o, qT = o.split([dv, dk], dim=-1)  # (2B, c, Hv, dv), (2B, c, Hv, dk)
        S0 = sp.initial_states(shard, *sp.exchange(shard, *final.split([dv, dk], dim=-1)), sp.matrix)
        o = o + torch.einsum("bthk,bhkv->bthv", qT.to(compute), S0).to(o.dtype)
        return sp.from_pieces(self._output(o, z))

    def _forward_cached(self, x: torch.Tensor, state: GDNState) -> torch.Tensor:
        """The inference path: the conv continues from `state.conv`, the rule from `state.recurrent` (any number
        of new positions: the prompt, then one per step); updates `state`."""
        qkv, z, b, a = self._project(x)
        qkv, state.conv = causal_conv_step(state.conv, qkv, self.conv1d.weight)  # (B, conv_dim, L)
        out, state.recurrent = self._mix(F.silu(qkv), z, b, a, initial_state=state.recurrent)
        return out


# ------------------------------------------------------------------------------------------ the kind


def _split_tp(g: GatedDeltaNet, tp: TensorSplit) -> None:
    """Key heads split over TP, each with its n_v_heads / n_k_heads value heads (config rule: the key heads divisible
    by tp). The fused projections are packed per key head, so a rank's rows are one contiguous block; the conv's
    q, k, v channels are split alone; the gated norm is per head (its weight, shared by the heads, is replicated)."""
    tp.shard(g.in_proj_qkvz, "weight", 0)  # per key head [q, k, v, z]
    tp.shard(g.in_proj_ba, "weight", 0)  # per key head [b, a]
    tp.shard(g.conv1d, "weight", 0, parts=(g.key_dim, g.key_dim, g.value_dim))
    tp.shard(g, "dt_bias", 0)
    tp.shard(g, "A_log", 0)
    tp.shard(g.out_proj, "weight", 1)
    tp.sum_grad(g.norm.weight)
    for name in ("n_k_heads", "n_v_heads", "key_dim", "value_dim", "conv_dim"):
        setattr(g, name, getattr(g, name) // tp.tp)
    conv = g.conv1d
    conv.in_channels = conv.out_channels = conv.groups = g.conv_dim
    tp.region(g)


def _check(cfg, placed: bool) -> None:
    """The section's shapes (checked whether or not a layer uses it: its defaults satisfy them)."""
    g = cfg.model.gdn
    for key in ("n_k_heads", "n_v_heads", "head_k_dim", "head_v_dim", "conv_size", "chunk_size"):
        require(getattr(g, key) > 0, f"model.gdn.{key}: must be positive, got {getattr(g, key)}")
    require(
        g.n_v_heads % g.n_k_heads == 0,
        f"model.gdn.n_k_heads: must divide n_v_heads={g.n_v_heads}, got {g.n_k_heads}",
    )
    require(
        g.chunk_size & (g.chunk_size - 1) == 0,
        f"model.gdn.chunk_size: must be a power of two, got {g.chunk_size}",
    )


def _activation_bytes(cfg, tp: int, cp: int, a: int) -> float:
    """Per token (layers/delta_rule.py's chunked WY/UT rule; derived by listing the tensors autograd keeps): the qkvz
    and ba projections, the conv and SiLU outputs (2·conv_dim), q and k L2-normalised and repeated over the value
    heads with their chunk-decayed copies (6·Hv·dk), the chunk's attention, decay and WY rows (5·Hv·chunk), v, the
    rule's output, the gated norm's input/output and out_proj's input (6·Hv·dv), and the fp32 states at chunk
    boundaries with their decayed copies (12·Hv·dk·dv per chunk); the whole layer's, not 1/tp."""
    g = cfg.model.gdn
    kd, vd, L = g.n_k_heads * g.head_k_dim, g.n_v_heads * g.head_v_dim, g.chunk_size
    conv = 2 * kd + vd
    return (
        (2 * kd + 2 * vd + 2 * g.n_v_heads + 2 * conv + 6 * g.n_v_heads * g.head_k_dim + 6 * vd) * a
        + 5 * g.n_v_heads * L * 4
        + 12 * 4 * g.n_v_heads * g.head_k_dim * g.head_v_dim / L
    )


def _flops_per_token(m, S: int) -> float:
    """Chunked gated delta rule per value head: Mamba-2's shape with dk for N and dv for P, plus the WY correction
    (the chunk's triangular solve and k·S products, about 2·chunk·dk + 4·dk·dv)."""
    g = m.gdn
    dk, dv = g.head_k_dim, g.head_v_dim
    return g.n_v_heads * (2.0 * g.chunk_size * (2 * dk + dv) + 8.0 * dk * dv)


def _collectives(cfg, tp: int, cp: int, tokens: int, a: int):
    """Under CP the pieces' summaries (final state and the dk × dk transition per value head, fp32) and conv halos."""
    g = cfg.model.gdn
    hv, conv = g.n_v_heads // tp, (2 * g.n_k_heads * g.head_k_dim + g.n_v_heads * g.head_v_dim) // tp
    halo = a * min(g.conv_size - 1, cfg.train.seq_len // (2 * cp)) * conv
    summary = 4.0 * hv * g.head_k_dim * (g.head_v_dim + g.head_k_dim)
    return piece_collectives(cfg.train.micro_batch_size, cp, summary, halo)


KIND = LayerKind(
    config=GDNConfig,
    name="gdn",
    role="mixer",
    module=GatedDeltaNet,
    build=lambda m, device: GatedDeltaNet(m.d_model, m.gdn, m.norm_eps, m.init_std, device),
    part="gdn",
    section="gdn",
    doc="Gated DeltaNet mixer (Qwen3-Next, Qwen3.5)",
    check=_check,
    check_tp=lambda cfg: divides(
        cfg.model.gdn.n_k_heads, "model.gdn.n_k_heads", "Gated DeltaNet key heads", cfg.parallel.tp
    ),
    tp_rule=_split_tp,
    new_state=lambda g, batch, max_len, device, dtype: g.new_state(batch, device, dtype),
    flops_per_token=_flops_per_token,
    activation_bytes=_activation_bytes,
    collectives=_collectives,
)
