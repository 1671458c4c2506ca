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

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
from torch import nn

from moe_dist.config import MoEConfig
from moe_dist.layers.experts import Experts
from moe_dist.layers.mlp import SharedExperts
from moe_dist.layers.permutation import Permutation
from moe_dist.layers.router import Router, Routing, RoutingStats
from moe_dist.parallel.context_parallel import SeqShard


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
