"""The parts of the GPU check that check pieces in one process (benchmarks/gpu_check/__init__.py says what each
proves), the warm part and its worker (`python -m benchmarks.gpu_check.parts warm ...`), and the shared helpers.
The training runs (train, memory, resume) are in runs.py, the benchmarks in bench.py.

Each part is `part_NAME(args, budget, figures) -> (status, summary)`: it fills `figures` (the JSON summary's
numbers) and raises BudgetSpent when its budget runs out. On --dry-run every part runs on the CPU at a tiny size
with the PyTorch paths standing in for the kernels, so that its plumbing and comparisons are exercised without a
GPU; what only a GPU can measure is then left out of the figures.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from benchmarks.gpu_check.budget import REPO, Budget, BudgetSpent, finish, start, tail

FLA_SITE = REPO / ".fla"  # as tests/support.py: fla-core installed apart from the environment

DEBUG = "configs/debug.json"
MIXTRAL = "configs/mixtral_8x7b.json"
QUIET = ["train.eval_every=0", "train.image_every=0", "train.save_every=0"]
# debug.json widened so that the kernels have work to do (head_dim 64, 256 positions)
WIDE = ["model.d_model=256", "model.d_ff=512", "train.seq_len=256", *QUIET]
TINY = ["train.seq_len=32", *QUIET]  # --dry-run
KERNEL_KEYS = ("model.attention.impl", "model.mamba.impl", "model.moe.impl")
# what training runs: bf16 (ZeRO 2: bf16 accumulates gradients in fp32), full recompute, packed documents kept apart
TRAINING = ["train.dtype=bf16", "deepspeed.zero_stage=2", "train.activation_checkpointing=full"]
TRAINING.append("data.document_masking=true")
# Mixtral width on one GPU: two layers, every expert local, one sequence of 4096 per micro-batch, 4 micro-batches
MIXTRAL_PROBE = ["model.n_layers=2", "parallel.ep=1", "train.global_batch_size=4", "train.steps=4", *QUIET]
MIXTRAL_PROBE.append("train.eval_batches=1")
MIXTRAL_TINY = [*MIXTRAL_PROBE, "model.d_model=64", "model.d_ff=96", "model.vocab_size=256", "train.seq_len=64"]
MIXTRAL_TINY += ["train.global_batch_size=2", "train.steps=2"]
MIXTRAL_TINY += ["model.attention.n_heads=4", "model.attention.n_kv_heads=2"]


def device_of(args) -> torch.device:
    return torch.device("cpu" if args.dry_run else "cuda")


def kernels(args) -> list[str]:
    """Our Triton kernels on the GPU; the PyTorch paths stand in for them on --dry-run."""
    return [f"{k}={'torch' if args.dry_run else 'triton'}" for k in KERNEL_KEYS]


def load_sibling(name: str, path: Path):
    """A module from a file outside the import path (the CPU sync counter lives with its tests)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(args, budget: Budget, name: str, cmd: list[str]) -> Path:
    """One subprocess under the budget; its log path. A nonzero exit is a failure, with the log's tail."""
    log = args.out / "logs" / f"{name}.log"
    env = {"CUDA_VISIBLE_DEVICES": ""} if args.dry_run else {}
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    code = finish({name: start(cmd, log, env)}, budget)[name]
    if code != 0:
        raise RuntimeError(f"{name} exited {code}:\n{tail(log)}")
    return log


# ----------------------------------------------------------------------------------------------- warm


def part_warm(args, budget, figures):
    """One forward + backward of each model the later parts run, in parallel processes: Triton compiles each
    kernel variant once into its on-disk cache, which the later parts then read."""
    models = {"train": [DEBUG, *(TINY if args.dry_run else WIDE), *TRAINING, *kernels(args)]}
    models["mixtral"] = [MIXTRAL, *(MIXTRAL_TINY if args.dry_run else MIXTRAL_PROBE), "model.n_layers=1"]
    models["fp32"] = [DEBUG, *QUIET, *kernels(args)]  # the fp32 variants hf and syncs run (head_dim 16)
    env = {"CUDA_VISIBLE_DEVICES": ""} if args.dry_run else {}
    logs = {name: args.out / "logs" / f"warm_{name}.log" for name in models}
    procs = {
        name: start([sys.executable, "-m", __name__, "warm", "--config", cfg, "--set", *sets], logs[name], env)
        for name, (cfg, *sets) in models.items()
    }
    codes = finish(procs, budget)
    if failed := [n for n, c in codes.items() if c]:
        return "FAILED", "; ".join(f"{n} exited {codes[n]}:\n{tail(logs[n])}" for n in failed)
    done = {n: json.loads(tail(logs[n], 1)) for n in models}
    figures.update(done)
    return "ok", "; ".join(f"{n}: {d['implementations']} in {d['seconds']:.0f} s" for n, d in done.items())


