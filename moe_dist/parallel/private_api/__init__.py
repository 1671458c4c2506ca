"""Every private or undocumented API of DeepSpeed and torch that moe_dist relies on, in this one package: one module
per area of their internals, every name re-exported here (callers write `private_api.<name>`).

Checked against deepspeed 0.19.8 and torch 2.13.0 (CPU build), the versions the CPU machines install
(`CHECKED_AGAINST`; pyproject.toml pins deepspeed to exactly that release, and a test holds the two equal). Each
function names what it reaches into and what breaks when that changes. tests/parallel/test_private_api.py runs
every function against the installed versions in one process (no spawned world, in the quick subset); the
end-to-end equivalence tests (EP, TP and ZeRO runs == one process) prove the integration as a whole. When
upgrading either library, read this package first: nothing else in moe_dist/, launch/ or benchmarks/ touches
DeepSpeed's internals (test_private_api.py scans them for it), and nothing else in moe_dist/ torch.distributed's.

- groups: DeepSpeed's registry of expert-parallel and expert-data-parallel groups
- parameters: the marks DeepSpeed reads on parameters (expert, model-parallel) and its MoE layer class
- zero: ZeRO 1/2's partitioned optimizer state, a step without update, ZeRO 1's optimizer class under bf16
- zero_overlap: ZeRO 1's gradient reduction overlapped with backward; the weight all-gather deferred
- pipeline: an engine whose stages a pipeline schedule runs
- shm: DeepSpeed's CPU shared-memory all-reduce buffer
- c10d: torch.distributed's process groups (timeouts, NCCL errors)
- versions: the checked releases

DeepSpeed and torch.distributed internals are imported inside the functions: `import deepspeed` probes the
accelerator, and this package is imported by mesh.py, which the index-math tests load without a process group.
"""

from moe_dist.parallel.private_api.c10d import aborted_nccl_groups, set_timeout_of_every_group
from moe_dist.parallel.private_api.groups import expert_groups, register_expert_groups
from moe_dist.parallel.private_api.parameters import (
    deepspeed_moe_marker,
    expert_group_of,
    mark_expert_parameter,
    mark_model_parallel,
)
from moe_dist.parallel.private_api.pipeline import count_once_in_grad_norm, engine_backward, engine_before_forward
from moe_dist.parallel.private_api.shm import deepspeed_shm_buffer_name
from moe_dist.parallel.private_api.versions import CHECKED_AGAINST, deepspeed_version_unchecked_for_overlap
from moe_dist.parallel.private_api.zero import (
    has_partitioned_fp32_state,
    inner_optimizer,
    reduced_gradient_partitions,
    relink_zero_optimizer_state,
    step_without_update,
    zero1_keeps_its_optimizer,
    zero_fp32_partitions,
)
from moe_dist.parallel.private_api.zero_overlap import (
    ZeroWeightBuffer,
    overlap_zero1_reduction,
    replace_zero_weight_gather,
    zero_weight_buffers,
)

__all__ = [
    "CHECKED_AGAINST",
    "ZeroWeightBuffer",
    "aborted_nccl_groups",
    "count_once_in_grad_norm",
    "deepspeed_moe_marker",
    "deepspeed_shm_buffer_name",
    "deepspeed_version_unchecked_for_overlap",
    "engine_backward",
    "engine_before_forward",
    "expert_group_of",
    "expert_groups",
    "has_partitioned_fp32_state",
    "inner_optimizer",
    "mark_expert_parameter",
    "mark_model_parallel",
    "overlap_zero1_reduction",
    "reduced_gradient_partitions",
    "register_expert_groups",
    "relink_zero_optimizer_state",
    "replace_zero_weight_gather",
    "set_timeout_of_every_group",
    "step_without_update",
    "zero1_keeps_its_optimizer",
    "zero_fp32_partitions",
    "zero_weight_buffers",
]
