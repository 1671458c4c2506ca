"""The balancing study (docs/balancing.md): train one config under several balancing recipes and tabulate, per
recipe, the final drop fraction per MoE layer, max/mean load, dead experts and eval loss, with a plot.

    python -m benchmarks.studies.balancing --config configs/mixtral_small.json --out runs/balancing [--steps 200]
        [--only NAME ...] [--set KEY=VALUE ...]

Each recipe trains in its own run directory OUT/NAME (one process, `python launch/train.py`); a recipe whose
run directory already holds a finished run is summarized, not retrained. Writes OUT/table.md and, with
matplotlib (`pip install -e '.[report]'`), OUT/balancing.png (drop fraction and max/mean load over steps).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPES = {  # name: model.moe overrides
    "aux 0": ["model.moe.aux_loss_coef=0"],
    "aux 1e-3": ["model.moe.aux_loss_coef=0.001"],
    "aux 1e-2": ["model.moe.aux_loss_coef=0.01"],
    "aux 1e-1": ["model.moe.aux_loss_coef=0.1"],
    "bias only": ["model.moe.aux_loss_coef=0", "model.moe.bias_update_rate=0.001"],
    "bias + aux 1e-2": ["model.moe.aux_loss_coef=0.01", "model.moe.bias_update_rate=0.001"],
    "sequence aux 1e-2": ["model.moe.aux_loss_coef=0.01", "model.moe.aux_loss_scope=sequence"],
    "global-batch aux 1e-2": ["model.moe.aux_loss_coef=0.01", "model.moe.aux_loss_scope=global_batch"],
}


def run_dir_name(name: str) -> str:
    return name.replace(" ", "_").replace("+", "and")


def train(config: str, out: Path, steps: int, name: str, extra: list[str]) -> list[dict]:
    run = out / run_dir_name(name)
    metrics = run / "metrics.jsonl"
    if not (metrics.is_file() and any(json.loads(ln).get("step") == steps for ln in metrics.read_text().splitlines())):
        cmd = [sys.executable, str(REPO / "launch/train.py"), "--config", config, "--run-dir", str(run), "--resume"]
        cmd += ["--set", f"train.steps={steps}", "train.threads=1", *RECIPES[name], *extra]
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return [json.loads(ln) for ln in metrics.read_text().splitlines()]


def summary(records: list[dict]) -> dict:
    """Final-step figures; eval loss of the last evaluation."""
    last = [r for r in records if "loss" in r][-1]
    layers = last["moe"]
    return {
        "drop": [layer["drop_fraction"] for layer in layers],
        "max_mean": [layer["max_over_mean_load"] for layer in layers],
        "dead": [layer.get("dead_experts", 0) for layer in layers],
        "eval": [r["eval_loss"] for r in records if "eval_loss" in r][-1],
    }


def table(results: dict[str, dict]) -> str:
    rows = [
        "| recipe | drop fraction per layer (%) | max/mean load per layer | dead experts | eval loss |",
        "|---|---|---|---|---|",
    ]
    for name, s in results.items():
        drop = " ".join(f"{100 * d:.1f}" for d in s["drop"])
        load = " ".join(f"{m:.2f}" for m in s["max_mean"])
        rows.append(f"| {name} | {drop} | {load} | {sum(s['dead'])} | {s['eval']:.4f} |")
    return "\n".join(rows) + "\n"


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_drop, ax_load) = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in runs.items():
        train_records = [r for r in records if "loss" in r]
        steps = [r["step"] for r in train_records]
        ax_drop.plot(
            steps, [sum(m["drop_fraction"] for m in r["moe"]) / len(r["moe"]) for r in train_records], label=name
        )
        ax_load.plot(steps, [max(m["max_over_mean_load"] for m in r["moe"]) for r in train_records], label=name)
    ax_drop.set(xlabel="step", ylabel="drop fraction (mean over layers)")
    ax_load.set(xlabel="step", ylabel="max/mean load (worst layer)")
    ax_load.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/mixtral_small.json")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--only", nargs="+", default=list(RECIPES), choices=list(RECIPES), metavar="NAME")
    p.add_argument(
        "--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE", help="overrides for every recipe"
    )
    args = p.parse_args(argv)
    runs = {name: train(args.config, args.out, args.steps, name, args.set) for name in args.only}
    results = {name: summary(records) for name, records in runs.items()}
    (args.out / "table.md").write_text(table(results))
    print(table(results))
    try:
        plot(runs, args.out / "balancing.png")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
