"""The training loop: checks → build → DeepSpeed engine → resume → steps of micro-batches → metrics, eval,
checkpoints.

Order matters for safety (README "Reliability"): everything that can reject the job's input (data, run
directory, the checkpoint to resume from, its fit to this model) is checked before the first byte is written,
so a bad input never overwrites or deletes anything already on disk.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from moe_dist.config import JobConfig, config_to_dict
from moe_dist.config.parallel_checks import check_layout, check_pipeline_runtime
from moe_dist.data.batches import IGNORE, Batch, TokenDataset
from moe_dist.data.shards import atomic_write
from moe_dist.data.sources import load_tokens
from moe_dist.data.tokenizer import copy_tokenizer, tokenizer_identity
from moe_dist.layers.moe import moe_routers
from moe_dist.models.activation_checkpointing import apply_activation_checkpointing
from moe_dist.models.compile import maybe_compile
from moe_dist.models.decoder import build_model, check_context_parallel, lm_loss, param_counts
from moe_dist.parallel.comm import agree_on_error, all_reduce_sum, barrier
from moe_dist.parallel.mesh import Mesh, init_distributed
from moe_dist.parallel.parallelize import parallelize
from moe_dist.parallel.pipeline import Pipeline
from moe_dist.parallel.tensor_parallel import vocab_parallel_lm_loss
from moe_dist.planning.stage_cut import stage_starts
from moe_dist.train.checkpoint import (
    Checkpointer,
    CheckpointMismatch,
    check_fits,
    complete_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    select_checkpoint,
)
from moe_dist.train.disk import NoSpaceError, check_room, quiet_full_disk_in_threads
from moe_dist.train.guard import NonFiniteGuard, operation
from moe_dist.train.metrics import DeadExperts, MetricsLogger, StepAccumulator
from moe_dist.train.optim import build_optimizer, initialize_engine
from moe_dist.train.pipeline_step import pipeline_evaluate, pipeline_micro_batches
from moe_dist.train.preempt import EXIT_STOPPED, Stopped, StopRequest, stop_signals
from moe_dist.train.router_step import end_router_step, route_step_ahead
from moe_dist.train.shared_storage import check_shared_run_dir
from moe_dist.train.startup import choose_threads, run_line, shm_op_note, startup_report, summary_line
from moe_dist.train.throughput import Utilisation, device_peak, maybe_profile, model_flops_per_token


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (it holds a run and --resume was not given, or is not writable)."""


@dataclass(frozen=True)
class StepContext:
    """What the step helpers read, built once the engine exists: the engine, the job, this rank's mesh, the
    training and validation data, the non-finite guard and the number of MoE layers."""

    engine: Any  # the DeepSpeed engine wrapping the model
    cfg: JobConfig
    mesh: Mesh
    data: TokenDataset
    val: TokenDataset
    guard: NonFiniteGuard
    n_moe: int
    utilisation: Utilisation  # tokens/s → model TFLOP/s per device and MFU
    pipeline: Optional[Pipeline] = None  # parallel.pp > 1: this rank's stages under the schedule


