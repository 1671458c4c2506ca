"""apply_ep: turn a single-device model into its expert-parallel shard, before it is materialized.

Each MoE layer keeps its full router (routing is decided locally, over all experts) but holds only the experts
[ep_rank·L, (ep_rank+1)·L) of its EP group (mesh.py), and its dispatcher becomes the one `build_dispatcher` chooses,
the one place that knows every dispatcher (the TP token split included). Invariants: the layer math is untouched,
the dispatcher is the one seam expert parallelism uses; expert shards are marked for DeepSpeed and one parameter-
free marker of its MoE class is attached (private_api/parameters.py), or its engine would not reduce them over the
EDP group. Why and how: docs/parallelism.md, section "The mesh"; proof: tests/parallel/test_ep_dispatch.py and the
EP equivalence tests (EP run equals one process with gradient accumulation, ZeRO 1 and 2).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_dist.config import ConfigError
from moe_dist.layers.moe import Dispatcher, LocalDispatcher, MoE
from moe_dist.layers.permutation import Permutation
from moe_dist.parallel import private_api
from moe_dist.parallel.dedup import DedupAllToAllDispatcher
from moe_dist.parallel.dispatch import AllToAllDispatcher, TokenSplit
from moe_dist.parallel.mesh import Mesh, layout_groups


def check_node_groups(n_groups: int, mesh: Mesh) -> None:
    """`model.moe.group_by` "node": the expert groups must be the nodes the EP group spans (ranks of a node are
    consecutive, so each node holds a contiguous block of experts), bounding the nodes a token is sent to."""
    groups = layout_groups(mesh.dp, mesh.ep, mesh.tp, mesh.etp, mesh.cp, mesh.pp)
    ep_ranks = next(g for g in groups["ep"] if mesh.rank in g)
    nodes = len({r // mesh.local_world_size for r in ep_ranks})
    if n_groups != nodes:
        raise ConfigError(
            f"model.moe.n_groups: group_by 'node' needs one group per node of the expert-parallel group "
            f"({nodes} nodes of {mesh.local_world_size} ranks), got {n_groups}"
        )


def build_dispatcher(mesh: Mesh, num_experts: int, permutation: Permutation, a2a_chunks: int = 1) -> Dispatcher:
    """This rank's dispatcher for an MoE layer of `num_experts` experts, from the mesh and `parallel.a2a_chunks`:
    local without EP; else deduplicated (`mesh.ep_dedup`, its stage 2 inside the block composed of the all-to-all
    dispatcher over the block, or the local one for single-rank blocks) or all-to-all in `a2a_chunks` chunks. Under
    TP every rank dispatches its own token slice (`TokenSplit`), gathering its peers' received rows when the
    experts are split over TP. A new dispatcher is one more branch here."""
    if mesh.ep == 1:
        return LocalDispatcher(permutation)
    split = TokenSplit(mesh.tp_group, mesh.tp, mesh.tp_rank, gather=mesh.experts_split) if mesh.tp > 1 else None
    groups = mesh.ep_dedup
    if groups is not None:
        block_experts = num_experts // groups.blocks
        inner = (
            AllToAllDispatcher(groups.block, groups.size, groups.position, block_experts, permutation)
            if groups.size > 1
            else LocalDispatcher(permutation)
        )
        return DedupAllToAllDispatcher(num_experts, permutation, groups, inner, split)
    return AllToAllDispatcher(mesh.ep_group, mesh.ep, mesh.ep_rank, num_experts, permutation, split, chunks=a2a_chunks)


def apply_ep(model: nn.Module, mesh: Mesh, a2a_chunks: int = 1) -> nn.Module:
    """Shard every MoE layer's experts over the EP group and install `build_dispatcher`'s dispatcher; call on the
    meta-device model. `a2a_chunks` > 1 pipelines each all-to-all dispatch over that many token chunks."""
    if mesh.ep == 1:
        return model
    num_experts = None
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        if module.router.cfg.group_by == "node":
            check_node_groups(module.router.cfg.n_groups, mesh)
        experts = module.experts
        num_experts = experts.w2.shape[0]
        local = num_experts // mesh.ep
        for name in experts.weight_names:
            full = getattr(experts, name)
            shard = nn.Parameter(torch.empty((local, *full.shape[1:]), device=full.device, dtype=full.dtype))
            private_api.mark_expert_parameter(shard, mesh.ep_group_name)  # reduced over the EDP group only
            setattr(experts, name, shard)
        experts.expert_offset = mesh.ep_rank * local
        module.dispatcher = build_dispatcher(mesh, num_experts, module.dispatcher.permutation, a2a_chunks)
    if num_experts is not None:
        model.deepspeed_moe_marker = private_api.deepspeed_moe_marker(num_experts, mesh.ep, mesh.ep_group_name)
    return model
