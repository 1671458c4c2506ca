"""Checkpoint save and load of one process: wall time and peak host-memory growth, for this tree's checkpoint
package or moe_dist/train/checkpoint.py of an earlier commit (`--ref`, from before the package), so that
before/after figures come from the same script and machine.

    python -m benchmarks.studies.ckpt_bench [--ref COMMIT] [--config C] [--set KEY=VALUE ...]
    python -m benchmarks.studies.ckpt_bench --train [--steps N] [--save-every K] [--set ...]   # what async_save hides

Builds the model, its DeepSpeed engine (ZeRO from the config) and zero Adam moments, then saves a checkpoint into
a temporary directory and loads it back. Peak memory is the kernel's high-water mark of this process (VmHWM),
reset just before each operation (/proc/self/clear_refs), minus the resident size at that moment. Prints one JSON
line. Run each variant in its own process (the allocator keeps freed memory, so a second save in the same
process would measure less).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
# About 160 M parameters: a 1.9 GB checkpoint (fp32 values and both Adam moments).
DEFAULT_SET = ["model.d_model=768", "model.d_ff=2048", "model.n_layers=4", "model.vocab_size=8192", "train.threads=1"]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measured(fn):
    """(result, seconds, peak resident growth in MB, peak anonymous-memory growth in MB) of fn(). The first
    counts mapped file pages too (safetensors reads through mmap: page cache, reclaimable); the second, sampled
    every millisecond, is the memory the process itself allocated."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    base, anon = _status_kb("VmRSS"), [_status_kb("RssAnon")]
    done = threading.Event()

    def sample():
        while not done.wait(0.001):
            anon.append(_status_kb("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tic = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - tic
    done.set()
    sampler.join()
    return out, seconds, (_status_kb("VmHWM") - base) / 1024, (max(anon) - anon[0]) / 1024


def checkpoint_module(ref: str | None):
    """What provides save_checkpoint, verify_checkpoint and load_checkpoint: today's package, or checkpoint.py as
    it was at commit `ref` (which held all three before the read side moved to checkpoint_read.py, then the
    whole into moe_dist/train/checkpoint/)."""
    if ref is None:
        import moe_dist.train.checkpoint as ckpt

        return SimpleNamespace(
            save_checkpoint=ckpt.save_checkpoint,
            verify_checkpoint=ckpt.verify_checkpoint,
            load_checkpoint=ckpt.load_checkpoint,
        )
    source = subprocess.run(
        ["git", "show", f"{ref}:moe_dist/train/checkpoint.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "checkpoint_at_ref.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("checkpoint_at_ref", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def train_intervals(cfg_path: str, overrides: list[str], steps: int, save_every: int) -> dict:
    """One training run in this process with train.async_save off, then one with it on: the wall time from the
    start of one step to the start of the next (the step, its metrics and any save), mean over steps with and
    without a save, and the final wait for the last save. Same process, same model, same data."""
    import moe_dist.train.loop as loop
    from moe_dist.config import load_config

    out = {}
    for mode in ("sync", "async"):
        starts = []
        train_step = loop._train_step

        def timed(*a, _inner=train_step, _starts=starts, **k):
            _starts.append(time.perf_counter())
            return _inner(*a, **k)

        loop._train_step = timed
        cfg = load_config(
            cfg_path,
            [*overrides, f"train.steps={steps}", f"train.save_every={save_every}", "train.eval_every=0",
             f"train.async_save={str(mode == 'async').lower()}"],
        )  # fmt: skip
        try:
            loop.train(cfg, Path(tempfile.mkdtemp(prefix=f"ckpt_bench_{mode}_")))
        finally:
            loop._train_step = train_step
        starts.append(time.perf_counter())  # the end of train(): after the last save is published
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        with_save = [g for i, g in enumerate(gaps[:-1], 1) if i % save_every == 0]  # step i ended with a save
        without = [g for i, g in enumerate(gaps[:-1], 1) if i % save_every and i > 1]  # the first step warms up
        out[mode] = {
            "step_without_save_s": round(sum(without) / len(without), 3),
            "step_with_save_s": round(sum(with_save) / len(with_save), 3),
            "last_step_and_final_save_s": round(gaps[-1], 3),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", default=None, help="git commit whose moe_dist/train/checkpoint.py to measure")
    p.add_argument("--config", default=str(REPO / "configs" / "mixtral_small.json"))
    p.add_argument("--set", nargs="*", action="extend", default=[], help="overrides after the default size ones")
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    p.add_argument(
        "--train",
        action="store_true",
        help="instead: time training steps with and without checkpoint saves, train.async_save off then on",
    )
    p.add_argument("--steps", type=int, default=9, help="with --train: steps per run")
    p.add_argument("--save-every", type=int, default=2, help="with --train: save period")
    args = p.parse_args()
    if args.train:
        print(json.dumps(train_intervals(args.config, [*DEFAULT_SET, *args.set], args.steps, args.save_every)))
        return

    import deepspeed
    import torch

    from moe_dist.config import load_config
    from moe_dist.models.decoder import build_model
    from moe_dist.parallel.mesh import init_distributed
    from moe_dist.parallel.parallelize import parallelize
    from moe_dist.train.optim import build_optimizer, deepspeed_config

    ckpt = checkpoint_module(args.ref)
    cfg = load_config(args.config, [*DEFAULT_SET, *args.set])
    torch.set_num_threads(cfg.train.threads or 1)
    mesh = init_distributed(cfg)
    model = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)
    optimizer, scheduler = build_optimizer(model, cfg)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg, mesh.dp)
    )
    from moe_dist.train.checkpoint.state import ensure_optimizer_state

    ensure_optimizer_state(engine, 1)
    params = sum(p.numel() for p in model.parameters())
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt_bench_"))
    path, save_s, save_mb, save_anon = measured(
        lambda: ckpt.save_checkpoint(engine, model, scheduler, root, 1, cfg, mesh)
    )
    written = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    (meta, index), verify_s, _, _ = measured(lambda: ckpt.verify_checkpoint(path))
    _, load_s, load_mb, load_anon = measured(
        lambda: ckpt.load_checkpoint(engine, model, scheduler, path, meta, index, mesh)
    )
    print(
        json.dumps(
            {
                "impl": args.ref or "worktree",
                "params_M": round(params / 1e6, 1),
                "written_GB": round(written / 1e9, 3),
                "save_s": round(save_s, 2),
                "save_peak_growth_MB": round(save_mb),
                "save_anon_peak_growth_MB": round(save_anon),
                "verify_s": round(verify_s, 2),
                "load_s": round(load_s, 2),
                "load_peak_growth_MB": round(load_mb),
                "load_anon_peak_growth_MB": round(load_anon),
            }
        )
    )
    if args.dir is None:
        import shutil

        shutil.rmtree(root)


if __name__ == "__main__":
    sys.exit(main())
