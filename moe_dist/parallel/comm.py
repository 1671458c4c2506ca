"""The one place that issues collectives. Every rank calls these in the same order (DESIGN.md §5): callers guard
what they do with the results, never whether they call."""

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place sum over `group` (the world by default); a no-op without an initialized process group."""
    if _active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def barrier() -> None:
    if _active():
        dist.barrier()


def all_to_all_equal(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Not differentiable: chunk i of dim 0 goes to rank i of `group`; returns what every rank sent here."""
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t.contiguous(), group=group)
    return out


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: in_splits[i] rows go to rank i, out_splits[i] arrive from it."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return dist_fn.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
