"""Every private or undocumented API of DeepSpeed and torch that moe_dist relies on, in one file.

Checked against deepspeed 0.19.8 and torch 2.13.0 (CPU build), the versions the CPU machines install
(`CHECKED_AGAINST`; pyproject.toml pins deepspeed to exactly that release, and a test holds the two equal). Each
function names what it reaches into and what breaks when that changes. tests/parallel/test_private_api.py runs
every function against the installed versions in one process (no spawned world, in the quick subset); the
end-to-end equivalence tests (EP, TP and ZeRO runs == one process) prove the integration as a whole. When
upgrading either library, read this file first: nothing else in moe_dist/, launch/ or benchmarks/ touches
DeepSpeed's internals (test_private_api.py scans them for it), and nothing else in moe_dist/ torch.distributed's.

DeepSpeed and torch are imported inside the functions: `import deepspeed` probes the accelerator, and this
module is imported by mesh.py, which the index-math tests load without a process group.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

CHECKED_AGAINST = {"deepspeed": "0.19.8", "torch": "2.13.0"}


# ------------------------------------------------------------------------------ DeepSpeed's expert groups


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


# ------------------------------------------------------------------------------ how DeepSpeed sees parameters


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


# ------------------------------------------------------------------------------ ZeRO optimizer internals


def has_partitioned_fp32_state(p: nn.Parameter) -> bool:
    """Whether ZeRO 1/2 holds this parameter's fp32 master weight and Adam moments in partitions, readable only
    through deepspeed.utils.safe_get_full_* (public).

    deepspeed 0.19.8: ZeRO 1/2 attaches `_hp_mapping` to each parameter it partitions. If the attribute is
    renamed, checkpoints read the torch optimizer's (empty) state instead: saving raises KeyError.
    """
    return hasattr(p, "_hp_mapping")


def inner_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer we handed `deepspeed.initialize`, whose `state` and `param_groups` hold the Adam moments
    and learning rates (under ZeRO 1/2 keyed by the fp32 partitions, `zero_fp32_partitions`).

    deepspeed 0.19.8: its wrappers (DeepSpeedZeroOptimizer, BF16_Optimizer, FP16_Optimizer) keep it as their
    `optimizer` attribute; without a wrapper (ZeRO 0 in fp32) `engine.optimizer` is the torch optimizer itself. If
    the attribute moves, this returns the wrapper, whose `state` is empty: checkpoints miss the moments and the
    exact-resume tests fail.
    """
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def zero_fp32_partitions(engine) -> list[torch.Tensor] | None:
    """ZeRO 1/2: the fp32 master-weight partitions this rank updates, one flat tensor per parameter group (the
    parameters of `inner_optimizer(engine)`); None for an optimizer that updates the parameters themselves.

    deepspeed 0.19.8: DeepSpeedZeroOptimizer's `single_partition_of_fp32_groups`. If it moves, this returns None
    and a resumed run creates its Adam state on the bf16 parameters instead: the exact-resume tests fail.
    """
    return getattr(engine.optimizer, "single_partition_of_fp32_groups", None)


def relink_zero_optimizer_state(optimizer) -> None:
    """(Re)build ZeRO 1/2's per-parameter views of the partitioned Adam state (no-op for other optimizers).

    deepspeed 0.19.8: DeepSpeedZeroOptimizer and BF16_Optimizer link them once, lazily
    (`_lazy_init_hp_params_optimizer_state`, guarded by `_hp_optimizer_states_linked`), right after the first
    parameter group's first step, when later groups (the expert groups) have no state yet, and never again:
    their moments would stay unreachable. If the names change this silently does nothing and checkpoints miss
    the expert groups' moments; the exact-resume tests catch it.
    """
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def reduced_gradient_partitions(optimizer) -> list[torch.Tensor] | None:
    """ZeRO 1/2: the partition of the reduced gradients this rank updates, after the accumulation boundary's
    backward; None for an optimizer that keeps the gradients in `p.grad` (ZeRO 0).

    deepspeed 0.19.8: DeepSpeedZeroOptimizer's `averaged_gradients` ({group index: [tensors]}, or a list). If it
    moves, this returns None and the non-finite guard reads `p.grad` instead, which ZeRO 1/2 may already have
    released: a NaN gradient could go unnoticed (test_reliability.py's non-finite test checks).
    """
    partitions = getattr(optimizer, "averaged_gradients", None)
    if partitions is None:
        return None
    groups = partitions.values() if isinstance(partitions, dict) else partitions
    return [g for group in groups if group is not None for g in group if g is not None]


