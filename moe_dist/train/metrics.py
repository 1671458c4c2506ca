"""Step metrics: accumulate over micro-batches, reduce over ranks in one collective, log to JSONL and TensorBoard.

Every value written is an average over the whole global batch (all ranks, all micro-batches), and expert
load is the global count, not rank 0's local view.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_dist.layers.moe import RoutingStats
from moe_dist.models.decoder import DecoderOutput
from moe_dist.parallel.comm import all_reduce_sum

SCALARS = ("loss", "lm_loss", "aux_loss", "z_loss")


class StepAccumulator:
    """Sums the per-micro-batch scalars and routing statistics of one optimizer step on this rank.

    Layout of the flat vector: [n_micro, loss, lm, aux, z] then per MoE layer [tokens_per_expert (E), dropped,
    assignments, entropy, all-to-all bytes sent]; one all-reduce of it gives the global step statistics.
    """

    def __init__(self, n_moe_layers: int, num_experts: int):
        self.n_layers, self.E = n_moe_layers, num_experts
        self.total = torch.zeros(1 + len(SCALARS) + n_moe_layers * (num_experts + 4), dtype=torch.float64)

    def add(self, loss: torch.Tensor, lm: torch.Tensor, out: DecoderOutput) -> None:
        parts = [torch.ones(1), loss.detach().reshape(1), lm.detach().reshape(1),
                 out.aux_loss.detach().reshape(1), out.z_loss.detach().reshape(1)]
        for s in out.moe_stats:
            parts += [s.tokens_per_expert_E.detach(), s.dropped.detach().reshape(1),
                      torch.tensor([float(s.assignments)]), s.entropy.detach().reshape(1),
                      torch.tensor([float(s.sent_bytes)])]
        self.total += torch.cat([p.double().cpu() for p in parts])

    def reduce(self) -> dict:
        """All-reduce over the world and return global averages and expert-load summaries."""
        total = all_reduce_sum(self.total.clone())
        n = total[0].item()
        out = {k: total[1 + i].item() / n for i, k in enumerate(SCALARS)}
        layers, off = [], 1 + len(SCALARS)
        for _ in range(self.n_layers):
            tpe = total[off:off + self.E]
            dropped, assigned, entropy, sent = total[off + self.E:off + self.E + 4].tolist()
            mean = tpe.mean().item()
            layers.append({
                "tokens_per_expert": [int(round(v)) for v in tpe.tolist()],
                "drop_fraction": dropped / assigned,
                "max_over_mean_load": tpe.max().item() / mean if mean > 0 else 0.0,
                "router_entropy": entropy / n,
                "a2a_bytes_per_rank": sent / n,  # mean bytes one rank sends per dispatch all-to-all
            })
            off += self.E + 4
        out["moe"] = layers
        return out


class MetricsLogger:
    """Rank 0's writer of RUN_DIR/metrics.jsonl and RUN_DIR/tb; other ranks hold a disabled logger."""

    def __init__(self, run_dir: Path, enabled: bool, histogram_every: int, resume_step: int = 0):
        self.enabled, self.histogram_every = enabled, histogram_every
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        if resume_step and self.path.exists():
            # Records past the checkpoint came from the interrupted run; the resumed run rewrites them.
            kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def text(self, tag: str, text: str) -> None:
        if self.tb is not None:
            self.tb.add_text(tag, text, 0)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                self.tb.add_scalar(("eval/" if key.startswith("eval_") else "train/") + key, value, step)
        for i, layer in enumerate(record.get("moe", [])):
            tag = f"moe/layer{i}"
            tpe = torch.tensor(layer["tokens_per_expert"], dtype=torch.float64)
            share = tpe / max(tpe.sum().item(), 1.0)
            for e, v in enumerate(share.tolist()):
                self.tb.add_scalar(f"{tag}/expert{e}_token_share", v, step)
            for key in ("drop_fraction", "max_over_mean_load", "router_entropy", "a2a_bytes_per_rank"):
                self.tb.add_scalar(f"{tag}/{key}", layer[key], step)
            if self.histogram_every and (step == 1 or step % self.histogram_every == 0):
                self.tb.add_histogram(f"{tag}/tokens_per_expert", tpe, step)
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
