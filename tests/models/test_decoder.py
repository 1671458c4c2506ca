"""The decoder stack: layer patterns, meta build + materialize, outputs, parameter counts."""

import torch

from moe_dist.config import load_config
from moe_dist.layers.attention import Attention
from moe_dist.layers.mamba import Mamba
from moe_dist.layers.mlp import SwiGLU
from moe_dist.layers.moe import MoE
from moe_dist.models.decoder import build_model, layer_kinds, lm_loss, materialize_whole, param_counts


def _cfg(*overrides):
    return load_config("configs/debug.json", list(overrides)).model


def test_jamba_pattern_places_attention_every_eighth_layer_and_moe_every_other():
    kinds = layer_kinds(load_config("configs/jamba_v0.1.json").model)
    assert [i for i, (m, _) in enumerate(kinds) if m == "attention"] == [4, 12, 20, 28]
    assert [i for i, (_, f) in enumerate(kinds) if f == "moe"] == list(range(1, 32, 2))


def test_blocks_follow_the_patterns():
    model = build_model(_cfg())
    types = [(type(b.mixer), type(b.ffn)) for b in model.blocks]
    assert types == [(Attention, MoE), (Mamba, SwiGLU), (Attention, MoE), (Mamba, SwiGLU)]
    assert all(p.is_meta for p in model.parameters())


def test_materialize_is_deterministic_in_the_seed_and_forward_has_the_right_shapes():
    cfg = _cfg()
    a = materialize_whole(build_model(cfg), "cpu", seed=1)
    b = materialize_whole(build_model(cfg), "cpu", seed=1)
    c = materialize_whole(build_model(cfg), "cpu", seed=2)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    tokens = torch.randint(0, 256, (3, 11))
    out = a(tokens)
    assert out.logits.shape == (3, 11, 256) and len(out.moe_stats) == 2
    assert torch.allclose(out.aux_loss, torch.stack([s.aux_loss for s in out.moe_stats]).mean())
    assert torch.allclose(out.z_loss, torch.stack([s.z_loss for s in out.moe_stats]).mean())
    for s in out.moe_stats:
        assert s.tokens_per_expert_E.sum() == 3 * 11 * 2


def test_tied_embeddings_share_the_matrix():
    model = materialize_whole(build_model(_cfg("model.tie_embeddings=true")), "cpu", 0)
    assert model.head is None
    tokens = torch.randint(0, 256, (2, 5))
    out = model(tokens)
    lm_loss(out.logits, tokens).backward()
    assert model.embed.weight.grad is not None and model.embed.weight.grad.abs().sum() > 0


def test_param_counts_active_counts_top_k_experts_per_moe_layer():
    cfg = _cfg()
    counts = param_counts(cfg)
    model = build_model(cfg)
    assert counts["params_total"] == sum(p.numel() for p in model.parameters())
    expert = 3 * cfg.d_model * cfg.d_ff  # one SwiGLU expert
    n_moe = sum(f == "moe" for _, f in layer_kinds(cfg))
    assert counts["params_total"] - counts["params_active"] == n_moe * expert * (cfg.moe.num_experts - cfg.moe.top_k)


def test_a_few_adam_steps_reduce_the_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    model = materialize_whole(build_model(_cfg()), "cpu", 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, 256, (4, 17))
    losses = []
    for _ in range(15):
        out = model(batch[:, :-1])
        loss = lm_loss(out.logits, batch[:, 1:]) + 0.01 * out.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_shard_by_shard_materialization_equals_whole_model_with_router_buffers():
    """parallelize's shard-by-shard initialization, in a world of one, gives every parameter and every buffer (the
    routers' balancing bias and previous-step load) the values the whole model gets from the same seed, on the
    device, with no tensor left on meta."""
    from moe_dist.parallel.mesh import Mesh
    from moe_dist.parallel.parallelize import parallelize

    cfg = load_config(
        "configs/debug.json", ["model.moe.bias_update_rate=0.001", "model.moe.aux_loss_scope=global_batch"]
    )
    mesh = Mesh(0, 1, 0, 1, torch.device("cpu"), 1, 0, 1, 0, None, None, "ep_size_1")
    got = parallelize(build_model(cfg.model), mesh, cfg).state_dict()
    want = materialize_whole(build_model(cfg.model), "cpu", cfg.train.seed).state_dict()
    assert got.keys() == want.keys() and any(k.endswith("router.bias_E") for k in got)
    for name, t in want.items():
        assert got[name].device.type == "cpu" and torch.equal(got[name], t), name
