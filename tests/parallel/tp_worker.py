"""Worker for test_tp_layers.py, run as `torchrun --nproc_per_node 2 tp_worker.py OUT_DIR`.

Both ranks build the same single-device model, keep an unsharded copy as the reference, shard the other with
the real `apply_tp` (tp = 2), and run every layer (attention with grouped-query heads, MLA, Mamba with and without
Jamba's inner norms, Mamba-2 with fewer and more B/C groups than ranks, Gated DeltaNet, dense SwiGLU, MoE with
capacity drops, squared-ReLU dense FFNs, experts (split, or whole behind the all-to-all) and shared experts,
vocabulary-parallel embedding and loss, tied and untied heads) forward and backward on the same
inputs through both. Each rank writes, per compared tensor, the largest absolute difference and the reference's
largest magnitude; the test asserts on them.
"""

import copy
import dataclasses
from pathlib import Path

import torch
import workers

from moe_dist.config import load_config
from moe_dist.layers.experts import Experts
from moe_dist.layers.moe import MoE
from moe_dist.models.activation_checkpointing import apply_activation_checkpointing
from moe_dist.models.decoder import build_model, lm_loss, materialize_whole
from moe_dist.parallel.expert_parallel import apply_ep
from moe_dist.parallel.tensor_parallel import apply_tp, shard, vocab_parallel_lm_loss

BASE = [
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_layers=2",
    "model.mixer_pattern=AM",
    "model.ffn_pattern=DE",
    "model.attention.n_heads=4",
    "model.attention.n_kv_heads=2",
    "model.mamba.d_state=8",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.capacity_factor=1.0",
    "parallel.tp=2",
    "deepspeed.zero_stage=1",
]
VARIANTS = {
    "norms_untied": ["model.mamba.inner_norms=true", "model.tie_embeddings=false"],
    "plain_tied": ["model.mamba.inner_norms=false", "model.tie_embeddings=true"],
    "sp_norms_untied": [
        "model.mamba.inner_norms=true",
        "model.tie_embeddings=false",
        "parallel.sequence_parallel=true",
    ],
    "moe_recipes": [  # sigmoid scores, bias, groups, sequence aux loss and gated shared experts under TP
        "model.mamba.inner_norms=false",
        "model.moe.score=sigmoid",
        "model.moe.bias_update_rate=0.01",
        "model.moe.n_groups=2",
        "model.moe.aux_loss_scope=sequence",
        "model.moe.n_shared_experts=1",
        "model.moe.shared_gate=true",
        "model.attention.qk_norm=head",  # Qwen3's per-head q/k norms and Qwen2's q/k/v biases under TP too
        "model.attention.qkv_bias=true",
        "model.attention.output_gate=true",  # Qwen3-Next's gated attention (wq rows per head [q | gate]),
        "model.attention.rope_fraction=0.5",  # partial RoPE
        "model.norm_zero_centered=true",  # and zero-centred norms
    ],
    # Nemotron-H's squared-ReLU FFNs (no gate: w1 up, w2 down) in the dense FFN, the experts (split over TP) and the
    # shared expert
    "relu2": ["model.ffn_activation=relu2", "model.moe.n_shared_experts=1"],
    # the same with whole experts (etp = 1) behind an all-to-all over the TP ranks (`_folded`), sequence parallel
    "sp_relu2_whole": [
        "model.ffn_activation=relu2",
        "model.moe.n_shared_experts=1",
        "parallel.ep=2",
        "parallel.etp=1",
        "parallel.sequence_parallel=true",
    ],
}
# Mamba-2 and Gated DeltaNet (the patterns reset to their defaults for a layer list). One B/C group, fewer than the TP
# ranks (Granite's default): split along its state and all-gathered, its norm statistics summed over the ranks; four
# groups, two whole ones per rank, under sequence parallelism. Gated DeltaNet with two and with one value heads per
# key head. Chunks of 8 over 16 positions: the chunked scans cross a chunk boundary. The first recomputes every
# sublayer in backward (activation checkpointing), collectives inside the mixers included.
_SSM = [
    "model.mixer_pattern=A",
    "model.ffn_pattern=E",
    'model.layers=["mamba2+mlp","gdn+moe"]',
    "model.mamba2.head_dim=8",  # 8 heads of d_inner 64
    "model.mamba2.d_state=8",
    "model.mamba2.chunk_size=8",
    "model.gdn.head_k_dim=8",
    "model.gdn.head_v_dim=8",
    "model.gdn.chunk_size=8",
]
VARIANTS.update(
    {
        "ssm_groups1_untied": [
            *_SSM,
            "model.mamba2.n_groups=1",
            "model.gdn.n_k_heads=2",
            "model.gdn.n_v_heads=4",
            "model.tie_embeddings=false",
            "train.activation_checkpointing=full",  # the mixers' collectives run again in the recompute
        ],
        "sp_ssm_groups4": [
            *_SSM,
            "model.mamba2.n_groups=4",
            "model.gdn.n_k_heads=2",
            "model.gdn.n_v_heads=2",
            "parallel.sequence_parallel=true",
        ],
    }
)