def step_without_update(engine) -> bool:
    """The accumulation boundary's `engine.step()` with every update held back; False when DeepSpeed applied an
    update anyway (its internals moved: the caller must stop).

    deepspeed 0.19.8:
    - ZeRO 1/2 (`runtime.base_optimizer.ZeROOptimizer` subclasses): its overflow verdict is forced, by setting
      `check_grad_overflow` and shadowing `check_overflow` to set `overflow = True`. That is DeepSpeed's fp16/bf16
      overflow path: it frees the reduced gradient partitions, resets its micro-step bookkeeping, leaves the fp32
      master weights and Adam state alone, and `engine.was_step_applied()` turns false.
    - ZeRO 0 (the torch optimizer itself): its `step` is shadowed by a no-op for this one call, so DeepSpeed does
      its bookkeeping (clipping, zero_grad, LR, counters) and nothing is updated.
    If the overflow hooks change, the step is applied and this returns False.
    """
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    opt = engine.optimizer
    if not isinstance(opt, ZeROOptimizer):
        own = opt.__dict__.get("step")
        opt.step = lambda *args, **kwargs: None  # shadows the class's step() for this one call
        try:
            engine.step()
        finally:
            if own is None:
                del opt.step
            else:
                opt.step = own
        return True
    saved = opt.check_grad_overflow
    opt.check_grad_overflow = True
    opt.check_overflow = lambda partition_gradients=True: setattr(opt, "overflow", True)
    try:
        engine.step()
    finally:
        del opt.check_overflow  # back to the class's method
        opt.check_grad_overflow = saved
    return not engine.was_step_applied()


@contextlib.contextmanager
def zero1_keeps_its_optimizer():
    """Within: `deepspeed.initialize` wraps ZeRO stage 1 with bf16 weights and fp32 gradient accumulation in
    DeepSpeedZeroOptimizer, the class of every other ZeRO 1/2 run, instead of BF16_Optimizer.

    deepspeed 0.19.8: `DeepSpeedEngine._do_optimizer_sanity_check` returns BFLOAT16 for exactly that combination;
    this maps it to ZERO_OPTIMIZATION. DeepSpeedZeroOptimizer handles it itself (stage 1 with an accumulation
    dtype other than the weights' keeps an fp32 `param.grad_accum` per parameter, `use_grad_accum_attribute`).
    If the routing moves, the engine gets BF16_Optimizer again and `has_partitioned_fp32_state` turns false:
    saving raises KeyError and test_private_api.py fails.
    """
    from deepspeed.runtime.constants import BFLOAT16
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION

    original = DeepSpeedEngine._do_optimizer_sanity_check

    def routed(engine, basic_optimizer):
        wrapper = original(engine, basic_optimizer)
        return ZERO_OPTIMIZATION if wrapper == BFLOAT16 and engine.zero_optimization_stage() == 1 else wrapper

    DeepSpeedEngine._do_optimizer_sanity_check = routed
    try:
        yield
    finally:
        DeepSpeedEngine._do_optimizer_sanity_check = original


# ---------------------------------------------------------------------- ZeRO 1's reduction overlapped with backward


def deepspeed_version_unchecked_for_overlap() -> str | None:
    """The installed DeepSpeed version when it is not the one `overlap_zero1_reduction` and
    `replace_zero_weight_gather` were checked against (and pyproject.toml pins), else None (read from the
    package's metadata: no `import deepspeed`, which probes the accelerator). Only an install that bypassed the
    pin (`--no-deps`, a machine's own DeepSpeed) gets another."""
    from importlib.metadata import version

    installed = version("deepspeed")
    return None if installed == CHECKED_AGAINST["deepspeed"] else installed


def _require_checked_deepspeed(what: str) -> None:
    unchecked = deepspeed_version_unchecked_for_overlap()
    if unchecked is not None:
        raise RuntimeError(f"{what} is checked against deepspeed {CHECKED_AGAINST['deepspeed']}, not {unchecked}")


