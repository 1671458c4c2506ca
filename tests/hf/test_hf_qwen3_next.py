"""Qwen3-Next, Qwen3.5-MoE's text model and Qwen3.5-MoE's vision-language checkpoints against transformers' own
implementations: tiny random models built and saved locally (nothing downloaded), imported, compared logit for
logit, exported back bit for bit, decoded greedily with the cache as transformers' generate does. Tensors our model
has no place for (multi-token prediction, the vision tower) are dropped with one warning line each; what the config
cannot express is refused by name."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from hf.test_hf import (
    _greedy_as_transformers,
    _max_diff,
    _perturb,
    _same_tensors,
    _tensors,
    _tokens,
    _transformers_reloads_to,
)
from safetensors.torch import save_file

from moe_dist.config import load_config
from moe_dist.hf import HFConfigError, config_from_hf, config_to_hf, load_hf_model, save_hf_model
from moe_dist.hf.format import family_of
from moe_dist.models.decoder import build_model
from moe_dist.planning.memory import memory_plan

ATOL = 1e-5  # fp32; measured max |logit difference| is printed by each test (-s)
TEXT = dict(
    vocab_size=256,
    hidden_size=32,
    num_hidden_layers=4,  # layer_types: three linear_attention, then full_attention
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=20,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    max_position_embeddings=128,
)
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
KINDS = ["qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"]


def build(kind: str):
    torch.manual_seed(0)
    if kind == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**TEXT, intermediate_size=40, mlp_only_layers=[1])
        model = transformers.Qwen3NextForCausalLM(cfg)
    elif kind == "qwen3_5_moe_text":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TEXT))
    else:
        cfg = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION)
        model = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    model.eval()
    _perturb(model, 4)  # zero-centred norm weights start at zero: moved, so a missing "1 +" cannot hide
    return model


@pytest.fixture(scope="module", params=KINDS)
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = build(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def _load(path, capsys=None):
    """The imported model, and the warning lines the import printed (with `capsys`)."""
    if capsys is not None:
        capsys.readouterr()
    model = load_hf_model(path)
    return model, [] if capsys is None else capsys.readouterr().err.splitlines()


def test_config_mapping(family, capsys):
    kind, _, path = family
    cfg, dropped = _load(path, capsys)
    cfg = cfg.cfg
    a, g, moe = cfg.attention, cfg.gdn, cfg.moe
    second = "gdn+mlp" if kind == "qwen3_next" else "gdn+moe"  # mlp_only_layers=[1]
    assert cfg.layers == ["gdn+moe", second, "gdn+moe", "attention+moe"]
    assert (a.output_gate, a.rope_fraction, a.head_dim, a.qk_norm, a.n_kv_heads) == (True, 0.25, 16, "head", 2)
    assert (g.n_k_heads, g.n_v_heads, g.head_k_dim, g.head_v_dim, g.conv_size) == (2, 4, 8, 8, 4)
    shared = (moe.n_shared_experts, moe.shared_d_ff, moe.shared_gate)
    assert (*shared, moe.d_ff, moe.renormalize) == (1, 20, True, 24, True)
    assert cfg.norm_zero_centered and moe.capacity_factor is None
    assert cfg.d_ff == (40 if kind == "qwen3_next" else 24)
    assert len(dropped) == (kind == "qwen3_5_moe")  # the vision tower, one line
    if dropped:
        assert "vision-tower tensors (model.visual.*)" in dropped[0]


def test_logits_match_transformers(family):
    kind, hf_model, path = family
    diff = _max_diff(hf_model, _load(path)[0], _tokens(1))
    print(f"{kind} max |logit difference| = {diff:.2e}")
    assert diff <= ATOL


def test_export_import_round_trip_is_bit_identical(family, tmp_path):
    """Export → the source tensors bit for bit (the vision-language checkpoint's text model: its tensors with
    `language_model.` dropped from their names, written as qwen3_5_moe_text), which transformers loads with the
    source model's logits."""
    kind, hf_model, path = family
    ours = _load(path)[0]
    source = json.loads((path / "config.json").read_text())
    save_hf_model(ours, tmp_path / "exported", template=source)
    original = _tensors(path)
    if kind == "qwen3_5_moe":
        original = {k.replace("model.language_model.", "model."): t for k, t in original.items() if ".visual." not in k}
    _same_tensors(original, tmp_path / "exported")
    out = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert out["model_type"] == ("qwen3_5_moe_text" if kind == "qwen3_5_moe" else kind)
    assert "vision_config" not in out and "text_config" not in out
    assert config_from_hf(out) == config_from_hf(source)
    again = _load(tmp_path / "exported")[0]
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))
    _transformers_reloads_to(tmp_path / "exported", hf_model, 3)


