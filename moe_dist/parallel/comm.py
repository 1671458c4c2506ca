"""The one place that issues collectives. Every rank calls these in the same order (DESIGN.md §5)."""

import torch
import torch.distributed as dist


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place sum over `group` (the world by default); a no-op without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
