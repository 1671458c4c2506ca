"""`bench.py step`: training steps of a config in one process, and where their time goes.

The step is launch/train.py's without DeepSpeed: micro-batches with gradient accumulation, clipping, the
optimizer (fp32 master weights for bf16, as the engine keeps them). tokens/s and MFU (the training log's model
FLOPs, moe_dist.train.throughput, against this machine's torch.mm rate) are medians over steps; `time_share` comes
from one more step under torch.profiler, with a range around every mixer and the four parts of every MoE layer.
"""

from __future__ import annotations

import copy
import time

import torch

from benchmarks.common import DTYPES, interleaved_ms, matmul_fns, matmul_gflops, resolve_device, sig, sync
from moe_dist.config import ConfigError, load_config
from moe_dist.layers.moe import Dispatcher

SECTIONS = ("attention", "mamba", "moe.router", "moe.dispatch", "moe.experts", "moe.combine", "optimizer")


def _ranged(fn, name: str):
    """`fn` inside a profiler range named bench::<name>; the layer's own code is untouched."""
    from torch.profiler import record_function

    def wrapped(*args, **kwargs):
        with record_function(f"bench::{name}"):
            return fn(*args, **kwargs)

    return wrapped


class _RangedDispatcher(Dispatcher):
    """Wraps an MoE dispatcher so that dispatch and combine each run inside their own profiler range (`run` is
    the unchunked dispatch → experts → combine: one process has no all-to-all to overlap)."""

    def __init__(self, inner):
        self.inner = inner
        self.dispatch = _ranged(inner.dispatch, "moe.dispatch")
        self.combine = _ranged(inner.combine, "moe.combine")


def instrument(model) -> None:
    """Profiler ranges around every mixer and the four parts of every MoE layer (instance attributes only)."""
    from moe_dist.layers.attention import Attention
    from moe_dist.layers.moe import MoE

    for block in model.blocks:
        block.mixer.forward = _ranged(
            block.mixer.forward, "attention" if isinstance(block.mixer, Attention) else "mamba"
        )
        if isinstance(block.ffn, MoE) and hasattr(block.ffn, "dispatcher"):
            block.ffn.router.forward = _ranged(block.ffn.router.forward, "moe.router")
            block.ffn.experts.forward = _ranged(block.ffn.experts.forward, "moe.experts")
            block.ffn.dispatcher = _RangedDispatcher(block.ffn.dispatcher)


def section_times(events, cuda: bool) -> dict:
    """Seconds per bench:: section, forward and backward: a backward node counts for the section whose forward
    op created it (same autograd sequence number), found through its forward op's enclosing range."""

    def elapsed(e) -> float:
        return (e.device_time_total if cuda else e.time_range.elapsed_us()) / 1e6

    def section_of(e):
        while e is not None:
            if e.name.startswith("bench::"):
                return e.name[len("bench::") :]
            e = e.cpu_parent
        return None

    out = {name: 0.0 for name in SECTIONS}
    seq_section = {}
    for e in events:
        if e.name.startswith("bench::") and e.name[7:] in out:
            out[e.name[7:]] += elapsed(e)
        elif e.sequence_nr >= 0 and not e.name.startswith("autograd::engine"):
            sec = section_of(e)
            if sec is not None:
                seq_section.setdefault(e.sequence_nr, sec)
    for e in events:
        if e.name.startswith("autograd::engine::evaluate_function") and e.sequence_nr in seq_section:
            out[seq_section[e.sequence_nr]] += elapsed(e)
    return out


def bench_step(args) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    from moe_dist.data.batches import TokenDataset, micro_batches
    from moe_dist.data.sources import load_tokens
    from moe_dist.models.compile import maybe_compile
    from moe_dist.models.decoder import build_model, lm_loss, materialize_whole
    from moe_dist.train.optim import build_optimizer
    from moe_dist.train.throughput import model_flops_per_token

    cfg = load_config(args.config, args.set)
    t, moe_cfg = cfg.train, cfg.model.moe
    device = resolve_device(args.device)
    torch.set_num_threads(args.threads or t.threads or torch.get_num_threads())
    dtype = DTYPES[t.dtype]
    try:
        train_tokens, _, _ = load_tokens(cfg.data, t.seq_len, cfg.model.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    data = TokenDataset(train_tokens, t.seq_len, t.seed)
    model = materialize_whole(build_model(cfg.model, device), device, t.seed)
    fpt = model_flops_per_token(cfg)  # what the training log's mfu counts
    # bf16 as the DeepSpeed engine runs it: bf16 weights and gradients, fp32 master weights in the optimizer.
    master = copy.deepcopy(model).float() if dtype != torch.float32 else model
    model = model.to(dtype)
    optimizer, scheduler = build_optimizer(master, cfg)
    params, master_params = list(model.parameters()), list(master.parameters())
    compiled = maybe_compile(model, cfg)
    implementations = model.implementations()  # before `instrument` wraps the dispatchers
    if not t.compile:
        instrument(model)  # profiler ranges would only break a compiled graph

    def step(s: int) -> None:
        for batch in micro_batches(data.global_batch(s, t.global_batch_size), t.micro_batch_size, 0, 1):
            batch = batch.to(device)
            out = compiled(batch[:, :-1])
            loss = (
                lm_loss(out.logits, batch[:, 1:])
                + moe_cfg.aux_loss_coef * out.aux_loss
                + moe_cfg.z_loss_coef * out.z_loss
            )
            loss.backward()
        with record_function("bench::optimizer"):
            if master is not model:
                for mp, p in zip(master_params, params, strict=True):
                    mp.grad = p.grad.float()
            if t.grad_clip:
                torch.nn.utils.clip_grad_norm_(master_params, t.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if master is not model:
                with torch.no_grad():
                    torch._foreach_copy_(params, master_params)
                model.zero_grad(set_to_none=True)

    step(0)  # compilation, when train.compile is on
    steps = iter(range(1, 1 << 30))
    fns = {
        "step": lambda: step(next(steps)),
        **matmul_fns([(4096, 1024, 1024), (1024, 4096, 1024), (2048, 2048, 2048)], dtype, device),
    }
    ms = interleaved_ms(fns, device, args.steps, warmup=1)
    step_s, peak = ms["step"] / 1e3, matmul_gflops(ms)
    tokens = t.global_batch_size * t.seq_len
    tokens_per_s = tokens / step_s
    result = {
        "bench": "step",
        "device": str(device),
        "config": args.config,
        "dtype": t.dtype,
        "compile": t.compile,
        "tokens_per_step": tokens,
        "step_ms": sig(step_s * 1e3),
        "tokens_per_s": sig(tokens_per_s),
        "flops_per_token": round(fpt),
        "gemm_peak_gflops": sig(peak),
        "implementations": implementations,
        "mfu": sig(fpt * tokens_per_s / (peak * 1e9)),
    }
    if not t.compile:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            sync(device)
            tic = time.perf_counter()
            step(next(steps))
            sync(device)
            total = time.perf_counter() - tic
        secs = section_times(prof.events(), device.type == "cuda")
        shares = {k: round(v / total, 4) for k, v in secs.items()}
        shares["other"] = round(max(0.0, 1 - sum(secs.values()) / total), 4)
        result["time_share"] = shares
        result["profiled_step_ms"] = sig(total * 1e3)
    print(
        f"step {args.config} {t.dtype} on {device}: {t.global_batch_size}×{t.seq_len} tokens per step, median of "
        f"{args.steps} steps after one warm-up; one process, no DeepSpeed (fp32 master weights for bf16); "
        f"time_share from one more step under torch.profiler (forward + backward per section)"
    )
    return result
