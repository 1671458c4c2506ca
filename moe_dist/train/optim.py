"""Optimizer, learning-rate schedule and the DeepSpeed engine config, all derived from one JobConfig."""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_dist.config import JobConfig, grad_accum_steps


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; exempt vectors (norm weights, biases, D) and the SSM's A_log, as is standard."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or name.endswith("A_log") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(cfg: JobConfig):
    """Multiplier of train.lr at optimizer step s: linear warmup, then cosine decay to min_lr_ratio."""
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(model: nn.Module, cfg: JobConfig):
    t = cfg.train
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=tuple(t.betas), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    return opt, sched


def deepspeed_config(cfg: JobConfig, dp: int) -> dict:
    """The engine config. Batch sizes come from train.* only, so they cannot disagree with the data loader."""
    t = cfg.train
    ds = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps(cfg, dp),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "bf16": {"enabled": t.dtype == "bf16"},
        # We hand DeepSpeed torch's AdamW: its own Adam ops would compile C++/CUDA extensions first.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    ds.update(cfg.deepspeed.extra)
    return ds
