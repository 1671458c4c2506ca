"""A DeepSpeed engine whose stages a pipeline schedule runs without `engine.forward`: what its forward and
backward would have done around them, and the pipeline-replicated mark of its gradient norm."""

from __future__ import annotations

import torch
from torch import nn


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