def warm_worker(argv: list[str]) -> None:
    """One forward + backward of the config's model as training runs it (its dtype, activation checkpointing,
    document masks when the config packs documents); prints what ran and the seconds it took as JSON."""
    import argparse
    import time

    from moe_dist.config import load_config
    from moe_dist.models.activation_checkpointing import apply_activation_checkpointing
    from moe_dist.models.decoder import build_model, lm_loss, materialize_whole

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--set", nargs="*", default=[])
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.set)
    t = cfg.train
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tic = time.monotonic()
    model = materialize_whole(build_model(cfg.model, device), device, t.seed)
    model = apply_activation_checkpointing(model.to(torch.bfloat16 if t.dtype == "bf16" else torch.float32), t)
    batch = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), device=device)
    docs = {}
    if cfg.data.document_masking:  # three documents per row, cut at different places
        pos = torch.arange(t.seq_len, device=device)
        docs["document_ids"] = (pos >= t.seq_len // 3).int() + (pos >= t.seq_len // 2 + 1).int()
        docs["document_ids"] = docs["document_ids"].expand(t.micro_batch_size, -1).contiguous()
    out = model(batch[:, :-1], **docs)
    (lm_loss(out.logits.float(), batch[:, 1:]) + out.aux_loss).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"implementations": model.implementations(), "seconds": time.monotonic() - tic}))


# ----------------------------------------------------------------------------------------------- hf


def _ours(raw: dict, device: torch.device):
    from moe_dist.config import load_config
    from moe_dist.models.decoder import build_model, materialize_whole

    cfg = load_config(None, [f"model={json.dumps(raw)}"]).model
    model = materialize_whole(build_model(cfg, device), device, seed=0).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norms and D off their init values (ones), so that a mix-up cannot hide
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name or name.endswith(".D")):
                p.add_(0.2 * torch.randn(p.shape, generator=gen).to(device))
    return model


def part_hf(args, budget, figures):
    """Our model exported (save_hf_model) and run by transformers itself, both in fp32 on the device (TF32 off;
    our fp32 kernels compute in IEEE fp32): logits agree to 1e-4 (CPU, --dry-run: 2e-5, tests/hf/test_hf.py's
    bound). A mapping or kernel error shows at 1e-2 and above."""
    import transformers

    from moe_dist.hf import save_hf_model

    device = device_of(args)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    impl = "torch" if args.dry_run else "triton"
    common = {"vocab_size": 256, "d_model": 64, "n_layers": 4, "d_ff": 96}
    moe = {"num_experts": 4, "top_k": 2, "capacity_factor": None, "impl": impl}
    models = {
        "mixtral": {
            **common,
            "mixer_pattern": "A",
            "ffn_pattern": "E",
            "attention": {"n_heads": 4, "n_kv_heads": 2, "impl": impl},
            "moe": {**moe, "renormalize": True},
        },
        "jamba": {
            **common,
            "mixer_pattern": "MA",
            "ffn_pattern": "ED",
            "attention": {"n_heads": 4, "n_kv_heads": 2, "rope": False, "impl": impl},
            "mamba": {"d_state": 8, "inner_norms": True, "impl": impl},
            "moe": {**moe, "renormalize": False},
        },
    }
    atol = 2e-5 if args.dry_run else 1e-4
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0)).to(device)
    lines, worst = [], 0.0
    for name, raw in models.items():
        budget.check(name)
        ours = _ours(raw, device)
        path = args.out / "hf" / name
        shutil.rmtree(path, ignore_errors=True)
        save_hf_model(ours, path)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        with torch.no_grad():
            diff = (theirs(tokens).logits - ours(tokens).logits).abs().max().item()
        figures[f"{name}_max_abs_logit_diff"] = diff
        worst = max(worst, diff)
        lines.append(f"{name} ({type(theirs).__name__}, ours {ours.implementations()}): max |Δlogit| {diff:.1e}")
    status = "ok" if worst <= atol else "FAILED"
    return status, f"{'; '.join(lines)} (tolerance {atol:g})"


# ----------------------------------------------------------------------------------------------- syncs


