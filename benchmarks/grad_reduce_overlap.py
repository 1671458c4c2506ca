"""Exposed gradient-reduction time per optimizer step, with and without train.grad_reduce_overlap, in one run.

    torchrun --nproc_per_node 4 benchmarks/grad_reduce_overlap.py --config configs/debug.json \
        --set train.dtype=bf16 parallel.ep=2 train.global_batch_size=32 train.eval_batches=4 --steps 6

Builds two engines exactly as training does (`initialize_engine`, ZeRO 1: one reduction per step), identical but
for the overlap option, and alternates their optimizer steps (same micro-batches, so both see the same load). Per
step it times the gradient-reduction collectives of the backward calls (DeepSpeed's reduce of each bucket slice
onto its owner, over the data-parallel and expert-data-parallel groups): how long the training thread was
blocked in them (exposed), and the wall clock of the last micro-batch's backward call including its reduction.
Rank 0 prints medians (means over ranks) and the ratio exposed(overlap) / exposed(no overlap).

What the ratio shows depends on the device. On GPUs DeepSpeed issues the buckets on a side stream, so the
training thread only enqueues them; on CPU the "stream" is the calling thread and every bucket blocks backward
where it is issued: the ratio is then about 1, and what the overlap option changes is only *when* the buckets go
out (inside the last backward rather than after it), which `issued_in_backward` reports.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from common import CollectiveTracer

from moe_dist.config import load_config
from moe_dist.models.decoder import build_model, lm_loss
from moe_dist.parallel.comm import all_reduce_sum
from moe_dist.parallel.mesh import init_distributed
from moe_dist.parallel.parallelize import parallelize
from moe_dist.train.optim import build_optimizer, initialize_engine

REDUCTIONS = {"reduce", "all_reduce", "reduce_scatter", "reduce_scatter_tensor"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", nargs="+", action="extend", default=[])
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per option (after one warm-up)")
    args = p.parse_args(argv)
    state = {"blocked": 0.0, "in_bwd_calls": 0, "after_calls": 0}

    def on_call(call):
        x = call.args.get("tensor")
        if call.name not in REDUCTIONS or not isinstance(x, torch.Tensor) or x.numel() < 2:
            return  # scalars: the gradient norm and loss metrics, not gradients
        state["blocked"] += call.seconds
        # Inside the autograd pass (a gradient hook) or after it (DeepSpeed's epilogue in engine.backward). torch
        # 2.13: the graph task id is -1 outside a backward pass (private; a benchmark-only use).
        inside = torch._C._current_graph_task_id() != -1
        state["in_bwd_calls" if inside else "after_calls"] += 1

    tracer = CollectiveTracer(on_call).install()  # before DeepSpeed binds torch.distributed's functions
    base = load_config(args.config, [*args.set, "deepspeed.zero_stage=1"])
    mesh = init_distributed(base)
    torch.set_num_threads(base.train.threads or 1)
    engines = {}
    for overlap in (True, False):
        option = f"train.grad_reduce_overlap={'true' if overlap else 'false'}"
        cfg = load_config(args.config, [*args.set, "deepspeed.zero_stage=1", option])
        torch.manual_seed(0)
        model = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)
        opt, sched = build_optimizer(model, cfg)
        engines[overlap] = (cfg, initialize_engine(model, opt, sched, cfg, mesh.dp, mesh.mpu))
    t = base.train
    micro = t.grad_accum_steps(mesh.dp)
    samples = {True: [], False: []}
    issued = {True: [0, 0], False: [0, 0]}
    for step in range(args.steps + 1):
        gen = torch.Generator().manual_seed(1000 * step + mesh.dp_rank)
        batches = [torch.randint(0, base.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=gen)]
        batches += [torch.randint(0, base.model.vocab_size, batches[0].shape, generator=gen) for _ in range(micro - 1)]
        for overlap, (cfg, engine) in engines.items():
            state.update(blocked=0.0, in_bwd_calls=0, after_calls=0)
            last_backward = 0.0
            for i, tokens in enumerate(batches):
                out = engine(tokens[:, :-1])
                loss = lm_loss(out.logits, tokens[:, 1:]) + cfg.model.moe.aux_loss_coef * out.aux_loss
                dist.barrier()  # the ranks start each backward together: waits for stragglers are not reduction
                tic = time.perf_counter()
                engine.backward(loss)
                last_backward = time.perf_counter() - tic
                if i < micro - 1:
                    engine.step()
            engine.step()
            if step > 0:  # the first step is warm-up
                samples[overlap].append((state["blocked"], last_backward))
                issued[overlap][0] += state["in_bwd_calls"]
                issued[overlap][1] += state["after_calls"]
    tracer.uninstall()
    med = torch.tensor(
        [[statistics.median(s[k] for s in samples[o]) for k in (0, 1)] for o in (True, False)], dtype=torch.float64
    )
    all_reduce_sum(med)
    if mesh.rank == 0:
        med /= mesh.world_size
        (on_exposed, on_bwd), (off_exposed, off_bwd) = med.tolist()
        print(
            f"layout dp={mesh.dp} ep={mesh.ep} tp={mesh.tp}; {micro} micro-batches of {t.micro_batch_size}x{t.seq_len} "
            f"per rank; {t.dtype}, accumulation {t.grad_accum_dtype}; medians of {args.steps} steps, means over ranks"
        )
        print(
            "| grad_reduce_overlap | exposed reduction ms per step | last backward call ms | "
            "reduce calls per step issued in backward / after it |"
        )
        print("|---|---|---|---|")
        for name, exposed, bwd, (inside, after) in (
            ("true", on_exposed, on_bwd, issued[True]),
            ("false", off_exposed, off_bwd, issued[False]),
        ):
            print(
                f"| {name} | {1e3 * exposed:.2f} | {1e3 * bwd:.1f} | "
                f"{inside / args.steps:.0f} / {after / args.steps:.0f} |"
            )
        print(f"exposed ratio (overlap / no overlap): {on_exposed / off_exposed:.2f}")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