# Multi-head Latent Attention: heads split, its down-projections and norms replicated (their gradients summed); with
# the query bottleneck, RoPE interleaved and YaRN, and with a full-rank query under sequence parallelism
_MLA = [
    "model.mixer_pattern=A",
    "model.ffn_pattern=E",
    'model.layers=["mla+mlp","mla+moe"]',
    "model.mla.n_heads=4",
    "model.mla.kv_lora_rank=12",
    "model.mla.qk_nope_head_dim=6",
    "model.mla.qk_rope_head_dim=4",
    "model.mla.v_head_dim=5",
]
VARIANTS.update(
    {
        "mla_q_lora": [
            *_MLA,
            "model.mla.q_lora_rank=10",
            "model.mla.rope_interleave=true",
            "model.mla.rope_scaling.type=yarn",
            "model.mla.rope_scaling.factor=4.0",
            "model.mla.rope_scaling.original_max_position_embeddings=8",
            "model.mla.rope_scaling.mscale_all_dim=1.0",
        ],
        "sp_mla_full_q": [*_MLA, "parallel.sequence_parallel=true"],
    }
)


def _folded(mesh):
    """The 2-rank TP mesh as (dp, ep, tp, etp) = (1, 2, 2, 1): expert parallelism folded across TP, its EP group the
    TP group (both ranks hold the same tokens, each dispatches its slice of them to whole experts)."""
    return dataclasses.replace(
        mesh, ep=2, ep_rank=mesh.tp_rank, ep_group=mesh.tp_group, ep_group_name="ep_size_2", etp=1
    )


def _models(cfg, mesh):
    """The single-device model (seed 0) and its tensor-parallel version with the same values: a copy sharded by
    apply_tp, or with whole experts (etp = 1) the model built with this rank's experts (apply_ep) and then sharded."""
    ref = materialize_whole(build_model(cfg.model), "cpu", seed=0)
    if cfg.parallel.etp == 1:
        mesh = _folded(mesh)
        model = materialize_whole(apply_ep(build_model(cfg.model), mesh), "cpu", seed=0)
    else:
        model = copy.deepcopy(ref)
    return ref, apply_tp(model, mesh, cfg.parallel.sequence_parallel)


def _diff(got: torch.Tensor, want: torch.Tensor) -> dict:
    return {"err": (got.float() - want.float()).abs().max().item(), "scale": want.float().abs().max().item()}


def _compare_grads(ref: torch.nn.Module, sharded: torch.nn.Module, mesh, prefix: str, out: dict) -> None:
    offsets = {id(p): m.expert_offset for m in sharded.modules() if isinstance(m, Experts) for p in m.parameters()}
    for (name, p_ref), (name_tp, p_tp) in zip(ref.named_parameters(), sharded.named_parameters(), strict=True):
        assert name_tp == name, (name_tp, name)  # apply_tp keeps global parameter names
        want = p_ref.grad
        if id(p_tp) in offsets:  # this rank's experts (all of them unless apply_ep kept a slice)
            want = want[offsets[id(p_tp)] : offsets[id(p_tp)] + p_tp.shape[0]]
        if hasattr(p_tp, "tp_dim"):
            want = shard(want, p_tp.tp_dim, mesh.tp_rank, mesh.tp, p_tp.tp_parts)
        out[f"{prefix}.grad.{name}"] = _diff(p_tp.grad, want)


def _check_relu2_shards(cfg, model: torch.nn.Module) -> None:
    """Squared-ReLU FFNs have no w3; their up projections are split (or the experts kept whole) as SwiGLU's are."""
    if cfg.model.ffn_activation != "relu2":
        return
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    experts, dense = moe.experts, next(b.ffn for b in model.blocks if not isinstance(b.ffn, MoE))
    assert dense.w3 is None and moe.shared.w3 is None and not hasattr(experts, "w13")
    assert dense.w1.weight.tp_dim == moe.shared.w1.weight.tp_dim == 0
    if cfg.parallel.etp == 1:  # two of the four experts, whole (d_ff 64)
        assert experts.w1.shape == (2, 32, 64) and not hasattr(experts.w1, "tp_dim")
    else:  # all four, half of each one's hidden units
        assert experts.w1.shape == (4, 32, 32) and (experts.w1.tp_dim, experts.w1.tp_parts) == (2, 1)


