"""Worker for test_pp_schedule.py, run as `torchrun --nproc_per_node P pp_schedule_worker.py OUT_DIR`.

A pipeline of P gloo ranks (the mesh's pp groups, `init_distributed` with parallel.pp = P) runs one step of M
micro-batches of an fp64 hybrid decoder (attention, Mamba-1, Mamba-2, Gated DeltaNet; capacity-dropping MoE,
documents packed) under torch.distributed.pipelining's schedules, the MoE balancing losses injected in each
stage's backward. Every rank also runs the whole model in one process with gradient accumulation (the reference:
Σ (lm + α·aux + β·z) / M, backward per micro-batch). Each rank writes OUT_DIR/rank<R>.json: per case, its stages'
parameter gradients' largest difference from the reference's and the reference's magnitude, the last stage's
micro-batch LM losses beside the reference's, and its MoE layers' tokens and drops per expert beside the reference's.
Cases: 1F1B (one stage per rank) and interleaved 1F1B (two stages per rank), and with P = 2 untied and tied
embeddings (the tied head's copy on the last stage: its gradient summed with the first stage's embedding's).
"""

import json
import os
from pathlib import Path

import torch
import workers

from moe_dist.config import load_config
from moe_dist.data.batches import IGNORE
from moe_dist.models.decoder import build_model, lm_loss, materialize_whole
from moe_dist.parallel.comm import all_reduce_sum
from moe_dist.parallel.pipeline import build_schedule, local_stages
from moe_dist.planning.stage_cut import stage_starts

B, S, M = 1, 16, 4  # rows per micro-batch, positions, micro-batches
CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "debug.json")
MODEL = [
    "model.mixer_pattern=A",
    "model.ffn_pattern=E",
    "model.mamba2.head_dim=16",
    "model.mamba2.d_state=16",
    "model.mamba2.chunk_size=8",
    "model.gdn.head_k_dim=16",
    "model.gdn.head_v_dim=16",
    "model.gdn.chunk_size=8",
    "model.moe.capacity_factor=1.0",
    "model.moe.z_loss_coef=0.01",
]
# 8 layers: attention, Mamba and MoE layers on every stage of 2 and of 4; layer 7 dense, so at 4 stages of 2 the
# last stage has one MoE layer and at 8 stages (P = 4, interleaved) stage 7 has none and stage 6 only an MoE FFN.
LAYERS = [
    "attention+moe",
    "mamba1+mlp",
    "mamba2+moe",
    "gdn+mlp",
    "attention+moe",
    "mamba1+moe",
    "moe",
    "gdn+mlp",
]


def cases(pp: int) -> dict[str, list[str]]:
    base = [*MODEL, f"model.layers={json.dumps(LAYERS)}", f"model.n_layers={len(LAYERS)}", f"parallel.pp={pp}"]
    out = {"1f1b": base, "interleaved": [*base, "parallel.pp_virtual=2"]}
    if pp == 2:
        out["tied"] = [*base, "model.tie_embeddings=true"]
    return out


def data(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (M * B, S + 1), generator=g)
    docs = torch.zeros(M * B, S + 1, dtype=torch.long)
    docs[:, 7:] = 1  # a document boundary inside every row
    targets = tokens[:, 1:].clone()
    targets[docs[:, 1:] != docs[:, :-1]] = IGNORE  # a document's first token has no target
    return tokens[:, :-1], targets, docs[:, :-1]


def reference(cfg, tokens, targets, docs):
    """One process: the whole model, M micro-batches accumulated. Gradients by name, LM losses, stats per layer."""
    model = materialize_whole(build_model(cfg.model), "cpu", cfg.train.seed).double()
    moe = cfg.model.moe
    lms, stats = [], []
    for i in range(M):
        rows = slice(i * B, (i + 1) * B)
        out = model(tokens[rows], document_ids=docs[rows])
        lm = lm_loss(out.logits, targets[rows])
        ((lm + moe.aux_loss_coef * out.aux_loss + moe.z_loss_coef * out.z_loss) / M).backward()
        lms.append(lm.item())
        stats.append(out.moe_stats)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return grads, lms, stats


def run_case(cfg, mesh) -> dict:
    tokens, targets, docs = data(cfg.model.vocab_size)
    ref_grads, ref_lms, ref_stats = reference(cfg, tokens, targets, docs)

    model = materialize_whole(build_model(cfg.model), "cpu", cfg.train.seed).double()
    starts = stage_starts(cfg)
    stages = local_stages(model, starts, mesh.pp, mesh.pp_rank)
    indices = list(range(mesh.pp_rank, len(starts), mesh.pp))
    kinds = cfg.model.layer_kinds()
    n_moe = sum(f == "moe" for _, f in kinds)
    moe = cfg.model.moe
    for st in stages:
        st.aux_scale, st.z_scale = moe.aux_loss_coef / (n_moe * M), moe.z_loss_coef / (n_moe * M)
    lms: list[torch.Tensor] = []

    def loss_fn(logits, target):
        lm = lm_loss(logits, target)
        lms.append(lm.detach())
        return lm / M

    schedule = build_schedule(stages, indices, len(starts), M, loss_fn, mesh.pp_group, (B, S))
    first, last = any(s.first for s in stages), any(s.last for s in stages)
    args = (tokens,) if first else ()
    schedule.step(*args, target=targets if last else None, document_ids=docs)

    result = {"grads": {}, "tokens_per_expert": [], "dropped": [], "stages": indices}
    if cfg.model.tie_embeddings:  # the first stage's embedding and the last stage's head copy: one parameter
        tied = next(s.embed.weight for s in stages if s.embed is not None)
        tied.grad = all_reduce_sum(tied.grad.clone(), mesh.pp_group)
    for st in stages:
        for name, p in st.named_parameters():
            if name.startswith("blocks."):
                _, i, rest = name.split(".", 2)
                name = f"blocks.{i}.{rest}"
            want = ref_grads[name]
            result["grads"][f"stage{st.start}:{name}"] = {
                "err": (p.grad - want).abs().max().item(),
                "scale": want.abs().max().item(),
            }
        moe_layers = [i for i in range(st.start, st.end) if kinds[i][1] == "moe"]
        first_moe = sum(f == "moe" for _, f in kinds[: st.start])
        for j in range(len(moe_layers)):
            got = torch.stack([mb[j].tokens_per_expert_E for mb in st.stats]).sum(0)
            want = torch.stack([mb[first_moe + j].tokens_per_expert_E for mb in ref_stats]).sum(0)
            result["tokens_per_expert"].append([got.tolist(), want.tolist()])
            got_d = sum(float(mb[j].dropped) for mb in st.stats)
            want_d = sum(float(mb[first_moe + j].dropped) for mb in ref_stats)
            result["dropped"].append([got_d, want_d])
        result.setdefault("moe_layers", []).extend(moe_layers)
    if last:
        result["lm"] = [[a.item(), b] for a, b in zip(lms, ref_lms, strict=True)]
    return result


def main(out_dir: Path) -> None:
    pp = int(os.environ["WORLD_SIZE"])
    results = {}
    mesh = None
    for name, overrides in cases(pp).items():
        cfg = load_config(CONFIG, overrides)
        if mesh is None:
            mesh = workers.start_mesh(cfg)
        results[name] = run_case(cfg, mesh)
    workers.finish(out_dir, mesh.rank, results)


if __name__ == "__main__":
    workers.run(main)
