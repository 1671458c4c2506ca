"""The updated weights' gather after a ZeRO 1/2 step, overlapped with the next forward (`train.param_gather_overlap`).

DeepSpeed's ZeRO 1/2 keeps each parameter group's bf16 weights in one flat buffer, cut into equal contiguous
partitions, one per data-parallel rank; after the optimizer updates its partition every rank all-gathers the others
(`all_gather_dp_groups`, blocking, at the end of `step`). The first layers' weights then sit in the first ranks'
partitions, so no chunking of that all-gather lets the first layer start before the whole buffer has arrived.
Here instead each region of the buffer that a module's parameters occupy is broadcast from the rank(s) owning it,
module by module in forward order, asynchronously, and each module's forward waits (a forward pre-hook) only for its
own regions: the first layers compute while the later ones are still on the wire. Every rank receives the same
bytes as from the all-gather (the buffer less its partition) and ends with the same values, bit for bit.

What this reads of DeepSpeed's optimizer and how the step's own gather is held back are private: both live in
private_api/zero_overlap.py (`zero_weight_buffers`, `replace_zero_weight_gather`), which says what they touch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moe_dist.parallel import comm, private_api


def _regions(flat: torch.Tensor, params: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The merged [start, end) element ranges of `params` (views into `flat`) in the flat buffer."""
    size = flat.element_size()
    spans = sorted(
        ((p.data_ptr() - flat.data_ptr()) // size, (p.data_ptr() - flat.data_ptr()) // size + p.numel()) for p in params
    )
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def forward_order(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward uses each parameter, in the order the forward reaches them: the embedding, each
    block, the final norm, the head (a pipeline part: those it holds)."""
    from moe_dist.models.decoder import held_blocks

    parts = [getattr(model, "embed", None), *held_blocks(model), getattr(model, "norm", None)]
    parts.append(getattr(model, "head", None))
    return [m for m in parts if m is not None and any(True for _ in m.parameters())]


class DeferredGather:
    """The step's parameter gather issued as per-module broadcasts after the step, waited for by each module's
    forward (see the module docstring). `wait_all` finishes whatever is in flight (before anything reads every
    parameter outside a forward: a checkpoint, the end of the run)."""

    def __init__(self, buffers: list[private_api.ZeroWeightBuffer], model: nn.Module):
        self.buffers = buffers
        self.pending: dict[int, list] = {}  # id(module) -> works in flight
        modules = forward_order(model)
        self.plan: list[tuple[nn.Module, list[tuple[int, int, int]]]] = []  # module, [(group, start, end)]
        covered = set()
        for m in modules:
            ranges, ids = [], {id(q) for q in m.parameters()}
            for g, buf in enumerate(buffers):
                mine = [p for p in buf.params if id(p) in ids]
                covered.update(id(p) for p in mine)
                ranges += [(g, a, b) for a, b in _regions(buf.flat, mine)]
            self.plan.append((m, ranges))
            m.register_forward_pre_hook(lambda mod, args: self._wait(mod))
        rest = [(g, p) for g, buf in enumerate(buffers) for p in buf.params if id(p) not in covered]
        if rest:  # parameters outside those modules: gathered with the first
            first, ranges = self.plan[0]
            for g in {g for g, _ in rest}:
                ranges += [(g, a, b) for a, b in _regions(buffers[g].flat, [p for h, p in rest if h == g])]

    def _wait(self, module: nn.Module) -> None:
        for work in self.pending.pop(id(module), []):
            work.wait()

    def wait_all(self) -> None:
        for m, _ in self.plan:
            self._wait(m)

    def issue(self) -> None:
        """The broadcasts of every module's regions from their owners, in forward order."""
        for m, ranges in self.plan:
            works = []
            for g, a, b in ranges:
                flat, _, part, group = self.buffers[g]
                world = dist.get_world_size(group=group)
                if world == 1:
                    continue
                for owner in range(a // part, min(world, (b - 1) // part + 1)):
                    lo, hi = max(a, owner * part), min(b, (owner + 1) * part)
                    src = dist.get_global_rank(group, owner)
                    works.append(comm.broadcast_async(flat.narrow(0, lo, hi - lo), src, group))
            self.pending[id(m)] = works


def defer_parameter_gather(engine) -> DeferredGather | None:
    """On this engine (ZeRO 1/2's optimizer): each step's parameter gather becomes a DeferredGather's broadcasts,
    issued when the step returns; None where the optimizer keeps no flat weight buffers."""
    buffers = private_api.zero_weight_buffers(engine)
    if buffers is None:
        return None
    deferred = DeferredGather(buffers, engine.module)
    # a step without a forward since the last waits for what is in flight first (nothing, normally)
    private_api.replace_zero_weight_gather(engine, gather=deferred.issue, before_step=deferred.wait_all)
    return deferred