def count_syncs(fn, device: torch.device, host_syncs) -> list[str]:
    """Where fn makes the host wait for the GPU: on CUDA every synchronizing operation torch reports under
    set_sync_debug_mode (each as the warning's file:line, the Python line that called it; a backward's syncs
    are replayed at the `.backward()` call); on the CPU (--dry-run) the test suite's counter, which models the
    same on host tensors."""
    import warnings

    if device.type != "cuda":
        with host_syncs() as s:
            fn()
        return [f"{what} {where}" for what, where in s.events]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    return [f"{Path(w.filename).name}:{w.lineno}" for w in syncs]


def _host_syncs():
    return load_sibling("gpu_check_host_syncs", REPO / "tests" / "train" / "test_host_syncs.py").HostSyncs


def part_syncs(args, budget, figures):
    """configs/debug.json, one micro-batch forward + backward, fp32, the kernels `auto` picks: as many syncs on
    the GPU as tests/train/test_host_syncs.py counts on the CPU for the same step (one per MoE layer with
    capacity). More on the GPU is a sync the CPU test cannot see."""
    from moe_dist.config import load_config
    from moe_dist.models.decoder import build_model, lm_loss, materialize_whole

    HostSyncs = _host_syncs()
    cfg = load_config(DEBUG)
    batch = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    counts = {}
    sides = (("cpu", torch.device("cpu")), ("device", device_of(args)))
    for name, device in sides[: 1 if args.dry_run else 2]:  # --dry-run: the device is the CPU
        model = materialize_whole(build_model(cfg.model, device), device, seed=0)
        b = batch.to(device)

        def step(model=model, b=b):
            out = model(b[:, :-1])
            (lm_loss(out.logits, b[:, 1:]) + out.aux_loss + out.z_loss).backward()

        step()  # once outside the count: first-call work (kernel compiles, allocator growth) is not the step's
        counts[name] = count_syncs(step, device, HostSyncs)
    counts.setdefault("device", counts["cpu"])
    figures.update({"cpu_syncs_per_microbatch": len(counts["cpu"]), "gpu_syncs_per_microbatch": len(counts["device"])})
    where = f"; device syncs at {', '.join(counts['device'])}" if counts["device"] else ""
    summary = f"{len(counts['device'])} syncs per micro-batch on the {'CPU stand-in' if args.dry_run else 'GPU'}, "
    summary += f"{len(counts['cpu'])} counted on the CPU{where}"
    return ("ok" if len(counts["device"]) <= len(counts["cpu"]) else "FAILED"), summary


# ----------------------------------------------------------------------------------------------- dispatch

DISPATCHERS = ("local", "all-to-all", "all-to-all chunks=3", "dedup")


def _moe_layer(kind: str, group, cf, device: torch.device):
    """A small MoE layer (the same weights for every call) whose dispatcher is `kind` over `group`."""
    from moe_dist.config import MoEConfig
    from moe_dist.layers.moe import LocalDispatcher, MoE
    from moe_dist.parallel.dedup import DedupAllToAllDispatcher
    from moe_dist.parallel.dispatch import AllToAllDispatcher
    from moe_dist.parallel.mesh import DedupGroups

    E, d = 8, 64
    torch.manual_seed(0)
    moe = MoE(d, 2 * d, MoEConfig(num_experts=E, top_k=2, capacity_factor=cf), 0.5, 2, device)
    moe.init_weights()
    moe = moe.to(device)
    perm = moe.dispatcher.permutation
    if kind.startswith("all-to-all"):
        moe.dispatcher = AllToAllDispatcher(group, 1, 0, E, perm, chunks=3 if "chunks" in kind else 1)
    elif kind == "dedup":
        moe.dispatcher = DedupAllToAllDispatcher(E, perm, DedupGroups(group, 1, 0, None, 1, 0), LocalDispatcher(perm))
    return moe


def _dispatch_once(moe, x: torch.Tensor, device: torch.device, HostSyncs):
    """(output, input gradient) of one forward + backward, and the syncs it made."""
    xi = x.to(device).requires_grad_(True)

    def step():
        y, stats = moe(xi)
        (y.square().sum() + stats.aux_loss).backward()

    syncs = count_syncs(step, device, HostSyncs)
    with torch.no_grad():
        return (moe(xi.detach())[0].cpu(), xi.grad.cpu()), syncs


