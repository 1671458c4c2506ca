"""Nemotron-H and Granite 4.0-H against transformers' own implementations: tiny random models built and saved
locally (nothing downloaded), imported, compared logit for logit, exported back bit for bit, decoded greedily with
our cache as transformers' generate does; the published config.json form (hybrid_override_pattern, mamba_* keys)
is read; what the formats hold that we cannot express is refused by name, MTP tensors dropped with a warning."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from hf.test_hf import _greedy_as_transformers, _perturb, _same_tensors, _tensors, _tokens, _transformers_reloads_to
from safetensors.torch import load_file, save_file

from moe_dist.config import ModelConfig
from moe_dist.hf import HFConfigError, config_from_hf, config_to_hf, load_hf_model, save_hf_model
from moe_dist.models.decoder import build_model, materialize_whole

ATOL = 1e-5  # fp32; the measured max |logit difference| is printed (-s)
MAMBA = dict(chunk_size=8)  # several chunks over the test's 20 tokens

NEMOTRON = dict(
    vocab_size=256,
    hidden_size=32,
    layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=24,
    mamba_num_heads=4,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=8,
    chunk_size=8,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=20,
    initializer_range=0.1,
)
GRANITE = dict(
    vocab_size=256,
    hidden_size=32,
    num_hidden_layers=4,
    layer_types=["mamba", "attention", "mamba", "mamba"],
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=16,
    shared_intermediate_size=20,
    num_local_experts=4,
    num_experts_per_tok=2,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=8,
    mamba_n_groups=2,
    mamba_chunk_size=8,
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.3,
    logits_scaling=2.0,
    position_embedding_type="nope",
    tie_word_embeddings=True,  # as Granite 4.0-H's published configs
    initializer_range=0.1,
)
FAMILIES = {
    "nemotron_h": (transformers.NemotronHForCausalLM, transformers.NemotronHConfig, NEMOTRON),
    "granitemoehybrid": (transformers.GraniteMoeHybridForCausalLM, transformers.GraniteMoeHybridConfig, GRANITE),
}


def family_dir(kind: str, path, **overrides):
    cls, cfg_cls, kwargs = FAMILIES[kind]
    torch.manual_seed(0)
    model = cls(cfg_cls(**{**kwargs, **overrides})).eval()
    _perturb(model, 5)
    with torch.no_grad():  # the correction bias starts at zero: move it so that it decides some choices
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, family_dir(request.param, path), path


def test_layer_lists_and_fields(family):
    kind, _, path = family
    cfg = load_hf_model(path).cfg
    if kind == "nemotron_h":
        assert cfg.layers == ["mamba2", "moe", "attention", "mlp", "mamba2", "moe"]
        moe, mb = cfg.moe, cfg.mamba2
        assert (cfg.ffn_activation, moe.score, moe.route_scale, moe.n_groups, moe.topk_groups) == (
            "relu2",
            "sigmoid",
            2.5,
            2,
            1,
        )
        assert (moe.n_shared_experts, moe.shared_d_ff, moe.d_ff, cfg.attention.rope) == (1, 20, 16, False)
        assert (mb.n_heads, mb.head_dim, mb.n_groups, mb.d_state, mb.dt_limit) == (4, 16, 2, 8, [0.001, math.inf])
    else:
        assert cfg.layers == ["mamba2+moe", "attention+moe", "mamba2+moe", "mamba2+moe"]
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (3.0, 0.5, 2.0)
        assert (cfg.attention.softmax_scale, cfg.attention.rope, cfg.moe.shared_d_ff) == (0.3, False, 20)


def test_logits_match_transformers(family):
    kind, hf_model, path = family
    ours = load_hf_model(path).eval()
    tokens = _tokens()
    with torch.no_grad():
        diff = (hf_model(tokens).logits - ours(tokens).logits).abs().max().item()
    print(f"{kind}: max |logit diff| = {diff:.2e}")
    assert diff <= ATOL


def test_export_import_round_trip_is_bit_identical(family, tmp_path):
    _, _, path = family
    ours = load_hf_model(path)
    save_hf_model(ours, tmp_path, template=json.loads((path / "config.json").read_text()))
    _same_tensors(_tensors(path), tmp_path)
    assert load_hf_model(tmp_path).cfg == ours.cfg
    _transformers_reloads_to(tmp_path, family[1], 1)


def test_greedy_generation_matches_transformers(family):
    _, hf_model, path = family
    _greedy_as_transformers(load_hf_model(path), hf_model, _tokens(2, (2, 7)), 6)


def test_our_hybrid_models_export_to_transformers(tmp_path):
    """A model of ours (random init) in each family's form exports and transformers computes the same logits."""
    for kind, layers, extra in (
        ("nemotron_h", ["mamba2", "attention", "moe", "mlp"], dict(ffn_activation="relu2")),
        ("granitemoehybrid", ["attention+moe", "mamba2+moe"], dict(embedding_multiplier=2.0, logits_scaling=3.0)),
        ("granitemoehybrid", ["attention+mlp", "mamba2+mlp"], dict(rope=True)),  # RoPE; no experts: shared MLP alone
    ):
        cfg = config_from_hf(json.loads(json.dumps(config_to_hf(_ours(kind, layers, extra)))))
        assert cfg.layers == layers and cfg.attention.rope == extra.get("rope", False)
        model = materialize_whole(build_model(cfg), "cpu", seed=3)
        out = save_hf_model(model, tmp_path / f"{kind}{len(extra)}")
        theirs = FAMILIES[kind][0].from_pretrained(out).eval()
        tokens = _tokens(3)
        with torch.no_grad():
            diff = (theirs(tokens).logits - model.eval()(tokens).logits).abs().max().item()
        assert diff <= ATOL, (kind, diff)


