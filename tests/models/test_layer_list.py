"""The layer list in the decoder: `model.layers` spelled out builds the same parameters (names, shapes, values)
and logits as the pattern form of the shipped configs; single-sublayer layers and the Mamba-2 / Gated DeltaNet
mixers decode with the cache as full recomputation does."""

from pathlib import Path

import pytest
import torch

from moe_dist.config import ModelConfig, load_config
from moe_dist.models.decoder import Block, build_model, generate, materialize_whole

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


def _spelled_out(cfg: ModelConfig) -> ModelConfig:
    """The same model with `layers` given explicitly and the patterns back at their defaults."""
    import dataclasses

    return dataclasses.replace(cfg, layers=cfg.layer_list(), mixer_pattern="A", ffn_pattern="E")


@pytest.mark.parametrize("name", ["debug", "mixtral_small", "jamba_v0.1"])
def test_explicit_layers_build_the_parameters_of_the_pattern_form(name):
    cfg = load_config(REPO / f"configs/{name}.json").model
    explicit = _spelled_out(cfg)
    assert explicit.layers is not None and explicit.layer_list() == cfg.layer_list()
    shapes = [(n, tuple(p.shape)) for n, p in build_model(cfg, "meta").named_parameters()]
    assert [(n, tuple(p.shape)) for n, p in build_model(explicit, "meta").named_parameters()] == shapes


def test_explicit_layers_give_bitwise_equal_logits():
    cfg = load_config(REPO / "configs/debug.json").model
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = materialize_whole(build_model(cfg), "cpu", seed=3)(tokens).logits
        out = materialize_whole(build_model(_spelled_out(cfg)), "cpu", seed=3)(tokens).logits
    assert torch.equal(out, ref)


HYBRID = ["attention+moe", "mamba2", "gdn+mlp", "moe"]


def _hybrid(dtype=torch.float64) -> torch.nn.Module:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=4, d_ff=48, layers=HYBRID)
    cfg.attention.n_heads, cfg.attention.n_kv_heads = 4, 2
    cfg.moe.num_experts, cfg.moe.capacity_factor = 4, None  # dropless, as generate requires
    cfg.mamba2.head_dim, cfg.mamba2.d_state, cfg.mamba2.chunk_size = 16, 8, 4
    cfg.gdn.head_k_dim, cfg.gdn.head_v_dim, cfg.gdn.chunk_size = 8, 8, 4
    return materialize_whole(build_model(cfg), "cpu", seed=0).to(dtype)


def test_single_sublayer_layers_have_only_their_sublayer():
    model = _hybrid()
    names = {n.split(".", 2)[1] + "." + n.split(".", 3)[2] for n, _ in model.named_parameters() if n[:6] == "blocks"}
    assert {"1.mixer_norm", "1.mixer"} <= names and not {"1.ffn", "1.ffn_norm"} & names
    assert {"3.ffn_norm", "3.ffn"} <= names and not {"3.mixer", "3.mixer_norm"} & names
    assert isinstance(model.blocks[1], Block) and model.blocks[1].ffn is None and model.blocks[3].mixer is None
    assert set(model.implementations()) >= {"attention", "ssd", "delta_rule", "experts"}


def test_cached_greedy_generation_equals_recomputation_on_a_hybrid():
    model = _hybrid()
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    cached = generate(model, prompt, 9, temperature=0)
    assert torch.equal(cached, generate(model, prompt, 9, temperature=0, use_cache=False))
    # The logits themselves: one token at a time through the cache against the whole sequence at once (fp64).
    cache = model.new_cache(2, cached.shape[1])
    with torch.no_grad():
        full = model(cached).logits
        steps = [model(cached[:, :7], cache).logits]
        steps += [model(cached[:, i : i + 1], cache).logits for i in range(7, cached.shape[1])]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-10
