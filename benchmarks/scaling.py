"""Weak- and strong-scaling sweeps with a time breakdown per collective, and the calibrated performance model.

    python -m benchmarks.scaling [sweep] [--out runs/scaling] [--worlds 1 2 4] [--steps 6] [--no-netns]
    python -m benchmarks.scaling report --out runs/scaling      # re-aggregate and re-fit a finished sweep
    python -m benchmarks.scaling predict [--config C] [--mfu 0.4] [--levers] [--published]  # H200s (and H100s)

`sweep` runs every point on one node (torchrun) and, as root, across two network-namespace nodes
(tests/netns_cluster.sh), then writes OUT/scaling.md (tables), OUT/scaling.csv, OUT/scaling.png and
TensorBoard scalars in OUT/tb, and OUT/predictions.md (`predict`'s table). Strong scaling keeps the global
batch fixed; weak scaling grows it with the world size. The job is configs/debug.json widened (DEFAULT_SET)
with its experts spread over all ranks (parallel.ep = world), so the all-to-all crosses the nodes.

Each point runs benchmarks/scaling_worker.py: launch/train.py's job with every torch.distributed collective
timed (common.CollectiveTracer), per step and rank seconds and bytes sent per collective kind, and per call the
(hops, bytes, seconds) samples that moe_dist.planning.perfmodel fits α and β on. Blocking gloo collectives are timed
wall-clock, so their time includes waiting for the slowest rank: "compute" is step time minus time inside
collectives.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("all_to_all", "all_reduce", "reduce_scatter", "all_gather", "other")
SCALARS = ("tokens_per_s", "speedup", "efficiency", "step_s", "compute_s")  # per point, in the CSV and TensorBoard
# configs/debug.json widened so that FLOPs, not per-operator overhead, dominate a rank's compute (2 cores).
DEFAULT_SET = ["model.d_model=128", "model.d_ff=512", "train.seq_len=64"]


# ------------------------------------------------------------------------------------------------ the sweep


def points(worlds: list[int], nodes: list[int], num_experts: int, per_rank_batch: int, micro: int) -> list[dict]:
    """Strong scaling keeps the global batch at `per_rank_batch` sequences; weak scaling gives every rank
    `per_rank_batch`. World 1 is the same run for both (and only exists on one node)."""
    out = []
    for n_nodes in nodes:
        for mode in ("strong", "weak"):
            for w in worlds:
                if w % n_nodes or (w == 1 and (n_nodes > 1 or mode == "weak")):
                    continue
                ep = max(e for e in range(1, w + 1) if w % e == 0 and num_experts % e == 0)
                out.append(
                    {
                        "name": f"{'both' if w == 1 else mode}_{n_nodes}node_w{w}",
                        "mode": "both" if w == 1 else mode,
                        "nodes": n_nodes,
                        "world": w,
                        "ep": ep,
                        "global_batch": per_rank_batch * (w if mode == "weak" else 1),
                        "micro_batch": micro,
                    }
                )
    return out


def point_overrides(p: dict, steps: int, extra: list[str]) -> list[str]:
    # One thread per rank: ranks then share the cores predictably (OpenMP threads of one rank spin badly when
    # other processes, or other users' jobs, hold the cores).
    return [
        f"train.steps={steps}",
        "train.threads=1",
        "train.eval_every=0",
        "train.save_every=0",
        f"train.eval_batches={p['world']}",
        f"train.global_batch_size={p['global_batch']}",
        f"train.micro_batch_size={p['micro_batch']}",
        f"parallel.ep={p['ep']}",
        *extra,
    ]


def run_point(p: dict, config: str, overrides: list[str], out: Path, timeout: float) -> bool:
    run_dir = out / p["name"]
    if run_dir.exists():
        shutil.rmtree(run_dir)
    worker_args = ["--config", config, "--set", *overrides]
    if p["nodes"] == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            shutil.which("torchrun") or "torchrun",
            "--nproc_per_node",
            str(p["world"]),
            "--master_port",
            str(port),
            "-m",
            "benchmarks.scaling_worker",
            *worker_args,
            "--run-dir",
            str(run_dir),
        ]
    else:
        # netns_cluster.sh writes the job into RUN_DIR/<launcher>; run_dir is that folder.
        run_dir = out / p["name"] / "torchrun"
        cmd = [
            "bash",
            str(REPO / "tests" / "netns_cluster.sh"),
            "--nodes",
            str(p["nodes"]),
            "--nproc",
            str(p["world"] // p["nodes"]),
            "--launchers",
            "torchrun",
            "--run-dir",
            str(out / p["name"]),
            "--script",
            str(REPO / "benchmarks" / "scaling_worker.py"),
            "--timeout",
            str(int(timeout)),
            "--",
            *worker_args,
        ]
    # netns_cluster.sh runs the worker by its path, whose own folder is first on its path: the repository on
    # PYTHONPATH lets it import benchmarks.common (under torchrun -m, the working directory does).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    tic, load = time.perf_counter(), os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout + 60)
    p["run_dir"] = str(run_dir)
    p["wall_s"] = time.perf_counter() - tic
    p["load"] = (load + os.getloadavg()[0]) / 2  # the machine's run queue: other users' jobs slow every point
    if proc.returncode != 0:
        print(
            f"  {p['name']}: FAILED ({proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}", file=sys.stderr
        )
        return False
    print(f"  {p['name']}: done in {p['wall_s']:.0f} s (end to end)", flush=True)
    return True


def aggregate(p: dict) -> dict:
    """Median over the measured steps (the first is warm-up), mean over ranks."""
    run_dir = Path(p["run_dir"])
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    train = [r for r in records if "loss" in r][1:]
    profiles = [json.loads(f.read_text()) for f in sorted((run_dir / "profile").glob("rank*.json"))]
    row = {k: p[k] for k in ("name", "mode", "nodes", "world", "ep", "global_batch", "micro_batch", "load")}
    row["tokens_per_s"] = statistics.median([r["tokens_per_s"] for r in train])
    per_rank = []
    for prof in profiles:
        steps = prof["steps"][1:]
        agg = {"step_s": statistics.median([s["wall_s"] for s in steps])}
        for kind in KINDS:
            agg[f"{kind}_s"] = statistics.median([s["kinds"].get(kind, [0, 0, 0])[0] for s in steps])
            agg[f"{kind}_bytes"] = statistics.median([s["kinds"].get(kind, [0, 0, 0])[1] for s in steps])
        per_rank.append(agg)
    for key in per_rank[0]:
        row[key] = sum(r[key] for r in per_rank) / len(per_rank)
    row["compute_s"] = row["step_s"] - sum(row[f"{k}_s"] for k in KINDS)
    row["bytes_per_rank"] = sum(row[f"{k}_bytes"] for k in KINDS)
    row["samples"] = [s for prof in profiles for s in prof["samples"]]
    return row


# ------------------------------------------------------------------------------------------------ reporting


def fit_and_predict(rows: list[dict], config: str, overrides: list[str], steps: int, cores: int):
    import numpy as np

    from moe_dist.config import load_config
    from moe_dist.planning import fit
    from moe_dist.planning import perfmodel as pm
    from moe_dist.planning import workload as wl

    runs = []
    for r in rows:
        cfg = load_config(config, point_overrides(r, steps, overrides))
        # The "device" is one core (one thread per rank); all nodes' ranks share this machine's cores.
        share = max(1, -(-r["world"] // cores))
        runs.append(
            fit.MeasuredRun(
                r["name"],
                cfg,
                wl.Layout(r["world"], r["ep"], 1),
                r["world"] // r["nodes"],
                share,
                r["step_s"],
                r["compute_s"],
            )
        )
    samples = {"intra": [], "inter": []}
    for r in rows:
        for _kind, n, g, hops, wire, seconds, _source in r["samples"]:
            samples["intra" if g == n else "inter"].append((hops, wire, seconds))
    hw = fit.fit_hardware(runs, {k: np.array(v) for k, v in samples.items() if v}, name="this machine (fitted)")
    errors = fit.fit_errors(runs, hw)
    for r, e, run in zip(rows, errors, runs, strict=True):
        pred = pm.predict_step(
            run.cfg, run.layout, hw, ranks_per_device=run.ranks_per_device, ranks_per_node=run.ranks_per_node
        )
        r.update(
            predicted_step_s=e["predicted_s"],
            rel_error=e["rel_error"],
            predicted_bytes_per_rank=sum(pred.bytes_per_rank.values()),
        )
    return hw, errors


def write_outputs(rows: list[dict], hw, out: Path, cores: int, matmul_peak: float) -> None:
    ref = next((r for r in rows if r["world"] == 1), None)
    for r in rows:  # speed-up over one process; efficiency against the ideal this machine's cores allow
        r["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else float("nan")
        r["efficiency"] = r["speedup"] / min(r["world"], cores)
    point = "name mode nodes world ep global_batch load".split()
    model = "bytes_per_rank predicted_bytes_per_rank predicted_step_s rel_error".split()
    cols = [*point, *SCALARS, *[f"{k}_s" for k in KINDS], *[f"{k}_bytes" for k in KINDS], *model]
    with (out / "scaling.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    lines = [
        "# Scaling sweep",
        "",
        f"{cores} cores, one thread per rank; efficiency = speed-up over one process / min(world, cores); "
        "load = the machine's 1-minute load average during the point (other users' jobs share the cores). "
        "Times are per step, median over steps, mean over ranks; collectives are timed wall-clock (waiting "
        "for the slowest rank included), compute = step - collectives.",
        "",
        f"Fitted model: {describe(hw)}; F is {100 * hw.flops_per_s / matmul_peak:.0f}% of this machine's "
        f"measured one-thread fp32 matmul rate ({matmul_peak / 1e9:.1f} GFLOP/s).",
        "",
        "| run | nodes × ranks | ep | global batch | load | tokens/s | speed-up | efficiency | step ms | "
        "compute ms | all-to-all ms | all-reduce ms | all-gather ms | other ms | KB sent / step / rank (model) | "
        "model step ms | error |",
        "|" + "---|" * 17,
    ]
    for r in rows:
        other = r["reduce_scatter_s"] + r["other_s"]
        lines.append(
            f"| {r['name']} | {r['nodes']} × {r['world'] // r['nodes']} | {r['ep']} | {r['global_batch']} | "
            f"{r['load']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f} | {r['efficiency']:.2f} | {ms(r['step_s'])} | "
            f"{ms(r['compute_s'])} | "
            f"{ms(r['all_to_all_s'])} | {ms(r['all_reduce_s'])} | {ms(r['all_gather_s'])} | {ms(other)} | "
            f"{r['bytes_per_rank'] / 1e3:.0f} ({r.get('predicted_bytes_per_rank', 0) / 1e3:.0f}) | "
            f"{ms(r.get('predicted_step_s', 0))} | {100 * r.get('rel_error', 0):+.0f}% |"
        )
    errs = [abs(r["rel_error"]) for r in rows if "rel_error" in r]
    if errs:
        lines += [
            "",
            f"Model error on these runs: mean |error| {100 * sum(errs) / len(errs):.0f}%, max {100 * max(errs):.0f}%.",
        ]
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    from torch.utils.tensorboard import SummaryWriter

    tb = SummaryWriter(str(out / "tb"))
    for r in rows:
        modes = ("strong", "weak") if r["mode"] == "both" else (r["mode"],)
        for mode in modes:
            tag = f"{mode}_{r['nodes']}node"
            for key in (*SCALARS, "bytes_per_rank", *[f"{k}_s" for k in KINDS]):
                tb.add_scalar(f"{tag}/{key}", r[key], r["world"])
    tb.close()
    plot(rows, out / "scaling.png")


def measure_matmul_peak(n: int = 512) -> float:
    """FLOP/s of an n×n fp32 matmul on one thread: the device's own peak that F is compared with (DESIGN §7)."""
    import torch

    from moe_dist.train.throughput import measured_peak

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measured_peak(torch.device("cpu"), "fp32", n=n, repeats=20).flops_per_s
    finally:
        torch.set_num_threads(threads)


