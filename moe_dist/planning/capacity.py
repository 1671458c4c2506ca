"""The memory one GPU offers the plan (memory.py), and whether the plan fits in it.

Units: the driver reports bytes; device memory is stated in MiB (2^20 bytes), as `nvidia-smi` and torch's messages
state it, and the plan in GB (10^9 bytes). An H200 reports 143,771 MiB = 150.76 GB = 140.4 GiB; NVIDIA sells it as
"141 GB". Capacity is the device's own total where a GPU is present (`device_capacity_bytes`), `plan.device_memory_mib`
where the config sets it, else the table value below. The plan must fit in that capacity less
`plan.fragmentation_margin` of it: the caching allocator's reserved-but-unallocated memory, which no tensor of ours
accounts for (docs/memory.md, "Headroom").
"""

from __future__ import annotations

import torch

from moe_dist.config import JobConfig

MIB = 2**20
GB = 1e9
# torch.cuda.mem_get_info's total on an H200 SXM, the GPU the shipped configs are planned for: what the dry-run
# plans against on a machine without a GPU (issue 36's figure; benchmarks/gpu_check/ records the device's own).
H200_MIB = 143_771
# The same for an H100 SXM 80 GB (the figure of plan.device_memory_mib=81559 in tests/planning/test_memory.py).
H100_MIB = 81_559


def device_capacity_bytes(device: torch.device | str | int | None = None) -> int:
    """Total memory of a CUDA device in bytes as the driver reports it (`torch.cuda.mem_get_info`'s total; the
    current device when None). Creates the device's CUDA context if it has none."""
    return int(torch.cuda.mem_get_info(device)[1])


def planned_capacity(cfg: JobConfig) -> tuple[int, str]:
    """(bytes, where the figure comes from) of one GPU: `plan.device_memory_mib`, else this machine's GPU, else
    the H200 table value."""
    if cfg.plan.device_memory_mib is not None:
        return cfg.plan.device_memory_mib * MIB, "plan.device_memory_mib"
    if torch.cuda.is_available():
        return device_capacity_bytes(), f"this machine's {torch.cuda.get_device_name()}, torch.cuda.mem_get_info"
    return H200_MIB * MIB, "no GPU here: an H200's"


def headroom(cfg: JobConfig, total_bytes: float, capacity_bytes: int | None = None) -> dict:
    """The plan's total against one GPU: capacity, the fragmentation margin (a fraction of capacity), what is left
    for the plan (usable = capacity · (1 − margin)), the headroom (usable − total) and whether it fits."""
    source = "given"
    if capacity_bytes is None:
        capacity_bytes, source = planned_capacity(cfg)
    margin = cfg.plan.fragmentation_margin * capacity_bytes
    usable = capacity_bytes - margin
    return {
        "device_mib": capacity_bytes / MIB,
        "device_gb": capacity_bytes / GB,
        "source": source,
        "fragmentation_margin": cfg.plan.fragmentation_margin,
        "margin_gb": margin / GB,
        "usable_gb": usable / GB,
        "headroom_gb": (usable - total_bytes) / GB,
        "fits": total_bytes <= usable,
    }
