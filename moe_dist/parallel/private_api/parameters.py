"""The marks DeepSpeed reads on parameters and modules to decide how it reduces gradients and counts the norm:
expert parameters, tensor-parallel shards, and the MoE layer class its engine looks for."""

from __future__ import annotations

import functools

from torch import nn


def mark_expert_parameter(p: nn.Parameter, group_name: str) -> None:
    """Mark an expert-parallel parameter the way DeepSpeed's own MoE experts do.

    deepspeed 0.19.8: `deepspeed.moe.utils.is_moe_param` tests `allreduce == False`; the engine's gradient
    reduction and ZeRO's partitioning then take the EDP group named by `group_name`. If the attributes change
    meaning, expert gradients are averaged over the whole data-parallel group: EP runs no longer equal one
    process (test_ep_e2e.py).
    """
    p.allreduce = False
    p.group_name = group_name


def expert_group_of(p: nn.Parameter) -> str | None:
    """The EDP group name of a parameter marked by `mark_expert_parameter`, else None."""
    return getattr(p, "group_name", None) if getattr(p, "allreduce", True) is False else None


def mark_model_parallel(p: nn.Parameter) -> None:
    """Mark a parameter that differs between TP peers for DeepSpeed's gradient norm: a tensor-parallel shard, or
    a whole expert under parallel.etp = 1 (TP peers hold other experts, or other ZeRO partitions of them).

    deepspeed 0.19.8: `runtime.utils.is_model_parallel_parameter` tests `model_parallel` (or
    `tensor_model_parallel`); marked parameters count on every TP rank, the others on tp_rank 0 only. ZeRO 1/2's
    norm (`get_grad_norm_direct`) sums each group's squared partitions over the DP group, then over the TP group:
    over the whole world, where each element of an expert group's partitions lives exactly once; the per-group
    average over the EDP group (`_average_expert_grad_norms`) then averages equal values. If that changes, the
    clipped gradient norm is wrong under TP (test_tp_e2e.py compares grad norms step by step).
    """
    p.model_parallel = True


@functools.cache
def _marker_class() -> type:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class DeepSpeedMoEMarker(DeepSpeedMoE):
        """Tells DeepSpeed's engine that the model has expert-parallel parameters; never called."""

        def __init__(self, num_experts: int, ep_size: int, group_name: str):
            nn.Module.__init__(self)  # DeepSpeed's own __init__ would build its experts; we only need the type
            self.num_experts, self.ep_size, self.expert_group_name = num_experts, ep_size, group_name

        def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
            """Groups already exist: the mesh registered them (register_expert_groups)."""

        def forward(self, *args, **kwargs):
            raise RuntimeError("the DeepSpeed MoE marker is not a layer")

    return DeepSpeedMoEMarker


def deepspeed_moe_marker(num_experts: int, ep_size: int, group_name: str) -> nn.Module:
    """A parameter-free module to attach to a model with expert-parallel parameters.

    deepspeed 0.19.8: `DeepSpeedEngine._configure_distributed_model` sets `has_moe_layers` only when it finds an
    instance of `deepspeed.moe.layer.MoE` among the modules (reading its `num_experts`), and only then does it
    reduce `allreduce = False` parameters over their EDP group and hand ZeRO the expert groups; it also calls
    `set_deepspeed_parallelism` on every module that has one. The subclass skips MoE.__init__ (which would
    build DeepSpeed's own experts and gate). If the engine's check changes (another class, more attributes
    read), initialize raises AttributeError or expert gradients are reduced over the whole data-parallel group:
    the EP equivalence tests fail.
    """
    return _marker_class()(num_experts, ep_size, group_name)