def part_dispatch(args, budget, figures):
    """The three dispatchers (all-to-all also chunked) on a one-rank NCCL world (gloo on --dry-run), dropless and
    with capacity: each one's output and input gradient equal the local dispatcher's (to fp32 reordering), and it
    syncs no more on the device than the CPU counter counts for it on a gloo group."""
    from datetime import timedelta

    import torch.distributed as dist

    HostSyncs = _host_syncs()
    device = device_of(args)
    made = not dist.is_initialized()
    if made:
        backend = "gloo" if device.type == "cpu" else "nccl"
        kw = {} if device.type == "cpu" else {"device_id": torch.device("cuda", torch.cuda.current_device())}
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60), **kw
        )
    try:
        group, cpu_group = dist.new_group([0]), dist.new_group([0], backend="gloo")
        x = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(2))
        lines, bad, local = [], [], {}
        for cf in (None, 1.0):
            for kind in DISPATCHERS:
                budget.check(f"{kind} cf={cf}")
                out, syncs = _dispatch_once(_moe_layer(kind, group, cf, device), x, device, HostSyncs)
                cpu_syncs = syncs
                if device.type != "cpu":  # the CPU counter's figure for the same layer
                    _, cpu_syncs = _dispatch_once(
                        _moe_layer(kind, cpu_group, cf, torch.device("cpu")), x, torch.device("cpu"), HostSyncs
                    )
                ref = local.setdefault(cf, out)  # "local" comes first
                err = max((a - b).abs().max().item() for a, b in zip(out, ref))
                figures[f"{kind} cf={cf}"] = {"max_abs_diff": err, "syncs": len(syncs), "cpu_syncs": len(cpu_syncs)}
                line = f"{kind} cf={cf}: Δ {err:.1e}, syncs {len(syncs)} (CPU {len(cpu_syncs)})"
                if err > 1e-4 or len(syncs) > len(cpu_syncs):
                    bad.append(f"{line} at {', '.join(syncs)}")
                lines.append(line)
    finally:
        if made:
            dist.destroy_process_group()
    return ("FAILED", "\n".join(bad)) if bad else ("ok", "; ".join(lines))


# ----------------------------------------------------------------------------------------------- kernels


KERNEL_TESTS = (
    "tests/kernels/test_flash_attention.py",
    "tests/kernels/test_fla_ops.py",
    "tests/kernels/test_permute.py",
    "tests/kernels/test_selective_scan.py",
)


def _fla_path() -> str | None:
    """Where the fla kernels' test process finds fla-core: "" where this Python imports it (the device's carried
    wheels), the repository's .fla/ (the README's test command installs it there), else None (not installed)."""
    import importlib.util

    if importlib.util.find_spec("fla") is not None:
        return ""
    return str(FLA_SITE) if (FLA_SITE / "fla").is_dir() else None


def part_kernels(args, budget, figures):
    """The kernel suites on the GPU (MOE_DIST_KERNEL_DEVICE=cuda), one process per file in parallel. --dry-run
    only collects them under the Triton interpreter (running them there takes minutes). Without fla-core its
    kernels' file is not run, and the summary says so."""
    env = {"TRITON_INTERPRET": "1"} if args.dry_run else {"MOE_DIST_KERNEL_DEVICE": "cuda"}
    extra = ["--collect-only"] if args.dry_run else []
    fla = _fla_path()
    files = [f for f in KERNEL_TESTS if fla is not None or "test_fla_ops" not in f]
    logs = {f: args.out / "logs" / f"{Path(f).stem}.log" for f in files}
    print(f"$ {' '.join(f'{k}={v}' for k, v in env.items())} python -m pytest -q {' '.join(extra)} FILE, in parallel")

    def env_of(f: str) -> dict:
        if "test_fla_ops" in f and fla:
            return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [fla, os.environ.get("PYTHONPATH")]))}
        return env

    procs = {
        f: start([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, f], logs[f], env_of(f))
        for f in files
    }
    try:
        codes = finish(procs, budget)
    except BudgetSpent as stop:
        done = {f: tail(logs[f], 1) for f, p in procs.items() if p.returncode == 0}
        raise BudgetSpent(f"{stop}; passed: {', '.join(f'{Path(f).stem}: {s}' for f, s in done.items())}") from None
    lines = []
    for f, code in codes.items():
        last = tail(logs[f], 1)
        figures[Path(f).stem] = {"exit": code, "last_line": last}
        lines.append(f"{Path(f).stem.removeprefix('test_')}: {'' if code == 0 else f'FAILED (exit {code}) '}{last}")
        if code:
            print(tail(logs[f]))
    if fla is None:
        lines.append("fla_ops: not run (fla-core not installed: benchmarks/device/prepare_wheels.sh carries it)")
    return ("ok" if not any(codes.values()) else "FAILED"), "; ".join(lines)


if __name__ == "__main__":
    {"warm": warm_worker}[sys.argv[1]](sys.argv[2:])