def describe(hw) -> str:
    return (
        f"F = {hw.flops_per_s / 1e9:.2f} GFLOP/s per device (one core); "
        f"intra-node α = {1e6 * hw.intra.alpha_s:.0f} µs, β = {hw.intra.beta_Bps / 1e6:.0f} MB/s; "
        f"inter-node α = {1e6 * hw.inter.alpha_s:.0f} µs, β = {hw.inter.beta_Bps / 1e6:.0f} MB/s"
    )


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no PNG written", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in ("strong", "weak"):
        for nodes in sorted({r["nodes"] for r in rows}):
            pts = sorted(
                (r["world"], r["tokens_per_s"]) for r in rows if r["nodes"] == nodes and r["mode"] in (mode, "both")
            )
            if pts:
                ax1.plot(*zip(*pts, strict=True), marker="o", label=f"{mode}, {nodes} node(s)")
    ax1.set(
        xlabel="world size (ranks)", ylabel="tokens/s", title="throughput", xticks=sorted({r["world"] for r in rows})
    )
    ax1.legend()
    bottom = [0.0] * len(rows)
    labels = [r["name"].replace("_", "\n") for r in rows]
    for key in ("compute_s", *[f"{k}_s" for k in KINDS]):
        vals = [1e3 * max(r[key], 0.0) for r in rows]
        ax2.bar(labels, vals, bottom=bottom, label=key[:-2])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax2.set(ylabel="ms per step (mean over ranks)", title="where the step goes")
    ax2.tick_params(axis="x", labelsize=7)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="sweep", choices=["sweep", "report", "predict"])
    p.add_argument("--out", type=Path, default=Path("runs/scaling"))
    p.add_argument("--config", default=None, help="sweep: configs/debug.json; predict: configs/mixtral_8x7b.json")
    p.add_argument(
        "--set",
        nargs="+",
        default=DEFAULT_SET,
        help=f"overrides for every sweep point (default: {' '.join(DEFAULT_SET)})",
    )
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=6, help="steps per point (the first is warm-up)")
    p.add_argument(
        "--per-rank-batch",
        type=int,
        default=8,
        help="sequences per step: per rank (weak scaling) and in total (strong scaling)",
    )
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--no-netns", action="store_true", help="skip the two-node points")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--mfu", type=float, default=0.40, help="predict: assumed share of peak the device sustains")
    p.add_argument("--levers", action="store_true", help="predict: also what moves 64 and 1,024 GPUs (slower)")
    p.add_argument(
        "--published",
        action="store_true",
        help="predict: also Megatron-LM's published Qwen3-235B-A22B layout on H100 and H200 (with its config)",
    )
    args = p.parse_args(argv)
    if args.command == "predict":
        from benchmarks.scaling_predict import predict_table

        print(predict_table(args.config or "configs/mixtral_8x7b.json", args.mfu, args.levers, args.published))
        return 0

    from moe_dist.config import load_config

    config = args.config or "configs/debug.json"
    args.out.mkdir(parents=True, exist_ok=True)
    state = args.out / "points.json"
    if args.command == "sweep":
        nodes = [1]
        if not args.no_netns:
            check = subprocess.run(
                ["bash", str(REPO / "tests" / "netns_cluster.sh"), "--check"], capture_output=True, text=True
            )
            if check.returncode == 0:
                nodes.append(2)
            else:
                print(f"two-node points skipped: {check.stderr.strip()}", file=sys.stderr)
        experts = load_config(config, args.set).model.moe.num_experts
        matmul_peak = measure_matmul_peak()
        print(f"fp32 matmul on one thread: {matmul_peak / 1e9:.1f} GFLOP/s", flush=True)
        todo = points(args.worlds, nodes, experts, args.per_rank_batch, args.micro_batch)
        done = []
        for pt in todo:
            print(f"running {pt['name']} (ep={pt['ep']}, global batch {pt['global_batch']})", flush=True)
            if run_point(pt, config, point_overrides(pt, args.steps, args.set), args.out, args.timeout):
                done.append(pt)
        state.write_text(
            json.dumps(
                {
                    "config": config,
                    "set": args.set,
                    "steps": args.steps,
                    "cores": len(os.sched_getaffinity(0)),
                    "matmul_peak": matmul_peak,
                    "points": done,
                }
            )
        )
    saved = json.loads(state.read_text())
    rows = [aggregate(pt) for pt in saved["points"]]
    hw, _ = fit_and_predict(rows, saved["config"], saved["set"], saved["steps"], saved["cores"])
    write_outputs(rows, hw, args.out, saved["cores"], saved["matmul_peak"])
    from benchmarks.scaling_predict import predict_table

    (args.out / "predictions.md").write_text(predict_table("configs/mixtral_8x7b.json", args.mfu) + "\n")
    print(f"\nwrote {args.out}/scaling.md, scaling.csv, scaling.png, predictions.md and tb/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
