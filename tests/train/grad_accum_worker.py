"""Worker for test_grad_accum.py, run as `python grad_accum_worker.py OUT_DIR` (a world of one, real DeepSpeed
engines built as the training loop builds them: bf16 weights, ZeRO 2, and ZeRO 1's one reduction per step, also
overlapped with the last backward).

1. Accumulation: for train.grad_accum_dtype in (fp32, bf16), one engine accumulates 16 micro-batches; the
   gradient DeepSpeed hands the optimizer (fp32, `safe_get_full_grad`) is compared with the exact sum (fp64) of
   the same 16 bf16 micro-batch gradients, computed by plain autograd on an identical bf16 copy of the model.
2. Resume from a checkpoint saved before any applied step: an engine saves step 0 before it ever steps; a fresh
   engine loads it and its Adam state (moments, step) is inspected, then it takes one real step.
"""

import copy
import tempfile
from pathlib import Path

import torch
import workers

from moe_dist.config import load_config
from moe_dist.models.decoder import build_model, lm_loss
from moe_dist.parallel.parallelize import parallelize
from moe_dist.train.checkpoint import load_checkpoint, save_checkpoint, select_checkpoint
from moe_dist.train.checkpoint.state import inner_optimizer
from moe_dist.train.optim import build_optimizer, initialize_engine

MICRO = 16
BASE = [
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_layers=2",
    "model.attention.n_heads=4",
    "model.attention.n_kv_heads=2",
    "model.mamba.d_state=8",
    "train.dtype=bf16",
    "deepspeed.zero_stage=2",
    "train.seq_len=16",
    f"train.global_batch_size={MICRO}",
    "train.micro_batch_size=1",
    "train.grad_clip=0",
]


def engine_for(cfg, mesh, model):
    opt, sched = build_optimizer(model, cfg)
    return initialize_engine(model, opt, sched, cfg, 1), sched


def loss_of(model, cfg, batch):
    out = model(batch[:, :-1])
    moe = cfg.model.moe
    return lm_loss(out.logits, batch[:, 1:]) + moe.aux_loss_coef * out.aux_loss + moe.z_loss_coef * out.z_loss


def accumulation(mesh, accum: str, stage: int = 2, extra: tuple[str, ...] = ()) -> dict:
    from deepspeed.utils import safe_get_full_grad

    sets = [*BASE, f"train.grad_accum_dtype={accum}", f"deepspeed.zero_stage={stage}", *extra]
    cfg = load_config("configs/debug.json", sets)
    model = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)
    ref = copy.deepcopy(model).to(torch.bfloat16)  # what the engine computes with
    engine, _ = engine_for(cfg, mesh, model)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (1, 17), generator=gen) for _ in range(MICRO)]
    exact = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in ref.named_parameters()}
    for batch in batches:
        ref.zero_grad()
        loss_of(ref, cfg, batch).backward()
        for n, p in ref.named_parameters():
            exact[n] += p.grad.double() / MICRO  # DeepSpeed averages over the micro-batches (x 1/16: exact)
    for i, batch in enumerate(batches):
        engine.backward(loss_of(engine, cfg, batch))
        if i < MICRO - 1:
            engine.step()  # a micro-step: DeepSpeed only counts it
    got = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    dtypes = sorted({str(g.dtype) for g in got.values()})
    num = sum(((got[n].double() - exact[n]) ** 2).sum().item() for n in exact)
    den = sum((exact[n] ** 2).sum().item() for n in exact)
    engine.step()
    return {
        "rel_error": (num / den) ** 0.5,
        "grad_dtypes": dtypes,
        "param_dtype": str(next(model.parameters()).dtype),
        "optimizer": type(engine.optimizer).__name__,
    }


def resume_before_any_step(mesh, stage: int) -> dict:
    cfg = load_config("configs/debug.json", [*BASE, f"deepspeed.zero_stage={stage}"])
    root = Path(tempfile.mkdtemp()) / "checkpoints"
    model = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)
    engine, sched = engine_for(cfg, mesh, model)
    save_checkpoint(engine, model, sched, root, 0, cfg, mesh, extra_meta={"skipped_steps": 0})

    fresh = parallelize(build_model(cfg.model, mesh.device), mesh, cfg)
    engine2, sched2 = engine_for(cfg, mesh, fresh)
    found = select_checkpoint(root, mesh, print)
    step = load_checkpoint(engine2, fresh, sched2, *found, mesh)
    inner = inner_optimizer(engine2)
    flats = engine2.optimizer.single_partition_of_fp32_groups
    states = [inner.state[f] for f in flats]
    loaded = [
        {
            "param": [str(f.dtype), str(f.device)],
            "step": [str(s["step"].dtype), str(s["step"].device), float(s["step"])],
            **{
                k: [str(s[k].dtype), str(s[k].device), list(s[k].shape) == list(f.shape)]
                for k in ("exp_avg", "exp_avg_sq")
            },
        }
        for f, s in zip(flats, states)
    ]
    gen = torch.Generator().manual_seed(2)
    for _ in range(MICRO):
        engine2.backward(loss_of(engine2, cfg, torch.randint(0, 256, (1, 17), generator=gen)))
        engine2.step()
    return {
        "step": step,
        "loaded": loaded,
        "applied": bool(engine2.was_step_applied()),
        "steps_after": [float(inner.state[f]["step"]) for f in flats],
    }


def main(out_dir: Path) -> None:
    mesh = workers.start_mesh(load_config("configs/debug.json", BASE))
    result = {accum: accumulation(mesh, accum) for accum in ("fp32", "bf16")}
    result["fp32_zero1"] = accumulation(mesh, "fp32", stage=1)  # one reduction per step (train/optim.py)
    # the same, reduced from the last micro-batch's gradient hooks in 0.1 MiB buckets (several per step)
    overlap = ("train.grad_reduce_overlap=true", "train.grad_reduce_bucket_mb=0.1")
    result["fp32_zero1_overlap"] = accumulation(mesh, "fp32", stage=1, extra=overlap)
    result["resume"] = resume_before_any_step(mesh, 2)
    result["resume_zero1"] = resume_before_any_step(mesh, 1)
    workers.finish(out_dir, mesh.rank, result)


if __name__ == "__main__":
    workers.run(main)