def _run_module(ref, sharded, x, mesh, prefix: str, out: dict, sp: bool) -> None:
    """Forward both on x, backward a random projection of the output (+ MoE losses), compare everything. With
    sequence parallelism the sharded module takes and returns this rank's slice of the sequence (dim 1)."""
    local = (lambda t: shard(t, 1, mesh.tp_rank, mesh.tp)) if sp else (lambda t: t)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for module, view in ((ref, lambda t: t), (sharded, local)):
        xi = view(x).clone().requires_grad_(True)
        y = module(xi)
        extra = 0.0
        if isinstance(y, tuple):  # MoE: (output, routing stats)
            y, stats = y
            extra = stats.aux_loss + stats.z_loss
        ((y * view(w)).sum() + extra).backward()
        results.append((y.detach(), xi.grad))
    out[f"{prefix}.out"] = _diff(results[1][0], local(results[0][0]))
    out[f"{prefix}.grad.input"] = _diff(results[1][1], local(results[0][1]))
    _compare_grads(ref, sharded, mesh, prefix, out)


def _documents(overrides: list[str], mesh, variant: str, out: dict) -> None:
    """Packed documents (dropless MoE, where routing is per token): the sharded model keeps them apart as the
    single-device one does; changing one document leaves the other documents' logits unchanged."""
    cfg = load_config(None, BASE + overrides + ["model.moe.capacity_factor=null"])
    ref, tp_model = _models(cfg, mesh)
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])  # (2, 16)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    changed = tokens.clone()
    changed[0, 5:12] = (changed[0, 5:12] + 1) % cfg.model.vocab_size
    with torch.no_grad():
        ref_base = ref(tokens, document_ids=docs).logits
        base, chg = (tp_model(t, document_ids=docs).logits for t in (tokens, changed))
    other = docs != 1
    other[1] = True
    out[f"{variant}.documents.vs_single"] = _diff(base, shard(ref_base, 2, mesh.tp_rank, mesh.tp))
    out[f"{variant}.documents.other"] = _diff(chg[other], base[other])
    out[f"{variant}.documents.changed"] = _diff(chg[~other], base[~other])


def main(out_dir: Path) -> None:
    out: dict = {}
    mesh = None
    for variant, overrides in VARIANTS.items():
        cfg = load_config(None, BASE + overrides)
        if mesh is None:
            mesh = workers.start_mesh(cfg)
        ref, tp_model = _models(cfg, mesh)
        _check_relu2_shards(cfg, tp_model)
        tp_model = apply_activation_checkpointing(tp_model, cfg.train)
        x = torch.randn(2, 16, cfg.model.d_model, generator=torch.Generator().manual_seed(0))
        for b_ref, b_tp in zip(ref.blocks, tp_model.blocks):
            kind = type(b_ref.mixer).__name__.lower()
            sp = cfg.parallel.sequence_parallel
            _run_module(b_ref.mixer, b_tp.mixer, x, mesh, f"{variant}.{kind}", out, sp)
            kind = "moe" if isinstance(b_ref.ffn, MoE) else "swiglu"
            _run_module(b_ref.ffn, b_tp.ffn, x, mesh, f"{variant}.{kind}", out, sp)
        # Whole model: vocabulary-parallel embedding, head and loss; every parameter's gradient.
        ref.zero_grad()
        tp_model.zero_grad()
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
        o_ref, o_tp = ref(tokens[:, :-1]), tp_model(tokens[:, :-1])
        assert o_tp.logits.shape[-1] == cfg.model.vocab_size // 2, "the logits must stay vocabulary-sharded"
        loss_ref = lm_loss(o_ref.logits, tokens[:, 1:]) + 0.01 * o_ref.aux_loss
        loss_tp = vocab_parallel_lm_loss(o_tp.logits, tokens[:, 1:], mesh) + 0.01 * o_tp.aux_loss
        loss_ref.backward()
        loss_tp.backward()
        out[f"{variant}.model.loss"] = _diff(loss_tp.detach(), loss_ref.detach())
        logits_shard = shard(o_ref.logits.detach(), 2, mesh.tp_rank, mesh.tp)
        out[f"{variant}.model.logits"] = _diff(o_tp.logits.detach(), logits_shard)
        _compare_grads(ref, tp_model, mesh, f"{variant}.model", out)
        _documents(overrides, mesh, variant, out)
    workers.finish(out_dir, mesh.rank, out)


if __name__ == "__main__":
    workers.run(main)
