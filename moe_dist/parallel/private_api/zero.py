"""ZeRO 1/2 optimizer internals: where the fp32 master weights, Adam moments and reduced gradient partitions
live, a step that updates nothing, and ZeRO 1's optimizer class with bf16 weights."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


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
