"""DeepSpeed's registry of expert-parallel and expert-data-parallel groups, filled with ours."""

from __future__ import annotations

import torch.distributed as dist


def register_expert_groups(
    name: str, ep: tuple[dist.ProcessGroup, list[int]], edp: tuple[dist.ProcessGroup, list[int]]
) -> None:
    """Hand our expert-parallel (EP) and expert-data-parallel (EDP) groups, each as (group, global ranks), to
    DeepSpeed under its group name ("ep_size_N").

    deepspeed 0.19.8: `deepspeed.utils.groups` keeps module-level dicts `_EXPERT_PARALLEL_GROUP`,
    `_EXPERT_DATA_PARALLEL_GROUP` and their `_RANKS` twins; the engine copies the two group dicts at
    initialize (`_get_expert_parallel_group_dict`, `_get_expert_data_parallel_group_dict`) and ZeRO 1/2
    partitions and reduces every `moe` parameter group over the EDP group of its name. Its own constructor
    (`_create_expert_and_data_parallel`) would put TP peers into one EDP group (experts replicated over TP, not
    split as ours are), hence the direct write. If the dicts are renamed or the engine stops reading them,
    deepspeed.initialize fails with "expert data parallel group is not initialized" or a KeyError, or ZeRO
    reduces expert gradients over the wrong ranks, which the EP equivalence tests catch.
    """
    from deepspeed.utils import groups

    groups._EXPERT_PARALLEL_GROUP[name], groups._EXPERT_PARALLEL_GROUP_RANKS[name] = ep
    groups._EXPERT_DATA_PARALLEL_GROUP[name], groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = edp


def expert_groups(name: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
    """(EP group, EDP group) DeepSpeed holds under `name`, or None when none is registered.

    deepspeed 0.19.8: the getters `groups._get_expert_parallel_group_dict`, `_get_expert_parallel_group` and
    `_get_expert_data_parallel_group` (what the engine and ZeRO call). A rename is an AttributeError here.
    """
    from deepspeed.utils import groups

    if name not in groups._get_expert_parallel_group_dict():
        return None
    return groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name)
