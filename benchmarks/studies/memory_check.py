"""Measured memory on the CPU, to hold the memory plan (moe_dist/planning/memory.py) and activation checkpointing
honest.

    python -m benchmarks.studies.memory_check activations --config C [--set K=V ...] [--settings none,full,...]
        one process, one micro-batch forward + backward per checkpointing setting: the peak resident memory above
        the level just before the forward (activations + gradients + transients), the bytes autograd saved, and
        the plan's figure for the same; JSON per setting on stdout.
    torchrun --nproc_per_node N -m benchmarks.studies.memory_check init --config C [--set ...] [--whole-then-slice]
        building the model: each rank's peak resident memory while it builds its shard, against the shard's size
    torchrun --nproc_per_node N -m benchmarks.studies.memory_check train --config C --run-dir D [--set ...]
        a real training run (launch/train.py's `train`); each rank writes D/memory_rankR.json: its peak resident
        memory above its level before the run started (after imports) up to the first checkpoint save, beside the
        plan for its layout.

Peaks are the kernel's high-water mark of this process (VmHWM), reset through /proc/self/clear_refs before the
measured region, so they count every allocation torch made, its allocator's slack included. Run with
MALLOC_MMAP_THRESHOLD_=1048576: glibc otherwise raises its mmap threshold after the first large free and serves
later blocks from a heap it does not give back, so the peak depends on the order of frees (+20% seen).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

GB = 1e9


def rss_bytes(field: str = "VmRSS") -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


SETTINGS = {
    "none": [],
    "full": ["train.activation_checkpointing=full"],
    "moe_experts": ["train.activation_checkpointing=selective", 'train.checkpoint_parts=["moe_experts"]'],
}


def activations(args) -> None:
    from moe_dist.config import load_config
    from moe_dist.models.activation_checkpointing import apply_activation_checkpointing
    from moe_dist.models.decoder import build_model, lm_loss, materialize_whole
    from moe_dist.planning.memory import memory_plan

    settings = args.settings.split(",")
    if len(settings) > 1:  # one fresh process each: freed memory stays resident and would hide the next peak
        for setting in settings:
            cmd = [sys.executable, "-m", __spec__.name, "activations", "--config", args.config, "--settings", setting]
            subprocess.run([*cmd, "--set", *args.set] if args.set else cmd, check=True)
        return
    torch.set_num_threads(1)
    for setting in settings:
        cfg = load_config(args.config, [*args.set, *SETTINGS[setting]])
        t = cfg.train
        model = apply_activation_checkpointing(materialize_whole(build_model(cfg.model), "cpu", t.seed), t)
        batch = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1))
        saved = 0

        def pack(x):
            nonlocal saved
            saved += x.numel() * x.element_size()
            return x

        gc.collect()
        reset_peak()
        base = rss_bytes()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = model(batch[:, :-1])
            loss = lm_loss(out.logits, batch[:, 1:]) + out.aux_loss
        loss.backward()
        peak = rss_bytes("VmHWM") - base
        plan = memory_plan(cfg, world_size=1, device="cpu")
        print(
            json.dumps(
                {
                    "setting": setting,
                    "seq_len": t.seq_len,
                    "micro_batch_size": t.micro_batch_size,
                    "measured_peak_gb": peak / GB,
                    "saved_by_autograd_gb": saved / GB,
                    "planned_activations_gb": plan["memory_per_rank_gb"]["activations"],
                    "planned_grads_gb": plan["memory_per_rank_gb"]["grads"],
                }
            ),
            flush=True,
        )
        del model, out, loss
        gc.collect()


def train_run(args) -> None:
    import deepspeed  # noqa: F401  (imported before the baseline: its import is not the run's memory)

    from moe_dist.config import load_config
    from moe_dist.planning.memory import memory_plan
    from moe_dist.train.checkpoint import Checkpointer
    from moe_dist.train.loop import train

    cfg = load_config(args.config, args.set)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    peaks: list[int] = []
    save = Checkpointer.save

    def save_after_noting_the_peak(self, *a, **kw):  # the plan is of training: the peak up to the first save
        peaks.append(rss_bytes("VmHWM"))
        return save(self, *a, **kw)

    Checkpointer.save = save_after_noting_the_peak
    gc.collect()
    reset_peak()
    base = rss_bytes()
    train(cfg, args.run_dir)
    peak = (peaks[0] if peaks else rss_bytes("VmHWM")) - base
    rank = int(os.environ.get("RANK", "0"))
    plan = memory_plan(cfg, world_size=world, device="cpu")
    out = {"rank": rank, "world_size": world, "measured_peak_gb": peak / GB, "plan": plan}
    (args.run_dir / f"memory_rank{rank}.json").write_text(json.dumps(out))


def init_run(args) -> None:
    """Peak resident memory of building this rank's shard (parallelize: EP and TP on meta, shard-wise init), or with
    --whole-then-slice the former way (materialize the local model whole, then slice it for TP), above the level
    after the process group exists; against the bytes of the shard it ends with."""
    from moe_dist.config import load_config
    from moe_dist.models.decoder import build_model, materialize_whole
    from moe_dist.parallel.expert_parallel import apply_ep
    from moe_dist.parallel.mesh import init_distributed
    from moe_dist.parallel.parallelize import parallelize
    from moe_dist.parallel.tensor_parallel import apply_tp

    cfg = load_config(args.config, args.set)
    mesh = init_distributed(cfg)
    total = sum(p.numel() * 4 for p in build_model(cfg.model, "meta").parameters())
    gc.collect()
    reset_peak()
    base = rss_bytes()
    if args.whole_then_slice:
        model = apply_tp(materialize_whole(apply_ep(build_model(cfg.model), mesh), "cpu", cfg.train.seed), mesh)
    else:
        model = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)
    peak = rss_bytes("VmHWM") - base
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        json.dumps(
            {
                "rank": mesh.rank,
                "layout": {"dp": mesh.dp, "ep": mesh.ep, "tp": mesh.tp},
                "method": "whole_then_slice" if args.whole_then_slice else "shard_wise",
                "model_gb": total / GB,
                "shard_gb": shard / GB,
                "peak_above_start_gb": peak / GB,
            }
        ),
        flush=True,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["activations", "train", "init"])
    p.add_argument("--config", required=True)
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    p.add_argument("--settings", default="none,full,moe_experts", help="activations: checkpointing settings")
    p.add_argument("--run-dir", type=Path, default=None)
    p.add_argument("--whole-then-slice", action="store_true", help="init: the former way, for comparison")
    args = p.parse_args(argv)
    {"activations": activations, "train": train_run, "init": init_run}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
