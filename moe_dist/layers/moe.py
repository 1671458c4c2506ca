"""Mixture-of-Experts FFN: router → dispatcher seam → grouped SwiGLU experts (+ shared experts on every token).

Shape legend (suffixes on tensor names):
    T tokens in the micro-batch (batch × seq)    D d_model        F expert hidden size (2F: gate and up fused)
    E experts                                    K top_k           A = K·T assignments, slot-major (a = k·T + t)
    R routed rows: kept assignments, sorted by expert (R ≤ A)

`MoE.forward` is router (router.py) → dispatcher.run(experts): dispatch → experts (experts.py) → combine. The
default `LocalDispatcher` permutes rows on this device; expert parallelism swaps in another dispatcher with the
same methods (`build_dispatcher` in parallel/expert_parallel.py), and the layer does not know which one it has:
the EP runs equal one process (tests/parallel/test_ep_dispatch.py, docs/parallelism.md). The dispatcher runs the
experts (it is handed them) so that one may pipeline the three steps over chunks of the rows
(`parallel.a2a_chunks`, parallel/dispatch.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Protocol

import torch
from torch import nn

from moe_dist.config.errors import require
from moe_dist.layers.experts import Experts
from moe_dist.layers.kind import LayerKind, TensorSplit, divides
from moe_dist.layers.mlp import SharedExperts, split_ffn_tp
from moe_dist.layers.permutation import Permutation
from moe_dist.layers.router import Router, Routing, RoutingStats, check_routing
from moe_dist.layers.sequence_shard import SeqShard


@dataclass
class MoEConfig:
    num_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts chosen per token
    d_ff: Optional[int] = None  # expert hidden size; null = model.d_ff
    capacity_factor: Optional[float] = 1.25  # per-expert capacity multiplier; null = dropless
    min_capacity: int = 0  # lower bound on the per-expert capacity
    drop_policy: Literal["position", "probability"] = "position"  # which over-capacity assignments are dropped
    renormalize: bool = True  # renormalize the top-k weights to sum to 1 (Mixtral)
    aux_loss_coef: float = 0.01  # coefficient of the Switch/GShard load-balancing loss
    z_loss_coef: float = 0.001  # coefficient of the ST-MoE router z-loss
    impl: Literal["auto", "torch", "triton"] = "auto"  # token permutation: auto = Triton kernel on CUDA, PyTorch on CPU
    backend: Literal["native", "megablocks"] = "native"  # expert GEMMs: torch grouped_mm, or MegaBlocks (CUDA only)
    score: Literal["softmax", "sigmoid"] = "softmax"  # router score: softmax over experts (Mixtral) or sigmoid each
    route_scale: float = 1.0  # multiplier of the chosen experts' combine weights (DeepSeek-V3's routed scaling factor)
    bias_update_rate: float = 0.0  # loss-free balancing: per-expert choice bias moved by this × sign each step; 0 = off
    choice_bias: bool = False  # keep the per-expert choice bias even at bias_update_rate 0 (an imported one, frozen)
    aux_loss_scope: Literal["micro_batch", "sequence", "global_batch"] = (
        "micro_batch"  # load fractions f_i of the aux loss: per micro-batch, per sequence, or the whole step
    )
    global_batch_load: Literal["this_step", "previous_step"] = (
        "this_step"  # aux_loss_scope global_batch's f_i: this step's, from a no-grad routing pre-pass (one extra
        # forward per micro-batch), or the previous step's (no extra forward, one step stale)
    )
    n_groups: int = 1  # expert groups for group-limited routing (contiguous blocks of experts); 1 = off
    topk_groups: int = 1  # groups a token may choose its experts from (best by the sum of their top-2 scores)
    group_by: Literal["experts", "ep_rank", "node"] = "experts"  # what the groups must coincide with under EP
    n_shared_experts: int = 0  # shared experts: a dense SwiGLU on every token beside the routed ones (0 = none)
    shared_d_ff: Optional[int] = None  # hidden size of the shared SwiGLU; null = n_shared_experts × expert d_ff
    shared_gate: bool = False  # scale the shared experts' output by sigmoid(x · w) per token (Qwen2-MoE)
    dead_expert_window: int = 100  # telemetry: an expert is dead when no token reached it in this many steps

    def shared_hidden(self, d_ff: int) -> int:
        """Hidden size of the layer's shared SwiGLU (0 without shared experts); `d_ff` is model.d_ff."""
        if self.n_shared_experts == 0:
            return 0
        return self.shared_d_ff or self.n_shared_experts * (self.d_ff or d_ff)


