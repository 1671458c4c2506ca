"""Where pipeline parallelism cuts the layer list: pp × pp_virtual contiguous stages of layers, the embedding on the
first, the final norm and LM head on the last.

The cost of a layer is its forward FLOPs per token (the backward is about twice that for every kind, so the ratio
between layers is the step's): the matmul weights a token touches (an MoE layer's experts at top_k / E, its router
and shared experts whole) plus what its mixer computes beyond them (attention scores grow with the sequence, the
recurrent scans with their state). Attention, Mamba-1, Mamba-2, Gated DeltaNet, MoE and dense layers therefore weigh
differently, and a cut by layer count would leave the stages unequal. The automatic cut minimises the costliest
stage, since that stage sets the pipeline's pace; `parallel.pp_cut` overrides it.
"""

from __future__ import annotations

from moe_dist.config import ConfigError, JobConfig
from moe_dist.planning.workload import mixer_flops_per_token

# The costliest stage may cost at most this much more than the mean before the automatic cut is refused: beyond it
# every other stage idles a third of the step or more waiting for it.
MAX_IMBALANCE = 1.5


def layer_costs(cfg: JobConfig) -> tuple[list[float], float]:
    """(forward FLOPs per token of each layer, of the LM head). The first stage's embedding is a lookup: no FLOPs."""
    from moe_dist.models.decoder import build_model

    m = cfg.model
    moe_share = m.moe.top_k / m.moe.num_experts
    layers = [0.0] * m.n_layers
    head = 0.0
    for name, p in build_model(m, "meta").named_parameters():
        if p.ndim < 2 or name.endswith("A_log"):
            continue  # vectors and the SSM's A cost no matmul FLOPs
        flops = 2.0 * p.numel() * (moe_share if ".experts." in name else 1.0)
        if name.startswith("blocks."):
            layers[int(name.split(".")[1])] += flops
        elif name.startswith("head.") or (m.tie_embeddings and name.startswith("embed.")):
            head += flops  # the LM head (the tied embedding matrix is the head's matmul); a lookup costs none
    for i, (mixer, _) in enumerate(m.layer_kinds()):
        layers[i] += mixer_flops_per_token(cfg, mixer) if mixer else 0.0
    return layers, head


def _best_cut(costs: tuple[float, ...], stages: int) -> tuple[float, list[int]]:
    """(bottleneck, starts) of the contiguous cut of `costs` into `stages` non-empty parts whose largest part is
    smallest: a dynamic programme over (parts, prefix), O(stages · n²)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: the smallest bottleneck of the first j items in s parts; start[s][j]: where the last part starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    start = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], prefix[j] - prefix[i])
                if value < best[s][j]:
                    best[s][j], start[s][j] = value, i
    starts, j = [], n
    for s in range(stages, 0, -1):
        j = start[s][j]
        starts.append(j)
    return best[stages][n], starts[::-1]


def stage_costs(cfg: JobConfig, starts: list[int]) -> list[float]:
    """Forward FLOPs per token of each stage under the cut `starts` (the LM head on the last)."""
    layers, head = layer_costs(cfg)
    out = [sum(layers[a:b]) for a, b in zip(starts, [*starts[1:], len(layers)])]
    out[-1] += head
    return out


def stage_starts(cfg: JobConfig) -> list[int]:
    """The first layer of each of the pp × pp_virtual stages, in pipeline order (stage s runs on pipeline rank
    s mod pp): `parallel.pp_cut` when given, else the cut whose costliest stage is cheapest. An automatic cut whose
    costliest stage exceeds MAX_IMBALANCE × the mean is refused in one line naming parallel.pp."""
    pa = cfg.parallel
    stages = pa.pp * pa.pp_virtual
    if stages == 1:
        return [0]
    if pa.pp_cut is not None:
        return [0, *pa.pp_cut]
    layers, head = layer_costs(cfg)
    costs = [*layers[:-1], layers[-1] + head]  # the head rides with the last layer: it cannot move elsewhere
    bottleneck, starts = _best_cut(tuple(costs), stages)
    mean = sum(costs) / stages
    if bottleneck > MAX_IMBALANCE * mean:
        ends = [*starts[1:], len(costs)]
        worst = max(range(stages), key=lambda s: sum(costs[starts[s] : ends[s]]))
        end = ends[worst] - 1
        raise ConfigError(
            f"parallel.pp: {stages} stages of model.n_layers={len(layers)} cannot be cut evenly enough: the best "
            f"cut's costliest stage (layers {starts[worst]}..{end}) costs {bottleneck / mean:.2f} × the mean "
            f"(limit {MAX_IMBALANCE}); use fewer stages or set parallel.pp_cut"
        )
    return starts
