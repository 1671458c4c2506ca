"""`--set model.…` on `launch/convert.py import` and `upcycle` (tiny transformers models built locally, nothing
downloaded): settings that keep the source's architecture reach the run's config.json and checkpoint; keys that
would change it are refused with one line naming the key, exit 2, and nothing written."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
import torch
import transformers
from hf.test_hf import _cli, _max_diff, _perturb, _tokens, mixtral_dir

from moe_dist.config import ConfigError, ModelConfig
from moe_dist.hf import load_checkpoint_model
from moe_dist.hf.overrides import ARCHITECTURE_KEYS, model_settings

pytestmark = pytest.mark.usefixtures("one_thread")

# Every model key outside ARCHITECTURE_KEYS: a conversion applies it. A new ModelConfig field fails
# test_every_model_key_is_decided until it is put here or there.
SETTINGS = {
    "model.init_std",
    "model.attention.impl",
    "model.attention.mask",
    "model.mla.impl",
    "model.mla.mask",
    "model.mamba.chunk_size",
    "model.mamba.impl",
    "model.mamba2.chunk_size",
    "model.mamba2.dt_min",
    "model.mamba2.dt_max",
    "model.mamba2.dt_init_floor",
    "model.mamba2.impl",
    "model.moe.capacity_factor",
    "model.moe.min_capacity",
    "model.moe.drop_policy",
    "model.moe.aux_loss_coef",
    "model.moe.z_loss_coef",
    "model.moe.impl",
    "model.moe.backend",
    "model.moe.bias_update_rate",
    "model.moe.aux_loss_scope",
    "model.moe.global_batch_load",
    "model.moe.group_by",
    "model.moe.dead_expert_window",
    "model.gdn.chunk_size",
    "model.gdn.impl",
}
APPLIED = [
    "model.moe.aux_loss_coef=0.05",
    "model.moe.capacity_factor=2.0",
    "model.moe.drop_policy=probability",
    "model.moe.bias_update_rate=0.001",  # adds a buffer (bias_E) the imported model did not have
    "model.moe.aux_loss_scope=global_batch",  # and load_E
    "model.attention.impl=torch",
]


def _model_keys(cls=ModelConfig, prefix="model") -> set[str]:
    keys = set()
    for name, tp in typing.get_type_hints(cls).items():
        keys |= _model_keys(tp, f"{prefix}.{name}") if dataclasses.is_dataclass(tp) else {f"{prefix}.{name}"}
    return keys


def test_every_model_key_is_decided():
    keys = _model_keys()
    assert not set(ARCHITECTURE_KEYS) & SETTINGS
    assert keys == set(ARCHITECTURE_KEYS) | SETTINGS


def test_model_settings_expands_sections_and_names_unknown_keys():
    got = model_settings(['model.moe={"aux_loss_coef": 0.1, "impl": "torch"}', "model.init_std=0.01"], "import")
    assert got == {"model.moe.aux_loss_coef": 0.1, "model.moe.impl": "torch", "model.init_std": 0.01}
    with pytest.raises(ConfigError, match=r"^model\.moe\.aux_los_coef: unknown config key \(did you mean"):
        model_settings(["model.moe.aux_los_coef=0.1"], "import")
    with pytest.raises(ConfigError, match=r"^model\.moe\.d_ff: cannot be set on import"):
        model_settings(['model.moe={"d_ff": 8}'], "import")
    # upcycle draws a new router: its routing recipe is the user's; its expert count is --experts
    assert model_settings(["model.moe.score=sigmoid", "model.moe.n_shared_experts=1"], "upcycle")
    with pytest.raises(ConfigError, match="--experts"):
        model_settings(["model.moe.num_experts=8"], "upcycle")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    return mixtral_dir(path), path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    _perturb(model, 6)
    model.save_pretrained(path)
    return model, path


def _sets(*texts: str) -> list[str]:
    return [arg for text in texts for arg in ("--set", text)]  # one --set per key: repeated flags accumulate


def _applied(cfg: dict) -> None:
    moe = cfg["model"]["moe"]
    assert (moe["aux_loss_coef"], moe["capacity_factor"], moe["drop_policy"]) == (0.05, 2.0, "probability")
    assert (moe["bias_update_rate"], moe["aux_loss_scope"]) == (0.001, "global_batch")
    assert cfg["model"]["attention"]["impl"] == "torch" and cfg["train"]["steps"] == 3


def test_import_applies_model_settings(mixtral, tmp_path):
    hf_model, path = mixtral
    run = tmp_path / "run"
    assert _cli("convert.py")(["import", str(path), str(run), *_sets(*APPLIED, "train.steps=3")]) == 0
    cfg = json.loads((run / "config.json").read_text())
    _applied(cfg)
    assert (cfg["model"]["d_model"], cfg["model"]["moe"]["num_experts"]) == (32, 4)  # still Mixtral's
    model, job = load_checkpoint_model(run, dropless=True)  # every tensor the config implies is in step_0
    router = model.blocks[0].ffn.router
    assert torch.equal(router.bias_E, torch.zeros(4)) and torch.equal(router.load_E, torch.full((4,), 0.25))
    assert _max_diff(hf_model, model, _tokens(3)) <= 2e-5  # the same weights: settings change training only


def _refused(capsys, key: str, run) -> None:
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {key}: cannot be set on "), err
    assert not run.exists()


@pytest.mark.parametrize("key", ["model.d_model=64", "model.moe.num_experts=8", "model.moe.top_k=1"])
def test_import_refuses_architecture_keys(mixtral, tmp_path, capsys, key):
    _, path = mixtral
    run = tmp_path / "run"
    args = ["import", str(path), str(run), *_sets("model.moe.aux_loss_coef=0.05", key)]
    assert _cli("convert.py")(args) == 2
    _refused(capsys, key.split("=")[0], run)


def test_upcycle_applies_model_settings(llama, tmp_path):
    hf_model, path = llama
    run = tmp_path / "run"
    sets = _sets(*APPLIED, "train.steps=3")
    assert _cli("convert.py")(["upcycle", str(path), str(run), "--experts", "4", "--top-k", "2", *sets]) == 0
    cfg = json.loads((run / "config.json").read_text())
    _applied(cfg)
    assert (cfg["model"]["ffn_pattern"], cfg["model"]["moe"]["num_experts"], cfg["model"]["moe"]["top_k"]) == (
        "E",
        4,
        2,
    )
    model, _ = load_checkpoint_model(run, dropless=True)
    assert torch.equal(model.blocks[0].ffn.router.bias_E, torch.zeros(4))
    assert _max_diff(hf_model, model, _tokens(4)) <= 1e-5  # zero noise, dropless: the dense logits


@pytest.mark.parametrize("key", ["model.d_model=64", "model.moe.num_experts=8", "model.moe.d_ff=16"])
def test_upcycle_refuses_architecture_keys(llama, tmp_path, capsys, key):
    _, path = llama
    run = tmp_path / "run"
    args = ["upcycle", str(path), str(run), "--experts", "4", "--top-k", "2", *_sets(key)]
    assert _cli("convert.py")(args) == 2
    _refused(capsys, key.split("=")[0], run)


def test_an_invalid_setting_is_named_and_nothing_written(mixtral, tmp_path, capsys):
    _, path = mixtral
    run = tmp_path / "run"
    assert _cli("convert.py")(["import", str(path), str(run), "--set", "model.moe.drop_policy=random"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.moe.drop_policy: expected one of"), err
    assert not run.exists()
