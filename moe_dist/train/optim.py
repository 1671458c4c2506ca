"""Optimizer, learning-rate schedule and the DeepSpeed engine config, all derived from one JobConfig."""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_dist.config import JobConfig
from moe_dist.parallel import private_api
from moe_dist.parallel.param_gather import defer_parameter_gather


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; exempt vectors (norm weights, biases, D) and the SSM's A_log, as is standard.

    Expert-parallel parameters (marked by apply_ep through private_api.mark_expert_parameter) go in their own
    groups flagged `moe` with the expert group's name: DeepSpeed's ZeRO partitions and reduces those over the
    expert-data-parallel group instead of the whole data-parallel group.
    """
    groups: dict[tuple, dict] = {}
    for name, p in model.named_parameters():
        decay = weight_decay if p.ndim >= 2 and not name.endswith("A_log") else 0.0
        expert_group = private_api.expert_group_of(p)
        key = (decay, expert_group)
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": decay}
            if expert_group is not None:
                groups[key].update(moe=True, name=expert_group)
        groups[key]["params"].append(p)
    return list(groups.values())


def lr_lambda(cfg: JobConfig):
    """Multiplier of train.lr after s optimizer steps (the lr of step s + 1): linear warmup over warmup_steps, then

    - cosine: cosine decay from 1 to min_lr_ratio over the remaining steps;
    - wsd (warmup-stable-decay): 1 until the last D = decay_fraction × steps (rounded half up) steps, then linear decay
      from 1 at s = steps - D to min_lr_ratio at s = steps.

    A function of s and the current train.steps alone (checkpoints store no schedule state): resuming a wsd run
    with more train.steps moves the decay to the new end, so the resumed steps continue the stable phase
    (tests/train/test_lr_schedule.py)."""
    t = cfg.train
    decay_start = t.steps - t.decay_steps()

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "wsd":
            progress = min(1.0, max(0, step - decay_start) / max(1, t.steps - decay_start))
            return 1 - (1 - t.min_lr_ratio) * progress
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(model: nn.Module, cfg: JobConfig):
    t = cfg.train
    # fused: one kernel over all tensors (CPU and CUDA); half the step time of the default per-tensor loop on CPU
    opt = torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=tuple(t.betas), eps=t.adam_eps, fused=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    return opt, sched


def deepspeed_config(cfg: JobConfig, dp: int, cp: int = 1) -> dict:
    """The engine config. Batch sizes come from train.* only, so they cannot disagree with the data loader. Under
    context parallelism DeepSpeed's data-parallel world is dp × cp ranks, each CP rank a replica that sees the
    same micro-batches (each its pieces): its batch-size identity (batch = micro × accumulation × its world)
    counts every sequence cp times.

    The gradient reduction (docs/parallelism.md, "Gradient reduction once per step"). With bf16 weights and fp32
    accumulation, ZeRO 1 is the one-reduction-per-step mode: each micro-batch's bf16 gradient is added into an fp32
    buffer of the parameter's full size (`param.grad_accum`, the memory plan's accumulation buffer), and the step's
    sum is reduced once, after the last micro-batch's backward, in buckets of train.grad_reduce_bucket_mb, each
    bucket's gradients summed onto the data-parallel rank that owns their optimizer partition (reduce-scatter
    volume; expert parameters over their expert-data-parallel group, DeepSpeed's `moe` parameter groups). With
    train.grad_reduce_overlap the buckets are reduced from the last micro-batch's gradient hooks while its backward
    goes on (DeepSpeed's overlap_comm, corrected by private_api.overlap_zero1_reduction, whose docstring says what
    DeepSpeed 0.19.8 got wrong), else after that backward. ZeRO 2 instead reduces every micro-batch's gradient (no
    full-size buffer; micro-batches × the bytes), overlapped with train.grad_reduce_overlap.

    Why DeepSpeed's ZeRO 1 optimizer and not our own reduction: its optimizer class is the one every ZeRO 1/2 run
    already has, so checkpoints (save, resume, resharding) read the same partitioned fp32 state unchanged, and
    DeepSpeed keeps the reduction, clipping and step consistent. DeepSpeed would wrap this combination in
    BF16_Optimizer instead, which all-reduces (twice the bytes of a reduce-scatter) the whole fp32 gradient after
    the backward, overlapping nothing, and keeps state our checkpoints do not read; private_api routes it back
    (`zero1_keeps_its_optimizer`). DeepSpeed's `engine.coalesce_grad_reduction()` was the other candidate: it
    rejects BF16_Optimizer and, for DeepSpeedZeroOptimizer, reduces only when its block exits, after the last
    backward, leaving the micro-batches' gradients in bf16 `param.grad` meanwhile. The updated bf16 weights'
    all-gather (DeepSpeed's, one per parameter group after the optimizer step) overlaps nothing.
    """
    t = cfg.train
    stage = cfg.deepspeed.zero_stage
    zero = {"stage": stage}
    if stage >= 1:  # null: off
        overlap = bool(t.grad_reduce_overlap)
        zero.update(reduce_scatter=True, reduce_bucket_size=t.reduce_bucket_elements(), overlap_comm=overlap)
    if stage == 1:
        # Each bucket's slices go to their owners only (a reduce per owner: reduce-scatter volume) instead of an
        # all-reduce of the whole bucket (twice the bytes on a ring), DeepSpeed's default.
        zero["use_multi_rank_bucket_allreduce"] = False
    ds = {
        "train_batch_size": t.global_batch_size * cp,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps(dp),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": t.dtype == "bf16"},
        # We hand DeepSpeed torch's AdamW: its own Adam ops would compile C++/CUDA extensions first.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if t.dtype == "bf16":
        # Summing many micro-batches' bf16 gradients in bf16 loses low bits at every addition (16 micro-batches:
        # errors of ~1e-3 relative, tests/train/test_grad_accum.py): fp32 by default (train.grad_accum_dtype).
        ds["data_types"] = {"grad_accum_dtype": t.grad_accum_dtype}
        ds["communication_data_type"] = t.grad_reduce_dtype
    ds.update(cfg.deepspeed.extra)
    return ds


def initialize_engine(model: nn.Module, optimizer, scheduler, cfg: JobConfig, dp: int, mpu=None, cp: int = 1):
    """deepspeed.initialize with our config; ZeRO 1 with bf16 weights keeps DeepSpeed's ZeRO optimizer class
    (deepspeed_config's docstring says why), and its overlapped reduction is corrected on this engine."""
    import deepspeed

    with private_api.zero1_keeps_its_optimizer():
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg, dp, cp), mpu=mpu
        )
    private_api.overlap_zero1_reduction(engine)  # a no-op unless ZeRO 1 with train.grad_reduce_overlap
    # train.param_gather_overlap: the step's weight gather behind the next forward (parallel/param_gather.py);
    # `engine.deferred_gather.wait_all()` before anything reads every weight outside a forward
    engine.deferred_gather = defer_parameter_gather(engine) if cfg.train.param_gather_overlap else None
    return engine
