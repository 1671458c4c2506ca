"""model.layers: its expansion from the patterns (`ModelConfig.layer_list`) and its one-line refusals."""

import pytest

from moe_dist.config import ConfigError, ModelConfig, load_config

HYBRID = '["attention+moe","mamba2","gdn+mlp","moe"]'


def test_null_expands_the_patterns_tiled():
    cfg = ModelConfig(n_layers=4, mixer_pattern="AM", ffn_pattern="ED")
    assert cfg.layer_list() == ["attention+moe", "mamba1+mlp", "attention+moe", "mamba1+mlp"]
    assert cfg.layer_kinds()[1] == ("mamba1", "mlp")
    assert ModelConfig(n_layers=2).layer_list() == ["attention+moe", "attention+moe"]


def test_an_explicit_list_with_single_sublayer_layers():
    cfg = load_config(None, [f"model.layers={HYBRID}"]).model
    assert cfg.layer_list() == ["attention+moe", "mamba2", "gdn+mlp", "moe"]
    assert cfg.layer_kinds() == [("attention", "moe"), ("mamba2", None), ("gdn", "mlp"), (None, "moe")]
    assert cfg.has_kind("gdn") and not cfg.has_kind("mamba1")


@pytest.mark.parametrize(
    "layers, message",
    [
        ('["attention+moe","mamba3","moe","mlp"]', r"^model\.layers\[1\]: expected a mixer .* got 'mamba3'$"),
        ('["attention+moe","moe+attention","moe","mlp"]', r"^model\.layers\[1\]: .* got 'moe\+attention'$"),
        ('["attention+moe","","moe","mlp"]', r"^model\.layers\[1\]: .* got ''$"),
        ('["attention+mamba2","moe","moe","mlp"]', r"^model\.layers\[0\]: .* got 'attention\+mamba2'$"),
        ('["attention+moe+mlp","moe","moe","mlp"]', r"^model\.layers\[0\]: .*"),
        ('["attention+moe","moe"]', r"^model\.layers: 2 entries, but model\.n_layers=4$"),
    ],
)
def test_bad_entries_are_refused_naming_the_entry(layers, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [f"model.layers={layers}"])
    assert "\n" not in str(err.value)


def test_layers_and_patterns_are_not_both_set():
    with pytest.raises(ConfigError, match=r"^model\.layers: set either model\.layers or model\.mixer_pattern"):
        load_config(None, ["model.ffn_pattern=ED", f"model.layers={HYBRID}"])


def test_mamba2_shapes_are_checked_when_a_layer_places_it():
    bad = ["model.d_model=80", "model.mamba2.head_dim=64"]  # d_inner 160 is not a multiple of 64
    load_config(None, bad)  # no mamba2 layer: not checked
    with pytest.raises(ConfigError, match=r"^model\.mamba2\.head_dim: must divide d_inner"):
        load_config(None, [*bad, f"model.layers={HYBRID}"])


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_the_new_mixers_take_tensor_parallelism(kind):
    """Their splits are tested in parallel/test_tp_layers.py; what TP cannot split is refused in test_config.py."""
    layers = HYBRID if kind == "mamba2" else '["attention+moe","mamba1+mlp","gdn+mlp","moe"]'
    assert load_config(None, [f"model.layers={layers}", "parallel.tp=2"]).parallel.tp == 2
