"""Communication per layer of one micro-batch's forward and backward, measured, under a parallel layout.

    torchrun --nproc_per_node 2 -m benchmarks.comm_report --config configs/mixtral_small.json --set parallel.tp=2
    torchrun --nproc_per_node 4 -m benchmarks.comm_report --config ... --set parallel.tp=2 parallel.ep=2
    torchrun --nproc_per_node 4 -m benchmarks.comm_report --config ... --set parallel.tp=2 parallel.ep=4 parallel.etp=1

Builds this rank's shard exactly as training does (`parallelize`), runs one micro-batch forward, the loss and
backward (no optimizer: DeepSpeed's gradient reduction over the data-parallel group comes on top, once per step),
and traces the torch.distributed collectives that our layers issue (common.CollectiveTracer) to count, per layer,
each collective's kind, group size, calls and payload bytes (the tensor each rank contributes). Backward
collectives are attributed to the layer whose backward was running (module backward pre-hooks). Rank 0 prints a
markdown table.

    torchrun --nproc_per_node 2 -m benchmarks.comm_report --config configs/mixtral_small.json --set parallel.ep=2 \
        --overlap 1 2 4

    torchrun --nproc_per_node 4 -m benchmarks.comm_report --config configs/debug.json --set train.dtype=bf16 \
        parallel.ep=2 train.global_batch_size=32 train.eval_batches=4 --step deepspeed.zero_stage=1 \
        deepspeed.zero_stage=2

`--step [VARIANT ...]` counts instead the gradient reduction of one optimizer step through the DeepSpeed engine
(docs/parallelism.md, "Gradient reduction once per step"): bytes per group against one step's gradients.

`--overlap C [C ...]` times instead the expert-parallel row all-to-alls of forward+backward for each
`parallel.a2a_chunks` value C (one model per value, same weights and tokens, calls interleaved round by round by
common.interleaved_ms so all see the same load): per MoE layer, the all-to-alls' time (while at least one is in
flight: a blocking call's duration, an asynchronous one's from issue until its future completes) and the exposed
time (what the calling thread spent blocked: a blocking call whole, an asynchronous one's issue and its wait).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

from benchmarks.common import CollectiveTracer, interleaved_ms
from moe_dist.config import load_config
from moe_dist.layers.moe import MoE
from moe_dist.models.decoder import build_model, lm_loss
from moe_dist.parallel import comm
from moe_dist.parallel.comm import all_reduce_sum
from moe_dist.parallel.mesh import init_distributed
from moe_dist.parallel.parallelize import parallelize
from moe_dist.parallel.tensor_parallel import vocab_parallel_lm_loss


class RowAllToAllClock:
    """The MoE row all-to-alls since `reset`: `reset()` returns (seconds during which at least one was in flight,
    seconds the caller was blocked in them). Blocking calls come from the tracer; asynchronous ones
    (comm._InFlight, the chunked dispatch) are in flight from their issue until their future completes, and block
    the caller during the issue and the wait."""

    def __init__(self):
        self.lock = threading.Lock()
        self.spans: list[tuple[float, float]] = []
        self.exposed = 0.0
        self._originals = (comm._InFlight.start, comm._InFlight.wait)

    def reset(self) -> tuple[float, float]:
        with self.lock:
            spans, exposed, self.spans, self.exposed = sorted(self.spans), self.exposed, [], 0.0
        busy, end = 0.0, -math.inf
        for lo, hi in spans:  # length of the union of the in-flight intervals
            busy += max(hi - max(lo, end), 0.0)
            end = max(end, hi)
        return busy, exposed

    def _add(self, span: tuple[float, float] | None, exposed: float) -> None:
        with self.lock:
            if span is not None:
                self.spans.append(span)
            self.exposed += exposed

    def on_call(self, call) -> None:
        x = call.args.get("input")
        if call.kind == "all_to_all" and not call.args.get("async_op") and x is not None and x.is_floating_point():
            now = time.perf_counter()  # the count exchange (int64) is not a row all-to-all
            self._add((now - call.seconds, now), call.seconds)

    def install(self) -> "RowAllToAllClock":
        start, wait = self._originals
        clock = self

        def timed_start(flight, *args):
            tic = time.perf_counter()
            out = start(flight, *args)
            clock._add(None, time.perf_counter() - tic)
            flight.work.get_future().then(lambda _: clock._add((tic, time.perf_counter()), 0.0))
            return out

        def timed_wait(flight):
            tic = time.perf_counter()
            out = wait(flight)
            clock._add(None, time.perf_counter() - tic)
            return out

        comm._InFlight.start, comm._InFlight.wait = timed_start, timed_wait
        return self


def overlap_report(args, mesh) -> None:
    """Forward+backward of one micro-batch per `parallel.a2a_chunks` value; rank 0 prints the table."""
    base_cfg = load_config(args.config, args.set)
    t = base_cfg.train
    tokens = torch.randint(
        0,
        base_cfg.model.vocab_size,
        (t.micro_batch_size, t.seq_len + 1),
        generator=torch.Generator().manual_seed(0),
    ).to(mesh.device)
    clock = RowAllToAllClock().install()
    tracer = CollectiveTracer(clock.on_call).install()
    fns, samples = {}, {}
    for chunks in args.overlap:
        cfg = load_config(args.config, [*args.set, f"parallel.a2a_chunks={chunks}"])
        model = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)
        n_moe = sum(isinstance(m, MoE) for m in model.modules())
        samples[chunks] = []

        def step(model=model, chunks=chunks, n_moe=n_moe, cfg=cfg):
            clock.reset()
            out = model(tokens[:, :-1])
            if mesh.tp == 1:
                lm = lm_loss(out.logits, tokens[:, 1:])
            else:
                lm = vocab_parallel_lm_loss(out.logits, tokens[:, 1:], mesh)
            (lm + cfg.model.moe.aux_loss_coef * out.aux_loss).backward()
            dist.barrier()  # every rank's asynchronous calls have completed, their futures reported
            total, exposed = clock.reset()
            samples[chunks].append((total / n_moe, exposed / n_moe))

        fns[chunks] = step
    ms = interleaved_ms(fns, mesh.device, args.repeats, warmup=1)
    tracer.uninstall()
    per_rank = torch.tensor(
        [[statistics.median(x[i] for x in samples[c][-args.repeats :]) for i in (0, 1)] for c in args.overlap]
    )
    all_reduce_sum(per_rank)  # mean over ranks below
    if mesh.rank == 0:
        per_rank /= mesh.world_size
        load = os.getloadavg()[0]
        print(
            f"layout dp={mesh.dp} ep={mesh.ep} tp={mesh.tp}; micro-batch {t.micro_batch_size}x{t.seq_len} tokens; "
            f"medians of {args.repeats} forward+backward, means over {mesh.world_size} ranks; load {load:.1f}"
        )
        first = args.overlap[0]
        print(
            "| a2a_chunks | fwd+bwd ms | row all-to-all ms per MoE layer | exposed ms per MoE layer | "
            f"exposed / all-to-all | exposed / a2a_chunks={first}'s all-to-all |"
        )
        print("|---|---|---|---|---|---|")
        base = per_rank[0, 0].item()
        for c, (total, exposed) in zip(args.overlap, per_rank.tolist()):
            print(
                f"| {c} | {ms[c]:.1f} | {1e3 * total:.2f} | {1e3 * exposed:.2f} | {exposed / total:.2f} | "
                f"{exposed / base:.2f} |"
            )


def step_report(args, mesh) -> list[dict]:
    """One optimizer step of the configured micro-batches through the DeepSpeed engine training builds
    (`initialize_engine`), after one warm-up step, for each `--step` variant (comma-separated overrides on top of
    `--set`; one world serves them all): the collectives in the data-parallel group (dense gradients) and in the
    expert-data-parallel groups (expert gradients), by phase (the micro-batches' backward calls, or the boundary's
    `engine.step`: gradient norm, updated weights' all-gather), against the bytes of one step's gradients in the
    dtype that travels. Rank 0 prints the tables; every rank returns its counts."""
    tracer_rows: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    where = ["backward"]
    labels: dict = {}  # the ranks of a process group → label (DeepSpeed makes its own groups of the same ranks)

    def count(call):
        group = call.args.get("group")
        ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        label = labels.get(ranks, "other")
        row = tracer_rows[(where[0], label, call.name)]
        row[0] += 1
        row[1] += call.contributed_bytes

    tracer = CollectiveTracer(count).install()  # once, before DeepSpeed binds torch.distributed's functions
    results = []
    for variant in args.step or [""]:
        cfg = load_config(args.config, [*args.set, *(v for v in variant.split(",") if v)])
        tracer_rows.clear()
        results.append(_step_counts(cfg, mesh, tracer_rows, where, labels))
    tracer.uninstall()
    return results


def _step_counts(cfg, mesh, tracer_rows: dict, where: list, labels: dict) -> dict:
    from moe_dist.parallel import private_api
    from moe_dist.train.optim import build_optimizer, initialize_engine

    t = cfg.train
    model = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)
    optimizer, scheduler = build_optimizer(model, cfg)
    engine = initialize_engine(model, optimizer, scheduler, cfg, mesh.dp, mesh.mpu, mesh.cp)
    travels = 2 if t.dtype == "bf16" and t.grad_reduce_dtype == "bf16" else 4
    grad_bytes = collections.Counter()

    def ranks_of(group):
        return tuple(dist.get_process_group_ranks(group))

    if mesh.ep > 1:
        labels[ranks_of(mesh.ep_group)] = "expert-parallel"
    if mesh.tp > 1:
        labels[ranks_of(mesh.tp_group)] = "tensor-parallel"
    for p in model.parameters():
        name = private_api.expert_group_of(p)
        if name is not None:
            labels[ranks_of(private_api.expert_groups(name)[1])] = "expert data-parallel"
        grad_bytes["expert data-parallel" if name else "data-parallel"] += p.numel() * travels
    labels[ranks_of(mesh.dp_group if mesh.dp_group is not None else dist.group.WORLD)] = "data-parallel"
    micro = t.grad_accum_steps(mesh.dp)
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    for step in range(2):
        if step == 1:
            tracer_rows.clear()
        for i in range(micro):
            where[0] = "backward"
            tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=gen)
            out = engine(tokens[:, :-1].to(mesh.device))
            if mesh.tp == 1:
                lm = lm_loss(out.logits, tokens[:, 1:].to(mesh.device))
            else:
                lm = vocab_parallel_lm_loss(out.logits, tokens[:, 1:].to(mesh.device), mesh)
            engine.backward(lm + cfg.model.moe.aux_loss_coef * out.aux_loss)
            if i < micro - 1:
                engine.step()
        where[0] = "step"
        engine.step()
    groups = {"data-parallel": mesh.dp, "expert data-parallel": mesh.dp // mesh.ep}
    # Every rank's gradients travel once per step: one micro-batch's gradient bytes for each group of size > 1.
    reduced = {
        g: sum(b for (phase, label, _), (_, b) in tracer_rows.items() if phase == "backward" and label == g)
        for g in groups
    }
    result = {
        "micro_batches": micro,
        "grad_bytes": {g: grad_bytes[g] if groups[g] > 1 else 0 for g in groups},
        "reduced_bytes": reduced,
        "rows": [[*k, *v] for k, v in sorted(tracer_rows.items())],
        "grad_norm": float(engine.get_global_grad_norm()),  # the second step's, before clipping
    }
    if mesh.rank == 0:
        print(
            f"layout dp={mesh.dp} ep={mesh.ep} tp={mesh.tp}; {micro} micro-batches per step; ZeRO "
            f"{cfg.deepspeed.zero_stage}, {t.dtype} weights, accumulation {t.grad_accum_dtype}, "
            f"reduction {t.grad_reduce_dtype if t.dtype == 'bf16' else 'fp32'}"
        )
        print("| phase | group | collective | calls | bytes per rank |")
        print("|---|---|---|---|---|")
        for phase, label, name, calls, nbytes in result["rows"]:
            print(f"| {phase} | {label} | {name} | {calls} | {nbytes:,} |")
        for g, size in groups.items():
            print(
                f"{g} (size {size}): gradient bytes reduced in the step's backward {reduced[g]:,}; "
                f"one step's gradients {result['grad_bytes'][g]:,}"
            )
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", nargs="+", action="extend", default=[])
    p.add_argument("--overlap", type=int, nargs="+", help="time the row all-to-alls for these parallel.a2a_chunks")
    p.add_argument("--repeats", type=int, default=5, help="--overlap: forward+backward passes per value")
    p.add_argument(
        "--step",
        nargs="*",
        help="the gradient reduction of one optimizer step instead, for each variant given (comma-separated "
        "overrides on top of --set; none: --set alone)",
    )
    p.add_argument("--json", help="--step: write rank 0's counts to this file")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    mesh = init_distributed(cfg)
    if args.step is not None:
        result = step_report(args, mesh)
        if args.json and mesh.rank == 0:
            with open(args.json, "w") as f:
                json.dump(result, f)
        dist.barrier()
        return 0
    if args.overlap:
        overlap_report(args, mesh)
        dist.barrier()
        return 0
    model = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)

    where = ["other", "forward"]  # [layer, phase]
    table: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])  # key → [calls, bytes]

    def count(call):
        row = table[(where[0], where[1], call.name, call.group_size)]
        row[0] += 1
        row[1] += call.contributed_bytes

    def label(name):
        def fwd(module, inputs):
            where[:] = [name, "forward"]

        def bwd(module, grad_out):
            where[:] = [name, "backward"]

        return fwd, bwd

    layers = [("embed", model.embed)] + [
        (f"blocks.{i}.{part}", getattr(b, part)) for i, b in enumerate(model.blocks) for part in ("mixer", "ffn")
    ]
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # the embedding's input is token ids
    for name, module in layers:
        fwd, bwd = label(name)
        module.register_forward_pre_hook(fwd, prepend=True)  # before the TP region's own entry hook
        module.register_full_backward_pre_hook(bwd, prepend=True)
    tracer = CollectiveTracer(count).install()

    t = cfg.train
    tokens = torch.randint(
        0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(0)
    ).to(mesh.device)
    inputs, targets, extra = tokens[:, :-1], tokens[:, 1:], {}
    shard = mesh.seq_shard(t.seq_len)  # context parallelism: this rank's pieces of the sequence (None without)
    if shard is not None:
        inputs, targets, extra = shard.local(inputs), shard.local(targets), {"shard": shard}
    out = model(inputs, **extra)
    where[:] = ["loss (vocab-parallel cross-entropy)", "forward"]
    lm = lm_loss(out.logits, targets) if mesh.tp == 1 else vocab_parallel_lm_loss(out.logits, targets, mesh)
    where[:] = ["head", "backward"]
    (lm + cfg.model.moe.aux_loss_coef * out.aux_loss).backward()
    tracer.uninstall()

    if mesh.rank == 0:
        kinds = [type(b.mixer).__name__ + "/" + type(b.ffn).__name__ for b in model.blocks]
        sp = " sequence_parallel" if cfg.parallel.sequence_parallel else ""
        sp += f" etp={mesh.etp}" if mesh.tp > 1 else ""
        print(
            f"layout dp={mesh.dp} cp={mesh.cp} ep={mesh.ep} tp={mesh.tp}{sp}; "
            f"micro-batch {t.micro_batch_size}x{t.seq_len} tokens, "
            f"d_model {cfg.model.d_model}, {cfg.train.dtype}; blocks: {', '.join(kinds)}"
        )
        print("| layer | phase | collective | group size | calls | bytes per rank |")
        print("|---|---|---|---|---|---|")
        order = {name: i for i, (name, _) in enumerate(layers)}
        for (layer, phase, name, size), (calls, nbytes) in sorted(
            table.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][1] != "forward", kv[0][2])
        ):
            print(f"| {layer} | {phase} | {name} | {size} | {calls} | {nbytes:,} |")
        total = sum(v[1] for v in table.values())
        print(f"total bytes per rank for one micro-batch: {total:,}")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
