"""Step metrics: accumulate over micro-batches, reduce over ranks in one collective, log to JSONL and TensorBoard.

Every value written is an average over the whole global batch (all ranks, all micro-batches), and expert
load is the global count, not rank 0's local view.

TensorBoard gets every numeric record key as a scalar, per MoE layer the token share of each expert and
a tokens-per-expert histogram, a custom-scalars layout grouping the MoE metrics per layer, and every
`train.image_every` steps two layers × experts heatmaps (token share, drop rate) drawn with numpy and PIL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from moe_dist.models.decoder import DecoderOutput
from moe_dist.parallel.comm import all_reduce_sum

SCALARS = ("loss", "lm_loss", "aux_loss", "z_loss")
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
        if not self.counted:
            return
        host = [1.0] + [0.0] * len(SCALARS)
        dev = [loss.detach().reshape(1), lm.detach().reshape(1)]
        dev += [out.aux_loss.detach().reshape(1), out.z_loss.detach().reshape(1)]
        for s in out.moe_stats:
            counts, dropped = s.tokens_per_expert_E.detach().double(), s.dropped.detach().double()
            dev += [counts, dropped_per_expert(counts, dropped), dropped.reshape(1)]
            dev += [dropped.new_zeros(1), s.entropy.detach().reshape(1), dropped.new_zeros(1)]
            host += [0.0] * (2 * self.E + 1) + [float(s.assignments), 0.0, float(s.sent_bytes)]
        vec = torch.cat([torch.zeros(1, dtype=torch.float64, device=loss.device), *(d.double() for d in dev)])
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


# ----------------------------------------------------------------------------------------------- images

CELL = 24  # pixels per heatmap cell
TITLE_H, AXIS_H, LABEL_W, BAR_W = 20, 16, 28, 52  # margins: title, expert indices, layer indices, colour bar
MIN_W = 200  # room for the title
# viridis at 9 evenly spaced points: perceptually uniform and readable by colour-blind viewers
_VIRIDIS = np.array(
    [
        [68, 1, 84],
        [71, 44, 122],
        [59, 81, 139],
        [44, 113, 142],
        [33, 144, 141],
        [39, 173, 129],
        [92, 200, 99],
        [170, 220, 50],
        [253, 231, 37],
    ],
    dtype=np.float64,
)


def colormap(values: np.ndarray) -> np.ndarray:
    """Values in [0, 1] (clipped) → viridis RGB uint8, shape values.shape + (3,)."""
    x = np.clip(np.nan_to_num(values), 0.0, 1.0) * (len(_VIRIDIS) - 1)
    lo = np.minimum(np.floor(x).astype(int), len(_VIRIDIS) - 2)
    frac = (x - lo)[..., None]
    return np.round(_VIRIDIS[lo] * (1 - frac) + _VIRIDIS[lo + 1] * frac).astype(np.uint8)


def heatmap_size(n_rows: int, n_cols: int) -> tuple[int, int]:
    """(height, width) in pixels of `heatmap_image` for a (n_rows, n_cols) matrix."""
    return TITLE_H + n_rows * CELL + AXIS_H, max(LABEL_W + n_cols * CELL + BAR_W, MIN_W)


def heatmap_image(values_LE: np.ndarray, vmax: float, title: str) -> np.ndarray:
    """A (layers, experts) matrix as an RGB image (H, W, 3) uint8: one CELL×CELL square per value on the
    0..vmax viridis scale, layer indices on the left, expert indices below, a colour bar with its range."""
    from PIL import Image, ImageDraw

    L, E = values_LE.shape
    H, W = heatmap_size(L, E)
    img = np.full((H, W, 3), 255, dtype=np.uint8)
    cells = colormap(values_LE / vmax if vmax > 0 else np.zeros_like(values_LE))  # (L, E, 3)
    img[TITLE_H : TITLE_H + L * CELL, LABEL_W : LABEL_W + E * CELL] = cells.repeat(CELL, 0).repeat(CELL, 1)
    bar_x, bar_h = LABEL_W + E * CELL + 6, L * CELL
    ramp = colormap(np.linspace(1.0, 0.0, bar_h))[:, None, :]  # top = vmax
    img[TITLE_H : TITLE_H + bar_h, bar_x : bar_x + 8] = ramp
    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    draw.text((4, 4), title, fill=(0, 0, 0))
    for layer in range(L):
        draw.text((4, TITLE_H + layer * CELL + CELL // 2 - 5), str(layer), fill=(0, 0, 0))
    for e in range(E):  # a CELL-wide column holds a 3-digit label of the default font
        draw.text((LABEL_W + e * CELL + 4, TITLE_H + L * CELL + 2), str(e), fill=(0, 0, 0))
    draw.text((bar_x + 11, TITLE_H), f"{vmax:.2g}", fill=(0, 0, 0))
    draw.text((bar_x + 11, TITLE_H + bar_h - 11), "0", fill=(0, 0, 0))
    return np.asarray(pil)


def expert_load_images(layers: list[dict], step: int) -> dict[str, np.ndarray]:
    """The two per-step pictures of a record's MoE layers: token share and drop rate, (layers, experts) each.
    Token share uses a 0..max(2/E, max share) scale, so a balanced router sits mid-scale."""
    tpe = np.array([layer["tokens_per_expert"] for layer in layers], dtype=np.float64)  # (L, E)
    dpe = np.array([layer.get("dropped_per_expert", [0] * tpe.shape[1]) for layer in layers], dtype=np.float64)
    share = tpe / np.maximum(tpe.sum(axis=1, keepdims=True), 1.0)
    drop_rate = dpe / np.maximum(tpe, 1.0)
    return {
        "moe/expert_load": heatmap_image(
            share, max(2.0 / tpe.shape[1], share.max()), f"token share (layer x expert) @{step}"
        ),
        "moe/drop_rate": heatmap_image(drop_rate, 1.0, f"drop rate (layer x expert) @{step}"),
    }


def custom_scalars_layout(n_moe_layers: int) -> dict:
    """TensorBoard's custom-scalars layout: losses together, then one category per MoE layer."""
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
        layout[f"moe layer {i}"] = {
            "token share per expert": ["Multiline", [rf"{tag}/expert\d+_token_share"]],
            "drop fraction and imbalance": [
                "Multiline",
                [f"{tag}/drop_fraction", f"{tag}/max_over_mean_load", f"{tag}/load_cv", f"{tag}/dead_experts"],
            ],
            "balancing bias per expert": ["Multiline", [rf"{tag}/expert\d+_bias"]],
            "router entropy": ["Multiline", [f"{tag}/router_entropy"]],
        }
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
        if not enabled:
            return
        self.image_every = _image_every_from_run_dir(run_dir) if image_every is None else image_every
        if resume_step and self.path.exists():
            # Records past the checkpoint came from the interrupted run; the resumed run rewrites them.
            kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
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
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        for key, value in record.items():
            if _numeric(value) and key != "step":
                self.tb.add_scalar(("eval/" if key.startswith("eval_") else "train/") + key, value, step)
        layers = record.get("moe", [])
        if layers and not self.layout_written:
            self.tb.add_custom_scalars(custom_scalars_layout(len(layers)))
            self.layout_written = True
        for i, layer in enumerate(layers):
            tag = f"moe/layer{i}"
            tpe = torch.tensor(layer["tokens_per_expert"], dtype=torch.float64)
            share = tpe / max(tpe.sum().item(), 1.0)
            for e, v in enumerate(share.tolist()):
                self.tb.add_scalar(f"{tag}/expert{e}_token_share", v, step)
            for key, value in layer.items():
                if _numeric(value):
                    self.tb.add_scalar(f"{tag}/{key}", value, step)
            for e, v in enumerate(layer.get("bias", [])):  # loss-free balancing bias, when used
                self.tb.add_scalar(f"{tag}/expert{e}_bias", v, step)
            if self._periodic(self.histogram_every, step):
                self.tb.add_histogram(f"{tag}/tokens_per_expert", tpe, step)
        if layers and self._periodic(self.image_every, step):
            for tag, img in expert_load_images(layers, step).items():
                self.tb.add_image(tag, img, step, dataformats="HWC")
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
