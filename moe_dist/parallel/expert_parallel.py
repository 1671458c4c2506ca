"""apply_ep: turn a single-device model into its expert-parallel shard, before it is materialized.

Each MoE layer keeps its full router (routing is decided locally, over all experts) but holds only the
experts [ep_rank·L, (ep_rank+1)·L) of its EP group, and its dispatcher becomes the all-to-all one. The layer
math is untouched: this is the one seam expert parallelism uses (DESIGN.md §4.2).

DeepSpeed integration. DeepSpeed's engine decides how to reduce gradients per parameter: those marked
`allreduce = False` with a `group_name` are summed over that expert-data-parallel group and divided by the
data-parallel size, and ZeRO partitions them over that group. But the engine only enables that path when it
finds an instance of its own `deepspeed.moe.layer.MoE` class in the model. We therefore attach one
parameter-free marker subclass of it to the model; it is never called. The equivalence tests (EP run == one
process with gradient accumulation, ZeRO 1 and 2) are what prove the integration, not this comment.
"""

from __future__ import annotations

import torch
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from torch import nn

from moe_dist.layers.moe import MoE
from moe_dist.parallel.dispatch import AllToAllDispatcher
from moe_dist.parallel.mesh import Mesh


class _DeepSpeedMoEMarker(DeepSpeedMoE):
    """Tells DeepSpeed's engine that the model has expert-parallel parameters (see the module docstring)."""

    def __init__(self, num_experts: int, ep_size: int, group_name: str):
        nn.Module.__init__(self)  # DeepSpeed's own __init__ would build its experts; we only need the type
        self.num_experts, self.ep_size, self.expert_group_name = num_experts, ep_size, group_name

    def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
        """Groups already exist: the mesh created them through DeepSpeed's groups API."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("the DeepSpeed MoE marker is not a layer")


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


def apply_ep(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Shard every MoE layer's experts over the EP group; call on the meta-device model."""
    if mesh.ep == 1:
        return model
    num_experts = None
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        num_experts = experts.w13.shape[0]
        local = num_experts // mesh.ep
        for name in ("w13", "w2"):
            full = getattr(experts, name)
            shard = nn.Parameter(torch.empty((local, *full.shape[1:]), device=full.device, dtype=full.dtype))
            shard.allreduce = False  # DeepSpeed: reduce over the expert-data-parallel group only
            shard.group_name = mesh.ep_group_name
            setattr(experts, name, shard)
        experts.expert_offset = mesh.ep_rank * local
        module.dispatcher = AllToAllDispatcher(mesh.ep_group, mesh.ep, mesh.ep_rank, num_experts,
                                               module.dispatcher.permutation)
    if num_experts is not None:
        model.deepspeed_moe_marker = _DeepSpeedMoEMarker(num_experts, mesh.ep, mesh.ep_group_name)
    return model