def overlap_zero1_reduction(engine) -> None:
    """ZeRO 1's once-per-step reduction (train.grad_reduce_overlap at stage 1) made right and overlapped with the
    last micro-batch's backward, on this engine's instances only; a no-op unless its optimizer is
    DeepSpeedZeroOptimizer at stage 1 with overlap_comm.

    deepspeed 0.19.8 (refused otherwise: `deepspeed_version_unchecked_for_overlap`). At stage 1 with overlap_comm
    each parameter's gradient hook adds the micro-batch's gradient into its fp32 `grad_accum` and, when the
    optimizer's boundary flag is set, copies it into the current bucket (`ipg_buckets`, two buffers used in turn),
    reducing the bucket onto the owners of its slices once it is full; `reduce_gradients` (the epilogue, at the
    boundary) reduces the last bucket. Three defects, each corrected here:

    1. The flag is stale. DeepSpeed mirrors the engine's boundary into the optimizer in `_backward_prologue`, run
       by hooks that `engine.forward` puts on the output's tensors, found only inside tensors, tuples, lists and
       dicts: not in our DecoderOutput dataclass. The flag then holds the previous backward's value (the epilogue's
       `allreduce_gradients` sets it), so the hooks reduced during the FIRST micro-batch of each step (the flag
       left true by the previous boundary) and never during the last. With one bucket the error hid: that bucket
       is never full, each `grad_accum` had been re-pointed into the bucket buffer, so the later micro-batches
       accumulated in place and the epilogue reduced their sum; with more, each full bucket carried micro-batch 1
       alone (step-1 grad norm 2.11 instead of 3.15 at dp2·ep2). `engine.backward` now sets the flag first.
    2. A parameter whose hook does not fire in the last micro-batch (a branch only earlier micro-batches took)
       kept its `grad_accum` unreduced: the overlapped `reduce_gradients` skips the loop over every parameter that
       the plain path runs. Those (neither reduced, `params_already_reduced`, nor waiting in a bucket) are reduced
       at the boundary, in parameter-group order as that loop does, before the epilogue's last bucket. (A set of
       parameters with gradients that differs between ranks breaks both paths alike.)
    3. Nothing overlapped on CPU: without a reduction stream (`reduction_stream` is None on a "synchronized"
       device) each bucket's reduce ran blocking inside the hook, inside the backward. `allreduce_and_copy` (one
       owner's slices of a bucket) now starts the reduce (comm.reduce_sum_async) on a flattened copy, so the
       bucket buffer may be refilled, and `reduce_gradients` waits for all of them after the backward and adds the
       sums into this rank's fp32 gradient partition (the `output_bucket` slices), before the step reads it.

    If these names move, construction raises AttributeError; if their meaning does, the overlap equivalence
    tests fail (test_private_api.py in one process, test_grad_reduce.py against the reduction without overlap).
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from moe_dist.parallel import comm

    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer) or not opt.overlap_comm or opt.partition_gradients:
        return
    _require_checked_deepspeed("ZeRO 1 overlap")
    plain_backward, plain_copy, plain_reduce = engine.backward, opt.allreduce_and_copy, opt.reduce_gradients
    pending = []  # (work, flat sum, the bucket's tensors (shapes), this rank's partition slices or None)

    def backward(loss, *args, **kwargs):
        opt.set_gradient_accumulation_boundary(engine.is_gradient_accumulation_boundary())
        return plain_backward(loss, *args, **kwargs)

    def allreduce_and_copy(small_bucket, communication_data_type, rank=None, **kw):
        group = opt.dp_process_group if kw.get("process_group") is None else kw["process_group"]
        owner = rank is not None and rank == dist.get_rank(group=group)
        outputs = kw.get("output_bucket")
        if (
            rank is None
            or opt.sequence_parallel_size > 1
            or (owner and (outputs is None or any(o is None for o in outputs)))
        ):
            return plain_copy(small_bucket, communication_data_type, rank=rank, **kw)
        flat = torch.cat([t.reshape(-1) for t in small_bucket]).to(communication_data_type)  # always a copy
        if kw.get("divide", True) and opt.gradient_average:
            flat.div_(dist.get_world_size(group=group))
        work = comm.reduce_sum_async(flat, dist.get_global_rank(group, rank), group)
        pending.append((work, flat, list(small_bucket), list(outputs) if owner else None))

    def reduce_gradients(pipeline_parallel=False):
        queued = {param_id for bucket in opt.ipg_buckets.values() for _, _, param_id in bucket.params}
        left = [
            (p, i)
            for i, group in enumerate(opt.bit16_groups)
            for p in group
            if opt.get_gradient_for_reduction(p) is not None
            and not opt.params_already_reduced[opt.get_param_id(p)]
            and opt.get_param_id(p) not in queued
        ]
        if left:
            opt.setup_buckets()
        for p, i in left:
            opt.reduce_ready_partitions_and_remove_grads(p, i)
        plain_reduce(pipeline_parallel=pipeline_parallel)
        for work, flat, tensors, outputs in pending:
            work.wait()
            if outputs is not None:
                for out, part in zip(outputs, opt.unflatten(flat, tensors)):
                    out.add_(part.to(out.dtype))
        pending.clear()

    engine.backward, opt.allreduce_and_copy, opt.reduce_gradients = backward, allreduce_and_copy, reduce_gradients


# ------------------------------------------------------------------ ZeRO 1/2's gather of the updated weights, deferred


class ZeroWeightBuffer(NamedTuple):
    """One parameter group's low-precision weights under ZeRO 1/2: `flat` holds every parameter of `params` (views
    into it), cut into equal contiguous partitions of `partition_numel` elements, the i-th updated by rank i of
    `group` (the group's data-parallel or expert-data-parallel group)."""

    flat: torch.Tensor
    params: list[nn.Parameter]
    partition_numel: int
    group: dist.ProcessGroup


def zero_weight_buffers(engine) -> list[ZeroWeightBuffer] | None:
    """The flat weight buffers of the engine's ZeRO 1/2 optimizer, one per parameter group; None for another
    optimizer (ZeRO 0, BF16_Optimizer), which has none.

    deepspeed 0.19.8: DeepSpeedZeroOptimizer's `bit16_groups_flat` (the buffers), `bit16_groups` (their
    parameters), `parallel_partitioned_bit16_groups` (each buffer's partitions, views into it) and
    `real_dp_process_group` (each group's process group), read once: their tensors, sizes and groups do not
    change after construction. If they move, this raises AttributeError; if their meaning does, the deferred
    gather's equivalence test (test_grad_reduce.py, bitwise against DeepSpeed's own gather) fails.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer):
        return None
    return [
        ZeroWeightBuffer(flat, list(params), parts[0].numel(), group)
        for flat, params, parts, group in zip(
            opt.bit16_groups_flat, opt.bit16_groups, opt.parallel_partitioned_bit16_groups, opt.real_dp_process_group
        )
    ]


def replace_zero_weight_gather(engine, gather: Callable[[], None], before_step: Callable[[], None]) -> None:
    """Each step of the engine's ZeRO 1/2 optimizer (`zero_weight_buffers` not None): `before_step()`, then the
    step without its all-gather of the updated weights, then `gather()` where the step applied an update (it
    asked for the all-gather); a skipped step (overflow, `step_without_update`) gathers nothing either way.

    deepspeed 0.19.8 (refused otherwise: `deepspeed_version_unchecked_for_overlap`): DeepSpeedZeroOptimizer.step
    ends with `all_gather_dp_groups(groups_flat=self.bit16_groups_flat, ...)`, the module-level function that
    runtime/zero/stage_1_and_2.py imports from runtime/utils.py; it is replaced in that module, for the duration
    of this optimizer's `step` only, by a recorder (the optimizer's `step` is shadowed on the instance). Nothing
    else calls it during the step. If the step gathers another way, `gather()` never runs: the overlap is lost, or,
    with no gather left, the ranks train on stale weights (the equivalence test diverges from step 2); if the
    name moves, the first step raises AttributeError.
    """
    from deepspeed.runtime.zero import stage_1_and_2

    _require_checked_deepspeed("train.param_gather_overlap")
    opt = engine.optimizer
    plain_step = opt.step

    def step(*args, **kwargs):
        before_step()
        asked: list = []
        plain_gather = stage_1_and_2.all_gather_dp_groups
        stage_1_and_2.all_gather_dp_groups = lambda **kw: asked.append(True)
        try:
            out = plain_step(*args, **kwargs)
        finally:
            stage_1_and_2.all_gather_dp_groups = plain_gather
        if asked:
            gather()
        return out

    opt.step = step


# ------------------------------------------------------------------------------ torch.distributed internals


def set_timeout_of_every_group(timeout: timedelta, keep: tuple = ()) -> None:
    """Give every process group this rank belongs to, except those in `keep`, the collective timeout `timeout`.

    torch 2.13.0: torch keeps no public list of a process's groups; `distributed_c10d._world.pg_map` is that
    list, `_rank_not_in_group` tells member groups from placeholders, and `_set_pg_timeout` sets the timeout of
    the group's gloo/NCCL backends. If they move, this raises AttributeError at start-up (never silently: a
    group left at torch's 30-minute default would hang a stopped rank's peers for half an hour).
    """
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group) and group not in keep:
            c10d._set_pg_timeout(timeout, group)


def aborted_nccl_groups() -> list[str]:
    """The groups of this rank whose NCCL communicators the watchdog has aborted, as "name (TIMEOUT)" (or
    COMM_ERROR, REMOTE_ERROR); empty when none was (always on gloo).

    torch 2.13.0: `ProcessGroup._get_backend(device)` gives a group's NCCL backend (RuntimeError: the group has
    none) and `ProcessGroupNCCL.get_error()` its error state, which the watchdog sets when a collective fails or
    times out; groups from `distributed_c10d._world.pg_map` as above. A backend without `get_error` reports none.
    """
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return []
    from torch._C._distributed_c10d import ErrorType

    aborted = []
    for group in list(c10d._world.pg_map):
        if c10d._rank_not_in_group(group):
            continue
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:  # no backend for CUDA tensors in this group
            continue
        error = getattr(backend, "get_error", lambda: ErrorType.SUCCESS)()
        if error != ErrorType.SUCCESS:
            aborted.append(f"{group.group_name} ({error.name})")
    return aborted


# ------------------------------------------------------------------------------ DeepSpeed's CPU shm all-reduce


def deepspeed_shm_buffer_name(rank: int) -> str:
    """The /dev/shm name of rank `rank`'s DeepSpeed shared-memory all-reduce buffer in this job.

    deepspeed 0.19.8: ops/csrc/cpu/comm/shm.cpp (`shm_initialize`) creates
    `deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>` and never unlinks it. If the format
    changes, nothing is removed and every run leaks 69 MB of tmpfs per rank again
    (tests/launch/test_launchers.py's check).
    """
    return (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    )


# ------------------------------------------------------------------------------ an engine driven by a pipeline schedule


def engine_before_forward(engine) -> None:
    """What `engine.forward` does before running the module, for a forward the pipeline schedule runs on a stage
    of the engine's module without the engine.

    deepspeed 0.19.8: ZeRO 1/2 defer clearing the fp32 accumulation buffers (`grad_accum`) of a finished step to
    `clear_backward_seen_flag`, which `engine.forward` calls first; skipped, the next step would add onto the
    previous step's gradients (the pipeline equivalence tests fail)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if isinstance(engine.optimizer, ZeROOptimizer):
        engine.optimizer.clear_backward_seen_flag()


def engine_backward(engine, surrogate: torch.Tensor, boundary: bool) -> None:
    """`engine.backward` of a stage's backward: `surrogate` is a scalar whose gradient is the stage's (its loss on
    the last stage, Σ output · output gradient elsewhere), already scaled as one process scales its micro-batch
    (no division by the accumulation steps here); `boundary` marks this rank's last backward of the step, where
    the engine reduces.

    deepspeed 0.19.8: `engine.backward` runs the backward epilogue (ZeRO's reduction at the boundary) but leaves
    the prologue (ZeRO's `enter_backward`, the optimizer's boundary flag) to hooks that `engine.forward` puts on
    the module's outputs. The schedule runs the stages without `engine.forward`, so the prologue runs from a hook
    on the surrogate, at the same point of the backward as DeepSpeed's own."""
    engine.set_gradient_accumulation_boundary(boundary)
    ran = []

    def prologue(grad):
        if not ran:
            ran.append(True)
            engine._backward_prologue()
        return grad

    surrogate.register_hook(prologue)
    engine.backward(surrogate, scale_wrt_gas=False)


def count_once_in_grad_norm(p: nn.Parameter) -> None:
    """Leave `p` out of ZeRO's gradient norm on this rank: the second holder of a parameter replicated over
    pipeline stages (a tied embedding's copy on the last stage), whose first holder counts it.

    deepspeed 0.19.8: ZeRO 1/2's norm (`complete_grad_norm_calculation_for_cpu_offload`, `get_grad_norm_direct`)
    and runtime/utils.py's skip parameters whose `ds_pipe_replicated` (runtime.constants.PIPE_REPLICATED) is true,
    the mark its own pipeline engine sets on tied modules. Renamed, the norm counts the copy twice: the tied
    pipeline test's gradient norms fail."""
    from deepspeed.runtime.constants import PIPE_REPLICATED

    setattr(p, PIPE_REPLICATED, True)