@dataclass
class LocalState:
    routing: Routing
    sent_bytes: int = 0  # nothing leaves this device


class Dispatcher(Protocol):
    """The expert-parallel seam: move routed rows to the experts and back.

    `dispatch` returns (rows for this rank's experts sorted by local expert, rows per local expert, state); the
    state carries whatever `combine` needs plus `sent_bytes`, the bytes this rank sent to other ranks. Both move
    rows with `permutation`, the token gather and weighted sum chosen for the layer's device. `run`, what the
    layer calls, is the three steps in a row here; a dispatcher may pipeline them over chunks instead."""

    permutation: Permutation

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, LocalState]: ...

    def combine(self, y_RD: torch.Tensor, state) -> torch.Tensor: ...

    def run(self, x_TD: torch.Tensor, routing: Routing, experts: Callable) -> tuple[torch.Tensor, int]:
        """dispatch → experts(rows, rows per local expert) → combine: (out_TD, sent_bytes)."""
        x_RD, rows_per_expert_E, state = self.dispatch(x_TD, routing)
        return self.combine(experts(x_RD, rows_per_expert_E), state), state.sent_bytes


class LocalDispatcher(Dispatcher):
    """All experts on this device: a gather into expert order and a weighted sum back."""

    def __init__(self, permutation: Permutation):
        self.permutation = permutation

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, LocalState]:
        x_RD = self.permutation.permute(x_TD, routing.rows_R, routing.top_k)
        return x_RD, routing.tokens_per_expert_E, LocalState(routing)

    def combine(self, y_RD: torch.Tensor, state: LocalState) -> torch.Tensor:
        r = state.routing
        return self.permutation.unpermute(y_RD, r.rows_R, r.weight_A, r.num_tokens)


class MoE(nn.Module):
    """Router → dispatcher.run: dispatch → experts → combine (+ the shared experts on every token); its kernels
    chosen for `device`."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        cfg: MoEConfig,
        init_std: float,
        n_layers: int,
        device: torch.device | str = "cpu",
        activation: str = "swiglu",
    ):
        super().__init__()
        self.router = Router(d_model, cfg, init_std)
        self.experts = Experts(cfg.num_experts, d_model, cfg.d_ff or d_ff, init_std, n_layers, cfg.backend, activation)
        self.dispatcher: Dispatcher = LocalDispatcher(Permutation.for_device(cfg.impl, device))
        shared_ff = cfg.shared_hidden(d_ff)
        self.shared = (
            SharedExperts(d_model, shared_ff, cfg.shared_gate, init_std, n_layers, activation)
            if cfg.n_shared_experts
            else None
        )

    @property
    def implementations(self) -> dict[str, str]:
        """What this layer's operations run: {"permutation": "torch" | "triton", "experts": ...}."""
        experts = "grouped_mm" if self.experts.backend == "native" else self.experts.backend
        return {"permutation": self.dispatcher.permutation.permute.name, "experts": experts}

    def init_weights(self) -> None:
        self.router.init_weights()
        self.experts.init_weights()
        if self.shared is not None:
            self.shared.init_weights()

    def forward(self, x: torch.Tensor, shard: Optional[SeqShard] = None) -> tuple[torch.Tensor, RoutingStats]:
        """x (B, S, D) or (T, D); `shard`: x holds this rank's pieces of each sequence (context parallelism), and
        routing statistics, capacity and drops are those of the whole micro-batch (router.py)."""
        x_TD = x.reshape(-1, x.shape[-1])
        routing, stats = self.router(x_TD, x.shape[-2] if x.ndim >= 3 else None, shard)
        out_TD, stats.sent_bytes = self.dispatcher.run(x_TD, routing, self.experts)
        if self.shared is not None:
            out_TD = out_TD + self.shared(x_TD)
        return out_TD.view_as(x), stats


