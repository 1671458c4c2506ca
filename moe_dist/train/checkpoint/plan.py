"""Which rank writes which tensor of a checkpoint: pure index math, computed identically on every rank.

Every rank holding a replica of a tensor after the save's gathers may write it: a dense tensor any rank; expert e
the ranks at its EP position (every EDP replica and TP rank; with parallel.etp = 1 the EDP replicas alone).
Invariants: the plan depends only on names, shapes and the layout, so every rank derives the same one without
communicating; the greedy longest-processing-time rule (decreasing size, ties by name, to the least-loaded holder,
ties to the lowest rank) keeps every writer within the mean plus the largest tensor. Details: docs/reliability.md,
section "Checkpoints: atomic publish" ("Who writes what"); proof: tests/train/test_checkpoint_plan.py.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

from moe_dist.parallel.mesh import ep_rank_of

MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_KEYS = ("param", *MOMENTS)
BYTES_PER_ELEMENT = 4  # everything is stored in fp32


@dataclass(frozen=True)
class Entry:
    """One model parameter as a checkpoint sees it, the same on every rank whatever the layout."""

    name: str  # parameter name (stacked expert weights: without the expert index)
    shape: tuple[int, ...]  # full shape of one stored tensor (one expert's, for stacked experts)
    experts: int = 0  # 0 for a dense parameter, else the global number of experts stacked in it


def stored_name(key: str, name: str) -> str:
    """The checkpoint's name of state `key` ("param" or an Adam moment) of tensor `name`."""
    return name if key == "param" else f"{key}.{name}"


def tensors_in_order(entries: list[Entry]) -> list[tuple[str, Entry, int | None]]:
    """(stored name, its parameter's entry, expert index or None) of every tensor of the checkpoint, in the order
    saving produces them: parameter by parameter, its value then its moments, experts by global index."""
    out = []
    for e in entries:
        for key in STATE_KEYS:
            if e.experts:
                out.extend((stored_name(key, f"{e.name}.{x}"), e, x) for x in range(e.experts))
            else:
                out.append((stored_name(key, e.name), e, None))
    return out


def holders(experts: int, expert: int | None, dp: int, ep: int, tp: int, etp: int | None = None) -> tuple[int, ...]:
    """Global ranks (rank = dp_rank · tp + tp_rank) holding a replica of a tensor after the save's gathers:
    every rank for a dense tensor; for expert `expert` of `experts`, the ranks whose EP position holds it
    (mesh.ep_rank_of: counted over dp ranks, or over all ranks with whole experts, etp = 1)."""
    if expert is None:
        return tuple(range(dp * tp))
    position = expert // (experts // ep)
    return tuple(r for r in range(dp * tp) if ep_rank_of(r, ep, tp, tp if etp is None else etp) == position)


def plan_writers(entries: list[Entry], dp: int, ep: int, tp: int, etp: int | None = None) -> dict[str, int]:
    """{stored tensor name: the rank that writes it}: every tensor exactly once, balanced by bytes."""
    load = [0] * (dp * tp)
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # one heap of (load, rank) per holder set
    plan = {}
    for name, entry, expert in sorted(tensors_in_order(entries), key=lambda t: (-math.prod(t[1].shape), t[0])):
        ranks = holders(entry.experts, expert, dp, ep, tp, etp)
        heap = heaps.setdefault(ranks, [(0, r) for r in ranks])
        while heap[0][0] != load[heap[0][1]]:  # stale entry: that rank took a tensor through another holder set
            heapq.heapreplace(heap, (load[heap[0][1]], heap[0][1]))
        _, rank = heap[0]
        plan[name] = rank
        load[rank] += math.prod(entry.shape) * BYTES_PER_ELEMENT
        heapq.heapreplace(heap, (load[rank], rank))
    return plan


def pipeline_rank_of(name: str, starts: list[int], pp: int) -> int:
    """The pipeline rank holding parameter (or buffer) `name` of the whole model when its layers are cut at `starts`
    (stage_cut.stage_starts; stage s on pipeline rank s mod pp): blocks.i.* its layer's stage, the embedding the
    first stage, the final norm and the head the last."""
    if name.startswith("blocks."):
        stage = bisect.bisect_right(starts, int(name.split(".")[1])) - 1
    elif name.startswith("embed."):
        stage = 0
    else:
        stage = len(starts) - 1
    return stage % pp


def plan_pipeline_writers(
    entries: list[Entry], starts: list[int], pp: int, dp: int, ep: int, tp: int, etp: int | None = None
) -> dict[str, int]:
    """plan_writers under pipeline parallelism: each pipeline rank's tensors (entries of the whole model) planned
    over its own dp · tp ranks, global rank = pipeline rank · dp · tp + the rank inside the stage."""
    plan = {}
    for p in range(pp):
        mine = [e for e in entries if pipeline_rank_of(e.name, starts, pp) == p]
        plan.update({name: p * dp * tp + r for name, r in plan_writers(mine, dp, ep, tp, etp).items()})
    return plan


def bytes_per_rank(entries: list[Entry], plan: dict[str, int], world_size: int) -> list[int]:
    """Bytes of tensor data each rank writes under `plan`."""
    out = [0] * world_size
    for name, entry, _ in tensors_in_order(entries):
        out[plan[name]] += math.prod(entry.shape) * BYTES_PER_ELEMENT
    return out


def model_entries(model) -> list[Entry]:
    """Entries of an unsharded model (e.g. built on the meta device): a plan without any process group."""
    from moe_dist.layers.experts import Experts

    stacked = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)}
    return [
        Entry(name, tuple(p.shape[1:]), p.shape[0]) if id(p) in stacked else Entry(name, tuple(p.shape))
        for name, p in model.named_parameters()
    ]
