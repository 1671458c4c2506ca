"""torch.distributed internals: every process group of this rank, their timeouts and NCCL error states."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


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
