"""Mamba-2 mixer (Dao & Gu, 2024): the SSD scan over heads with a scalar decay per head and step, and a gated
RMSNorm grouped like B and C.

Parameter names and the in_proj layout follow transformers' Mamba2Mixer / NemotronH's mixer (in_proj, conv1d,
dt_bias, A_log, D, norm.weight, out_proj; in_proj's rows are z, then x, B, C, then dt), so an importer maps names
1:1 (tests/layers/test_mamba2.py loads our state dict into transformers' mixer and compares outputs).
Single-device math; `apply_tp` (moe_dist/parallel/tensor_parallel.py) splits heads and groups over TP ranks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.config.errors import require
from moe_dist.layers import state_passing as sp
from moe_dist.layers.causal_conv import causal_conv, causal_conv_step
from moe_dist.layers.kernel_choice import Kernel, recurrent_kernel
from moe_dist.layers.kind import LayerKind, TensorSplit, piece_collectives
from moe_dist.layers.norm import GatedRMSNorm
from moe_dist.layers.sequence_shard import SeqShard
from moe_dist.layers.ssd import ssd_scan
from moe_dist.layers.step_size import inverse_softplus_step_sizes


@dataclass
class Mamba2Config:
    d_state: int = 128  # SSM state size N per head (shared by the heads of a group)
    d_conv: int = 4  # depthwise causal conv width (over x, B and C)
    expand: int = 2  # d_inner = expand * d_model when n_heads is null
    n_heads: Optional[int] = None  # SSM heads; null = expand * d_model // head_dim; set: d_inner = n_heads * head_dim
    head_dim: int = 64  # channels per head (one scalar decay per head and step)
    n_groups: int = 1  # B/C groups: the heads are split evenly over them (also the gated norm's groups)
    chunk_size: int = 64  # chunk length of the chunked PyTorch SSD (a power of two)
    dt_min: float = 0.001  # init: the step size softplus(dt_bias) is log-uniform in [dt_min, dt_max]
    dt_max: float = 0.1  # init: upper end of that range
    dt_init_floor: float = 1e-4  # init: lower bound on the sampled step size
    dt_limit: Optional[list[float]] = (
        None  # [low, high] clamp of softplus(dt + dt_bias), high may be Infinity; null = none
    )
    conv_bias: bool = True  # bias in the depthwise conv1d
    proj_bias: bool = False  # bias in in_proj / out_proj
    impl: Literal["auto", "torch", "triton"] = "auto"  # SSD scan: torch = chunked; triton = fla-core's (extra `fla`)

    def d_inner(self, d_model: int) -> int:
        """The SSM width, n_heads * head_dim (the kind's config rules make the default n_heads exact)."""
        return self.heads(d_model) * self.head_dim

    def heads(self, d_model: int) -> int:
        """n_heads, or expand * d_model // head_dim when null."""
        return self.n_heads if self.n_heads is not None else self.expand * d_model // self.head_dim


def scan_kernel(impl: str, device: torch.device | str = "cpu", chunk_size: int = 64, d_state: int = 128) -> Kernel:
    """`model.mamba2.impl` for a layer built for `device`, with `ssd_scan_ref`'s signature: the chunked PyTorch SSD
    (`moe_dist.layers.ssd`), or fla-core's chunked Triton kernels (`moe_dist.layers.fla_ops`; see there why)."""
    fla_key_dim = ("model.mamba2.d_state", d_state)
    return recurrent_kernel(impl, "model.mamba2.impl", device, ssd_scan, chunk_size, _fla_ssd, "SSD scan", fla_key_dim)


def _fla_ssd():
    from moe_dist.layers.fla_ops import fla_ssd_scan  # lazy: imported only when chosen (resolve)

    return fla_ssd_scan


@dataclass
class Mamba2State:
    """The recurrent state of one Mamba-2 layer between inference calls (zeros before the first position)."""

    conv: torch.Tensor  # (B, conv_dim, d_conv - 1): the conv's last inputs (x, B, C channels), oldest first
    ssm: torch.Tensor  # (B, H, P, N): the SSM state per head, in fp32 (at least), as the scan returns it


class Mamba2(nn.Module):
    """x → in_proj → (z, xBC, dt); xBC → causal depthwise conv → SiLU → (x, B, C); dt → softplus(dt + dt_bias),
    clamped to dt_limit; SSD scan with A = -exp(A_log) and the D skip; gated grouped RMSNorm with z; out_proj.
    Input and output are (batch, seq, d_model).

    `__init__` only declares parameters so the layer can be built on the meta device; `init_weights` fills them.
    """

    def __init__(
        self, d_model: int, cfg: Mamba2Config, norm_eps: float, init_std: float, device: torch.device | str = "cpu"
    ):
        super().__init__()
        check_shapes(d_model, cfg)
        self.n_heads, self.head_dim = cfg.heads(d_model), cfg.head_dim
        self.d_inner, self.d_state, self.n_groups = cfg.d_inner(d_model), cfg.d_state, cfg.n_groups
        self.conv_dim = self.d_inner + 2 * self.n_groups * self.d_state  # the conv runs over x, B and C
        self.dt_limit = None if cfg.dt_limit is None else tuple(cfg.dt_limit)
        self.dt_init = (cfg.dt_min, cfg.dt_max, cfg.dt_init_floor)
        self.init_std = init_std
        self.scan = scan_kernel(cfg.impl, device, cfg.chunk_size, cfg.d_state)

        self.in_proj = nn.Linear(d_model, self.d_inner + self.conv_dim + self.n_heads, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, cfg.d_conv, groups=self.conv_dim, padding=cfg.d_conv - 1, bias=cfg.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads))  # inside the softplus: dt = softplus(dt + dt_bias)
        self.A_log = nn.Parameter(torch.empty(self.n_heads))  # A = -exp(A_log) < 0 keeps the SSM stable
        self.D = nn.Parameter(torch.empty(self.n_heads))  # skip connection x → y per head
        self.norm = GatedRMSNorm(self.d_inner, norm_eps, gate_first=True, groups=self.n_groups)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=cfg.proj_bias)

    @property
    def implementations(self) -> dict[str, str]:
        return {"ssd": self.scan.name}

    def init_weights(self) -> None:
        """mamba_ssm's Mamba2 init (A uniform in [1, 16], dt log-uniform in [dt_min, dt_max]), in place, from the
        global RNG."""
        dt_min, dt_max, dt_floor = self.dt_init
        with torch.no_grad():
            for linear in (self.in_proj, self.out_proj):
                nn.init.normal_(linear.weight, mean=0.0, std=self.init_std)
                if linear.bias is not None:
                    linear.bias.zero_()
            nn.init.kaiming_uniform_(self.conv1d.weight, a=math.sqrt(5))  # nn.Conv1d's own default
            if self.conv1d.bias is not None:
                self.conv1d.bias.zero_()
            self.dt_bias.copy_(inverse_softplus_step_sizes(self.n_heads, self.dt_bias.device, dt_min, dt_max, dt_floor))
            a = torch.empty(self.n_heads, device=self.A_log.device, dtype=torch.float32).uniform_(1.0, 16.0)
            self.A_log.copy_(torch.log(a))
            self.D.fill_(1.0)
            self.norm.init_weights()

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> Mamba2State:
        d_conv = self.conv1d.kernel_size[0]
        ssm_dtype = torch.promote_types(dtype, torch.float32)
        return Mamba2State(
            torch.zeros(batch, self.conv_dim, d_conv - 1, device=device, dtype=dtype),
            torch.zeros(batch, self.n_heads, self.head_dim, self.d_state, device=device, dtype=ssm_dtype),
        )

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[Mamba2State] = None,
        document_ids: Optional[torch.Tensor] = None,
        shard: Optional[SeqShard] = None,
        **_,
    ) -> torch.Tensor:
        """x (B, L, d_model) → (B, L, d_model). With a state (inference), x continues the sequence it holds and the
        state is updated. `document_ids` (B, L) int (packed documents, training): the conv window and the SSM
        state restart at each document start. With a `shard` (context parallelism), x is this rank's local pieces
        and document_ids the WHOLE sequence's. Other keywords (attention's prefix mask) do not apply."""
        if shard is not None:
            if cache is not None:
                raise ValueError("Mamba2: a context-parallel shard and an inference cache do not combine")
            return self._forward_cp(x, shard, document_ids)
        z, xBC, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)
        xBC = xBC.transpose(1, 2)  # (B, conv_dim, L)
        reset = None
        if cache is not None:
            xBC, cache.conv = causal_conv_step(cache.conv, xBC, self.conv1d.weight, self.conv1d.bias)
        else:
            xBC = causal_conv(xBC, self.conv1d.weight, self.conv1d.bias, document_ids)
            if document_ids is not None:
                reset = torch.zeros_like(document_ids, dtype=torch.bool)  # (B, L): True at a document start
                reset[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        xs, dt, A, B, C = self._ssm_inputs(xBC, dt)
        y, state = self.scan(
            xs, dt, A, B, C, D=self.D, initial_state=None if cache is None else cache.ssm, reset=reset
        )  # (B, L, H, P), (B, H, P, N)
        if cache is not None:
            cache.ssm = state
        return self.out_proj(self.norm(y.flatten(-2), z))  # (B, L, d_model)

    def _ssm_inputs(self, xBC: torch.Tensor, dt: torch.Tensor):
        """Conv output xBC (B, conv_dim, L) and dt (B, L, H) before its bias → the scan's x (B, L, H, P),
        dt (B, L, H), A (H,), B and C (B, L, G, N)."""
        bc = (self.conv_dim - self.d_inner) // 2  # n_groups · d_state (under TP: this rank's part of it)
        xs, B, C = F.silu(xBC).transpose(1, 2).split([self.d_inner, bc, bc], dim=-1)
        # dt and A in at least fp32: under bf16 parameters the decays exp(dt A) would lose their spacing.
        compute = torch.promote_types(dt.dtype, torch.float32)
        dt = F.softplus(dt.to(compute) + self.dt_bias.to(compute))  # (B, L, H)
        if self.dt_limit is not None:
            dt = dt.clamp(*self.dt_limit)
        A = -torch.exp(self.A_log.to(compute))  # (H,)
        groups = (self.n_groups, -1)
        return xs.unflatten(-1, (self.n_heads, self.head_dim)), dt, A, B.unflatten(-1, groups), C.unflatten(-1, groups)

    def _forward_cp(self, x: torch.Tensor, shard: SeqShard, document_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """Context parallelism by state passing (moe_dist/layers/state_passing.py): both local pieces run from a
        zero state, batched; their summaries (final state, per-head decay product exp(A Σ dt), zero once a document
        starts) cross the CP group in one all-gather; each piece's true initial state h0 then adds
        exp(A Σ_{s≤t} dt_s) · C_t h0 to y_t up to the piece's first document start (the scan is linear in h0)."""
        K = self.conv1d.kernel_size[0]
        z, xBC, dt = self.in_proj(sp.to_pieces(x)).split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)
        window, window_ids = sp.conv_window(shard, xBC.transpose(1, 2), K - 1, document_ids)
        xBC = causal_conv(window, self.conv1d.weight, self.conv1d.bias, window_ids, primed=True)  # (2B, conv_dim, c)
        reset = sp.piece_resets(shard, document_ids)  # (2B, c) or None
        xs, dt, A, B, C = self._ssm_inputs(xBC, dt)
        y, final = self.scan(xs, dt, A, B, C, D=self.D, reset=reset)  # (2B, c, H, P), (2B, H, P, N)
        if C.shape[-1] != self.d_state:  # TP with n_groups < tp: this rank holds a slice of its heads' group's C
            raise ValueError("context parallelism: under tensor parallelism, model.mamba2.n_groups must be >= tp")
        compute = final.dtype
        into = torch.exp((dt * A).cumsum(1))  # (2B, c, H): decay from the piece's entering state to step t
        if reset is not None:
            into = into * (reset.cumsum(1) == 0)[..., None]
        h0 = sp.initial_states(shard, *sp.exchange(shard, final, into[:, -1, :, None, None]), sp.diagonal)
        C_h = C.to(compute).repeat_interleave(self.n_heads // self.n_groups, dim=2)  # (2B, c, H, N)
        y = y + (torch.einsum("bthn,bhpn->bthp", C_h, h0) * into[..., None]).to(y.dtype)
        return sp.from_pieces(self.out_proj(self.norm(y.flatten(-2), z)))  # (B, L, d_model)


# ------------------------------------------------------------------------------------------ the kind


def _check_fields(mb: Mamba2Config) -> None:
    """The rules of model.mamba2 that hold whatever d_model is (the default section passes them)."""
    for name in ("d_state", "d_conv", "expand", "head_dim", "n_groups", "chunk_size"):
        require(getattr(mb, name) > 0, f"model.mamba2.{name}: must be positive, got {getattr(mb, name)}")
    require(
        mb.chunk_size & (mb.chunk_size - 1) == 0,
        f"model.mamba2.chunk_size: must be a power of two, got {mb.chunk_size}",
    )
    require(
        mb.n_heads is None or (mb.n_heads > 0 and mb.n_heads % mb.n_groups == 0),
        f"model.mamba2.n_groups: must divide model.mamba2.n_heads={mb.n_heads}, got {mb.n_groups}",
    )
    require(
        0 < mb.dt_init_floor and 0 < mb.dt_min <= mb.dt_max,
        f"model.mamba2.dt_min: need 0 < dt_min <= dt_max and dt_init_floor > 0, got {mb.dt_min}, {mb.dt_max}, "
        f"{mb.dt_init_floor}",
    )
    require(
        mb.dt_limit is None or (len(mb.dt_limit) == 2 and 0 <= mb.dt_limit[0] < mb.dt_limit[1]),
        f"model.mamba2.dt_limit: expected [low, high] with 0 <= low < high, or null, got {mb.dt_limit}",
    )


def check_shapes(d_model: int, mb: Mamba2Config) -> None:
    """The rules of a Mamba-2 layer in a model of width `d_model` (the layer runs them when it is built, and the
    config checks for a config that places Mamba-2 layers): the section's own, and the heads' split into groups."""
    _check_fields(mb)
    if mb.n_heads is None:
        d_inner = mb.expand * d_model
        require(
            d_inner % mb.head_dim == 0,
            f"model.mamba2.head_dim: must divide d_inner = expand * d_model = {d_inner} when n_heads is null, "
            f"got {mb.head_dim}",
        )
    heads = mb.heads(d_model)
    require(
        heads % mb.n_groups == 0,
        f"model.mamba2.n_groups: must divide the {heads} heads (d_inner / head_dim), got {mb.n_groups}",
    )


def _check(cfg, placed: bool) -> None:
    m = cfg.model
    if placed:
        check_shapes(m.d_model, m.mamba2)
    else:
        _check_fields(m.mamba2)
    tp = cfg.parallel.tp
    require(
        not placed or cfg.parallel.cp == 1 or tp == 1 or m.mamba2.n_groups >= tp,
        f"model.mamba2.n_groups: {m.mamba2.n_groups} < parallel.tp={tp} is not supported with parallel.cp > 1 (a rank "
        "would hold part of a B/C group, whose state the pieces pass)",
    )


def _check_tp(cfg) -> None:
    """Heads split; whole groups per rank, or one group spread over tp / n_groups ranks, each holding
    1/(tp / n_groups) of its B/C state channels."""
    mb, tp = cfg.model.mamba2, cfg.parallel.tp
    heads, g = mb.heads(cfg.model.d_model), mb.n_groups
    require(
        heads % tp == 0,
        f"model.mamba2.n_heads: the {heads} Mamba-2 heads (n_heads, or expand * d_model / head_dim) are not "
        f"divisible by parallel.tp={tp}",
    )
    require(
        g % tp == 0 or tp % g == 0,
        f"model.mamba2.n_groups: {g} groups must be a multiple or a divisor of parallel.tp={tp}",
    )
    if g < tp:
        require(
            mb.d_state % (tp // g) == 0,
            f"model.mamba2.d_state: {mb.d_state} is not divisible by parallel.tp / n_groups = {tp // g} (each group's "
            "B and C are split over that many ranks)",
        )
    require(
        not mb.proj_bias,
        "model.mamba2.proj_bias: biases of Mamba-2's in/out projections are not supported with parallel.tp > 1",
    )


def _split_tp(m: Mamba2, tp: TensorSplit) -> None:
    """Heads split over TP (config rule: n_heads divisible by tp; n_groups a multiple or a divisor of tp). Each
    component of in_proj (rows z, x, B, C, dt) and of the conv (channels x, B, C) is split alone; a rank's heads
    are contiguous and so are its groups' B/C rows. With groups >= tp every rank holds whole groups and the layer
    runs unchanged on them. With groups < tp each group spans tp / groups ranks: the B/C rows and conv channels are
    split along the group's flattened (group, state) block, so every parameter stays sharded (none partly
    replicated), the conv output's B/C slices are all-gathered before the scan, each rank keeping its heads' group,
    and the gated norm's per-group statistics are summed over the group's ranks."""
    gn = m.n_groups * m.d_state
    tp.shard(m.in_proj, "weight", 0, parts=(m.d_inner, m.d_inner, gn, gn, m.n_heads))
    for name in ("weight", "bias"):
        if getattr(m.conv1d, name) is not None:
            tp.shard(m.conv1d, name, 0, parts=(m.d_inner, gn, gn))
    for name in ("dt_bias", "A_log", "D"):
        tp.shard(m, name, 0)
    tp.shard(m.norm, "weight", 0)  # channels are head-major, like y
    tp.shard(m.out_proj, "weight", 1)
    if m.n_groups < tp.tp:
        span = tp.tp // m.n_groups  # ranks per group; this rank's heads all read group rank // span
        own = tp.rank // span
        m.scan = Kernel(m.scan.name, functools.partial(_scan_own_group, m.scan, m.n_groups, own, tp))
        m.norm = _SpanningGroupNorm(m.norm, tp, span, own)
    m.n_heads //= tp.tp
    m.d_inner //= tp.tp
    m.conv_dim //= tp.tp
    m.n_groups = max(m.n_groups // tp.tp, 1)  # local: whole groups, or the one group this rank's heads read
    m.norm.groups = m.n_groups
    conv = m.conv1d
    conv.in_channels = conv.out_channels = conv.groups = m.conv_dim
    tp.region(m)


def _scan_own_group(scan: Kernel, n_groups: int, own: int, tp: TensorSplit, x, dt, A, B, C, **kwargs):
    """B, C (batch, L, 1, n_groups·N / tp): this rank's slice of the flattened (group, state) block, all-gathered
    (backward: each slice's gradient summed over the ranks) and cut to group `own`, the one this rank's heads read."""
    B, C = (tp.gather(t, 3) for t in (B, C))  # (batch, L, 1, n_groups·N)
    n = B.shape[3] // n_groups
    return scan(x, dt, A, B[..., own * n : (own + 1) * n], C[..., own * n : (own + 1) * n], **kwargs)


class _SpanningGroupNorm(GatedRMSNorm):
    """The gated RMSNorm where this rank holds 1/span of one group's channels: the group's mean square is the sum
    of its `span` ranks' sums of squares (all-gathered; backward sums each rank's part of the gradient)."""

    def __init__(self, norm: GatedRMSNorm, tp: TensorSplit, span: int, own: int):
        nn.Module.__init__(self)
        self.groups, self.eps, self.gate_first, self.weight = 1, norm.eps, norm.gate_first, norm.weight
        self.tp, self.span, self.own = tp, span, own

    def _mean_square(self, h: torch.Tensor) -> torch.Tensor:
        sums = self.tp.gather(h.pow(2).sum(-1, keepdim=True), h.dim() - 1)  # (..., 1, tp)
        mine = sums.unflatten(-1, (-1, self.span))[..., self.own, :]  # (..., 1, span): this group's ranks
        return mine.sum(-1, keepdim=True) / (h.shape[-1] * self.span)


def _activation_bytes(cfg, tp: int, cp: int, a: int) -> float:
    """Per token (derived by listing the tensors autograd keeps, tests/planning/test_memory.py measures it): the
    in_proj output (z, xBC, dt), the conv and SiLU outputs (2·conv_dim), B and C broadcast to every head (2·H·N),
    the chunk's decay and score rows (2·H·chunk), x, y, the D skip, the gated norm's input/output and out_proj's
    input (6·d_inner), and the fp32 states at chunk boundaries (2·H·P·N per chunk); the whole layer's, not 1/tp."""
    m2, D = cfg.model.mamba2, cfg.model.d_model
    di, h, L = m2.d_inner(D), m2.heads(D), m2.chunk_size
    conv = di + 2 * m2.n_groups * m2.d_state
    return (di + conv + h + 2 * conv + 2 * h * m2.d_state + 6 * di) * a + 2 * h * L * 4 + 2 * 4 * di * m2.d_state / L


def _flops_per_token(m, S: int) -> float:
    """Chunked SSD: intra-chunk C·Bᵀ and its use (2·chunk·(N + P) per head, half for causality) plus the state update
    and readout (4·P·N per head): the quadratic-in-chunk plus linear-in-state terms of Mamba-2."""
    m2 = m.mamba2
    return m2.heads(m.d_model) * (2.0 * m2.chunk_size * (m2.d_state + m2.head_dim) + 4.0 * m2.head_dim * m2.d_state)


def _collectives(cfg, tp: int, cp: int, tokens: int, a: int):
    """With fewer groups than TP ranks: B and C gathered before the scan and the gated norm's fp32 sums of squares
    (one per rank and token); under CP the pieces' summaries (final state and per-head decay, fp32) and conv halos."""
    m, m2 = cfg.model, cfg.model.mamba2
    calls = []
    if m2.n_groups < tp:
        bc = tokens * m2.n_groups * m2.d_state * a  # B or C, all groups
        norm = tokens * tp * 4
        calls += [("all_gather", "tp_ssd_groups", "tp", bc, 2, 0), ("reduce_scatter", "tp_ssd_groups", "tp", bc, 0, 2)]
        calls += [("all_gather", "tp_ssd_norm", "tp", norm, 1, 0), ("reduce_scatter", "tp_ssd_norm", "tp", norm, 0, 1)]
    heads, conv = m2.heads(m.d_model) // tp, (m2.d_inner(m.d_model) + 2 * m2.n_groups * m2.d_state) // tp
    halo = a * min(m2.d_conv - 1, cfg.train.seq_len // (2 * cp)) * conv
    return calls + piece_collectives(cfg.train.micro_batch_size, cp, 4.0 * heads * (m2.head_dim * m2.d_state + 1), halo)


KIND = LayerKind(
    config=Mamba2Config,
    name="mamba2",
    role="mixer",
    module=Mamba2,
    build=lambda m, device: Mamba2(m.d_model, m.mamba2, m.norm_eps, m.init_std, device),
    part="mamba2",
    section="mamba2",
    doc="Mamba-2 (SSD) mixer (Nemotron-H, Granite 4.0-H)",
    check=_check,
    check_tp=_check_tp,
    tp_rule=_split_tp,
    new_state=lambda m, batch, max_len, device, dtype: m.new_state(batch, device, dtype),
    flops_per_token=_flops_per_token,
    activation_bytes=_activation_bytes,
    collectives=_collectives,
)
