"""The initial step size of the recurrent mixers (Mamba-1's Δ, Mamba-2's and Gated DeltaNet's dt), one home for the
three: Δ = softplus(bias) is log-uniform in [dt_min, dt_max] (floored), so the bias stores its inverse softplus."""

from __future__ import annotations

import math

import torch

# mamba_ssm's and fla's defaults (dt_min, dt_max, dt_init_floor); Mamba-2 takes its own from model.mamba2.
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4


def inverse_softplus_step_sizes(
    n: int, device: torch.device, dt_min: float = DT_MIN, dt_max: float = DT_MAX, floor: float = DT_FLOOR
) -> torch.Tensor:
    """n fp32 biases b with softplus(b) log-uniform in [dt_min, dt_max], at least `floor`, from one torch.rand draw
    of the global RNG."""
    u = torch.rand(n, device=device, dtype=torch.float32)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))
