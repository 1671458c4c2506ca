"""Start-up and finish shared by the workers that multi-process tests spawn (tests/parallel/*_worker.py,
tests/train/grad_accum_worker.py). A worker runs as `WORKER OUT` under torchrun (or plain python: a world of one),
with tests/ on its PYTHONPATH (`support.worker_env`), and reads:

    def main(out_dir: Path) -> None:
        rank = workers.start()                 # or mesh = workers.start_mesh(cfg) for the real mesh
        ...
        workers.finish(out_dir, rank, results) # OUT/rank<R>.json, then every rank leaves together

    if __name__ == "__main__":
        workers.run(main)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist


def _threads_and_seed() -> None:
    # Tiny models, 2 to 4 ranks on a 2-core machine: thread-pool hand-offs cost more than these ops, and ranks with
    # a pool each would oversubscribe the cores.
    torch.set_num_threads(1)
    # Every rank draws the same default stream: workers build the same reference model on each rank.
    torch.manual_seed(0)


def start() -> int:
    """A plain gloo default group from torchrun's environment (for workers that make their own groups); the rank."""
    _threads_and_seed()
    dist.init_process_group("gloo")
    return dist.get_rank()


def start_mesh(cfg, timeout_s: float | None = None):
    """The training mesh of `cfg` (`moe_dist.parallel.mesh.init_distributed`, groups and all); a world of one
    outside a launcher."""
    from moe_dist.parallel.mesh import init_distributed

    _threads_and_seed()
    return init_distributed(cfg, timeout_s=timeout_s)


def finish(out: Path, rank: int, results: dict | None = None) -> None:
    """Writes `results` (if any) to OUT/rank<R>.json, then waits for every rank before tearing the group down: a
    rank that leaves while others still talk to it fails them."""
    if results is not None:
        (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run(main: Callable[[Path], None]) -> None:
    """`main(OUT)`, OUT being the command line's one argument (the folder the test reads)."""
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} OUT")
    main(Path(sys.argv[1]))
