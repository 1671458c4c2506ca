"""One point of a scaling sweep (benchmarks/scaling.py runs it under torchrun or across netns nodes):
launch/train.py's job with every torch.distributed collective timed.

    torchrun --nproc_per_node 2 -m benchmarks.scaling_worker --config configs/debug.json --run-dir DIR [--set ...]

The tracer (common.CollectiveTracer) goes in before DeepSpeed binds torch.distributed's functions; the loop itself
is unchanged, and its step boundaries are those of its StepAccumulator. Per step and rank it records seconds,
bytes sent and calls per collective kind, and per call (after the first, warm-up, step) the (hops, bytes, seconds)
samples that moe_dist.planning.perfmodel fits α and β on; then a few all-reduces and all-to-alls of the world at larger
sizes (calibration). Writes RUN_DIR/profile/rank{R}.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from benchmarks.common import Collective, CollectiveTracer

MAX_SAMPLES = 4000  # per rank


class CollectiveTimer:
    """Attributes the collectives that common.CollectiveTracer sees to the current training step: seconds and
    bytes sent per kind, and the (hops, bytes, seconds) samples of each call after the first step."""

    def __init__(self, ranks_per_node: int):
        self.ranks_per_node = ranks_per_node
        self.steps: list[dict] = []
        self.samples: list[tuple] = []
        self.current: dict | None = None
        self._groups: dict[int, tuple[int, int]] = {}

    def _group(self, group) -> tuple[int, int]:
        """(most ranks of the group on one node, this rank's index in it), cached per group."""
        import torch.distributed as dist

        key = id(group)
        if key not in self._groups:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            per_node: dict[int, int] = {}
            for r in ranks:
                per_node[r // self.ranks_per_node] = per_node.get(r // self.ranks_per_node, 0) + 1
            self._groups[key] = (max(per_node.values()), ranks.index(dist.get_rank()))
        return self._groups[key]

    def record(self, call: Collective) -> None:
        from moe_dist.planning.collectives import bottleneck_features, collective_terms

        if self.current is None:  # outside a training step (set-up, eval, checkpoints)
            return
        n, kind, payload = call.group_size, call.kind, call.payload_bytes
        g, me = self._group(call.args.get("group"))
        wire = None
        if call.name == "all_to_all_single" and n > 1:  # uneven splits: count exactly what leaves this rank
            splits, x = call.args.get("input_split_sizes"), call.args["input"]
            row_bytes = math.prod(x.shape[1:]) * x.element_size()  # x may hold no rows at all
            own = splits[me] * row_bytes if splits else payload / n
            wire = payload - own
        hops, sent = collective_terms(kind, n, payload)
        sent = sent if wire is None else wire
        entry = self.current["kinds"].setdefault(kind, [0.0, 0.0, 0])
        entry[0] += call.seconds
        entry[1] += sent
        entry[2] += 1
        if n > 1 and len(self.steps) >= 1 and len(self.samples) < MAX_SAMPLES:  # skip the first (warm-up) step
            h, b = bottleneck_features(kind, n, g, payload, wire)
            self.samples.append((kind, n, g, h, b, call.seconds, "train"))

    def calibrate(self, sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 23), repeats=3) -> None:
        """All-reduce and all-to-all of the world at sizes the training step does not reach, each after a
        barrier (so no straggler wait is included): the samples that pin β, where the step's own collectives
        (KBs, latency-bound) pin α."""
        import torch
        import torch.distributed as dist

        from moe_dist.planning.collectives import bottleneck_features

        n, (g, _) = dist.get_world_size(), self._group(None)
        if n == 1:
            return
        for size in sizes:
            x = torch.ones(max(n, size // 4 // n * n), dtype=torch.float32)
            out = torch.empty_like(x)
            for kind in ("all_reduce", "all_to_all"):
                for _ in range(repeats):
                    dist.barrier()
                    tic = time.perf_counter()
                    if kind == "all_reduce":
                        dist.all_reduce(x)
                    else:
                        dist.all_to_all_single(out, x)
                    seconds = time.perf_counter() - tic
                    h, b = bottleneck_features(kind, n, g, x.numel() * 4)
                    self.samples.append((kind, n, g, h, b, seconds, "calibration"))

    def start_step(self) -> None:
        self.current = {"kinds": {}, "start": time.perf_counter()}

    def end_step(self) -> None:
        cur, self.current = self.current, None
        self.steps.append({"wall_s": time.perf_counter() - cur["start"], "kinds": cur["kinds"]})


def main(argv: list[str] | None = None) -> int:
    """launch/train.py's job with every collective timed; writes RUN_DIR/profile/rank{R}.json."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", nargs="+", action="extend", default=[])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = p.parse_args(argv)
    timer = CollectiveTimer(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    CollectiveTracer(timer.record).install()  # before DeepSpeed binds torch.distributed functions at its initialization

    import torch.distributed as dist

    from moe_dist.config import load_config
    from moe_dist.train import metrics
    from moe_dist.train.loop import train

    # Step boundaries: the loop creates a StepAccumulator right after starting its step timer and reduces it
    # last, so [__init__, reduce] is the timed step (eval and checkpoints fall outside).
    init, reduce = metrics.StepAccumulator.__init__, metrics.StepAccumulator.reduce

    def init_timed(self, *a, **k):
        timer.start_step()
        init(self, *a, **k)

    def reduce_timed(self):
        out = reduce(self)
        timer.end_step()
        return out

    metrics.StepAccumulator.__init__, metrics.StepAccumulator.reduce = init_timed, reduce_timed
    train(load_config(args.config, args.set), args.run_dir)
    timer.calibrate()
    out = args.run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": timer.steps, "samples": timer.samples}))
    if dist.is_initialized():  # a clean teardown: left to interpreter exit, gloo's threads sometimes abort it
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
