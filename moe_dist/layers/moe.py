"""Mixture-of-Experts FFN: fp32 router, top-k, capacity/drops, a dispatcher seam, grouped SwiGLU experts.

Shape legend (suffixes on tensor names):
    T tokens in the micro-batch (batch × seq)    D d_model        F expert hidden size (2F: gate and up fused)
    E experts                                    K top_k           A = K·T assignments, slot-major (a = k·T + t)
    R routed rows: kept assignments, sorted by expert (R ≤ A)

`MoE.forward` is router → dispatcher.dispatch → experts → dispatcher.combine. The default
`LocalDispatcher` permutes rows on this device; expert parallelism swaps in an all-to-all dispatcher
with the same two methods, and the layer does not know which one it has (DESIGN.md §4.2).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.config import ConfigError, MoEConfig
from moe_dist.kernels import grouped_gemm_cpu, permute_cpu, routing_cpu
from moe_dist.layers.impl import IMPLS_WITH_CPU, CpuKernel, resolve
from moe_dist.layers.mlp import gated_silu, select_gated_silu


def expert_capacity(cfg: MoEConfig, tokens: int) -> Optional[int]:
    """Per-expert capacity for one micro-batch on one rank: ceil(cf · T · K / E), at least min_capacity; None = dropless."""
    if cfg.capacity_factor is None:
        return None
    return max(math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.num_experts), cfg.min_capacity)


@dataclass
class RoutingStats:
    """Per-layer routing statistics of one micro-batch; tensors, so logging never forces a device sync here."""

    tokens_per_expert_E: torch.Tensor  # assignments per expert before drops (float)
    dropped: torch.Tensor  # assignments dropped by capacity (scalar)
    assignments: int  # A = K·T
    aux_loss: torch.Tensor  # E · Σ_i f_i · P_i (scalar, differentiable)
    z_loss: torch.Tensor  # mean_t logsumexp(logits_t)² (scalar, differentiable)
    entropy: torch.Tensor  # mean router entropy over tokens (scalar)
    sent_bytes: int = 0  # bytes this rank sent to other ranks in the dispatch all-to-all (0 without EP)


@dataclass
class Routing:
    """What the dispatcher needs: which assignment goes where, with which weight."""

    rows_R: torch.Tensor  # assignment indices a (slot-major) that are kept, sorted by expert
    tokens_per_expert_E: torch.Tensor  # kept rows per expert (int64), sums to R
    weight_A: torch.Tensor  # combine weight of every assignment (fp32, differentiable)
    num_tokens: int  # T


def topk(probs_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path of the router's top-k: (values, indices), (T, k) each, in descending order."""
    return probs_TE.topk(k, dim=-1)


