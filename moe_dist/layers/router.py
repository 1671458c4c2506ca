"""Routing: the fp32 router (scores → top-k → combine weights → capacity drops) and the index math behind it.

Shape legend as in moe.py: T tokens, D d_model, E experts, K top_k, A = K·T assignments (slot-major, a = k·T + t),
R kept rows sorted by expert (R ≤ A). Routing is decided per micro-batch per rank, in fp32, and never issues a
collective (docs/moe_recipes.md "The base layer"); its only host transfer is the kept-row count, and only where
a capacity drops rows (tests/train/test_host_syncs.py counts it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.config.errors import require
from moe_dist.layers.sequence_shard import SeqShard, piece_chunks

if TYPE_CHECKING:
    from moe_dist.layers.moe import MoEConfig


def expert_capacity(cfg: MoEConfig, tokens: int) -> Optional[int]:
    """Per-expert capacity for one micro-batch on one rank: ceil(cf · T · K / E), at least min_capacity;
    None = dropless."""
    if cfg.capacity_factor is None:
        return None
    return max(math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.num_experts), cfg.min_capacity)


@dataclass
class RoutingStats:
    """Per-layer routing statistics of one micro-batch; tensors, so logging never forces a device sync here."""

    tokens_per_expert_E: torch.Tensor  # assignments per expert before drops (float)
    dropped: torch.Tensor  # assignments dropped by capacity (scalar)
    assignments: int  # A = K·T
    aux_loss: torch.Tensor  # E · Σ_i f_i · P_i (scalar, differentiable; f_i per `aux_loss_scope`)
    z_loss: torch.Tensor  # mean_t logsumexp(logits_t)² (scalar, differentiable)
    entropy: torch.Tensor  # mean router entropy over tokens (scalar)
    sent_bytes: int = 0  # bytes this rank sent to other ranks in the dispatch all-to-all (0 without EP)
    dropped_E: Optional[torch.Tensor] = None  # assignments dropped per expert (int64; None: not recorded)


@dataclass
class Routing:
    """What the dispatcher needs: which assignment goes where, with which weight. Every tensor has a size known
    without reading the device (A, E): the kept rows' count R is data, so the kept rows themselves are cut from
    `order_A` only by `kept_rows`, where the dispatcher holds the kept counts on the host (one transfer per layer:
    tests/train/test_host_syncs.py)."""

    order_A: torch.Tensor  # every assignment index a (slot-major), grouped by expert, in drop-priority order inside
    counts_E: torch.Tensor  # assignments per expert before drops (int64), sums to A
    kept_A: Optional[torch.Tensor]  # in order_A's order, True where kept (a prefix of each expert's); None: dropless
    tokens_per_expert_E: torch.Tensor  # kept rows per expert (int64), sums to R
    weight_A: torch.Tensor  # combine weight of every assignment (fp32, differentiable)
    num_tokens: int  # T
    top_k: int  # K (explicit: a micro-batch with no tokens has no assignments to infer it from)
    _rows_R: Optional[torch.Tensor] = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def with_kept_prefix(
        cls,
        order_A: torch.Tensor,
        counts_E: torch.Tensor,
        kept_A: Optional[torch.Tensor],
        tokens_per_expert_E: torch.Tensor,
        weight_A: torch.Tensor,
        num_tokens: int,
        top_k: int,
        kept: int,
    ) -> "Routing":
        """A routing whose kept rows are the first `kept` of `order_A` (`kept` known on the host): `kept_rows` is
        that slice, with no transfer and no index math (the deduplicated dispatch's block routing)."""
        routing = cls(order_A, counts_E, kept_A, tokens_per_expert_E, weight_A, num_tokens=num_tokens, top_k=top_k)
        routing._rows_R = order_A[:kept]
        return routing

    def kept_rows(self, kept_E_host: Optional[torch.Tensor] = None) -> torch.Tensor:
        """rows_R: the kept assignment indices, sorted by expert (R,). Dropless, `order_A` itself. With capacity
        the size R = Σ kept is needed on the host: from `kept_E_host` (the kept counts the caller already moved
        to the host, so no transfer here) or else by one device-to-host copy of `tokens_per_expert_E`. The
        indices are then gathered with sizes known on the host: no boolean mask, no other sync."""
        if self._rows_R is not None:
            return self._rows_R
        if self.kept_A is None:
            self._rows_R = self.order_A
            return self._rows_R
        if kept_E_host is None:
            kept_E_host = self.tokens_per_expert_E.cpu()  # the local dispatcher's one transfer, with capacity
        R, kept_E = int(kept_E_host.sum()), self.tokens_per_expert_E
        skip_E = self.counts_E - kept_E  # each expert's dropped assignments, after its kept ones in order_A
        shift_R = torch.repeat_interleave(torch.cumsum(skip_E, 0) - skip_E, kept_E, output_size=R)
        self._rows_R = self.order_A.index_select(0, torch.arange(R, device=self.order_A.device) + shift_R)
        return self._rows_R

    @property
    def rows_R(self) -> torch.Tensor:
        return self.kept_rows()


def count_per_expert(index_N: torch.Tensor, n: int) -> torch.Tensor:
    """How often each value in [0, n) occurs in `index_N`, (n,) int64: `torch.bincount(index, minlength=n)` with a
    static size. CUDA's bincount reads the input's min and max on the host whatever `minlength` (aten
    SummaryOps.cu: `self.min().cpu()`, `self.max().item()`): two syncs per call; a scatter-add into n zeros none."""
    index_N = index_N.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=index_N.device).scatter_add_(0, index_N, torch.ones_like(index_N))