def test_greedy_generation_matches_transformers(family):
    _, hf_model, path = family
    _greedy_as_transformers(_load(path)[0], hf_model, _tokens(6, (1, 5)), 12)


def test_multi_token_prediction_tensors_are_dropped_with_one_warning(family, tmp_path, capsys):
    kind, hf_model, path = family
    copy = tmp_path / "with_mtp"
    shutil.copytree(path, copy)
    mtp = {f"mtp.layers.0.{n}": torch.ones(4, 4) for n in ("input_layernorm.weight", "mlp.gate.weight")}
    save_file({**mtp, "mtp.fc.weight": torch.ones(4, 8)}, str(copy / "mtp.safetensors"))
    model, dropped = _load(copy, capsys)
    assert [m for m in dropped if "multi-token-prediction" in m] == [
        f"warning: {copy}: dropped 3 multi-token-prediction tensors (mtp.*): our model has no place for them"
    ]
    assert len(dropped) == 1 + (kind == "qwen3_5_moe")
    assert _max_diff(hf_model, model, _tokens(1)) <= ATOL


def test_what_we_cannot_express_is_refused_by_name(family):
    kind, _, path = family
    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config", raw)

    def refused(match: str, **change):
        bad = {**raw, "text_config": {**text, **change}} if "text_config" in raw else {**raw, **change}
        with pytest.raises(HFConfigError, match=match):
            config_from_hf(bad)

    refused(r"layer_types\[0\]: 'sliding_attention'", layer_types=["sliding_attention", *text["layer_types"][1:]])
    refused("attention_bias", attention_bias=True)
    refused("rope_parameters.rope_type", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    refused("hidden_act", hidden_act="gelu")
    refused("model.gdn.n_k_heads", linear_num_key_heads=3)  # key heads must divide the value heads


def test_export_refuses_what_the_family_cannot_hold(family):
    kind, _, path = family
    ours = _load(path)[0].cfg
    ours.attention.output_gate = False
    with pytest.raises(
        HFConfigError, match=r"nearest family qwen3_(next|5_moe_text) .*attention.output_gate must be true"
    ):
        family_of(ours, kind)
    ours.attention.output_gate, ours.norm_zero_centered = True, False
    with pytest.raises(
        HFConfigError, match=r"nearest family qwen3_(next|5_moe_text) .*model.norm_zero_centered must be true"
    ):
        family_of(ours, kind)
    ours.norm_zero_centered = True
    want = "qwen3_next" if kind == "qwen3_next" else "qwen3_5_moe_text"  # the dense layer 1: Qwen3-Next only
    assert family_of(ours, kind).model_type == want


pytestmark = pytest.mark.usefixtures("one_thread")


REPO = Path(__file__).resolve().parents[2]
BIG = {"qwen3_next_80b_a3b": transformers.Qwen3NextForCausalLM, "qwen3_5_35b_a3b": transformers.Qwen3_5MoeForCausalLM}


@pytest.mark.parametrize("name", sorted(BIG))
def test_reference_configs_count_what_transformers_builds(name, capsys):
    """`--dry-run` of the shipped config (in this process) against transformers' own model built on the meta device
    from the config.json our export writes for it: within 0.2% (the MTP layer is in neither)."""
    sys.path.insert(0, str(REPO / "launch"))
    import train as launcher

    assert launcher.main(["--config", str(REPO / f"configs/{name}.json"), "--dry-run"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["params_total"]
    cls = BIG[name]
    kind = cls.config_class.model_type  # both families express an all-MoE model: the template chooses
    hf = config_to_hf(load_config(REPO / f"configs/{name}.json").model, {"model_type": kind})
    assert hf["architectures"] == [cls.__name__]
    with torch.device("meta"):
        theirs = sum(p.numel() for p in cls(cls.config_class(**hf)).parameters())
    print(f"{name}: ours {ours:,}, transformers {theirs:,}")
    assert abs(ours - theirs) <= 0.002 * theirs


H200 = 143_771 * 2**20  # bytes: torch.cuda.mem_get_info's total on an H200


@pytest.mark.parametrize(
    "name, smallest, sets",
    [("qwen3_next_80b_a3b", 32, []), ("qwen3_5_35b_a3b", 8, ["deepspeed.zero_stage=2"])],
)
def test_shipped_layouts_are_the_smallest_that_fit_h200s(name, smallest, sets):
    """The shipped layout (world tp × ep) fits an H200 less the plan's fragmentation margin, with the config's
    planned expert imbalance; half the GPUs (ep halved) does not. Qwen3.5 on one node of 8 runs ZeRO 2 (the shipped
    ZeRO 1 keeps an unsharded fp32 gradient buffer: docs/memory.md, "One reduction per step (ZeRO 1) against
    ZeRO 2"). Qwen3-Next on 8: under ZeRO ≤ 2 every parameter
    keeps 2 (bf16) + 4 (fp32 gradient partition) + 12 (fp32 master, two moments) bytes somewhere in the world,
    18 B × 79.7 B = 1.43 TB > 8 × 141 GB, whatever the layout."""
    cfg = load_config(REPO / f"configs/{name}.json", sets)
    assert cfg.parallel.tp * cfg.parallel.ep == smallest
    assert memory_plan(cfg, smallest, capacity_bytes=H200)["capacity"]["fits"]
    half = load_config(REPO / f"configs/{name}.json", [*sets, f"parallel.ep={smallest // 2}"])
    assert not memory_plan(half, smallest // 2, capacity_bytes=H200)["capacity"]["fits"]
    if name == "qwen3_next_80b_a3b":
        total = sum(p.numel() for p in build_model(cfg.model).parameters())
        assert 18 * total / 8 > 141e9


def test_fused_expert_tensors_load_as_the_per_expert_ones(family, tmp_path):
    """Qwen3.5 checkpoints may hold each layer's experts fused as transformers 5 does (gate_up_proj (E, 2F, D) with
    rows [gate; up], down_proj (E, D, F)): the same model as from the per-expert tensors."""
    kind, _, path = family
    if kind == "qwen3_next":
        pytest.skip("Qwen3-Next checkpoints hold experts per expert only")
    tensors, fused = _tensors(path), {}

    def each(stem: str, proj: str) -> torch.Tensor:
        return torch.stack([tensors.pop(f"{stem}.{e}.{proj}.weight") for e in range(4)])

    for name in [n for n in tensors if ".experts.0.gate_proj." in n]:
        stem = name.split(".experts.")[0] + ".experts"
        fused[f"{stem}.gate_up_proj"] = torch.cat([each(stem, "gate_proj"), each(stem, "up_proj")], dim=1)
        fused[f"{stem}.down_proj"] = each(stem, "down_proj")
    assert len(fused) == 8 and not any(".experts.0." in n for n in tensors)
    (tmp_path / "fused").mkdir()
    shutil.copy(path / "config.json", tmp_path / "fused" / "config.json")
    save_file({**tensors, **fused}, str(tmp_path / "fused" / "model.safetensors"))
    ours, again = _load(path)[0], _load(tmp_path / "fused")[0]
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


# The architecture keys of the published config.json files (Qwen/Qwen3-Next-80B-A3B-Instruct: the pre-5.x layout with
# top-level rope keys and no layer_types; Qwen/Qwen3.5-35B-A3B: the vision-language wrapper, vision keys left out).
PUBLISHED = {
    "qwen3_next_80b_a3b": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "decoder_sparse_step": 1,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "mlp_only_layers": [],
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
    },
    "qwen3_5_35b_a3b": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "num_hidden_layers": 40,
            "full_attention_interval": 4,
            "hidden_size": 2048,
            "vocab_size": 248320,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "attn_output_gate": True,
            "hidden_act": "silu",
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "rms_norm_eps": 1e-6,
            "mtp_num_hidden_layers": 1,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
                "partial_rotary_factor": 0.25,
            },
        },
    },
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_reference_configs_are_what_the_published_config_json_imports_as(name):
    """The shipped model sections equal the importer's reading of the published config.json, but for the training
    hyper-parameters the import does not map (loss coefficients: router_aux_loss_coef is 0.001 in both)."""
    shipped = load_config(REPO / f"configs/{name}.json").model
    imported = config_from_hf(PUBLISHED[name])
    imported.moe.aux_loss_coef, imported.moe.z_loss_coef = shipped.moe.aux_loss_coef, shipped.moe.z_loss_coef
    assert imported == shipped
    out = config_to_hf(shipped, PUBLISHED[name])  # the export of a model imported from it
    assert out["model_type"] == BIG[name].config_class.model_type and "text_config" not in out
    theirs = BIG[name].config_class(**out)  # transformers reads the same architecture back
    assert theirs.rope_parameters["partial_rotary_factor"] == 0.25 and theirs.rope_parameters["rope_theta"] == 1e7
    assert theirs.layer_types == ["linear_attention"] * 3 + ["full_attention"] + theirs.layer_types[4:]
    assert config_from_hf(out) == config_from_hf(PUBLISHED[name])