def argsort_by_expert(expert_A: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The PyTorch path of the stable sort of assignments by expert id."""
    return torch.argsort(expert_A, stable=True)


@dataclass(frozen=True)
class Selection:
    """The router's two selections for `model.moe.impl`, chosen once (moe_dist.layers.impl.resolve): the PyTorch
    functions above, or the compiled CPU kernels (moe_dist.kernels.routing_cpu) for CPU tensors."""

    topk: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    argsort_by_expert: Callable[[torch.Tensor, int], torch.Tensor]

    @classmethod
    def from_impl(cls, impl: str) -> "Selection":
        def cpu(name):
            return CpuKernel(getattr(routing_cpu, name), getattr(routing_cpu, f"{name}_unsupported"),
                             routing_cpu.unavailable)

        key = "model.moe.impl"
        return cls(resolve(impl, key, "router top-k", topk, None, cpu("topk"), IMPLS_WITH_CPU),
                   resolve(impl, key, "expert sort", argsort_by_expert, None, cpu("argsort_by_expert"),
                           IMPLS_WITH_CPU))

    def sorted_by_expert(self, expert_A: torch.Tensor, priority_A: Optional[torch.Tensor], num_experts: int):
        """Assignment indices grouped by expert, in `priority_A` order inside each expert (stable sorts); without
        `priority_A`, in assignment order (one sort: a stable sort keeps slot-major order within each expert)."""
        if priority_A is None:
            return self.argsort_by_expert(expert_A, num_experts)
        by_priority = torch.argsort(priority_A, stable=True)
        return by_priority[self.argsort_by_expert(expert_A[by_priority], num_experts)]


class Router(nn.Module):
    """Linear gate in fp32 → softmax → top-k (renormalized) → capacity drops; returns routing and its losses."""

    def __init__(self, d_model: int, cfg: MoEConfig, init_std: float):
        super().__init__()
        self.cfg = cfg
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, d_model))
        self.selection = Selection.from_impl(cfg.impl)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def forward(self, x_TD: torch.Tensor) -> tuple[Routing, RoutingStats]:
        cfg, T = self.cfg, x_TD.shape[0]
        E, K = cfg.num_experts, cfg.top_k
        logits_TE = F.linear(x_TD.float(), self.weight.float())  # router math in fp32 (DESIGN.md §5)
        # The z-loss's logsumexp from the softmax: the top-1 probability is exp(max - lse), so lse = max - log p_max
        # (p_max >= 1/E: no cancellation; its gradient is the softmax, as logsumexp's). Entropy = lse - Σ p·logit,
        # with no log over (T, E). On CPU torch's exp (and logsumexp) take a slow path where logits - max < -87,
        # as with spread logits (30x the time), its softmax does not: the router's forward+backward at T=4096 E=64
        # took 0.85x the time of one exp pass for softmax and lse (same process), 0.89x at E=8.
        probs_TE = logits_TE.softmax(dim=-1)
        top_p_TK, expert_TK = self.selection.topk(probs_TE, K)
        lse_T = logits_TE.gather(1, expert_TK[:, :1]).squeeze(1) - top_p_TK[:, 0].log()
        weight_TK = top_p_TK / top_p_TK.sum(dim=-1, keepdim=True) if cfg.renormalize else top_p_TK

        # Slot-major flattening: all first choices, then all second choices, ... (GShard's priority order).
        expert_A = expert_TK.t().reshape(-1)
        weight_A = weight_TK.t().reshape(-1)
        counts_E = torch.bincount(expert_A, minlength=E)

        # "probability": highest router probability first; "position": earlier tokens, first choices first,
        # which is the slot-major assignment order itself.
        priority_A = -top_p_TK.t().reshape(-1).detach() if cfg.drop_policy == "probability" else None
        order_A = self.selection.sorted_by_expert(expert_A, priority_A, E)
        cap = expert_capacity(cfg, T)
        if cap is None:
            rows_R, kept_E = order_A, counts_E
        else:
            starts_E = torch.cumsum(counts_E, 0) - counts_E
            position_A = torch.arange(K * T, device=x_TD.device) - starts_E[expert_A[order_A]]  # rank within expert
            rows_R = order_A[position_A < cap]
            kept_E = counts_E.clamp(max=cap)

        f_E = counts_E.float() / (K * T)  # fraction of assignments per expert, before drops
        p_E = probs_TE.mean(dim=0)
        stats = RoutingStats(
            tokens_per_expert_E=counts_E.float(),
            dropped=(K * T - kept_E.sum()).float(),
            assignments=K * T,
            aux_loss=E * torch.sum(f_E * p_E),
            z_loss=lse_T.square().mean(),
            entropy=(lse_T.detach() - torch.linalg.vecdot(probs_TE.detach(), logits_TE.detach())).mean(),
        )
        return Routing(rows_R=rows_R, tokens_per_expert_E=kept_E, weight_A=weight_A, num_tokens=T), stats


def _slots(rows_R: torch.Tensor, num_tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where every assignment's row is: row_KT[k, t] indexes rows_R's order (0 where the assignment was dropped),
    kept_KT is 1.0 for a kept assignment and 0.0 for a dropped one. (K, T) int64 and (K, T) fp32."""
    R, dev = rows_R.shape[0], rows_R.device
    row_A = torch.zeros(top_k * num_tokens, dtype=torch.long, device=dev).index_put_((rows_R,), torch.arange(R, device=dev))
    kept_A = torch.zeros(top_k * num_tokens, dtype=torch.float32, device=dev).index_fill_(0, rows_R, 1.0)
    return row_A.view(top_k, num_tokens), kept_A.view(top_k, num_tokens)


def _sum_slots(rows_RD: torch.Tensor, row_KT: torch.Tensor, scale_KT: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_k scale[k, t] · rows[row_KT[k, t]] in the compute dtype (fp32 at least). (T, D).

    One (T, D) gather, conversion and fused multiply-add per top-k slot: gathers instead of a scatter-add
    (index_put/index_add with repeated indices are serial on CPU), and no (R, D) temporary in fp32 (converting
    copies of the routed rows cost more than the arithmetic). A dropped slot reads row 0 with scale 0 (so an
    inf in row 0 would reach it as NaN: such a step is non-finite anyway, and the guard skips it)."""
    compute = torch.promote_types(rows_RD.dtype, torch.float32)
    K, T = row_KT.shape
    if rows_RD.shape[0] == 0:  # every assignment dropped: nothing to gather from
        return rows_RD.new_zeros(T, rows_RD.shape[1], dtype=compute)
    scale_KT = scale_KT.to(compute)
    out_TD = rows_RD.index_select(0, row_KT[0]).to(compute).mul_(scale_KT[0, :, None])
    for k in range(1, K):  # K ≤ a handful: a loop over slots, never over tokens or experts
        out_TD.addcmul_(rows_RD.index_select(0, row_KT[k]).to(compute), scale_KT[k, :, None])
    return out_TD


class _PermuteRows(torch.autograd.Function):
    """x_RD = x_TD[rows_R % T]; backward sums each token's kept slots by gathers (semantics of permute_tokens_ref)."""

    forward = staticmethod(permute_cpu.gather_forward)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        (rows_R,) = ctx.saved_tensors
        row_KT, kept_KT = _slots(rows_R, ctx.num_tokens, ctx.top_k)
        return _sum_slots(grad_RD, row_KT, kept_KT).to(grad_RD.dtype), None, None


class _UnpermuteRows(torch.autograd.Function):
    """out[t] = Σ_{kept a of t} weight_A[a] · y[row(a)], fp32 accumulation (semantics of unpermute_tokens_ref)."""

    @staticmethod
    def forward(ctx, y_RD: torch.Tensor, rows_R: torch.Tensor, weight_A: torch.Tensor, num_tokens: int):
        K = weight_A.shape[0] // max(num_tokens, 1)
        row_KT, kept_KT = _slots(rows_R, num_tokens, K)
        ctx.save_for_backward(y_RD, rows_R, weight_A, row_KT, kept_KT)
        ctx.num_tokens = num_tokens
        return _sum_slots(y_RD, row_KT, weight_A.view(K, num_tokens) * kept_KT).to(y_RD.dtype)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        y_RD, rows_R, weight_A, row_KT, kept_KT = ctx.saved_tensors
        compute = torch.promote_types(y_RD.dtype, torch.float32)
        grad_weight_A = None
        if ctx.needs_input_grad[2]:
            # d out[t] / d weight[k, t] = y[row(k, t)]: row-wise dot products in fp32, one top-k slot at a time (no
            # (R, D) fp32 temporaries); dropped slots get 0
            grad_weight_A = torch.zeros_like(weight_A)
            if y_RD.shape[0]:  # else every assignment was dropped: all zero
                g_TD = grad_TD.to(compute)
                dots = [torch.linalg.vecdot(g_TD, y_RD.index_select(0, row_KT[k]).to(compute))
                        for k in range(row_KT.shape[0])]
                grad_weight_A = (torch.stack(dots) * kept_KT).view(-1).to(weight_A.dtype)
        # each row's token gradient times its weight, in the gradient's dtype (the weight rounded to it once)
        weight_R = weight_A.index_select(0, rows_R).to(grad_TD.dtype)
        grad_y = grad_TD.index_select(0, rows_R % ctx.num_tokens).mul_(weight_R[:, None])
        return grad_y, None, grad_weight_A, None


def permute_rows(x_TD: torch.Tensor, rows_R: torch.Tensor, top_k: int) -> torch.Tensor:
    """The PyTorch path of the token gather: `permute_tokens_ref`'s semantics and signature, faster backward."""
    return _PermuteRows.apply(x_TD, rows_R, top_k)


def unpermute_rows(y_RD: torch.Tensor, rows_R: torch.Tensor, weight_A: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The PyTorch path of the weighted scatter back: `unpermute_tokens_ref`'s semantics and signature, by gathers."""
    return _UnpermuteRows.apply(y_RD, rows_R, weight_A, num_tokens)


@dataclass
class Permutation:
    """The gather into expert order and the weighted scatter back; Triton kernels on CUDA, compiled kernels
    (moe_dist.kernels.permute_cpu) for fp32/bf16 CPU tensors, the gather-only PyTorch functions above otherwise
    (chosen once, by moe_dist.layers.impl.resolve). Signatures of
    `moe_dist.kernels.reference.(un)permute_tokens_ref`, their specification and test oracle."""

    permute: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # (x_TD, rows_R, top_k) -> x_RD
    unpermute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]  # (y_RD, rows_R, weight_A, T)

    @classmethod
    def from_impl(cls, impl: str) -> "Permutation":
        key, what = "model.moe.impl", "token permutation"
        cpu = {name: CpuKernel(getattr(permute_cpu, name), getattr(permute_cpu, f"{name}_unsupported"),
                               permute_cpu.unavailable) for name in ("permute_tokens", "unpermute_tokens")}
        return cls(resolve(impl, key, what, permute_rows, "permute.permute_tokens", cpu["permute_tokens"],
                           IMPLS_WITH_CPU),
                   resolve(impl, key, what, unpermute_rows, "permute.unpermute_tokens", cpu["unpermute_tokens"],
                           IMPLS_WITH_CPU))

    def gather(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.permute(x_TD, routing.rows_R, routing.weight_A.shape[0] // routing.num_tokens)

    def scatter(self, y_RD: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.unpermute(y_RD, routing.rows_R, routing.weight_A, routing.num_tokens)


@dataclass
class LocalState:
    routing: Routing
    sent_bytes: int = 0  # nothing leaves this device


class Dispatcher(Protocol):
    """The expert-parallel seam: move routed rows to the experts and back.

    `dispatch` returns (rows for this rank's experts sorted by local expert, rows per local expert, state); the
    state carries whatever `combine` needs plus `sent_bytes`, the bytes this rank sent to other ranks."""

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, LocalState]: ...

    def combine(self, y_RD: torch.Tensor, state) -> torch.Tensor: ...


class LocalDispatcher:
    """All experts on this device: a gather into expert order and a weighted scatter-add back."""

    def __init__(self, permutation: Permutation):
        self.permutation = permutation

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, LocalState]:
        return self.permutation.gather(x_TD, routing), routing.tokens_per_expert_E, LocalState(routing)

    def combine(self, y_RD: torch.Tensor, state: LocalState) -> torch.Tensor:
        return self.permutation.scatter(y_RD, state.routing)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    # torch's grouped GEMM needs 16-byte aligned strides and a supported dtype (bf16 on CUDA; fp32/bf16/fp16 on
    # CPU); other cases (odd test sizes, fp64) take the fallback below.
    dtypes = (torch.bfloat16,) if x.is_cuda else (torch.float32, torch.bfloat16, torch.float16)
    es = x.element_size()
    return (hasattr(F, "grouped_mm") and x.dtype in dtypes and x.dtype == w.dtype and x.is_contiguous()
            and w.is_contiguous() and (x.shape[1] * es) % 16 == 0 and (w.shape[2] * es) % 16 == 0)


def grouped_mm(x_RI: torch.Tensor, w_EIO: torch.Tensor, rows_per_expert_E: torch.Tensor) -> torch.Tensor:
    """(R, I) rows sorted by expert × (E, I, O) stacked weights → (R, O): row r uses its expert's weight."""
    if _grouped_mm_ok(x_RI, w_EIO):
        # Measured on CPU bf16 (2 cores, 64 experts of 384 rows): grouped_mm runs as fast as a per-expert mm loop
        # into slices of one output (about 0.85 of a large matmul's rate either way), so the library call stays.
        offs_E = torch.cumsum(rows_per_expert_E, 0).to(torch.int32)
        y = F.grouped_mm(x_RI, w_EIO, offs=offs_E)
        if y.requires_grad:
            y.register_hook(lambda g: g.contiguous())  # its CPU backward rejects broadcast (stride-0) grads
        return y
    # Fallback for unaligned sizes: one matmul per expert over contiguous slices (no masks, no per-token work).
    chunks = torch.split(x_RI, rows_per_expert_E.tolist())
    return torch.cat([c @ w_EIO[e] for e, c in enumerate(chunks)]) if len(chunks) else x_RI.new_zeros(0, w_EIO.shape[2])


def select_grouped_mm(impl: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The experts' grouped GEMM for `model.moe.impl`: `grouped_mm` above, or the AMX kernel
    (`moe_dist.kernels.grouped_gemm_cpu`; "auto" and "cpu" take it for bf16 CPU tensors with weight dims that are
    multiples of 32). On a CPU without AMX-BF16 the layer has no compiled GEMM, so "cpu" runs torch's here, as for
    any part without a kernel of the chosen family. No Triton kernel: on CUDA, torch's grouped GEMM is the vendor's."""
    cpu = None
    if grouped_gemm_cpu.cpu_has_amx():
        cpu = CpuKernel(grouped_gemm_cpu.grouped_mm, grouped_gemm_cpu.grouped_mm_unsupported,
                        grouped_gemm_cpu.unavailable)
    return resolve(impl, "model.moe.impl", "grouped GEMM", grouped_mm, None, cpu, IMPLS_WITH_CPU)


def native_swiglu(x_RD: torch.Tensor, w13_ED2F: torch.Tensor, w2_EFD: torch.Tensor,
                  rows_per_expert_E: torch.Tensor, activation: Callable = gated_silu,
                  matmul: Callable = grouped_mm, gate_up: Optional[Callable] = None) -> torch.Tensor:
    """SwiGLU experts over expert-sorted rows with a grouped GEMM (`select_grouped_mm`). (R, D) → (R, D).
    The gate and up projections are one GEMM over [w1 | w3]: on CPU, six larger per-expert calls instead of nine
    (measured: 0.85× the layer time at 64 experts of 384 rows, no change at 8 experts of 1024 rows).
    `activation` is the gated SiLU over that GEMM's (R, 2F) output (`select_gated_silu`); `gate_up`, where given,
    computes both at once, (x, w13, counts) → h (`select_gate_up`)."""
    if gate_up is not None:
        h_RF = gate_up(x_RD, w13_ED2F, rows_per_expert_E)
    else:
        h_RF = activation(matmul(x_RD, w13_ED2F, rows_per_expert_E))
    return matmul(h_RF, w2_EFD, rows_per_expert_E)


def select_gate_up(impl: str, activation: Callable, matmul: Callable) -> Optional[Callable]:
    """The gate/up GEMM and gated SiLU as one call for `model.moe.impl` where a kernel fuses them: the AMX grouped
    GEMM's gated mode, the SiLU in its epilogue ("auto" and "cpu", bf16 CPU tensors, F a multiple of 32; the same
    bits as the two calls; measured in one process: the forward 0.73-0.93x the time of the GEMM and the SiLU's own
    pass). None where there is none (the two calls then run)."""
    if not grouped_gemm_cpu.cpu_has_amx() or impl in ("torch", "triton"):
        return None
    cpu = CpuKernel(grouped_gemm_cpu.grouped_mm_gated, grouped_gemm_cpu.grouped_mm_gated_unsupported,
                    grouped_gemm_cpu.unavailable)
    return resolve(impl, "model.moe.impl", "fused gate/up GEMM", lambda x, w, counts: activation(matmul(x, w, counts)),
                   None, cpu, IMPLS_WITH_CPU)


def expert_swiglu(backend: str, impl: str = "auto") -> Callable[..., torch.Tensor]:
    """The expert computation of `model.moe.backend` (its activation and grouped GEMM by `model.moe.impl`), chosen once;
    "megablocks" raises a ConfigError naming the key where MegaBlocks cannot run (not installed, no CUDA)."""
    if backend == "native":
        activation, matmul = select_gated_silu(impl), select_grouped_mm(impl)
        return functools.partial(native_swiglu, activation=activation, matmul=matmul,
                                 gate_up=select_gate_up(impl, activation, matmul))
    if backend == "megablocks":
        from moe_dist.layers.megablocks_backend import check_megablocks, megablocks_swiglu

        check_megablocks()
        return megablocks_swiglu
    raise ConfigError(f"model.moe.backend: expected 'native' or 'megablocks', got {backend!r}")


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights, run as grouped GEMMs over expert-sorted rows. The gate (w1) and up
    (w3) projections are stored side by side as w13 = [w1 | w3] (E, D, 2F), as Megatron's grouped MLP does, so
    that one GEMM computes both; `gate_up` names the halves where they are taken apart (checkpoints stay whole)."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int, init_std: float, n_layers: int,
                 backend: str = "native", impl: str = "auto"):
        super().__init__()
        self.swiglu = expert_swiglu(backend, impl)
        self.w13 = nn.Parameter(torch.empty(num_experts, d_model, 2 * d_ff))  # [gate | up] (E, D, 2F)
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))  # down (E, F, D)
        self.init_std = init_std
        self.out_std = init_std / math.sqrt(2 * n_layers)
        self.expert_offset = 0  # global index of the first expert held here (apply_ep holds a slice)

    def gate_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of w1 (gate) and w3 (up) in w13, each (E, D, F)."""
        return self.w13.chunk(2, dim=2)

    @torch.no_grad()
    def init_weights(self) -> None:
        # One generator per global expert, seeded from the global RNG: expert e gets the same values whichever
        # rank holds it, and the draws of the rest of the model do not depend on the expert-parallel layout.
        base = int(torch.randint(0, 2**62, (1,)).item())
        w1, w3 = self.gate_up()
        for j in range(self.w13.shape[0]):
            gen = torch.Generator(device=self.w13.device).manual_seed(base + self.expert_offset + j)
            for w, std in ((w1[j], self.init_std), (w3[j], self.init_std), (self.w2[j], self.out_std)):
                w.copy_(torch.randn(w.shape, generator=gen, device=w.device, dtype=w.dtype) * std)

    def forward(self, x_RD: torch.Tensor, rows_per_expert_E: torch.Tensor) -> torch.Tensor:
        return self.swiglu(x_RD, self.w13, self.w2, rows_per_expert_E)


class MoE(nn.Module):
    def __init__(self, d_model: int, d_ff: int, cfg: MoEConfig, init_std: float, n_layers: int):
        super().__init__()
        self.router = Router(d_model, cfg, init_std)
        self.experts = Experts(cfg.num_experts, d_model, cfg.d_ff or d_ff, init_std, n_layers, cfg.backend, cfg.impl)
        self.dispatcher: Dispatcher = LocalDispatcher(Permutation.from_impl(cfg.impl))

    def init_weights(self) -> None:
        self.router.init_weights()
        self.experts.init_weights()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        x_TD = x.reshape(-1, x.shape[-1])
        routing, stats = self.router(x_TD)
        x_RD, rows_per_expert_E, state = self.dispatcher.dispatch(x_TD, routing)
        y_RD = self.experts(x_RD, rows_per_expert_E)
        stats.sent_bytes = state.sent_bytes
        return self.dispatcher.combine(y_RD, state).view_as(x), stats