def sorted_by_expert(expert_A: torch.Tensor, priority_A: Optional[torch.Tensor]) -> torch.Tensor:
    """Assignment indices grouped by expert, in `priority_A` order inside each expert (stable sorts); without
    `priority_A`, in assignment order (one sort: a stable sort keeps slot-major order within each expert)."""
    if priority_A is None:
        return torch.argsort(expert_A, stable=True)
    by_priority = torch.argsort(priority_A, stable=True)
    return by_priority[torch.argsort(expert_A[by_priority], stable=True)]


def earlier_in_other_pieces(expert_A: torch.Tensor, num_tokens: int, top_k: int, E: int, shard: SeqShard):
    """Context parallelism's drop order: (A,) for each of this rank's assignments (slot-major over its T local
    tokens, B sequences of S / cp local positions), how many assignments to the same expert come before it in the
    WHOLE micro-batch's slot-major order (slot, sequence, global position) and sit in other ranks' pieces. Added to
    its rank within its expert in local order, that is its rank in the global order, which a capacity compares
    (position priority exactly as one process). One all-gather of per-piece per-expert counts (2·K·B·E integers)
    over the CP group: the local pieces of a sequence are in global order (head chunk before tail chunk), so the
    local slot-major order is the global one restricted to this rank."""
    T, K, cp, chunk = num_tokens, top_k, shard.size, shard.chunk
    s_local = shard.seq_len // cp
    B = T // s_local
    a_A = torch.arange(K * T, device=expert_A.device)
    t_A = a_A % T
    group_A = ((a_A // T) * B + t_A // s_local) * 2 + (t_A % s_local) // chunk  # (slot, sequence, piece), local
    counts_KBPE = count_per_expert(group_A * E + expert_A, K * B * 2 * E).view(K, B, 2, E)
    whole_CKBE = shard.gather_pieces(counts_KBPE.permute(2, 0, 1, 3).contiguous())  # (2·cp, K, B, E) global chunks
    whole_NE = whole_CKBE.permute(1, 2, 0, 3).reshape(-1, E)  # (slot, sequence, chunk): the global order
    before_KBCE = (torch.cumsum(whole_NE, 0) - whole_NE).view(K, B, 2 * cp, E)
    mine_KBPE = before_KBCE[:, :, list(piece_chunks(cp, shard.rank))]
    local_NE = counts_KBPE.view(-1, E)
    before_local_KBPE = (torch.cumsum(local_NE, 0) - local_NE).view(K, B, 2, E)
    return (mine_KBPE - before_local_KBPE).view(-1, E)[group_A, expert_A]


def top_k_lower_index_first(choice_TE: torch.Tensor, k: int) -> torch.Tensor:
    """(T, K) indices of each row's k largest values in descending order, exact ties broken by the lower expert
    index: the first k of a stable descending sort, on every device (torch.topk leaves the order of ties
    unspecified). For 16- and 32-bit floats, one topk over an int64 key that holds the value's order-preserving
    32-bit pattern above E - 1 - index: keys are distinct within a row and compare as (value, -index), so the topk
    is unique and exact, at the cost of a topk (a stable sort of every row cost 2-3x that). -0.0 counts as +0.0 and
    every NaN as the largest value, as the sort orders them. fp64 takes the sort (no room for the index)."""
    E = choice_TE.shape[-1]
    if choice_TE.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return torch.sort(choice_TE, dim=-1, descending=True, stable=True).indices[:, :k]
    v_TE = choice_TE.float() + 0.0  # exact widening; adding +0.0 turns -0.0 into +0.0
    bits_TE = v_TE.view(torch.int32)
    ordered_TE = bits_TE ^ ((bits_TE >> 31) & 0x7FFFFFFF)  # negatives' magnitude bits flipped: int order = float order
    ordered_TE = ordered_TE.masked_fill(v_TE.isnan(), torch.iinfo(torch.int32).max)
    lower_first_E = E - 1 - torch.arange(E, device=choice_TE.device, dtype=torch.int64)
    key_TE = ordered_TE.to(torch.int64).mul_(1 << 32).add_(lower_first_E)
    return key_TE.topk(k, dim=-1).indices


def limit_to_groups(choice_TE: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3): experts form `n_groups` contiguous blocks; a group's score is the sum
    of its two best choice scores (its best one for single-expert groups); experts outside each token's
    `topk_groups` best groups get -inf, so the top-k that follows picks only inside them. (T, E) → (T, E)."""
    T, E = choice_TE.shape
    grouped_TGS = choice_TE.view(T, n_groups, E // n_groups)
    best_TG = grouped_TGS.topk(min(2, E // n_groups), dim=-1).values.sum(-1)  # values only: order is irrelevant
    groups_TM = top_k_lower_index_first(best_TG, topk_groups)
    keep_TG = torch.zeros_like(best_TG, dtype=torch.bool).scatter_(1, groups_TM, True)
    return grouped_TGS.masked_fill(~keep_TG[..., None], float("-inf")).view(T, E)


class Router(nn.Module):
    """Linear gate in fp32 → scores (softmax or sigmoid) → top-k over scores + bias (optionally within the best
    groups) → combine weights from the scores alone → capacity drops; returns routing and its losses.

    Buffers (persistent, so checkpoints carry them; never parameters, so no optimizer or gradient clipping sees
    them), present only when their option is on, and identical on every rank (set from all-reduced counts):
      bias_E  loss-free balancing (DeepSeek-V3, `bias_update_rate` > 0, or `choice_bias`: an imported correction
              bias, frozen at rate 0): added to the scores to choose experts, never to the combine weights;
              `end_step` moves it by rate · sign(mean load − load) per optimizer step.
      load_E  `aux_loss_scope` "global_batch": the load fractions f_i over a whole global batch, of this optimizer
              step (`global_batch_load` "this_step": set by `set_load` from a routing pre-pass before the step's
              first forward with gradients) or of the previous one ("previous_step": set by `end_step`); see
              `aux_loss`."""

    def __init__(self, d_model: int, cfg: MoEConfig, init_std: float):
        super().__init__()
        self.cfg = cfg
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, d_model))
        if cfg.bias_update_rate > 0 or cfg.choice_bias:
            self.register_buffer("bias_E", torch.empty(cfg.num_experts))
        else:
            self.bias_E = None
        if cfg.aux_loss_scope == "global_batch":
            self.register_buffer("load_E", torch.empty(cfg.num_experts))
        else:
            self.load_E = None

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        if self.bias_E is not None:
            self.bias_E.zero_()
        if self.load_E is not None:
            self.load_E.fill_(1.0 / self.cfg.num_experts)  # uniform before the first step: the aux gradient is 0

    @torch.no_grad()
    def set_load(self, tokens_per_expert_E: torch.Tensor) -> None:
        """The global-batch load fractions f_i from a global batch's assignments per expert (before drops; all
        ranks, all micro-batches, the same on every rank). A batch without assignments keeps the last f."""
        if self.load_E is None:
            return
        load_E = tokens_per_expert_E.to(device=self.load_E.device, dtype=torch.float64)
        total = load_E.sum()  # compared on the device: no host sync
        self.load_E = torch.where(total > 0, load_E / total.clamp(min=1), self.load_E.double()).float()

    @torch.no_grad()
    def end_step(self, tokens_per_expert_E: torch.Tensor) -> None:
        """After optimizer step: the step's global assignments per expert (all ranks, all micro-batches; the same
        on every rank). Updates the bias by its sign (DeepSeek-V3) and, with `global_batch_load` "previous_step",
        the global-batch load fractions the next step uses ("this_step" sets them at the start of each step)."""
        load_E = tokens_per_expert_E.to(torch.float64)
        if self.bias_E is not None and self.cfg.bias_update_rate > 0:  # a frozen bias (rate 0) stays as it is
            # fp32 even where the module was cast (bf16): steps of 1e-3 must not round away
            step_E = torch.sign(load_E.mean() - load_E).float() * self.cfg.bias_update_rate
            self.bias_E = self.bias_E.float() + step_E.to(self.bias_E.device)
        if self.cfg.global_batch_load == "previous_step":
            self.set_load(load_E)

    def aux_loss(
        self, p_TE: torch.Tensor, expert_TK: torch.Tensor, seq_len: int, shard: Optional[SeqShard] = None
    ) -> torch.Tensor:
        """Switch/GShard balance loss E · Σ_i f_i · P_i; P_i = mean over tokens of the normalized score p_ti,
        f_i = fraction of assignments (before drops) to expert i, over the scope `aux_loss_scope`:
          micro_batch  this micro-batch on this rank (T tokens);
          sequence     each sequence alone (its S tokens), the loss averaged over the B sequences (DeepSeek-V3's
                       complementary sequence-wise loss);
          global_batch f_i over every assignment of a whole global batch (`load_E`): all micro-batches on all
                       data-parallel ranks, each token once (tensor-parallel peers route the same tokens, so
                       only TP rank 0's are counted); P_i this micro-batch's (Qwen's global-batch balance). f is
                       a constant (no gradient) of the global batch alone, not of how it is cut into micro-batches
                       and ranks, and the step averages the micro-batches' losses as it does the LM loss, so the
                       step's aux loss is E · Σ_i f_i · mean over its M micro-batches of P_i, the same for every
                       layout and for one process with gradient accumulation. Which step's f
                       (`global_batch_load`):
                         this_step      the current optimizer step's, exactly: each micro-batch's backward runs
                                        before the next forward, so the step's routing is known in advance only
                                        from a no-grad routing pre-pass over all its micro-batches (train/loop.py
                                        `route_step_ahead`: one extra forward per micro-batch, `set_load`);
                         previous_step  the previous optimizer step's (`end_step`, no extra forward, one step
                                        stale); step 1 uses uniform f, whose gradient is zero for softmax scores.
        Zero, not NaN, for a micro-batch without tokens.

        Context parallelism (`shard`: this rank holds S / cp positions of each of the micro-batch's sequences,
        `seq_len` of them): f is the whole micro-batch's (sequence's) from the counts summed over the CP group, P
        this rank's tokens' mean. The loss is then cp × this rank's share of the whole micro-batch's loss (the
        pieces are of equal size), the form of every loss under CP (train/loop.py): summed over the group it is cp
        times the loss one process computes, and the gradient averaged over dp × cp ranks that of one process."""
        T, E = p_TE.shape
        K = expert_TK.shape[1]
        cp = 1 if shard is None else shard.size
        total = (lambda counts: counts) if cp == 1 else shard.sum
        if T == 0:
            return p_TE.sum() * 0.0  # keeps the graph (every rank's backward reaches the router weight)
        if self.cfg.aux_loss_scope == "sequence":
            B = T // seq_len
            seq_TK = torch.arange(T, device=p_TE.device).div(seq_len, rounding_mode="floor")[:, None]
            counts_BE = total(count_per_expert(seq_TK * E + expert_TK, B * E)).view(B, E)
            f_BE = counts_BE.float() / (K * seq_len * cp)
            return E * (f_BE * p_TE.view(B, seq_len, E).mean(dim=1)).sum(-1).mean()
        if self.cfg.aux_loss_scope == "global_batch":
            f_E = self.load_E.float()
        else:
            f_E = total(count_per_expert(expert_TK, E)).float() / (K * T * cp)
        return E * torch.sum(f_E * p_TE.mean(dim=0))

    def forward(
        self, x_TD: torch.Tensor, seq_len: Optional[int] = None, shard: Optional[SeqShard] = None
    ) -> tuple[Routing, RoutingStats]:
        """x_TD: the micro-batch's tokens, sequences of `seq_len`. With `shard` (context parallelism) they are this
        rank's S / cp positions of each sequence: the capacity is the whole micro-batch's, an assignment's place in
        the drop order its place in the whole micro-batch (`earlier_in_other_pieces`), the aux loss's f the whole
        micro-batch's; the statistics count this rank's tokens (summed over ranks they are the micro-batch's),
        and the z loss and entropy are this rank's means (cp × its share, see `aux_loss`)."""
        cfg, T = self.cfg, x_TD.shape[0]
        cp = 1 if shard is None else shard.size
        E, K = cfg.num_experts, cfg.top_k
        logits_TE = F.linear(x_TD.float(), self.weight.float())  # router math in fp32 (docs/moe_recipes.md)
        if cfg.score == "softmax":
            # The z-loss's logsumexp from the softmax: the top probability is exp(max - lse), so lse = max - log p_max
            # (p_max >= 1/E: no cancellation; its gradient is the softmax, as logsumexp's). Entropy = lse - Σ p·logit,
            # with no log over (T, E). On CPU torch's exp (and so logsumexp) takes a slow path where logits - max <
            # -87, as with spread logits; its softmax does not.
            scores_TE = p_TE = logits_TE.softmax(dim=-1)
            p_max_T, i_max_T = scores_TE.max(dim=-1)
            lse_T = logits_TE.gather(1, i_max_T[:, None]).squeeze(1) - p_max_T.log()
            entropy_T = lse_T.detach() - torch.linalg.vecdot(p_TE.detach(), logits_TE.detach())
        else:  # independent sigmoid scores (DeepSeek-V3); the aux loss and entropy see them normalized per token
            scores_TE = logits_TE.sigmoid()
            p_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
            lse_T = torch.logsumexp(logits_TE, dim=-1)
            entropy_T = torch.special.entr(p_TE.detach()).sum(-1)

        # Choice: scores plus the balancing bias, limited to the best groups; weights: the scores alone.
        choice_TE = scores_TE.detach() if self.bias_E is None else scores_TE.detach() + self.bias_E.float()
        if cfg.n_groups > 1:
            choice_TE = limit_to_groups(choice_TE, cfg.n_groups, cfg.topk_groups)
        expert_TK = top_k_lower_index_first(choice_TE, K)
        top_s_TK = scores_TE.gather(1, expert_TK)
        weight_TK = top_s_TK / top_s_TK.sum(dim=-1, keepdim=True) if cfg.renormalize else top_s_TK
        if cfg.route_scale != 1.0:
            weight_TK = weight_TK * cfg.route_scale

        # Slot-major flattening: all first choices, then all second choices, ... (GShard's priority order).
        expert_A = expert_TK.t().reshape(-1)
        weight_A = weight_TK.t().reshape(-1)
        counts_E = count_per_expert(expert_A, E)

        # "probability": highest router score first; "position": earlier tokens, first choices first, which is the
        # slot-major assignment order itself.
        priority_A = -top_s_TK.t().reshape(-1).detach() if cfg.drop_policy == "probability" else None
        order_A = sorted_by_expert(expert_A, priority_A)
        cap = expert_capacity(cfg, T * cp)
        if cap is None:
            kept_A, kept_E = None, counts_E
        else:  # an assignment's rank within its expert, from fixed-size index math (no mask indexing: no sync)
            starts_E = torch.cumsum(counts_E, 0) - counts_E
            rank_A = torch.arange(K * T, device=x_TD.device) - starts_E[expert_A[order_A]]
            if cp == 1:
                kept_A = rank_A < cap
                kept_E = counts_E.clamp(max=cap)
            else:  # the rank in the whole micro-batch; kept ones stay a prefix of each expert's (rank grows)
                kept_A = rank_A + earlier_in_other_pieces(expert_A, T, K, E, shard)[order_A] < cap
                kept_E = torch.zeros_like(counts_E).scatter_add_(0, expert_A[order_A], kept_A.long())

        n = max(T, 1)  # a micro-batch without tokens: zero losses and entropy, no division by zero
        stats = RoutingStats(
            tokens_per_expert_E=counts_E.float(),
            dropped=(K * T - kept_E.sum()).float(),
            dropped_E=counts_E - kept_E,
            assignments=K * T,
            aux_loss=self.aux_loss(p_TE, expert_TK, seq_len or T, shard),
            z_loss=lse_T.square().sum() / n,
            entropy=entropy_T.sum() / n,
        )
        routing = Routing(order_A, counts_E, kept_A, kept_E, weight_A, num_tokens=T, top_k=K)
        return routing, stats


def check_routing(moe: MoEConfig) -> None:
    """The routing options of model.moe beyond top-k (scores, balancing, groups, shared experts)."""
    require(moe.route_scale > 0, f"model.moe.route_scale: must be positive, got {moe.route_scale}")
    require(moe.bias_update_rate >= 0, f"model.moe.bias_update_rate: must be >= 0, got {moe.bias_update_rate}")
    require(
        moe.n_groups >= 1 and moe.num_experts % moe.n_groups == 0,
        f"model.moe.n_groups: must divide model.moe.num_experts={moe.num_experts}, got {moe.n_groups}",
    )
    require(
        1 <= moe.topk_groups <= moe.n_groups,
        f"model.moe.topk_groups: must be in [1, n_groups={moe.n_groups}], got {moe.topk_groups}",
    )
    reachable = moe.topk_groups * (moe.num_experts // moe.n_groups)
    require(
        moe.top_k <= reachable,
        f"model.moe.top_k: {moe.top_k} experts cannot be chosen from topk_groups={moe.topk_groups} groups of "
        f"{moe.num_experts // moe.n_groups} experts",
    )
    require(moe.n_shared_experts >= 0, f"model.moe.n_shared_experts: must be >= 0, got {moe.n_shared_experts}")
    require(
        moe.shared_d_ff is None or moe.shared_d_ff > 0,
        f"model.moe.shared_d_ff: must be positive or null, got {moe.shared_d_ff}",
    )
    require(moe.dead_expert_window >= 1, f"model.moe.dead_expert_window: must be >= 1, got {moe.dead_expert_window}")
