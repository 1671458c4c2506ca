"""Train a moe_dist model.

    deepspeed [--num_gpus N] launch/train.py --config configs/mixtral_small.json [--set KEY=VALUE ...]
    torchrun --nproc_per_node N launch/train.py --config ...
    python launch/train.py --config ... [--dry-run]
    torchrun --max-restarts 3 --nproc_per_node N launch/train.py --config ... --resume   # restarts resume

Exit status: 0 done; 2 bad input (config, data, run directory, checkpoint that does not fit; nothing on disk
was changed); 1 the run failed (a collective failed or timed out, too many non-finite steps, a full disk: one line
naming the path and what to free, nothing already written lost); 3 stopped on request (SIGUSR1, e.g. Slurm's
--signal) after saving the checkpoint of the step every rank stopped after: rerun with --resume (launch/slurm/
requeues the job).
"""

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from moe_dist.config import ConfigError, load_config
from moe_dist.config.checks import advisories, validate


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="JSON job config (see configs/)")
    p.add_argument(
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="dotted-path overrides, values parsed as JSON where they parse, e.g. train.steps=50",
    )
    p.add_argument("--run-dir", type=Path, default=None, help="output directory (default: runs/<config name>)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --run-dir that verifies (else the one before); start "
        "fresh when there is none, so a restart can repeat the first command line",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build on the meta device; print parameter counts and the per-rank memory plan (docs/memory.md)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="--dry-run: plan for this many ranks (default: parallel.tp * parallel.ep, the smallest the layout takes)",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="--dry-run: plan device memory of GPU ranks (default) or resident memory of CPU ranks",
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # set by `deepspeed`
    return p.parse_args(argv)


def smallest_world(cfg) -> int:
    """The fewest ranks the config's layout takes (--dry-run's default): per pipeline stage tp · cp · dp ranks with
    ep dividing dp · cp (experts split over TP), or dividing the stage's ranks (whole experts, etp 1)."""
    pa = cfg.parallel
    if pa.expert_tp == 1:
        return pa.pp * math.lcm(pa.tp * pa.cp, pa.ep)
    return pa.pp * pa.tp * math.lcm(pa.cp, pa.ep)


def what_would_fit(cfg, world: int, device: str, most: int = 64) -> str:
    """After `fits: NO` at `world` ranks: the smallest larger world the layout divides that fits (up to `most`
    times `world`), and ZeRO 2 at this world where the config uses less and that fits."""
    from moe_dist.planning.memory import memory_plan

    step = smallest_world(cfg)
    found = None
    for candidate in range(world + step, most * world + 1, step):
        try:
            plan = memory_plan(cfg, candidate, device)
        except ConfigError:  # a world the layout does not divide (e.g. ep no longer divides dp)
            continue
        if plan["capacity"]["fits"]:
            found = (candidate, plan["memory_per_rank_gb"]["total"])
            break
    advice = [f"world {found[0]} ({found[1]:.2f} GB per rank)" if found else f"no world up to {most * world}"]
    if cfg.deepspeed.zero_stage < 2:
        zero2 = dataclasses.replace(cfg, deepspeed=dataclasses.replace(cfg.deepspeed, zero_stage=2))
        try:
            validate(zero2)
            plan = memory_plan(zero2, world, device)
        except ConfigError:  # a setting that needs ZeRO 1
            plan = None
        if plan is not None and plan["capacity"]["fits"]:
            total = plan["memory_per_rank_gb"]["total"]
            advice.append(f"--set deepspeed.zero_stage=2 at world {world} ({total:.2f} GB per rank)")
    return "would fit: " + "; or ".join(advice)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # legal but probably not meant (e.g. a warm-up longer than the run)
        for line in advisories(cfg):
            print(line, file=sys.stderr)
    if args.dry_run:
        from moe_dist.models.decoder import param_counts
        from moe_dist.planning.memory import memory_plan

        world = args.world_size or smallest_world(cfg)
        try:
            plan = memory_plan(cfg, world, args.device)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        lay, mem = plan["layout"], plan["memory_per_rank_gb"]
        cp_part = f" x cp {lay['cp']}" if lay["cp"] > 1 else ""
        pp_part = f"pp {lay['pp']} x " if lay["pp"] > 1 else ""
        sp = " + SP" if cfg.parallel.sequence_parallel and lay["tp"] > 1 else ""
        whole = " of whole experts (etp 1)" if cfg.parallel.expert_tp == 1 and lay["tp"] > 1 else ""
        print(
            f"layout: world {world} = {pp_part}dp {lay['dp']}{cp_part} x tp {lay['tp']}{sp}, "
            f"ep {lay['ep']}{whole}, ZeRO {lay['zero_stage']}, "
            f"activation checkpointing {cfg.train.activation_checkpointing}"
        )
        if "pipeline" in plan:
            pipe = plan["pipeline"]
            print(
                f"pipeline: {len(pipe['stage_starts'])} stages starting at layers {pipe['stage_starts']} "
                f"(pp_virtual {cfg.parallel.pp_virtual}); total per pipeline rank (GB) "
                + ", ".join(f"{t:.2f}" for t in pipe["total_gb_by_pp_rank"])
                + f"; below: pipeline rank {lay['pp_rank']}, {lay['micro_batches_in_flight']:g} micro-batches in flight"
            )
        print("per rank (GB): " + ", ".join(f"{k} {v:.2f}" for k, v in mem.items()))
        print(
            "activations by part (GB): " + ", ".join(f"{k} {v:.2f}" for k, v in plan["activations_by_part_gb"].items())
        )
        print("largest transients (GB): " + ", ".join(f"{k} {v:.2f}" for k, v in plan["transient_gb"].items()))
        if plan["host_gb"]["save_staging"]:  # host memory, not in the total above
            print(f"host memory (GB): async-save staging buffer {plan['host_gb']['save_staging']:.2f}")
        cap = plan["capacity"]
        if cap is not None:
            print(
                f"fits: {'yes' if cap['fits'] else 'NO'}: total {mem['total']:.2f} GB of {cap['usable_gb']:.2f} GB "
                f"usable = {cap['device_mib']:,.0f} MiB ({cap['device_gb']:.2f} GB; {cap['source']}) less the "
                f"{cap['fragmentation_margin']:.0%} fragmentation margin; headroom {cap['headroom_gb']:.2f} GB; "
                f"expert rows at {lay['expert_rows_factor']:g}x the mean"
            )
        if cap is not None and not cap["fits"]:
            print(what_would_fit(cfg, world, args.device))
        print(json.dumps({**param_counts(cfg.model), "memory_per_rank_gb": mem, "capacity": cap}))
        return 0
    from moe_dist.train.checkpoint import CheckpointError
    from moe_dist.train.disk import is_no_space, no_space
    from moe_dist.train.guard import TrainingError
    from moe_dist.train.loop import RunDirError, train
    from moe_dist.train.preempt import EXIT_STOPPED, Stopped

    run_dir = args.run_dir or Path("runs") / Path(args.config).stem
    try:
        train(cfg, run_dir, resume=args.resume)
    except (ConfigError, RunDirError, ValueError, CheckpointError) as e:  # bad input: nothing was written
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except TrainingError as e:  # a failed collective or too many non-finite steps: the launcher may restart
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # The process group is unusable after a failed collective, and tearing it down could wait on the
        # stopped peer: leave at once so the launcher sees the failure now.
        os._exit(1)
    except Stopped:  # rank 0 said at which step; the checkpoint is published
        return EXIT_STOPPED
    except OSError as e:  # a full disk met outside our own writes (e.g. TensorBoard's event file): one line, exit 1
        if not is_no_space(e):
            raise
        print(f"error: {no_space(e.filename, run_dir)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
