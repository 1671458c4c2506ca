"""The workload side of the performance model: a layout of ranks, the model's FLOPs per token, and the list of
collectives one training step issues (`step_calls`).

Invariant: `step_calls` mirrors what a training step of this repository issues (EP, TP, CP, the data-parallel
reduction) and the rank placement of moe_dist.parallel.mesh; a change to either must change this file too
(docs/perf_model.md, "The model"; checked against benchmarks/scaling.py's instrumented runs by
tests/benchmarks/test_bench_common.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moe_dist.config import JobConfig
from moe_dist.layers import registry
from moe_dist.models.activation_checkpointing import checkpointed_parts
from moe_dist.planning.collectives import LAST_BACKWARD, NEXT_FORWARD, SCALAR_ALL_REDUCES_PER_STEP, Call


@dataclass(frozen=True)
class Layout:
    dp: int
    ep: int
    tp: int
    etp: int | None = None  # expert tensor-parallel size: tp (None) or 1 (whole experts, EP spans dp × cp × tp)
    cp: int = (
        1  # context parallelism: each sequence split over cp ranks (rank = (dp_rank · cp + cp_rank) · tp + tp_rank)
    )
    pp: int = 1  # pipeline stages, the outermost dimension: every field above is of one stage's world / pp ranks

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def zero(self) -> int:
        """Ranks holding the same dense weights, over which ZeRO shards and the dense gradients are reduced."""
        return self.dp * self.cp

    @property
    def folded(self) -> bool:
        return self.etp == 1 and self.tp > 1

    def __str__(self) -> str:
        cp = f"-cp{self.cp}" if self.cp > 1 else ""
        pp = f"pp{self.pp}-" if self.pp > 1 else ""
        return f"{pp}dp{self.dp}{cp}-ep{self.ep}-tp{self.tp}" + ("-etp1" if self.folded else "")


def config_layout(cfg: JobConfig, world: int) -> Layout | None:
    """The config's own layout at `world` ranks (None where its pp × tp × cp does not divide the world)."""
    par = cfg.parallel
    cp, pp = par.cp, par.pp
    if world % (pp * par.tp * cp):
        return None
    folded = par.tp > 1 and par.expert_tp == 1
    return Layout(world // (pp * par.tp * cp), par.ep, par.tp, 1 if folded else None, cp, pp)


def stage_share(cost: ModelCost, pp: int) -> ModelCost:
    """What one pipeline rank runs and holds of the model: 1/pp of its FLOPs, parameters and layers of each kind (the
    cost-balanced cut of planning/stage_cut.py makes the stages' FLOPs about equal; the embedding and head are
    spread with them here)."""
    if pp == 1:
        return cost
    share = 1.0 / pp
    scaled = ("fwd_flops_per_token", "dense_params", "expert_params", "n_moe_layers", "n_layers")
    scaled += ("recompute_flops_per_token",)
    layers = {k: n * share for k, n in cost.layers.items()}
    return replace(cost, layers=layers, **{name: getattr(cost, name) * share for name in scaled})


@dataclass(frozen=True)
class ModelCost:
    """What a model costs per token, from its meta-built parameters (no memory allocated)."""

    fwd_flops_per_token: float
    dense_params: int  # everything but expert weights (embeddings, attention/Mamba, router, norms, dense FFN)
    expert_params: int  # stacked expert weights, all experts
    n_moe_layers: int
    n_layers: int
    d_model: int
    recompute_flops_per_token: float = 0.0  # the forward FLOPs activation checkpointing repeats in the backward
    recomputed: frozenset = frozenset()  # train.activation_checkpointing's parts
    layers: dict = field(default_factory=dict)  # layer kind → how many sublayers of it (a stage's share under PP)


def mixer_flops_per_token(cfg: JobConfig, kind: str) -> float:
    """Forward FLOPs per token of a mixer beyond its weights (causal attention scores, the recurrent scans):
    the kind's `flops_per_token` at the run's sequence length."""
    return registry.kind(kind).flops_per_token(cfg.model, cfg.train.seq_len)


def model_cost(cfg: JobConfig) -> ModelCost:
    """Forward FLOPs per token: 2 · (matmul weights a token touches) + attention scores + the SSM scans; and the
    part of them activation checkpointing runs again in the backward (models/activation_checkpointing.py: each
    checkpointed mixer and dense FFN whole, of an MoE layer only its experts)."""
    from moe_dist.models.decoder import build_model

    m = cfg.model
    model = build_model(m)
    kinds = m.layer_kinds()
    parts = frozenset(checkpointed_parts(cfg.train))

    def recomputed(name: str) -> bool:
        if not name.startswith("blocks."):
            return False  # embedding, final norm, LM head
        _, i, sub, *rest = name.split(".")
        kind = kinds[int(i)][0 if sub == "mixer" else 1] if sub in ("mixer", "ffn") else None
        if kind is None:
            return False  # the blocks' norms
        # An FFN kind with routed experts (MoE) recomputes only them (activation_checkpointing.py).
        routed = sub == "ffn" and hasattr(model.blocks[int(i)].ffn, "experts")
        return registry.kind(kind).part in parts and (not routed or rest[0] == "experts")

    matmul = dense = expert = again = 0.0
    for name, p in model.named_parameters():
        is_expert = ".experts." in name
        if is_expert:
            expert += p.numel()
        else:
            dense += p.numel()
        if p.ndim < 2 or name.endswith("A_log") or (name.startswith("embed.") and not m.tie_embeddings):
            continue  # vectors, the SSM's A and the embedding lookup cost no matmul FLOPs
        flops = p.numel() * (m.moe.top_k / m.moe.num_experts if is_expert else 1.0)
        matmul += flops
        again += flops if recomputed(name) else 0.0
    count = {k: sum(k in pair for pair in kinds) for k in registry.KINDS}
    mixers = {k: count[k] * mixer_flops_per_token(cfg, k) for k in registry.KINDS}
    fwd = 2.0 * matmul + sum(mixers.values())
    again = 2.0 * again + sum(v for k, v in mixers.items() if registry.kind(k).part in parts)
    n_moe = sum(ffn == "moe" for _, ffn in kinds)
    layers = {k: n for k, n in count.items() if n}
    return ModelCost(fwd, int(dense), int(expert), n_moe, m.n_layers, m.d_model, again, parts, layers)


def _group_placement(ranks: list[int], ranks_per_node: int) -> tuple[int, int]:
    """(group size, most ranks of the group on one node)."""
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[r // ranks_per_node] = per_node.get(r // ranks_per_node, 0) + 1
    return len(ranks), max(per_node.values())


def group_shapes(layout: Layout, ranks_per_node: int) -> dict[str, tuple[int, int]]:
    """(size, ranks per node) of rank 0's tp, cp, ep, dp (ZeRO: dp × cp) and edp groups under mesh.py's rank order
    rank = q · tp + tp_rank with q = dp_rank · cp + cp_rank: EP groups are blocks of ep consecutive q (of ep
    consecutive ranks with etp = 1), the EDP groups stride across them, inside one pipeline stage's ranks."""
    tp, ep, q = layout.tp, layout.ep, layout.zero
    rank = lambda q, t: q * tp + t  # noqa: E731
    folded = layout.folded
    return {
        "tp": _group_placement([rank(0, t) for t in range(tp)], ranks_per_node),
        "cp": _group_placement([rank(c, 0) for c in range(layout.cp)], ranks_per_node),
        "ep": _group_placement(list(range(ep)) if folded else [rank(d, 0) for d in range(ep)], ranks_per_node),
        "dp": _group_placement([rank(d, 0) for d in range(q)], ranks_per_node),
        "edp": _group_placement(
            list(range(0, layout.world // layout.pp, ep)) if folded else [rank(d, 0) for d in range(0, q, ep)],
            ranks_per_node,
        ),
    }


def micro_batches_per_rank(cfg: JobConfig, layout: Layout) -> int:
    t = cfg.train
    return t.global_batch_size // (t.micro_batch_size * layout.dp)


def tokens_per_micro_batch(cfg: JobConfig, layout: Layout) -> int:
    """Positions one rank runs per micro-batch: its 1/cp of each of the micro-batch's sequences."""
    return cfg.train.micro_batch_size * cfg.train.seq_len // layout.cp


def step_flops_per_rank(cfg: JobConfig, layout: Layout, cost: ModelCost | None = None) -> float:
    """Model FLOPs (forward + 2 × backward, no recompute: what MFU counts) one rank executes per optimizer step."""
    cost = cost or model_cost(cfg)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len / layout.dp
    return 3.0 * cost.fwd_flops_per_token * tokens / (layout.tp * layout.cp)


def recompute_flops_per_rank(cfg: JobConfig, layout: Layout, cost: ModelCost | None = None) -> float:
    """The forward FLOPs activation checkpointing repeats in the backward, per rank and optimizer step."""
    cost = cost or model_cost(cfg)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len / layout.dp
    return cost.recompute_flops_per_token * tokens / (layout.tp * layout.cp)


def step_calls(cfg: JobConfig, layout: Layout, ranks_per_node: int, cost: ModelCost | None = None) -> list[Call]:
    """Every collective one rank issues in one optimizer step (docs/perf_model.md, section "The model")."""
    cost = cost or model_cost(cfg)
    _m, t, moe = cfg.model, cfg.train, cfg.model.moe
    act = 2 if t.dtype == "bf16" else 4  # activations (and, in fp32 training, the gradients) in the training dtype
    micro = micro_batches_per_rank(cfg, layout)
    tokens_mb = tokens_per_micro_batch(cfg, layout)
    tp, cp = layout.tp, layout.cp
    shapes = group_shapes(layout, ranks_per_node)
    calls: list[Call] = []
    # A collective inside a checkpointed mixer's own forward runs again in its recompute (activation_checkpointing.py).
    fwd = lambda part: micro * (2 if part in cost.recomputed else 1)  # noqa: E731

    def add(kind, label, group, payload, count, hides_behind=None):
        n, g = shapes[group]
        if n > 1 and count > 0:
            calls.append(Call(kind, label, n, g, float(payload), float(count), hides_behind))

    # Expert parallelism: the micro-batch's rows, k assignments each, 1/tp of them from each TP rank.
    rows_bytes = tokens_mb * moe.top_k * cost.d_model * act / tp
    etp = 1 if layout.folded else tp
    add("all_to_all", "moe_counts", "ep", moe.num_experts * etp * 8, micro * cost.n_moe_layers)
    add("all_to_all", "moe_rows", "ep", rows_bytes, 4 * micro * cost.n_moe_layers)
    if layout.ep > 1 and etp > 1:  # the TP peers' received rows, gathered and reduce-scattered (tp · rows_bytes in all)
        add("all_gather", "moe_tp_rows", "tp", rows_bytes * tp, 2 * micro * cost.n_moe_layers)
        add("reduce_scatter", "moe_tp_rows", "tp", rows_bytes * tp, 2 * micro * cost.n_moe_layers)
    # Tensor parallelism: all-reduces at the region boundaries, see the docstring (sequence parallelism replaces each
    # by an all-gather and a reduce-scatter: the same hops and bytes).
    add("all_reduce", "tp_act", "tp", tokens_mb * cost.d_model * act, micro * (4 * cost.n_layers + 2))
    add("all_reduce", "tp_router", "tp", tokens_mb * moe.top_k * 4, micro * cost.n_moe_layers)
    add("all_reduce", "tp_loss", "tp", tokens_mb * 4, 3 * micro)
    # What each layer kind's own forward issues beyond the region boundaries (its `collectives`): under TP, e.g.
    # Mamba's x_proj sum; under CP, attention's K/V gather or a recurrent kind's piece summaries and conv halos
    # (every gather's backward reduce-scatters its gradient).
    for name, n_layers in cost.layers.items():
        kind = registry.kind(name)
        for collective, label, group, payload, n_fwd, n_bwd in kind.collectives(cfg, tp, cp, tokens_mb, act):
            if group == "cp" and cp == 1:
                continue
            add(collective, label, group, payload, (n_fwd * fwd(kind.part) + n_bwd * micro) * n_layers)
    # Data parallelism (dense over dp × cp, experts over the EDP group; docs/perf_model.md, "The reduction").
    dense_local = cost.dense_params / tp
    expert_local = cost.expert_params / (layout.ep * etp)
    stage = cfg.deepspeed.zero_stage
    if t.dtype == "bf16":  # reduced in train.grad_reduce_dtype
        g = 4 if t.grad_reduce_dtype == "fp32" else 2
        kind = "reduce_scatter" if stage >= 1 else "all_reduce"
        # ZeRO 0/1: fp32 accumulation and one reduction per step, behind the last backward. ZeRO 2 reduces each
        # micro-batch's gradient into the partitions (train/optim.py), charged whole: with train.grad_reduce_overlap
        # each would hide behind its own backward, which this one-window model does not split (an upper bound).
        reduces, window = (micro, None) if stage >= 2 else (1, LAST_BACKWARD)
        add(kind, "dense_grad", "dp", dense_local * g, reduces, window)
        add(kind, "expert_grad", "edp", expert_local * g, reduces, window)
        if stage >= 1:  # every rank's updated bf16 shard back to every rank
            add("all_gather", "dense_param", "dp", dense_local * 2, 1, NEXT_FORWARD)
            add("all_gather", "expert_param", "edp", expert_local * 2, 1, NEXT_FORWARD)
    else:  # fp32: DeepSpeed's ZeRO all-reduce after the backward (ZeRO-2: every micro-batch), as measured on gloo
        reduces = micro if stage >= 2 else 1
        add("all_reduce", "dense_grad", "dp", dense_local * act, reduces)
        add("all_reduce", "expert_grad", "edp", expert_local * act, reduces)
        add("all_gather", "dense_param", "dp", dense_local * act, 1)
        add("all_gather", "expert_param", "edp", expert_local * act, 1)
    if layout.pp > 1:  # each micro-batch's hidden state to the next stage and its gradient back, per virtual stage
        same_node = layout.world // layout.pp < ranks_per_node  # neighbouring stages are world / pp ranks apart
        hidden = tokens_mb * cost.d_model * act
        calls.append(Call("other", "pp_p2p", 2, 2 if same_node else 1, hidden, 2 * micro * cfg.parallel.pp_virtual))
    if layout.world > 1:
        n, g = layout.world, min(layout.world, ranks_per_node)
        calls.append(Call("all_reduce", "scalars", n, g, 8.0, SCALAR_ALL_REDUCES_PER_STEP, tree=True))
    return calls
