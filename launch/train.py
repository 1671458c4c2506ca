"""Train a moe_dist model.

    deepspeed [--num_gpus N] launch/train.py --config configs/mixtral_small.json [--set KEY=VALUE ...]
    torchrun --nproc_per_node N launch/train.py --config ...
    python launch/train.py --config ... [--dry-run]
"""

import argparse
import json
import sys
from pathlib import Path

from moe_dist.config import ConfigError, load_config


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="JSON job config (see configs/)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="dotted-path overrides, values parsed as JSON where they parse, e.g. train.steps=50")
    p.add_argument("--run-dir", type=Path, default=None, help="output directory (default: runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --run-dir")
    p.add_argument("--dry-run", action="store_true", help="build on the meta device and print parameter counts")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # set by `deepspeed`
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        from moe_dist.models.decoder import param_counts

        print(json.dumps(param_counts(cfg.model)))
        return 0
    from moe_dist.train.loop import RunDirError, train

    run_dir = args.run_dir or Path("runs") / Path(args.config).stem
    try:
        train(cfg, run_dir, resume=args.resume)
    except (ConfigError, RunDirError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