def _ours(kind: str, layers: list[str], extra: dict) -> ModelConfig:
    from moe_dist.config import AttentionConfig, Mamba2Config, MoEConfig

    extra = dict(extra)
    rope = extra.pop("rope", False)
    nemotron = kind == "nemotron_h"
    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        d_ff=16,
        capacity_factor=None,
        n_shared_experts=1,
        shared_d_ff=12,
        score="sigmoid" if nemotron else "softmax",
        bias_update_rate=1e-3 if nemotron else 0.0,
    )
    return ModelConfig(
        vocab_size=256,
        d_model=32,
        n_layers=len(layers),
        d_ff=24,
        layers=layers,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, rope=rope),
        mamba2=Mamba2Config(
            d_state=8,
            n_heads=4,
            head_dim=16,
            n_groups=2,
            chunk_size=8,
            dt_limit=[0.001, math.inf] if nemotron else None,
        ),
        moe=moe,
        **extra,
    )


def test_published_nemotron_config_form_is_read():
    """The form of the published config.json files (hybrid_override_pattern, mamba_* keys, Infinity)."""
    text = """{
      "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 256,
      "hidden_size": 32, "num_hidden_layers": 5, "hybrid_override_pattern": "M-M*E",
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 24,
      "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_n_groups": 2, "ssm_state_size": 8, "mamba_d_conv": 4,
      "mamba_chunk_size": 8, "mamba_dt_min": 0.002, "time_step_limit": [0.0, Infinity], "mlp_hidden_act": "relu2",
      "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
      "moe_shared_expert_intermediate_size": 12, "moe_latent_size": null, "num_nextn_predict_layers": 1,
      "norm_topk_prob": true, "routed_scaling_factor": 2.5, "layer_norm_epsilon": 1e-5
    }"""
    cfg = config_from_hf(json.loads(text))
    assert cfg.layers == ["mamba2", "mlp", "mamba2", "attention", "moe"]
    assert (cfg.mamba2.n_groups, cfg.mamba2.d_conv, cfg.mamba2.chunk_size, cfg.mamba2.dt_limit) == (
        2,
        4,
        8,
        [0.002, math.inf],
    )
    granite = json.loads(text.replace("nemotron_h", "granitemoehybrid"))
    granite.update(layer_types=["mamba", "attention", "mamba", "mamba", "mamba"], shared_intermediate_size=12)
    granite.update(
        mamba_n_heads=4, mamba_d_head="auto", mamba_expand=2, mamba_d_state=8, num_local_experts=4, hidden_act="silu"
    )
    g = config_from_hf(granite)
    assert g.layers == ["mamba2+moe", "attention+moe", "mamba2+moe", "mamba2+moe", "mamba2+moe"]
    assert g.mamba2.head_dim == 16