def _to_device(t: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    if mesh.device.type == "cuda":  # from pinned host memory, without waiting for the copy
        return t.pin_memory().to(mesh.device, non_blocking=True)
    return t


def _forward(ctx: StepContext, batch: Batch):
    """The model's forward of one micro-batch (DecoderOutput). Under context parallelism every CP rank of a dp
    rank has the same micro-batch and gives the model its pieces of the tokens (`shard.local`) with the WHOLE
    sequences' document ids and prefix (layers/sequence_shard.py)."""
    mesh = ctx.mesh
    shard = mesh.seq_shard(batch.tokens.shape[1] - 1)
    extra = {} if batch.document_ids is None else {"document_ids": _to_device(batch.document_ids[:, :-1], mesh)}
    if ctx.cfg.model.prefix_lm() and batch.loss_mask is not None:
        extra["prefix"] = _to_device(batch.prefix(), mesh)
    tokens = batch.tokens[:, :-1]
    if shard is not None:
        tokens, extra["shard"] = shard.local(tokens), shard
    return ctx.engine(_to_device(tokens, mesh), **extra)


def _forward_loss(ctx: StepContext, batch: Batch):
    """(loss, LM loss, model output) of one micro-batch. Under context parallelism each CP rank's losses are cp ×
    its share of the whole micro-batch's (the LM loss: its targets' cross-entropy sum over the whole micro-batch's
    target count / cp): the CP group's sum is cp × one process's loss, so the gradient averaged over the dp × cp
    ranks, and the metrics averaged over every rank's micro-batches, are one process's."""
    mesh = ctx.mesh
    whole = batch.targets()
    shard = mesh.seq_shard(whole.shape[1])
    n_targets = None if shard is None else (whole != IGNORE).sum().clamp(min=1).item() / shard.size
    targets = _to_device(whole if shard is None else shard.local(whole), mesh)
    out = _forward(ctx, batch)
    if mesh.tp == 1:
        lm = lm_loss(out.logits, targets, n_targets)
    else:
        lm = vocab_parallel_lm_loss(out.logits, targets, mesh, n_targets)
    moe = ctx.cfg.model.moe
    return lm + moe.aux_loss_coef * out.aux_loss + moe.z_loss_coef * out.z_loss, lm, out


@torch.no_grad()
def evaluate(ctx: StepContext) -> float:
    """Mean validation LM loss over the fixed eval set, identical whatever the data-parallel layout."""
    engine, t, mesh = ctx.engine, ctx.cfg.train, ctx.mesh
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64)
    batches = ctx.val.eval_batches(t.eval_batches // mesh.dp, t.micro_batch_size, mesh.dp_rank, mesh.dp)
    if ctx.pipeline is not None:
        total += pipeline_evaluate(ctx.pipeline, list(batches), ctx.cfg)
    else:
        for batch in batches:
            _, lm, _ = _forward_loss(ctx, batch)
            total += torch.tensor([lm.item(), 1.0], dtype=torch.float64)
    engine.train()
    all_reduce_sum(total)
    return (total[0] / total[1]).item()


def _train_step(ctx: StepContext, step: int) -> dict:
    """Optimizer step `step` (1-based) over this rank's micro-batches of the step's global batch; returns the
    step's record. Every collective runs inside `operation`, so a failure names the step and what was running."""
    engine, cfg, mesh, guard, n_moe = ctx.engine, ctx.cfg, ctx.mesh, ctx.guard, ctx.n_moe
    t, timeout = cfg.train, cfg.parallel.timeout_s
    tic = time.perf_counter()
    acc = StepAccumulator(n_moe, cfg.model.moe.num_experts, counted=mesh.tp_rank == 0)
    batches = ctx.data.micro_batches(step - 1, t.global_batch_size, t.micro_batch_size, mesh.dp_rank, mesh.dp)
    moe = cfg.model.moe
    if n_moe and moe.aux_loss_scope == "global_batch" and moe.global_batch_load == "this_step":
        with operation(f"step {step}: routing pre-pass of the global-batch load (MoE all-to-all)", timeout):
            route_step_ahead(
                moe_routers(engine.module),
                lambda b: _forward(ctx, b).moe_stats,
                batches,
                counted=mesh.tp_rank == 0,
            )
    if ctx.pipeline is not None:
        with operation(f"step {step}: pipeline schedule of {len(batches)} micro-batches (stage transfers)", timeout):
            guard.observe_loss(pipeline_micro_batches(ctx.pipeline, list(batches), acc, cfg))
    for i, batch in enumerate(batches if ctx.pipeline is None else []):
        last = i == len(batches) - 1
        with operation(f"step {step}: forward of micro-batch {i} (MoE all-to-all)", timeout):
            loss, lm, out = _forward_loss(ctx, batch)
        guard.observe_loss(loss)
        with operation(f"step {step}: backward{' and gradient reduction' if last else ''} of micro-batch {i}", timeout):
            engine.backward(loss)
            if not last:
                engine.step()  # between boundaries DeepSpeed only counts the micro-step
        acc.add(loss, lm, out)
    with operation(f"step {step}: non-finite check and optimizer step", timeout):
        skipped = guard.boundary_step(step)
    with operation(f"step {step}: metrics all-reduce", timeout):
        record = {"step": step, **acc.reduce()}
    end_router_step(engine.module, record["moe"], update=not skipped, mesh=mesh)
    elapsed = time.perf_counter() - tic
    grad_norm = engine.get_global_grad_norm()
    record.update(
        lr=engine.get_lr()[0],
        grad_norm=float(grad_norm) if grad_norm is not None else 0.0,
        tokens_per_s=t.global_batch_size * t.seq_len / elapsed,
        skipped_steps=guard.skipped_total,
    )
    record.update(ctx.utilisation(record["tokens_per_s"]))
    return record


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    """Every rank, before init: the directory can be used and written. Creates it if missing, writes nothing."""
    if not resume and ((run_dir / "metrics.jsonl").exists() or complete_checkpoints(run_dir / "checkpoints")):
        raise RunDirError(
            f"{run_dir}: already holds a run (metrics.jsonl or checkpoints); pass --resume to "
            f"continue it or choose another --run-dir"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{run_dir}: cannot create the run directory ({e.strerror})") from None
    for d in (run_dir, run_dir / "checkpoints"):
        if d.is_dir() and not os.access(d, os.W_OK | os.X_OK):  # also false on a read-only file system
            raise RunDirError(f"{d}: not writable")


def _checkpoint_to_resume(ckpt_root: Path, model, mesh: Mesh, data_identity: dict, cfg: JobConfig, say):
    """Collective: (path, meta, index) of the verified checkpoint to resume from, or None when there is none.
    Raises CheckpointMismatch on every rank when it does not fit this run (model shape, data order). Its
    collectives run under train.save_timeout_s (every rank hashes its share of the files)."""
    save_s, restore_s = cfg.train.save_timeout_s, cfg.parallel.timeout_s
    with operation(
        "resume: choosing a checkpoint (verifying files)", save_s, "train.save_timeout_s", restore_s=restore_s
    ):
        found = select_checkpoint(ckpt_root, mesh, say)
    if found is None:
        return None
    error = ""
    try:
        check_fits(*found, model, mesh, data_identity)
    except CheckpointMismatch as e:  # may hold on some ranks only (each checks the tensors it will read)
        error = str(e)
    with operation("resume: checking the checkpoint", save_s, "train.save_timeout_s", restore_s=restore_s):
        error = agree_on_error(error)
    if error:
        raise CheckpointMismatch(error)
    return found


def _check_room(run_dir: Path, cfg: JobConfig, mesh: Mesh, say) -> None:
    """Collective, before the run directory is written (resume: before metrics.jsonl is cut back to the checkpoint):
    rank 0 removes partial saves and checks that the run directory takes a write and the next checkpoint
    (train/disk.py); every rank raises rank 0's NoSpaceError."""
    error = ""
    if mesh.rank == 0:
        try:
            # A fresh run's checkpoint: every parameter with its two AdamW moments, in fp32.
            for line in check_room(run_dir, 12 * param_counts(cfg.model)["params_total"]):
                say(line)
        except NoSpaceError as e:
            error = str(e)
    with operation("start-up: checking the run directory's space", cfg.parallel.timeout_s):
        error = agree_on_error(error)
    if error:
        raise NoSpaceError(error)


def _start_run_dir(run_dir: Path, cfg: JobConfig, start: int) -> None:
    """Rank 0, once every check passed: the resolved config (replaced atomically: a full disk keeps the old one),
    and a fresh metrics file for a fresh start."""
    atomic_write(run_dir / "config.json", (json.dumps(config_to_dict(cfg), indent=2) + "\n").encode())
    copy_tokenizer(cfg.data.tokenizer, run_dir)
    if start == 0 and (run_dir / "metrics.jsonl").exists():  # --resume found no checkpoint: the run restarts
        (run_dir / "metrics.jsonl").unlink()


def train(cfg: JobConfig, run_dir: Path, resume: bool = False) -> list[dict]:
    """Run the job; returns rank 0's per-step records (other ranks get an empty list).

    With `resume`, continue from the newest checkpoint in the run directory that verifies, falling back to older
    ones; start fresh when there is none. So one command line serves the first start and every restart.
    A stop signal (preempt.py) ends the run after the step every rank agrees on, with that step's checkpoint,
    by raising Stopped on every rank."""
    with stop_signals() as stop, quiet_full_disk_in_threads():  # a signal during start-up is kept, not lost
        return _train(cfg, run_dir, resume, stop)


def _train(cfg: JobConfig, run_dir: Path, resume: bool, stop: StopRequest) -> list[dict]:
    started = time.perf_counter()  # the summary line's wall time: start-up included, as the user waited for it
    # The layout against the launcher's world size before anything is read, joined or written (one line, exit 2).
    check_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    check_context_parallel(cfg.model, cfg.parallel.cp)
    check_pipeline_runtime(cfg)
    if cfg.parallel.pp > 1:
        stage_starts(cfg)  # a cut too uneven to pipeline is refused here, before anything is joined or written
    t = cfg.train
    # The data fits the model's vocabulary and names the run's tokenizer (checked from the sidecars).
    train_tokens, val_tokens, weights = load_tokens(cfg.data, t.seq_len, cfg.model.vocab_size)
    _check_run_dir(run_dir, resume)
    masking = cfg.data.document_masking
    data = TokenDataset(train_tokens, t.seq_len, t.seed, weights, masking, cfg.data.align_to_documents)
    val = TokenDataset(val_tokens, t.seq_len, t.seed, None, masking)
    # What makes step s see the same samples: checkpoints record it, resume insists on it.
    data_identity = {
        "seed": t.seed,
        "global_batch_size": t.global_batch_size,
        "seq_len": t.seq_len,
        "source": cfg.data.source,
        "train_tokens": int(len(train_tokens)),
    }
    # Recorded only when they differ from bytes / one stream, so checkpoints of byte-level runs stay resumable.
    if cfg.data.tokenizer != "bytes":
        data_identity["tokenizer"] = tokenizer_identity(cfg.data.tokenizer)
    if cfg.data.mixture:
        data_identity["mixture_weights"] = weights
    if cfg.data.align_to_documents:
        data_identity["align_to_documents"] = True

    if not torch.cuda.is_available():  # what DeepSpeed detects anyway, without its warning in every process
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        note = shm_op_note()
        if note is not None and os.environ.get("LOCAL_RANK", "0") == "0":
            print(note, file=sys.stderr, flush=True)
    import deepspeed  # noqa: F401  (here, after the input checks: importing it takes seconds)

    timeout = cfg.parallel.timeout_s
    with operation("start-up: rendezvous with the other ranks", timeout):
        mesh = init_distributed(cfg)
    threads, why = choose_threads(t.threads, mesh.local_world_size)
    torch.set_num_threads(threads)

    def say(line: str) -> None:
        if mesh.rank == 0:
            tqdm.write(line, file=sys.stderr)

    check_shared_run_dir(run_dir, mesh)  # multi-node: every node sees the run directory, before anything is written

    model = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)
    for line in startup_report(cfg, model, mesh.device):  # versions, kernels, slow paths (README "Kernels")
        say(line)
    if mesh.device.type == "cpu":
        say(f"threads: {threads} per process ({why})")
    model = maybe_compile(apply_activation_checkpointing(model, t), cfg)
    ckpt_root = run_dir / "checkpoints"
    found = _checkpoint_to_resume(ckpt_root, model, mesh, data_identity, cfg, say) if resume else None

    optimizer, scheduler = build_optimizer(model, cfg)
    # restore_s: the groups DeepSpeed makes get parallel.timeout_s too (torch would give them its default).
    with operation("start-up: deepspeed.initialize", timeout, restore_s=timeout):
        engine = initialize_engine(model, optimizer, scheduler, cfg, mesh.dp, mesh.mpu, mesh.cp)
    checkpointer = Checkpointer(  # collective: its own process group, timeout train.save_timeout_s
        cfg, mesh, ckpt_root, on_published=lambda _, step: prune_checkpoints(ckpt_root, t.keep_last, step)
    )
    start, skipped = 0, 0
    if found is not None:
        path, meta, _ = found
        # Checkpoint reads have their own limit; the checkpoint group keeps its own.
        limit = {"restore_s": timeout, "keep": (checkpointer.group,)}
        with operation(f"resume: loading {path}", t.save_timeout_s, "train.save_timeout_s", **limit):
            start = load_checkpoint(engine, model, scheduler, *found, mesh)
        skipped = int(meta.get("skipped_steps", 0))
        say(f"resuming from {path} (step {start})")
    elif resume:
        say(f"no checkpoint in {ckpt_root}: starting fresh")
    _check_room(run_dir, cfg, mesh, say)
    if mesh.rank == 0:
        _start_run_dir(run_dir, cfg, start)
    say(run_line(cfg, run_dir, mesh, start))
    last_checkpoint = found[0] if found is not None else None

    n_moe = sum(ffn == "moe" for _, ffn in cfg.model.layer_kinds())
    logger = MetricsLogger(run_dir, mesh.rank == 0, t.histogram_every, resume_step=start)
    if start == 0:
        logger.text("config", "```\n" + json.dumps(config_to_dict(cfg), indent=2) + "\n```")
    guard = NonFiniteGuard(engine, scheduler, mesh, t.max_nonfinite_steps, say, skipped_total=skipped, stop=stop)
    utilisation = Utilisation(
        model_flops_per_token(cfg), mesh.world_size, device_peak(mesh.device, t.dtype, t.peak_tflops)
    )
    say(f"throughput: {utilisation.describe()}")
    pipeline = None
    if mesh.pp > 1:  # the schedule's stages wrap the part's modules; DeepSpeed's engine owns their gradients
        micro, sp = t.grad_accum_steps(mesh.dp), cfg.parallel.sequence_parallel and mesh.tp > 1
        shapes = (t.micro_batch_size, t.seq_len, t.seq_len // (mesh.tp if sp else 1), cfg.model.vocab_size // mesh.tp)
        loss = lm_loss if mesh.tp == 1 else lambda logits, targets: vocab_parallel_lm_loss(logits, targets, mesh)
        pipeline = Pipeline(model, engine, micro, shapes, mesh.pp_group, loss, mesh.embed_group)
    ctx = StepContext(engine, cfg, mesh, data, val, guard, n_moe, utilisation, pipeline)
    records: list[dict] = []
    if start == 0 and t.eval_every:
        with operation("step 0: evaluation", timeout):
            record = {"step": 0, "eval_loss": evaluate(ctx)}
        logger.log(record)
        records.append(record)

    last_seen = found[1].get("dead_expert_last_seen") if found is not None else None
    dead = DeadExperts(n_moe, cfg.model.moe.num_experts, cfg.model.moe.dead_expert_window, start, last_seen)
    bar = tqdm(total=t.steps, initial=start, disable=mesh.rank != 0, desc="train", dynamic_ncols=True)
    stopping = False
    try:
        for done in range(start + 1, t.steps + 1):  # the optimizer step being made, numbered as in metrics.jsonl
            with maybe_profile(run_dir, done, mesh.rank, t.profile_steps, t.profile_ranks, mesh.device):
                record = _train_step(ctx, done)
            dead.observe(record)
            if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                with operation(f"step {done}: evaluation", timeout):
                    record["eval_loss"] = evaluate(ctx)
            logger.log(record)  # before the checkpoint: a resumed run finds the record of every checkpointed step
            records.append(record)
            # A stop agreed at this step's boundary saves this step (once), and the loop ends after it.
            stopping = guard.stop_agreed and done < t.steps
            if (t.save_every and done % t.save_every == 0) or done == t.steps or stopping:
                # Names its phases and limits itself (train.save_timeout_s); rank 0 prunes after each publish.
                extra = {
                    "skipped_steps": guard.skipped_total,
                    "data": data_identity,
                    "dead_expert_last_seen": dead.last_seen(),
                }
                last_checkpoint = checkpointer.save(engine, model, scheduler, done, extra_meta=extra)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update(1)
            if stopping:
                break
    finally:  # an error message must not land on the progress bar's line
        bar.close()
        logger.close()
    checkpointer.wait()  # the last asynchronous save is published before the run ends
    if engine.deferred_gather is not None:  # the last step's weight gather, issued for a forward that never comes
        engine.deferred_gather.wait_all()
    if stopping:  # said before the barrier: once a rank has exited, a launcher may end the others at once
        line = f"step {done}: stopped on request (a stop signal reached rank(s) of the job), checkpoint saved"
        say(f"{line}; exit status {EXIT_STOPPED}: continue with --resume")
    with operation("end of training: barrier", timeout):
        barrier()
    if stopping:
        raise Stopped(line)
    say(summary_line(records, last_checkpoint, time.perf_counter() - started))
    return records if mesh.rank == 0 else []
