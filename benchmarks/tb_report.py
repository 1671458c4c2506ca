"""Summarize a run's TensorBoard events as one PNG, for people without a TensorBoard server.

    python -m benchmarks.tb_report RUN_DIR [--out report.png]      (default: RUN_DIR/tb_report.png)
    python -m benchmarks.tb_report RUN_DIR --bytes                  event-file bytes per step, by kind

Panels: loss curves (train loss, LM loss, eval loss), drop fraction per MoE layer over steps, and the token
share of every expert of every MoE layer over steps as a heatmap (rows grouped by layer; read from
RUN_DIR/metrics.jsonl when TensorBoard has no per-expert scalars, as above 64 experts). Needs matplotlib
(`pip install -e '.[report]'`); training itself never imports it.
"""

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

_SHARE = re.compile(r"moe/layer(\d+)/expert(\d+)_token_share$")
_DROP = re.compile(r"moe/layer(\d+)/drop_fraction$")


def read_scalars(tb_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every scalar tag of the event files under `tb_dir` → (steps, values), sorted by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = sorted(acc.Scalars(tag), key=lambda e: e.step)
        out[tag] = (np.array([e.step for e in events]), np.array([e.value for e in events]))
    return out


def share_matrix(scalars: dict) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Token share as (layers·experts rows, steps) with the steps and the number of experts of each layer."""
    by_layer: dict[int, dict[int, tuple]] = defaultdict(dict)
    for tag, series in scalars.items():
        m = _SHARE.match(tag)
        if m:
            by_layer[int(m.group(1))][int(m.group(2))] = series
    if not by_layer:
        return np.zeros((0, 0)), np.zeros(0), []
    steps = np.unique(np.concatenate([s for layer in by_layer.values() for s, _ in layer.values()]))
    rows, experts = [], []
    for layer in sorted(by_layer):
        experts.append(len(by_layer[layer]))
        for e in sorted(by_layer[layer]):
            s, v = by_layer[layer][e]
            row = np.full(len(steps), np.nan)
            row[np.searchsorted(steps, s)] = v
            rows.append(row)
    return np.stack(rows), steps, experts


def event_bytes(tb_dir: Path) -> tuple[dict[str, int], int]:
    """Bytes of the event files under `tb_dir` by kind (image, per-expert scalar, scalar, or the plugin's name;
    record framing included) and the last step logged."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2

    by_kind: dict[str, int] = defaultdict(int)
    last = 0
    for path in sorted(tb_dir.glob("events.*")):
        for raw in RawEventFileLoader(str(path)).Load():
            event = event_pb2.Event.FromString(raw)
            kind = "other"
            for v in event.summary.value:
                plugin = v.metadata.plugin_data.plugin_name
                if v.HasField("image") or plugin == "images":
                    kind = "image"
                elif "/expert" in v.tag and (v.HasField("simple_value") or plugin == "scalars"):
                    kind = "per-expert scalar"
                elif v.HasField("simple_value") or plugin == "scalars":
                    kind = "scalar"
                else:
                    kind = plugin or "other"
            by_kind[kind] += len(raw) + 16  # a record: length, its CRC, the data, the data's CRC
            last = max(last, event.step)
    return dict(by_kind), last


def share_matrix_from_jsonl(path: Path) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """`share_matrix` from the per-expert token counts of metrics.jsonl (kept there at any expert count)."""
    import json

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("moe")]
    if not records:
        return np.zeros((0, 0)), np.zeros(0), []
    experts = [len(layer["tokens_per_expert"]) for layer in records[0]["moe"]]
    columns = []
    for r in records:
        counts = [np.asarray(layer["tokens_per_expert"], dtype=np.float64) for layer in r["moe"]]
        columns.append(np.concatenate([c / max(c.sum(), 1.0) for c in counts]))
    return np.stack(columns, axis=1), np.array([r["step"] for r in records]), experts


def render(scalars: dict, out: Path, title: str, shares=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share, steps, experts = shares if shares is not None else share_matrix(scalars)
    fig, axes = plt.subplots(3, 1, figsize=(10, 11), gridspec_kw={"height_ratios": [1, 1, 1.6]})
    fig.suptitle(title)
    ax = axes[0]
    for tag, label in (("train/loss", "loss"), ("train/lm_loss", "LM loss"), ("eval/eval_loss", "eval loss")):
        if tag in scalars:
            ax.plot(*scalars[tag], label=label, marker="o" if tag.startswith("eval") else None)
    ax.set(xlabel="step", ylabel="loss", title="losses")
    ax.legend()
    ax = axes[1]
    drops = sorted((int(m.group(1)), tag) for tag in scalars if (m := _DROP.match(tag)))
    for layer, tag in drops:
        ax.plot(*scalars[tag], label=f"MoE layer {layer}")
    ax.set(xlabel="step", ylabel="dropped / routed", title="drop fraction per MoE layer")
    if drops:
        ax.legend(fontsize="small", ncol=max(1, len(drops) // 8))
    ax = axes[2]
    if len(share):
        mean = 1.0 / max(experts)
        im = ax.imshow(
            share,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            vmin=0,
            vmax=max(2 * mean, np.nanmax(share)),
            extent=(steps[0] - 0.5, steps[-1] + 0.5, len(share), 0),
        )
        bounds = np.cumsum([0] + experts)
        for b in bounds[1:-1]:
            ax.axhline(b, color="white", linewidth=1)
        ax.set_yticks((bounds[:-1] + bounds[1:]) / 2, [f"layer {i}" for i in range(len(experts))])
        fig.colorbar(im, ax=ax, label="token share")
    ax.set(xlabel="step", title="expert load: token share of each expert (rows: experts, grouped by MoE layer)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: RUN_DIR/tb_report.png)")
    p.add_argument("--bytes", action="store_true", help="print the event files' bytes per step by kind instead")
    args = p.parse_args(argv)
    tb = args.run_dir / "tb"
    if not tb.is_dir():
        print(f"error: {tb}: no TensorBoard directory (is {args.run_dir} a run directory?)", file=sys.stderr)
        return 2
    if args.bytes:
        by_kind, steps = event_bytes(tb)
        print(f"{tb}: {sum(by_kind.values())} bytes over {steps} steps")
        for kind, n in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:18s} {n:>10d} bytes  {n / max(steps, 1):>10.0f} per step")
        return 0
    scalars = read_scalars(tb)
    if not scalars:
        print(f"error: {tb}: no scalar events", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "tb_report.png"
    shares = share_matrix(scalars)
    if not len(shares[0]) and (args.run_dir / "metrics.jsonl").exists():
        shares = share_matrix_from_jsonl(args.run_dir / "metrics.jsonl")
    render(scalars, out, f"run {args.run_dir.resolve().name}", shares)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