def moe_routers(model: nn.Module) -> list[Router]:
    """Every MoE layer's router, in layer order (the order of the model's routing statistics)."""
    return [m.router for m in model.modules() if isinstance(m, MoE)]


# ------------------------------------------------------------------------------------------ the kind


def _split_tp(moe: MoE, tp: TensorSplit) -> None:
    """Experts split over TP by their hidden units (etp = tp) or whole (etp = 1: another EP rank's on each TP peer,
    or another ZeRO partition, each counted in the norm); the shared experts split as a dense FFN inside the MoE
    region (one all-reduce for both); the router replicated: its input gradient scaled by 1/tp, its combine weights
    entering the region. The dispatcher's token split is set where it is built (expert_parallel.build_dispatcher)."""
    experts = moe.experts
    if tp.experts_split:
        if experts.gated:
            tp.shard(experts, "w13", 2, parts=2)  # (E, D, 2F) = [w1 | w3]: each half's F split
        else:
            tp.shard(experts, "w1", 2)  # (E, D, F)
        tp.shard(experts, "w2", 1)  # (E, F, D)
    else:
        for name in experts.weight_names:
            tp.model_parallel(getattr(experts, name))
    tp.region(moe)
    scale = 1.0 / tp.tp
    moe.router.register_forward_pre_hook(lambda m, args: (tp.scale_grad(args[0], scale), *args[1:]))
    if moe.shared is not None:
        split_ffn_tp(moe.shared, tp)
        if moe.shared.gate is not None:  # replicated, as the router: full gradient in, input gradient / tp
            moe.shared.gate.register_forward_pre_hook(lambda m, args: (tp.scale_grad(args[0], scale),))
            moe.shared.gate.register_forward_hook(lambda m, args, out: tp.enter(out))

    def weights_enter(m, args, out):
        routing, stats = out
        return dataclasses.replace(routing, weight_A=tp.enter(routing.weight_A)), stats

    moe.router.register_forward_hook(weights_enter)


def _check(cfg, placed: bool) -> None:
    """The section's rules (checked whether or not a layer places an MoE FFN: its defaults pass them)."""
    moe = cfg.model.moe
    require(moe.num_experts > 0, f"model.moe.num_experts: must be positive, got {moe.num_experts}")
    require(
        0 < moe.top_k <= moe.num_experts,
        f"model.moe.top_k: must be in [1, num_experts={moe.num_experts}], got {moe.top_k}",
    )
    require(
        moe.capacity_factor is None or moe.capacity_factor > 0,
        f"model.moe.capacity_factor: must be positive or null (dropless), got {moe.capacity_factor}",
    )
    check_routing(moe)


def _slow_paths(cfg, moe: MoE, device: torch.device) -> list[str]:
    """Experts whose GEMMs torch's grouped GEMM cannot take on CUDA (`grouped_mm_unfit`)."""
    if device.type != "cuda":
        return []
    why = moe.experts.slow_path(device.type, torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32)
    return [f"grouped GEMM: {why}; the experts run one matmul per expert"] if why else []


def _check_tp(cfg) -> None:
    m, tp, moe = cfg.model, cfg.parallel.tp, cfg.model.moe
    if cfg.parallel.expert_tp > 1:  # parallel.etp=1 keeps the experts whole
        divides(moe.d_ff or m.d_ff, "model.moe.d_ff", "the expert hidden size", tp)
    if moe.shared_hidden(m.d_ff):
        divides(moe.shared_hidden(m.d_ff), "model.moe.shared_d_ff", "the shared experts' hidden size", tp)


KIND = LayerKind(
    config=MoEConfig,
    name="moe",
    role="ffn",
    module=MoE,
    build=lambda m, device: MoE(m.d_model, m.d_ff, m.moe, m.init_std, m.n_layers, device, m.ffn_activation),
    part="moe_experts",
    section="moe",
    letter="E",
    doc="Mixture-of-Experts FFN",
    check=_check,
    check_tp=_check_tp,
    tp_rule=_split_tp,
    slow_paths=_slow_paths,
)
