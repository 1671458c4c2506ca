"""Process start-up and the parallel layout: world = dp × tp, with ep dividing dp (DESIGN.md §5)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_dist.config import JobConfig, check_layout


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    dp: int  # data-parallel degree
    dp_rank: int
    device: torch.device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cfg: JobConfig, timeout_s: float = 600.0) -> World:
    """Join the process group the launcher describes (deepspeed, torchrun, accelerate), or form a world of one.

    Plain `python launch/train.py` sets no launcher variables; we fill them in for a single process so the
    same code path (and DeepSpeed) runs everywhere.
    """
    import deepspeed  # imported here: it probes the accelerator at import time

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                                   auto_mpi_discovery=False)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dp = check_layout(cfg, world_size)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return World(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world,
                 dp=dp, dp_rank=rank // cfg.parallel.tp, device=device)
