"""Worker for test_cp_model.py, run as `torchrun --nproc_per_node 4 cp_model_worker.py OUT_DIR`.

One world of 4 gloo ranks holds a CP group of 4 and two CP groups of 2 ({0, 1}, {2, 3}). Every rank builds the
same fp64 hybrid decoder (attention, Mamba-1, Mamba-2, Gated DeltaNet; MoE with capacity drops), runs it whole in
one process (the reference) and on its own pieces through `Decoder.forward(shard=...)` with the loss as the
training loop forms it under CP (cp × this rank's share), for cp = 2 and 4, documents off and on. The documents put
boundaries exactly at piece edges, make one piece a whole document, start documents inside pieces; at cp = 4 the
pieces (2 positions) are shorter than d_conv − 1 = 3. Each rank writes OUT_DIR/rank<R>.json: per case, the largest
difference and the reference's magnitude of its logits, of the loss summed over the group / cp, and of every
parameter's gradient summed over the group / cp, and the routing statistics summed over the group beside the
reference's.
"""

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import workers

from moe_dist.config import load_config
from moe_dist.data.batches import IGNORE, Batch
from moe_dist.models.decoder import build_model, lm_loss, materialize_whole
from moe_dist.parallel.context_parallel import seq_shard

B, S = 2, 16
CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "debug.json")
MODEL = [
    "model.mixer_pattern=A",
    "model.ffn_pattern=E",
    'model.layers=["attention+moe","mamba1+mlp","mamba2+moe","gdn+mlp"]',
    "model.mamba2.head_dim=16",
    "model.mamba2.d_state=16",
    "model.mamba2.chunk_size=8",
    "model.gdn.head_k_dim=16",
    "model.gdn.head_v_dim=16",
    "model.gdn.chunk_size=8",
    "model.moe.capacity_factor=1.0",
    "model.moe.aux_loss_scope=sequence",
]
# Pieces: 4 positions at cp = 2 (edges 4, 8, 12), 2 at cp = 4. Row 0: starts at 4 and 8 (piece edges at both cp;
# 4..7 is one whole piece at cp = 2, two at cp = 4) and 13 (inside a piece). Row 1: starts inside pieces.
DOC_STARTS = [[0, 4, 8, 13], [0, 3, 10]]


def documents() -> torch.Tensor:
    """(B, S + 1) document ids of DOC_STARTS (the last input's target belongs to the last document)."""
    ids = torch.zeros(B, S + 1, dtype=torch.long)
    for b, starts in enumerate(DOC_STARTS):
        for d, s in enumerate(starts):
            ids[b, s:] = d
    return ids


def loss_of(out, targets, coef, n_targets=None):
    lm = lm_loss(out.logits, targets, n_targets)
    return lm + coef[0] * out.aux_loss + coef[1] * out.z_loss


def run_case(cfg, model, cp: int, group, cp_rank: int, docs: bool) -> dict:
    tokens = torch.randint(0, cfg.model.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(3))
    batch = Batch(tokens, documents() if docs else None)
    targets, extra = batch.targets(), {}
    if docs:
        extra["document_ids"] = batch.document_ids[:, :-1]
    coef = (cfg.model.moe.aux_loss_coef, 1e-3)  # a z loss too, so its gradient is compared

    ref = copy.deepcopy(model)
    out = ref(batch.tokens[:, :-1], **extra)
    loss = loss_of(out, targets, coef)
    loss.backward()

    mine = copy.deepcopy(model)
    shard = seq_shard(group, cp, cp_rank, S)
    n_targets = (targets != IGNORE).sum().item() / cp
    out_cp = mine(shard.local(batch.tokens[:, :-1]), shard=shard, **extra)
    loss_cp = loss_of(out_cp, shard.local(targets), coef, n_targets)
    loss_cp.backward()

    def err(got, want):
        return {"err": (got - want).abs().max().item(), "scale": want.abs().max().item()}

    result = {
        "logits": err(out_cp.logits.detach(), shard.local(out.logits.detach())),
        "loss": err(_group_sum(loss_cp.detach(), group) / cp, loss.detach()),
        "grads": {},
        "tokens_per_expert": [],
        "dropped": [],
    }
    for (name, p_ref), p in zip(ref.named_parameters(), mine.parameters(), strict=True):
        result["grads"][name] = err(_group_sum(p.grad, group) / cp, p_ref.grad)
    for s_ref, s in zip(out.moe_stats, out_cp.moe_stats, strict=True):
        result["tokens_per_expert"].append(
            [_group_sum(s.tokens_per_expert_E.double(), group).tolist(), s_ref.tokens_per_expert_E.double().tolist()]
        )
        result["dropped"].append([_group_sum(s.dropped_E.double(), group).tolist(), s_ref.dropped_E.double().tolist()])
    return result


def _group_sum(t: torch.Tensor, group) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def main(out_dir: Path) -> None:
    rank = workers.start()
    groups = {4: dist.new_group([0, 1, 2, 3])}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in the same order
    groups[2] = pairs[rank // 2]
    cfg = load_config(CONFIG, MODEL)
    model = materialize_whole(build_model(cfg.model), "cpu", seed=0).double()
    results = {}
    for cp in (2, 4):
        for docs in (False, True):
            name = f"cp{cp}_{'docs' if docs else 'nodocs'}"
            results[name] = run_case(cfg, model, cp, groups[cp], rank % cp, docs)
    workers.finish(out_dir, rank, results)


if __name__ == "__main__":
    workers.run(main)
