"""Calibration of the performance model (perfmodel.py) on measured runs.

benchmarks/scaling.py measures steps and per-call collective samples; `fit_hardware` turns them into a
`Hardware` (F from the compute times, (α, β) per link class from the samples by non-negative least squares)
and `fit_errors` compares the model's predictions with the measured step times (docs/perf_model.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_dist.config import JobConfig
from moe_dist.planning.collectives import Hardware, Link
from moe_dist.planning.perfmodel import predict_step
from moe_dist.planning.workload import Layout, step_flops_per_rank


def fit_link(hops: np.ndarray, wire_bytes: np.ndarray, seconds: np.ndarray) -> Link:
    """α and 1/β of seconds ≈ α·hops + bytes/β by least squares on absolute seconds (so the fitted calls add
    up to the measured time in collectives), constrained non-negative: a coefficient that comes out negative is
    dropped and the other refitted."""
    A = np.stack([np.asarray(hops, float), np.asarray(wire_bytes, float)], axis=1)
    alpha, inv_beta = _nonneg_lstsq(A, np.asarray(seconds, float))
    return Link(alpha_s=float(alpha), beta_Bps=float(1.0 / inv_beta) if inv_beta > 0 else math.inf)


def fit_compute(flops_times_share: np.ndarray, compute_s: np.ndarray) -> float:
    """F (FLOP/s) of compute ≈ FLOPs · ranks_per_device / F, minimizing relative errors (every run counts alike)."""
    u = np.asarray(flops_times_share, float) / np.asarray(compute_s, float)  # each run's own F
    return float((u @ u) / u.sum())


def _nonneg_lstsq(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Scale columns so that latency (~1e-4 s) and bandwidth (~1e-9 s/B) terms are conditioned alike.
    scale = np.where(np.abs(A).max(axis=0) > 0, np.abs(A).max(axis=0), 1.0)
    coef = np.linalg.lstsq(A / scale, y, rcond=None)[0]
    if (coef < 0).any():
        keep = coef >= 0
        coef = np.zeros(A.shape[1])
        if keep.any():
            coef[keep] = np.clip(np.linalg.lstsq(A[:, keep] / scale[keep], y, rcond=None)[0], 0.0, None)
    return coef / scale


@dataclass(frozen=True)
class MeasuredRun:
    """One measured configuration, as benchmarks/scaling.py records it (medians over steps, means over ranks)."""

    name: str
    cfg: JobConfig
    layout: Layout
    ranks_per_node: int
    ranks_per_device: int  # ranks sharing the compute device (all ranks share one CPU here)
    step_s: float
    compute_s: float  # step time minus time inside collectives


def fit_hardware(runs: list[MeasuredRun], samples: dict[str, np.ndarray], name: str = "fitted") -> Hardware:
    """Fit F on the runs' compute times and (α, β) per link class on per-call samples.

    samples: {"intra" | "inter": array (N, 3) of (hops, bottleneck bytes, seconds)}; a class without samples
    borrows the other's fit.
    """
    flops = np.array([step_flops_per_rank(r.cfg, r.layout) * r.ranks_per_device for r in runs])
    F = fit_compute(flops, np.array([r.compute_s for r in runs]))
    links = {k: fit_link(v[:, 0], v[:, 1], v[:, 2]) for k, v in samples.items() if len(v) >= 2}
    if not links:
        raise ValueError("no collective samples to fit α and β")
    intra = links.get("intra") or links["inter"]
    inter = links.get("inter") or intra
    return Hardware(
        name=name, flops_per_s=F, ranks_per_node=max(r.ranks_per_node for r in runs), intra=intra, inter=inter
    )


def fit_errors(runs: list[MeasuredRun], hw: Hardware) -> list[dict]:
    """Measured vs predicted step time for every run (relative error = predicted / measured - 1)."""
    out = []
    for r in runs:
        p = predict_step(r.cfg, r.layout, hw, ranks_per_device=r.ranks_per_device, ranks_per_node=r.ranks_per_node)
        out.append(
            {
                "run": r.name,
                "measured_s": r.step_s,
                "predicted_s": p.step_s,
                "rel_error": p.step_s / r.step_s - 1.0,
                "predicted_compute_s": p.compute_s,
                "predicted_comm_s": sum(p.comm_s.values()),
            }
        )
    return out
