"""Mamba-1 selective-SSM mixer (Gu & Dao, 2023), with Jamba's optional inner RMSNorms on Δ, B and C.

Parameter names follow the Hugging Face Mamba/Jamba checkpoints (in_proj, conv1d, x_proj, dt_proj, A_log, D,
out_proj); only the inner norms are named dt_norm / b_norm / c_norm instead of Jamba's *_layernorm.
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
from moe_dist.layers.kernel_choice import Kernel, recurrent_kernel
from moe_dist.layers.kind import LayerKind, TensorSplit, divides, piece_collectives
from moe_dist.layers.norm import RMSNorm
from moe_dist.layers.scan import initial_state_outputs, selective_scan
from moe_dist.layers.sequence_shard import SeqShard
from moe_dist.layers.step_size import inverse_softplus_step_sizes


@dataclass
class MambaConfig:
    d_state: int = 16  # SSM state size N per channel
    d_conv: int = 4  # depthwise causal conv width
    expand: int = 2  # d_inner = expand * d_model
    dt_rank: Optional[int] = None  # rank of the Δ projection; null = ceil(d_model / 16)
    conv_bias: bool = True  # bias in the depthwise conv1d
    proj_bias: bool = False  # bias in in_proj / out_proj
    inner_norms: bool = False  # Jamba's RMSNorms on Δ, B and C after x_proj
    chunk_size: int = 16  # chunk length of the chunked PyTorch scan (the CPU path; 16 is fastest on CPU)
    impl: Literal["auto", "torch", "triton"] = "auto"  # scan: auto = Triton kernel on CUDA, chunked PyTorch on CPU


def scan_kernel(impl: str, device: torch.device | str = "cpu", chunk_size: int = 16) -> Kernel:
    """`model.mamba.impl` for a layer built for `device`, with `selective_scan_ref`'s signature: the chunked
    PyTorch scan (`moe_dist.layers.scan`) or the Triton kernel (`moe_dist.kernels.selective_scan`, which "auto"
    takes on CUDA)."""
    return recurrent_kernel(
        impl, "model.mamba.impl", device, selective_scan, chunk_size, _triton_scan, "selective scan"
    )


def _triton_scan():
    from moe_dist.kernels.selective_scan import selective_scan as triton_scan  # lazy: imports triton

    return triton_scan


@dataclass
class MambaState:
    """The recurrent state of one Mamba layer between inference calls (zeros before the first position)."""

    conv: torch.Tensor  # (B, Di, d_conv - 1): the conv's last inputs, oldest first
    ssm: torch.Tensor  # (B, Di, N): the SSM state h, in fp32 (at least), as the scan computes it


class Mamba(nn.Module):
    """x → in_proj → (x, z); x → causal depthwise conv → SiLU → x_proj → (Δ, B, C) → selective scan gated by
    silu(z) → out_proj. Input and output are (batch, seq, d_model).

    `__init__` only declares parameters so the layer can be built on the meta device; `init_weights` fills them.
    """

    def __init__(
        self, d_model: int, cfg: MambaConfig, norm_eps: float, init_std: float, device: torch.device | str = "cpu"
    ):
        super().__init__()
        self.d_inner = cfg.expand * d_model
        self.d_state = cfg.d_state
        self.dt_rank = cfg.dt_rank or math.ceil(d_model / 16)
        self.inner_norms = cfg.inner_norms
        self.init_std = init_std
        self.scan = scan_kernel(cfg.impl, device, cfg.chunk_size)

        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(
            self.d_inner, self.d_inner, cfg.d_conv, groups=self.d_inner, padding=cfg.d_conv - 1, bias=cfg.conv_bias
        )
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * self.d_state, bias=False)
        if cfg.inner_norms:
            self.dt_norm = RMSNorm(self.dt_rank, norm_eps)
            self.b_norm = RMSNorm(self.d_state, norm_eps)
            self.c_norm = RMSNorm(self.d_state, norm_eps)
        # dt_proj.bias is not added by the Linear: it is passed to the scan as delta_bias, inside the softplus.
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, self.d_state))  # A = -exp(A_log) < 0 keeps the SSM stable
        self.D = nn.Parameter(torch.empty(self.d_inner))  # skip connection u → y
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=cfg.proj_bias)

    @property
    def implementations(self) -> dict[str, str]:
        return {"scan": self.scan.name}

    def init_weights(self) -> None:
        """Standard Mamba init (mamba_ssm `Mamba.__init__`, dt_init="random"), in place, from the global RNG."""
        with torch.no_grad():
            for linear in (self.in_proj, self.x_proj, self.out_proj):
                nn.init.normal_(linear.weight, mean=0.0, std=self.init_std)
                if linear.bias is not None:
                    linear.bias.zero_()
            nn.init.kaiming_uniform_(self.conv1d.weight, a=math.sqrt(5))  # nn.Conv1d's own default
            if self.conv1d.bias is not None:
                self.conv1d.bias.zero_()

            bound = self.dt_rank**-0.5
            nn.init.uniform_(self.dt_proj.weight, -bound, bound)
            self.dt_proj.bias.copy_(inverse_softplus_step_sizes(self.d_inner, self.D.device))

            # S4D-Real init: A_n = -(n + 1) for every channel.
            a = torch.arange(1, self.d_state + 1, device=self.A_log.device, dtype=torch.float32)
            self.A_log.copy_(torch.log(a).expand(self.d_inner, -1))
            self.D.fill_(1.0)
            if self.inner_norms:
                for norm in (self.dt_norm, self.b_norm, self.c_norm):
                    norm.init_weights()

    def _ssm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output x (B, L, Di) → Δ before bias (B, L, Di), B (B, L, N), C (B, L, N), and A (Di, N)."""
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.inner_norms:
            dt, B, C = self.dt_norm(dt), self.b_norm(B), self.c_norm(C)  # (B, L, R), (B, L, N), (B, L, N)
        dt = F.linear(dt, self.dt_proj.weight)  # (B, L, Di)
        # exp in at least fp32: under bf16 parameters -exp(A_log) would lose the spacing of the S4D init.
        A = -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))  # (Di, N)
        return dt, B, C, A

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> MambaState:
        d_conv = self.conv1d.kernel_size[0]
        return MambaState(
            torch.zeros(batch, self.d_inner, d_conv - 1, device=device, dtype=dtype),
            torch.zeros(
                batch, self.d_inner, self.d_state, device=device, dtype=torch.promote_types(dtype, torch.float32)
            ),
        )

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[MambaState] = None,
        document_ids: Optional[torch.Tensor] = None,
        shard: Optional[SeqShard] = None,
        **_,
    ) -> torch.Tensor:
        """x (B, L, d_model) → (B, L, d_model). With a state (inference), x continues the sequence it holds.
        `document_ids` (B, L) int (packed documents): the conv and the SSM state restart at each document start.
        With a `shard` (context parallelism), x is this rank's local pieces and document_ids the WHOLE sequence's.
        Other keywords (attention's prefix mask) do not apply: Mamba stays causal."""
        if cache is not None:
            if shard is not None:
                raise ValueError("Mamba: a context-parallel shard and an inference cache do not combine")
            return self._forward_recurrent(x, cache)
        if shard is not None:
            return self._forward_cp(x, shard, document_ids)
        x, z = self.in_proj(x).chunk(2, dim=-1)  # (B, L, Di) each
        x = causal_conv(x.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, document_ids)  # (B, Di, L)
        reset = None
        if document_ids is not None:
            reset = torch.zeros_like(document_ids, dtype=torch.bool)  # (B, L): True at a document start
            reset[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        y = self._conv_out_scan(x, z, reset)[0]  # (B, Di, L)
        return self.out_proj(y.transpose(1, 2))  # (B, L, d_model)

    def _conv_out_scan(
        self,
        x: torch.Tensor,
        z: torch.Tensor,
        reset: Optional[torch.Tensor],
        final: bool = False,
        initial_state: Optional[torch.Tensor] = None,
    ):
        """The selective scan of the conv output x (B, Di, L) gated by z (B, L, Di), from `initial_state` (B, Di, N)
        or zeros: (the scan's output — y (B, Di, L), or with `final` (y, the last state (B, Di, N) fp32) — dt
        (B, L, Di), C (B, L, N), A). The whole sequence, a CP piece and the inference cache share it."""
        x = F.silu(x)
        dt, B, C, A = self._ssm_inputs(x.transpose(1, 2))
        out = self.scan(
            x,
            dt.transpose(1, 2),
            A,
            B.transpose(1, 2),
            C.transpose(1, 2),
            D=self.D,
            z=z.transpose(1, 2),
            delta_bias=self.dt_proj.bias,
            delta_softplus=True,
            **({"return_final_state": True} if final else {}),
            **({} if reset is None else {"reset": reset}),
            **({} if initial_state is None else {"initial_state": initial_state}),
        )
        return out, dt, C, A

    def _forward_cp(self, x: torch.Tensor, shard: SeqShard, document_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """Context parallelism by state passing (moe_dist/layers/state_passing.py): both local pieces run from a
        zero state, batched; their summaries (final state, and Σ Δ for the decay product exp(A Σ Δ), zero once a
        document starts) cross the CP group in one all-gather; each piece's true initial state h0 then adds
        C_t · (exp(A Σ_{s≤t} Δ_s) ⊙ h0) to y_t up to the piece's first document start (`initial_state_outputs`: the
        scan is linear in h0)."""
        K = self.conv1d.kernel_size[0]
        x, z = self.in_proj(sp.to_pieces(x)).chunk(2, dim=-1)  # (2B, c, Di) each
        window, window_ids = sp.conv_window(shard, x.transpose(1, 2), K - 1, document_ids)
        x = causal_conv(window, self.conv1d.weight, self.conv1d.bias, window_ids, primed=True)  # (2B, Di, c)
        reset = sp.piece_resets(shard, document_ids)  # (2B, c) or None
        (y, final), dt, C, A = self._conv_out_scan(x, z, reset, final=True)  # (2B, Di, c), (2B, Di, N) fp32
        compute = final.dtype
        delta_sum = F.softplus(dt.to(compute) + self.dt_proj.bias.to(compute)).cumsum(1)  # (2B, c, Di): Σ_{s≤t} Δ_s
        keep = None if reset is None else (reset.cumsum(1) == 0).to(compute)  # (2B, c): before the first start
        # The transition exp(A Σ Δ) is known from Σ Δ (Di values; A is every rank's) and whether a document starts
        # in the piece: that is what travels, half the bytes of the (Di, N) decays.
        kept = delta_sum.new_ones(delta_sum.shape[0], 1) if keep is None else keep[:, -1:]  # (2B, 1)
        finals, steps, kept = sp.exchange(shard, final, delta_sum[:, -1], kept)  # (2cp, B, ...) global order
        decays = torch.exp(steps[..., None] * A) * kept[..., None]  # (2cp, B, Di, N)
        h0 = sp.initial_states(shard, finals, decays, sp.diagonal)  # (2B, Di, N)
        correction = initial_state_outputs(C, delta_sum, A, h0)  # (2B, c, Di)
        if keep is not None:
            correction = correction * keep[..., None]
        y = y.transpose(1, 2) + (correction * F.silu(z.to(compute))).to(y.dtype)  # (2B, c, Di)
        return sp.from_pieces(self.out_proj(y))  # (B, L, d_model)

    def _forward_recurrent(self, x: torch.Tensor, state: MambaState) -> torch.Tensor:
        """The inference path: the conv continues from `state.conv`, the scan from `state.ssm` (any number of new
        positions: the prompt, then one per step); updates `state`."""
        x, z = self.in_proj(x).chunk(2, dim=-1)  # (B, L, Di) each
        x, state.conv = causal_conv_step(state.conv, x.transpose(1, 2), self.conv1d.weight, self.conv1d.bias)
        (y, state.ssm), *_ = self._conv_out_scan(x, z, None, final=True, initial_state=state.ssm)  # (B, Di, L)
        return self.out_proj(y.transpose(1, 2))  # (B, L, d_model)


# ------------------------------------------------------------------------------------------ the kind


def _split_tp(mamba: Mamba, tp: TensorSplit) -> None:
    """Channels split over TP: in_proj's x and z rows each, the conv, Δ's projection, A and D by channel; x_proj and
    out_proj by their input columns."""
    tp.shard(mamba.in_proj, "weight", 0, parts=2)  # rows: [x channels; z channels]
    for name in ("weight", "bias"):
        if getattr(mamba.conv1d, name) is not None:
            tp.shard(mamba.conv1d, name, 0)
    tp.shard(mamba.x_proj, "weight", 1)
    tp.shard(mamba.dt_proj, "weight", 0)
    tp.shard(mamba.dt_proj, "bias", 0)
    tp.shard(mamba, "A_log", 0)
    tp.shard(mamba, "D", 0)
    tp.shard(mamba.out_proj, "weight", 1)
    mamba.d_inner //= tp.tp
    conv = mamba.conv1d
    conv.in_channels = conv.out_channels = conv.groups = mamba.d_inner
    tp.region(mamba)
    # x_proj sums over all channels: its partial (Δ, B, C) are summed over the group; every rank's channels then use
    # them, so their gradient is summed again -- after Jamba's norms, whose weights need the full gradient.
    if mamba.inner_norms:
        mamba.x_proj.register_forward_hook(lambda m, args, out: tp.leave(out))
        for norm in (mamba.dt_norm, mamba.b_norm, mamba.c_norm):
            norm.register_forward_hook(lambda m, args, out: tp.enter(out))
    else:
        mamba.x_proj.register_forward_hook(lambda m, args, out: tp.enter(tp.leave(out)))


def _check(cfg, placed: bool) -> None:
    mb = cfg.model.mamba
    require(
        mb.d_state > 0 and mb.d_conv > 0 and mb.expand > 0 and mb.chunk_size > 0,
        "model.mamba: d_state, d_conv, expand and chunk_size must be positive",
    )


def _check_tp(cfg) -> None:
    m, tp = cfg.model, cfg.parallel.tp
    divides(m.mamba.expand * m.d_model, "model.mamba.expand", "d_inner = expand * d_model =", tp)
    require(
        not m.mamba.proj_bias,
        "model.mamba.proj_bias: biases of Mamba's in/out projections are not supported with parallel.tp > 1",
    )


def _dt_rank(m) -> int:
    return m.mamba.dt_rank or math.ceil(m.d_model / 16)


def _activation_bytes(cfg, tp: int, cp: int, a: int) -> float:
    m = cfg.model
    di, n, r = m.mamba.expand * m.d_model // tp, m.mamba.d_state, _dt_rank(m)
    inner = (11 * di + r + 4 * n + di * n / m.mamba.chunk_size) * a
    if m.mamba.inner_norms:
        inner += 2 * (r + 2 * n) * a + 12
    return inner


def _collectives(cfg, tp: int, cp: int, tokens: int, a: int):
    """x_proj's partial (Δ, B, C) summed over TP (forward and backward); under CP the pieces' summaries (final state
    and per-channel decay, fp32) and conv halos."""
    m, piece = cfg.model, cfg.train.seq_len // (2 * cp)
    di, n = m.mamba.expand * m.d_model // tp, m.mamba.d_state
    calls = [("all_reduce", "tp_ssm", "tp", tokens * (_dt_rank(m) + 2 * n) * a, 1, 1)]
    halo = a * min(m.mamba.d_conv - 1, piece) * di
    return calls + piece_collectives(cfg.train.micro_batch_size, cp, 4.0 * 2 * di * n, halo)


KIND = LayerKind(
    config=MambaConfig,
    name="mamba1",
    role="mixer",
    module=Mamba,
    build=lambda m, device: Mamba(m.d_model, m.mamba, m.norm_eps, m.init_std, device),
    part="mamba",
    section="mamba",
    letter="M",
    doc="Mamba-1 selective SSM (Jamba)",
    check=_check,
    check_tp=_check_tp,
    tp_rule=_split_tp,
    new_state=lambda mamba, batch, max_len, device, dtype: mamba.new_state(batch, device, dtype),
    flops_per_token=lambda m, S: 9.0 * m.mamba.expand * m.d_model * m.mamba.d_state,  # discretize, scan, readout
    activation_bytes=_activation_bytes,
    collectives=_collectives,
)