def test_mtp_tensors_are_dropped_with_one_warning(tmp_path, capsys):
    family_dir("nemotron_h", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    mtp = {"mtp.layers.0.norm.weight": torch.ones(32), "mtp.layers.0.mixer.q_proj.weight": torch.zeros(32, 32)}
    save_file({**weights, **mtp}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    load_hf_model(tmp_path)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert lines == [
        f"warning: {tmp_path}: dropped 2 multi-token-prediction tensors (mtp.*): our model has no place for them"
    ]


@pytest.mark.parametrize(
    "kind, key, value",
    [
        ("nemotron_h", "moe_latent_size", 8),
        ("nemotron_h", "mlp_hidden_act", "silu"),
        ("nemotron_h", "hybrid_override_pattern", "M*X"),
        ("granitemoehybrid", "position_embedding_type", "alibi"),
        ("granitemoehybrid", "attention_bias", True),
        ("granitemoehybrid", "hidden_act", "gelu"),
    ],
)
def test_what_we_cannot_express_is_refused_by_name(kind, key, value):
    hf = {"model_type": kind, **FAMILIES[kind][2], key: value}
    if key == "hybrid_override_pattern":
        hf.pop("layers_block_type")
    with pytest.raises(HFConfigError, match=key):
        config_from_hf(hf)


def test_other_families_refuse_the_hybrid_options():
    """A relu2 or multiplied model is never written as a family that would silently drop the option."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, d_ff=16, ffn_activation="relu2")
    with pytest.raises(HFConfigError, match="ffn_activation must be 'swiglu'"):
        config_to_hf(cfg)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, d_ff=16, residual_multiplier=0.5)
    with pytest.raises(HFConfigError, match="residual_multiplier"):
        config_to_hf(cfg)


@pytest.mark.parametrize(
    "name, cls",
    [
        ("nemotron3_nano_30b_a3b", transformers.NemotronHForCausalLM),
        ("granite4_h_small", transformers.GraniteMoeHybridForCausalLM),
    ],
)
def test_reference_configs_count_as_transformers(name, cls):
    """The full-size reference config, exported to config.json and built by transformers on the meta device, has
    the parameter count ours has (what `--dry-run` reports) to 0.2%; it is the same architecture, so it is exact."""
    from pathlib import Path

    from moe_dist.config import load_config
    from moe_dist.models.decoder import param_counts

    cfg = load_config(Path(__file__).resolve().parents[2] / f"configs/{name}.json").model
    hf = json.loads(json.dumps(config_to_hf(cfg)))  # through JSON, as a config.json file is read
    hf_cfg = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in cls(hf_cfg).parameters())
    ours = param_counts(cfg)["params_total"]
    print(f"{name}: ours {ours:,} transformers {theirs:,}")
    assert abs(ours - theirs) <= 0.002 * theirs
    assert ours == theirs


def test_import_keeps_the_correction_bias(tmp_path):
    """convert.py import: the balancing rate may change; at 0 the imported correction bias stays, frozen (it decides
    the expert choices the imported weights were trained with), and drops only with `choice_bias` false: refused."""
    from moe_dist.config import ConfigError
    from moe_dist.hf import import_hf_to_run, load_checkpoint_model

    family_dir("nemotron_h", tmp_path / "hf")
    bias = _tensors(tmp_path / "hf")["backbone.layers.1.mixer.gate.e_score_correction_bias"]
    import_hf_to_run(tmp_path / "hf", tmp_path / "run0", model_overrides=["model.moe.bias_update_rate=0"])
    model, _ = load_checkpoint_model(tmp_path / "run0")
    assert model.cfg.moe.bias_update_rate == 0 and torch.equal(model.blocks[1].ffn.router.bias_E, bias)
    with pytest.raises(ConfigError, match="model.moe.choice_bias"):
        import_hf_to_run(tmp_path / "hf", tmp_path / "run1", model_overrides=["model.moe.choice_bias=false"])
    assert not (tmp_path / "run1").exists()
