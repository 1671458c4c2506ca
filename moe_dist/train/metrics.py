"""Step metrics: accumulate over micro-batches, reduce over ranks in one collective, log to JSONL and TensorBoard.

Every value written is an average over the whole global batch (all ranks, all micro-batches), and expert
load is the global count, not rank 0's local view.

metrics.jsonl gets every value, per expert included. TensorBoard gets every numeric record key as a scalar, per
MoE layer a tokens-per-expert histogram and a custom-scalars layout grouping its metrics, and every
`train.image_every` steps the pictures of moe_dist/train/expert_images.py: (layers × experts) token share and drop
rate, and per layer an (experts × recent steps) load history. Per-expert scalars (token share, balancing bias) go
to TensorBoard only up to PER_EXPERT_SCALARS experts: beyond, one line per expert is an unreadable single-coloured
tangle that dominates the event file, and the history image is the view (a TensorBoard text says so)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from moe_dist.data.shards import atomic_write
from moe_dist.layers.router import RoutingStats
from moe_dist.models.decoder import DecoderOutput
from moe_dist.parallel.comm import all_reduce_sum
from moe_dist.train.disk import is_no_space, no_space
from moe_dist.train.expert_images import LoadHistory, expert_load_images

SCALARS = ("loss", "lm_loss", "aux_loss", "z_loss")
PER_EXPERT_SCALARS = 64  # above this many experts, per-expert values go to metrics.jsonl and images only
HISTORY_STEPS = 128  # logged steps kept per layer for the load-history image
_LAYER_EXTRA = 4  # per MoE layer after the two per-expert blocks: dropped, assignments, entropy, a2a bytes sent


def dropped_per_expert(tokens_per_expert_E: torch.Tensor, dropped: float) -> torch.Tensor:
    """Assignments dropped per expert in one micro-batch on one rank, recovered from the counts before drops
    and the total dropped: capacity is one number `cap` for every expert, each expert keeps min(count, cap),
    so dropped = Σ_e max(0, count_e − cap) fixes cap (for the j most loaded experts over capacity,
    cap = (their count − dropped) / j, the j that lies between the j-th and (j+1)-th largest counts)."""
    counts = tokens_per_expert_E.double()
    # Tensor ops only, no branch on values: on a GPU this runs without waiting for the device (dropped = 0 gives
    # cap = the largest count, so zeros).
    dropped = torch.as_tensor(dropped, dtype=torch.float64, device=counts.device)
    top, _ = counts.sort(descending=True)
    caps = (top.cumsum(0) - dropped) / torch.arange(1, len(top) + 1, dtype=torch.float64, device=counts.device)
    below = torch.cat([top[1:], top.new_zeros(1)])
    fits = (caps >= below) & (caps <= top)
    first_fit = caps.gather(0, fits.int().argmax().reshape(1)).squeeze(0)  # gather: indexing would read the index
    cap = torch.where(fits.any(), first_fit, caps[-1].clamp(min=0))
    return (counts - cap).clamp(min=0)


class StepAccumulator:
    """Sums the per-micro-batch scalars and routing statistics of one optimizer step on this rank.

    Layout of the flat vector: [n_micro, loss, lm, aux, z] then per MoE layer [tokens_per_expert (E),
    dropped_per_expert (E), dropped, assignments, entropy, all-to-all bytes sent]; one all-reduce of it gives
    the global step statistics.
    """

    def __init__(self, n_moe_layers: int, num_experts: int, counted: bool = True):
        self.n_layers, self.E = n_moe_layers, num_experts
        self.counted = counted  # False on tensor-parallel peers of a counted rank: they saw the same tokens
        self.total = torch.zeros(
            1 + len(SCALARS) + n_moe_layers * (2 * num_experts + _LAYER_EXTRA), dtype=torch.float64
        )
        self.device_total: Optional[torch.Tensor] = None  # the same layout, summed where the statistics live

    def add(self, loss: torch.Tensor, lm: torch.Tensor, out: DecoderOutput) -> None:
        """Sums stay on the tensors' device (no host transfer per layer or micro-batch); numbers the host already
        knows (assignments, bytes sent) are summed on the host. `reduce` moves the device sums once per step."""
        self.add_share(loss, lm, out.aux_loss, out.z_loss, dict(enumerate(out.moe_stats)), micro=1.0)

    def add_share(self, loss, lm, aux, z, stats: dict[int, RoutingStats], micro: float) -> None:
        """One micro-batch's values as far as this rank holds them: under pipeline parallelism a stage's MoE
        layers (`stats`, by index among the model's MoE layers), its part of the loss and of the layer-mean aux
        and z losses, and `micro` 1 on the rank that holds the LM loss, 0 elsewhere, so that summed over the
        stages every micro-batch, layer and loss term counts once."""
        if not self.counted:
            return
        host = [micro] + [0.0] * len(SCALARS)
        dev = [loss.detach().reshape(1), lm.detach().reshape(1), aux.detach().reshape(1), z.detach().reshape(1)]
        device, E = loss.device, self.E
        for layer in range(self.n_layers):
            s = stats.get(layer)
            if s is None:
                dev.append(torch.zeros(2 * E + _LAYER_EXTRA, dtype=torch.float64, device=device))
                host += [0.0] * (2 * E + _LAYER_EXTRA)
                continue
            counts, dropped = s.tokens_per_expert_E.detach().double(), s.dropped.detach().double()
            # per expert as the router counted them; recovered from the totals where it did not (one capacity for
            # every expert of this micro-batch: not so for a CP rank's pieces, whose capacity is shared)
            per_expert = dropped_per_expert(counts, dropped) if s.dropped_E is None else s.dropped_E.detach().double()
            dev += [counts, per_expert, dropped.reshape(1)]
            dev += [dropped.new_zeros(1), s.entropy.detach().reshape(1), dropped.new_zeros(1)]
            host += [0.0] * (2 * E + 1) + [float(s.assignments), 0.0, float(s.sent_bytes)]
        vec = torch.cat([torch.zeros(1, dtype=torch.float64, device=device), *(d.double() for d in dev)])
        self.device_total = vec if self.device_total is None else self.device_total + vec
        self.total += torch.tensor(host, dtype=torch.float64)

    def reduce(self) -> dict:
        """All-reduce over the world and return global averages and expert-load summaries."""
        total = self.total.clone()
        if self.device_total is not None:
            total += self.device_total.cpu()  # the step's one device-to-host transfer of metrics
        total = all_reduce_sum(total)
        n = total[0].item()
        out = {k: total[1 + i].item() / n for i, k in enumerate(SCALARS)}
        layers, off, E = [], 1 + len(SCALARS), self.E
        for _ in range(self.n_layers):
            tpe, dpe = total[off : off + E], total[off + E : off + 2 * E]
            dropped, assigned, entropy, sent = total[off + 2 * E : off + 2 * E + _LAYER_EXTRA].tolist()
            mean = tpe.mean().item()
            layers.append(
                {
                    "tokens_per_expert": [int(round(v)) for v in tpe.tolist()],
                    "dropped_per_expert": [int(round(v)) for v in dpe.tolist()],
                    "drop_fraction": dropped / assigned,
                    "max_over_mean_load": tpe.max().item() / mean if mean > 0 else 0.0,
                    "load_cv": tpe.std(correction=0).item() / mean if mean > 0 else 0.0,  # std / mean over experts
                    "router_entropy": entropy / n,
                    "a2a_bytes_per_rank": sent / n,  # mean bytes one rank sends per dispatch all-to-all
                }
            )
            off += 2 * E + _LAYER_EXTRA
        out["moe"] = layers
        return out


class DeadExperts:
    """Per MoE layer, the experts that received no token in the last `window` optimizer steps (so none during the
    first `window` - 1 steps of a run: history starts at `first_step`). `observe` adds `dead_experts` (count) and
    `dead_expert_ids` to each layer of a step record. `last_seen()` goes into checkpoints, so a resumed run
    continues the history (`last_seen=`) and reports what the uninterrupted run would have."""

    def __init__(self, n_moe_layers: int, num_experts: int, window: int, first_step: int, last_seen=None):
        self.window = window
        self.last_seen_LE = np.full((n_moe_layers, num_experts), first_step, dtype=np.int64)
        if last_seen is not None and np.shape(last_seen) == self.last_seen_LE.shape:  # else: an older checkpoint
            self.last_seen_LE[:] = last_seen

    def last_seen(self) -> list[list[int]]:
        return self.last_seen_LE.tolist()

    def observe(self, record: dict) -> None:
        step = record["step"]
        for last_E, layer in zip(self.last_seen_LE, record["moe"]):
            last_E[np.asarray(layer["tokens_per_expert"]) > 0] = step
            dead = np.flatnonzero(step - last_E >= self.window)
            layer["dead_experts"] = len(dead)
            layer["dead_expert_ids"] = dead.tolist()


def custom_scalars_layout(n_moe_layers: int, num_experts: int = 0) -> dict:
    """TensorBoard's custom-scalars layout: losses together, then one category per MoE layer (with per-expert
    charts only up to PER_EXPERT_SCALARS experts)."""
    layout = {
        "training": {
            "loss": ["Multiline", ["train/loss", "train/lm_loss", "eval/eval_loss"]],
            "aux and z losses": ["Multiline", ["train/aux_loss", "train/z_loss"]],
        },
        "moe: all layers": {
            "drop fraction": ["Multiline", [r"moe/layer\d+/drop_fraction"]],
            "max / mean load": ["Multiline", [r"moe/layer\d+/max_over_mean_load"]],
        },
    }
    for i in range(n_moe_layers):
        tag = f"moe/layer{i}"
        charts = {
            "token share per expert": ["Multiline", [rf"{tag}/expert\d+_token_share"]],
            "drop fraction and imbalance": [
                "Multiline",
                [f"{tag}/drop_fraction", f"{tag}/max_over_mean_load", f"{tag}/load_cv", f"{tag}/dead_experts"],
            ],
            "balancing bias per expert": ["Multiline", [rf"{tag}/expert\d+_bias"]],
            "router entropy": ["Multiline", [f"{tag}/router_entropy"]],
        }
        if num_experts > PER_EXPERT_SCALARS:
            del charts["token share per expert"], charts["balancing bias per expert"]
        layout[f"moe layer {i}"] = charts
    return layout


# ----------------------------------------------------------------------------------------------- logger


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _image_every_from_run_dir(run_dir: Path) -> int:
    """train.image_every of the resolved config the loop wrote into the run directory (default if absent)."""
    from moe_dist.config import TrainConfig

    path = run_dir / "config.json"
    default = TrainConfig().image_every
    if not path.is_file():
        return default
    return int(json.loads(path.read_text()).get("train", {}).get("image_every", default))


class MetricsLogger:
    """Rank 0's writer of RUN_DIR/metrics.jsonl and RUN_DIR/tb; other ranks hold a disabled logger.

    `image_every` None reads train.image_every from RUN_DIR/config.json, the resolved config of the run."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        histogram_every: int,
        resume_step: int = 0,
        image_every: Optional[int] = None,
    ):
        self.enabled, self.histogram_every = enabled, histogram_every
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        self.layout_written = False
        self.history = LoadHistory(HISTORY_STEPS)
        if not enabled:
            return
        self.image_every = _image_every_from_run_dir(run_dir) if image_every is None else image_every
        if resume_step and self.path.exists():
            # Records past the checkpoint came from the interrupted run; the resumed run rewrites them.
            # Replaced atomically: a write that fails (a full disk) leaves every record where it was.
            kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step]
            atomic_write(self.path, "".join(ln + "\n" for ln in kept).encode())
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def text(self, tag: str, text: str) -> None:
        if self.tb is not None:
            self.tb.add_text(tag, text, 0)

    def _periodic(self, every: int, step: int) -> bool:
        return bool(every) and (step == 1 or step % every == 0)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        size = self.path.stat().st_size if self.path.exists() else 0
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # no half record left behind: resume reads every line
            os.truncate(self.path, size)
            if is_no_space(e):
                raise no_space(self.path, self.path.parent) from None
            raise
        step = record["step"]
        for key, value in record.items():
            if _numeric(value) and key != "step":
                self.tb.add_scalar(("eval/" if key.startswith("eval_") else "train/") + key, value, step)
        layers = record.get("moe", [])
        num_experts = len(layers[0]["tokens_per_expert"]) if layers else 0
        per_expert = num_experts <= PER_EXPERT_SCALARS
        if layers and not self.layout_written:
            self.tb.add_custom_scalars(custom_scalars_layout(len(layers), num_experts))
            if not per_expert:
                self.tb.add_text(
                    "moe/per_expert",
                    f"{num_experts} experts > {PER_EXPERT_SCALARS}: per-expert token share and bias are in "
                    "metrics.jsonl and the moe/layerN/load_history images, not in scalars",
                    step,
                )
            self.layout_written = True
        if self.image_every:  # the history is only ever drawn into images
            self.history.observe(layers, step)
        for i, layer in enumerate(layers):
            tag = f"moe/layer{i}"
            tpe = torch.tensor(layer["tokens_per_expert"], dtype=torch.float64)
            share = tpe / max(tpe.sum().item(), 1.0)
            for e, v in enumerate(share.tolist() if per_expert else []):
                self.tb.add_scalar(f"{tag}/expert{e}_token_share", v, step)
            for key, value in layer.items():
                if _numeric(value):
                    self.tb.add_scalar(f"{tag}/{key}", value, step)
            for e, v in enumerate(layer.get("bias", []) if per_expert else []):  # loss-free balancing bias
                self.tb.add_scalar(f"{tag}/expert{e}_bias", v, step)
            if self._periodic(self.histogram_every, step):
                self.tb.add_histogram(f"{tag}/tokens_per_expert", tpe, step)
        if layers and self._periodic(self.image_every, step):
            images = {**expert_load_images(layers, step), **self.history.images()}
            for tag, img in images.items():
                self.tb.add_image(tag, img, step, dataformats="HWC")
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
