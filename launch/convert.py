"""Convert between Hugging Face checkpoint directories (Mixtral, Jamba, Qwen2/3-MoE, OLMoE; dense Llama and Qwen3)
and our training checkpoints, and upcycle dense models into MoE runs.

    python launch/convert.py import HF_DIR RUN_DIR [--config BASE.json] [--set KEY=VALUE ...]
        → RUN_DIR/checkpoints/step_0 (zero Adam moments) and RUN_DIR/config.json; continue training with
          python launch/train.py --config RUN_DIR/config.json --run-dir RUN_DIR --resume
    python launch/convert.py export CHECKPOINT HF_DIR [--dtype fp32|bf16|fp16] [--force]
        CHECKPOINT: RUN_DIR/checkpoints/step_N, or a run directory (its newest complete checkpoint)
        HF_DIR: missing or empty; a directory that holds anything is refused unless --force
    python launch/convert.py upcycle SRC RUN_DIR --experts E --top-k K [--noise SIGMA] [--config BASE.json] [--set ...]
        SRC: a dense Hugging Face Llama/Qwen3 directory or one of our checkpoints / run directories; every dense FFN
        becomes E experts copied from it (plus noise: SIGMA times each weight's std), with a fresh router.

The model section of an imported run comes from the Hugging Face config (dropless MoE); everything else
(data, train, parallel, deepspeed) from --config and --set, or the defaults. `--set model.KEY=VALUE` changes a
model setting that keeps the architecture (loss coefficients, capacity, drop policy, balancing, kernels); a key
that would not (widths, counts, vocabulary, heads, top_k, ...: moe_dist/hf/overrides.py) is refused, exit 2,
nothing written. --set may be repeated.
"""

import argparse
import sys
from pathlib import Path

import torch

from moe_dist.config import ConfigError, load_config
from moe_dist.hf import HFConfigError, export_run_to_hf, import_hf_to_run, upcycle_to_run
from moe_dist.hf.overrides import is_model_override
from moe_dist.train.checkpoint import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SET_HELP = "dotted overrides of --config; model keys only where they keep the source's architecture"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="direction", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory → training run directory (step-0 checkpoint)")
    imp.add_argument("hf_dir", type=Path)
    imp.add_argument("run_dir", type=Path)
    imp.add_argument(
        "--config", default=None, help="job config for everything but the model (its model section is not used)"
    )
    imp.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE", help=SET_HELP)
    exp = sub.add_parser("export", help="training checkpoint (or run directory) → Hugging Face directory")
    exp.add_argument("checkpoint", type=Path)
    exp.add_argument("hf_dir", type=Path)
    exp.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weight dtype (default: as stored, fp32)")
    exp.add_argument(
        "--force", action="store_true", help="write into a non-empty HF_DIR (files of the same name are replaced)"
    )
    up = sub.add_parser("upcycle", help="dense model → MoE run directory whose experts copy the dense FFNs")
    up.add_argument("src", type=Path)
    up.add_argument("run_dir", type=Path)
    up.add_argument("--experts", type=int, required=True, help="experts per upcycled layer")
    up.add_argument("--top-k", type=int, required=True, help="experts chosen per token")
    up.add_argument("--noise", type=float, default=0.0, help="per-expert noise, in units of each weight's std")
    up.add_argument("--config", default=None, help="job config for model.moe and everything but the model")
    up.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE", help=SET_HELP)
    return p.parse_args(argv)


def occupied(out: Path) -> str:
    """Why `out` cannot take an export as it stands ("" when it can: missing or an empty directory). An export
    beside an earlier one would mix their weight files, which transformers would then read together."""
    if not out.exists():
        return ""
    if not out.is_dir():
        return "exists and is not a directory"
    entries = sorted(p.name for p in out.iterdir())
    more = f" and {len(entries) - 1} more" if len(entries) > 1 else ""
    return f"not empty (it holds {entries[0]}{more})" if entries else ""


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.direction in ("import", "upcycle"):
            # model keys go to the conversion, which refuses those the source fixes before reading anything; the
            # rest configure the run, as for train.py
            model_sets = [s for s in args.set if is_model_override(s)]
            base = load_config(args.config, [s for s in args.set if not is_model_override(s)])
        if args.direction == "import":
            out = import_hf_to_run(args.hf_dir, args.run_dir, base, model_sets)
            print(
                f"wrote {out}; continue with: python launch/train.py --config {args.run_dir / 'config.json'} "
                f"--run-dir {args.run_dir} --resume"
            )
        elif args.direction == "upcycle":
            out = upcycle_to_run(args.src, args.run_dir, base, args.experts, args.top_k, args.noise, model_sets)
            print(
                f"wrote {out}; continue with: python launch/train.py --config {args.run_dir / 'config.json'} "
                f"--run-dir {args.run_dir} --resume"
            )
        else:
            taken = occupied(args.hf_dir)
            if taken and not args.force:
                print(
                    f"error: {args.hf_dir}: {taken}; pass --force to write into it, or choose an empty directory",
                    file=sys.stderr,
                )
                return 2
            out = export_run_to_hf(args.checkpoint, args.hf_dir, DTYPES.get(args.dtype))
            print(f"wrote {out}")
    except (ConfigError, CheckpointError, HFConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
