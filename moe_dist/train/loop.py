"""The training loop: build → DeepSpeed engine → steps of micro-batches → metrics, eval, checkpoints."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from moe_dist.config import JobConfig, config_to_dict
from moe_dist.models.decoder import build_model, lm_loss, materialize
from moe_dist.parallel.comm import all_reduce_sum, barrier
from moe_dist.parallel.mesh import Mesh, init_distributed
from moe_dist.parallel.parallelize import parallelize
from moe_dist.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from moe_dist.train.data import TokenDataset, load_tokens, micro_batches
from moe_dist.train.metrics import MetricsLogger, StepAccumulator
from moe_dist.train.optim import build_optimizer, deepspeed_config


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (e.g. it holds a run and --resume was not given)."""


def _forward_loss(engine, cfg: JobConfig, batch: torch.Tensor, device: torch.device):
    batch = batch.to(device)
    out = engine(batch[:, :-1])
    lm = lm_loss(out.logits, batch[:, 1:])
    moe = cfg.model.moe
    return lm + moe.aux_loss_coef * out.aux_loss + moe.z_loss_coef * out.z_loss, lm, out


@torch.no_grad()
def evaluate(engine, cfg: JobConfig, val: TokenDataset, mesh: Mesh) -> float:
    """Mean validation LM loss over the fixed eval set, identical whatever the data-parallel layout."""
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for batch in val.eval_batches(cfg.train.eval_batches // mesh.dp, cfg.train.micro_batch_size, mesh.dp_rank, mesh.dp):
        _, lm, _ = _forward_loss(engine, cfg, batch, mesh.device)
        total += torch.tensor([lm.item(), 1.0], dtype=torch.float64)
    engine.train()
    all_reduce_sum(total)
    return (total[0] / total[1]).item()


def _prepare_run_dir(run_dir: Path, cfg: JobConfig, resume: bool, rank: int) -> None:
    if rank == 0:
        if (run_dir / "metrics.jsonl").exists() and not resume:
            raise RunDirError(f"{run_dir}: already holds a run (metrics.jsonl); pass --resume to continue it "
                              f"or choose another --run-dir")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    barrier()


def train(cfg: JobConfig, run_dir: Path, resume: bool = False) -> list[dict]:
    """Run the job; returns rank 0's per-step records (other ranks get an empty list)."""
    import deepspeed

    mesh = init_distributed(cfg)
    torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // mesh.local_world_size))
    _prepare_run_dir(run_dir, cfg, resume, mesh.rank)

    train_tokens, val_tokens = load_tokens(cfg.data, cfg.train.seq_len)
    data = TokenDataset(train_tokens, cfg.train.seq_len, cfg.train.seed)
    val = TokenDataset(val_tokens, cfg.train.seq_len, cfg.train.seed)

    model = materialize(parallelize(build_model(cfg.model), mesh, cfg), mesh.device, cfg.train.seed)
    optimizer, scheduler = build_optimizer(model, cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, mesh.dp))

    ckpt_root = run_dir / "checkpoints"
    start = 0
    found = latest_checkpoint(ckpt_root) if resume else None
    if found is not None:
        start = load_checkpoint(engine, model, scheduler, found, mesh)

    n_moe = cfg.model.ffn_pattern.count("E") * (cfg.model.n_layers // len(cfg.model.ffn_pattern))
    logger = MetricsLogger(run_dir, mesh.rank == 0, cfg.train.histogram_every, resume_step=start)
    if start == 0:
        logger.text("config", "```\n" + json.dumps(config_to_dict(cfg), indent=2) + "\n```")
    t = cfg.train
    records: list[dict] = []
    if start == 0 and t.eval_every:
        record = {"step": 0, "eval_loss": evaluate(engine, cfg, val, mesh)}
        logger.log(record)
        records.append(record)

    bar = tqdm(total=t.steps, initial=start, disable=mesh.rank != 0, desc="train", dynamic_ncols=True)
    for step in range(start, t.steps):
        tic = time.perf_counter()
        acc = StepAccumulator(n_moe, cfg.model.moe.num_experts)
        global_batch = data.global_batch(step, t.global_batch_size)
        for batch in micro_batches(global_batch, t.micro_batch_size, mesh.dp_rank, mesh.dp):
            loss, lm, out = _forward_loss(engine, cfg, batch, mesh.device)
            engine.backward(loss)
            engine.step()  # DeepSpeed only updates at the gradient-accumulation boundary
            acc.add(loss, lm, out)
        done = step + 1
        record = {"step": done, **acc.reduce()}
        elapsed = time.perf_counter() - tic
        grad_norm = engine.get_global_grad_norm()
        record.update(lr=engine.get_lr()[0], grad_norm=float(grad_norm) if grad_norm is not None else 0.0,
                      tokens_per_s=t.global_batch_size * t.seq_len / elapsed)
        if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
            record["eval_loss"] = evaluate(engine, cfg, val, mesh)
        if (t.save_every and done % t.save_every == 0) or done == t.steps:
            save_checkpoint(engine, model, scheduler, ckpt_root, done, cfg, mesh)
        logger.log(record)
        records.append(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        bar.update(1)
    bar.close()
    logger.close()
    barrier()
    return records if mesh.rank == 0 else []
