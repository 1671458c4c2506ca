"""DeepSeek-V3 (MLA, sigmoid group-limited routing with a correction bias, first-k dense layers) against
transformers' own DeepseekV3ForCausalLM: tiny random models built and saved locally (nothing downloaded), with and
without the query bottleneck (q_lora_rank), with YaRN; imported, compared logit for logit, exported back bit for bit,
and decoded greedily with the latent cache as transformers' generate does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from hf.test_hf import _greedy_as_transformers, _max_diff, _perturb, _same_tensors, _tensors, _tokens
from safetensors.torch import save_file

from moe_dist.config import load_config
from moe_dist.hf import HFConfigError, config_from_hf, config_to_hf, load_hf_model, save_hf_model
from moe_dist.models.decoder import build_model, materialize_whole

REPO = Path(__file__).resolve().parents[2]

ATOL = 1e-5  # fp32; the measured max |logit difference| is printed (-s)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=8,
    beta_fast=32,
    beta_slow=1,
    mscale=0.707,
    mscale_all_dim=1.0,
)
COMMON = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=40,
    moe_intermediate_size=12,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=2,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    qk_nope_head_dim=10,
    qk_rope_head_dim=8,
    v_head_dim=12,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    max_position_embeddings=64,
)
MODELS = {
    # DeepSeek-V3 / Kimi K2's form: a query bottleneck, interleaved RoPE slice, YaRN
    "q_lora": dict(q_lora_rank=24, rope_parameters=YARN, max_position_embeddings=32),
    # Moonlight / DeepSeek-V2-Lite's form: full-rank query, plain RoPE, two dense layers, half-split RoPE slice
    "full_q": dict(
        q_lora_rank=None, first_k_dense_replace=2, rope_interleave=False, rope_parameters={"rope_theta": 50000.0}
    ),
}


def deepseek_dir(path, **overrides):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**COMMON, **overrides})).eval()
    _perturb(model, 4)
    with torch.no_grad():  # the correction bias starts at zero: move it so that choice and weights differ
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def deepseek(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, deepseek_dir(path, **MODELS[request.param]), path


def test_config_mapping(deepseek):
    kind, _, path = deepseek
    cfg = load_hf_model(path).cfg
    m, moe = cfg.mla, cfg.moe
    dense = 1 if kind == "q_lora" else 2
    assert cfg.layer_list() == ["mla+mlp"] * dense + ["mla+moe"] * (3 - dense)
    assert (m.n_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (4, 16, 10, 8, 12)
    assert m.q_lora_rank == (24 if kind == "q_lora" else None)
    assert m.rope_interleave == (kind == "q_lora")
    assert m.rope_scaling.type == ("yarn" if kind == "q_lora" else "none")
    assert (moe.score, moe.n_groups, moe.topk_groups, moe.route_scale, moe.n_shared_experts) == (
        "sigmoid",
        4,
        2,
        2.5,
        2,
    )
    assert (moe.num_experts, moe.top_k, moe.d_ff, moe.capacity_factor, cfg.d_ff) == (8, 3, 12, None, 40)


def test_logits_match_transformers(deepseek):
    kind, hf_model, path = deepseek
    diff = _max_diff(hf_model, load_hf_model(path), _tokens(1, (2, 24)))  # 24 positions > YaRN's original 8
    print(f"deepseek_v3 ({kind}) max |logit difference| = {diff:.2e}")
    assert diff <= ATOL


def test_export_import_round_trip_is_bit_identical(deepseek, tmp_path):
    kind, hf_model, path = deepseek
    ours = load_hf_model(path)
    save_hf_model(ours, tmp_path / "exported")
    _same_tensors(_tensors(path), tmp_path / "exported")
    out = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert out["model_type"] == "deepseek_v3"
    assert config_from_hf(out) == config_from_hf(json.loads((path / "config.json").read_text()))
    again = load_hf_model(tmp_path / "exported")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    tokens = _tokens(3)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)


def test_greedy_generation_matches_transformers(deepseek):
    _, hf_model, path = deepseek
    _greedy_as_transformers(load_hf_model(path), hf_model, _tokens(6, (1, 5)), 12)


def test_what_we_cannot_express_is_refused_by_name(tmp_path):
    base = {"model_type": "deepseek_v3", **COMMON}
    with pytest.raises(HFConfigError, match="^num_key_value_heads: 2 is not supported"):
        config_from_hf({**base, "num_key_value_heads": 2})
    with pytest.raises(HFConfigError, match="^rope_parameters.rope_type: 'linear'"):
        config_from_hf({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(HFConfigError, match="^attention_bias"):
        config_from_hf({**base, "attention_bias": True})


def test_moonlight_config_counts_what_transformers_builds(capsys):
    """`--dry-run` of configs/moonlight_16b_a3b.json (in this process) counts exactly the parameters of transformers'
    DeepseekV3ForCausalLM built on the meta device from the config.json our export writes for it."""
    sys.path.insert(0, str(REPO / "launch"))
    import train as launcher

    path = REPO / "configs/moonlight_16b_a3b.json"
    assert launcher.main(["--config", str(path), "--dry-run"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["params_total"]
    hf = config_to_hf(load_config(path).model)
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["q_lora_rank"] is None
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf))
    theirs = sum(p.numel() for p in model.parameters())
    print(f"moonlight_16b_a3b: ours {ours:,}, transformers {theirs:,}")
    assert ours == theirs


def _fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's published weight format: e4m3 values and one fp32 `weight_scale_inv` per block × block tile
    (edge tiles partial), each tile's largest magnitude mapped to e4m3's largest, 448."""
    rows, cols = w.shape
    tiles = F.pad(w, (0, -cols % block, 0, -rows % block)).unflatten(0, (-1, block)).unflatten(2, (-1, block))
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # (rows / block, cols / block)
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)[:rows, :cols]
    return q.contiguous(), scale


def test_fp8_block_quantized_checkpoint_is_dequantized(tmp_path, capfd):
    """A checkpoint quantized as DeepSeek-V3 and Kimi K2 publish theirs (every projection weight in e4m3 with block
    scales; here 8 × 8 tiles, so the tiny weights have several and partial edge ones) imports dequantized, saying so
    in one line; its logits equal transformers' on the dequantized values. An fp8 weight without its scales is
    refused by name."""
    deepseek_dir(tmp_path / "src", **MODELS["q_lora"])
    hf = json.loads((tmp_path / "src" / "config.json").read_text())
    stored, plain = {}, {}
    for name, w in _tensors(tmp_path / "src").items():
        if w.ndim == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight")):
            q, scale = _fp8_blocks(w, 8)
            stored[name], stored[f"{name}_scale_inv"] = q, scale
            plain[name] = q.float() * torch.kron(scale, torch.ones(8, 8))[: w.shape[0], : w.shape[1]]
            assert (plain[name] - w).abs().max() <= w.abs().max() / 16  # e4m3: 3 mantissa bits
        else:
            stored[name] = plain[name] = w
    for folder, tensors, extra in (("fp8", stored, {"weight_block_size": [8, 8]}), ("plain", plain, None)):
        (tmp_path / folder).mkdir()
        config = {**hf, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", **extra}} if extra else hf
        (tmp_path / folder / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(tmp_path / folder / "model.safetensors"), metadata={"format": "pt"})
    ours = load_hf_model(tmp_path / "fp8")
    n = sum(name.endswith("_scale_inv") for name in stored)
    assert f"dequantized {n} fp8 tensors (8x8 block scales) to float32" in capfd.readouterr().err
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    diff = _max_diff(theirs, ours, _tokens(1, (2, 24)))
    print(f"deepseek_v3 fp8 (dequantized) max |logit difference| = {diff:.2e}")
    assert diff <= ATOL
    missing = "model.layers.0.self_attn.o_proj.weight"
    save_file(
        {k: v for k, v in stored.items() if k != f"{missing}_scale_inv"}, str(tmp_path / "fp8" / "model.safetensors")
    )
    with pytest.raises(HFConfigError, match=f"fp8 tensor '{missing}' has no '{missing}_scale_inv'"):
        load_hf_model(tmp_path / "fp8")


def test_a_model_of_ours_exports_to_transformers(tmp_path):
    """A model built here (half-split RoPE slice, no balancing bias: the export writes none and the import reads
    zeros, as transformers initialises it) loads in transformers with our logits, and imports back to them."""
    cfg = load_config(
        None,
        [
            'model.layers=["mla+mlp","mla+moe"]',
            "model.n_layers=2",
            "model.d_model=32",
            "model.d_ff=48",
            "model.init_std=0.2",  # O(1) activations: a wiring mistake would show in the logits
            'model.mla={"n_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 8, "qk_nope_head_dim": 6, '
            '"qk_rope_head_dim": 4, "v_head_dim": 5}',
            'model.moe={"num_experts": 4, "top_k": 2, "d_ff": 8, "capacity_factor": null, "score": "sigmoid", '
            '"n_groups": 2, "topk_groups": 1, "route_scale": 1.5, "n_shared_experts": 1}',
        ],
    ).model
    ours = materialize_whole(build_model(cfg), "cpu", seed=0).eval()
    _perturb(ours, 5)
    assert ours.blocks[1].ffn.router.bias_E is None
    save_hf_model(ours, tmp_path / "out")
    assert not any("e_score_correction_bias" in name for name in _tensors(tmp_path / "out"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    diff = _max_diff(theirs, ours, _tokens(2))
    print(f"deepseek_v3 (exported from ours) max |logit difference| = {diff:.2e}")
    assert diff <= ATOL
    again = load_hf_model(tmp_path / "out")
    assert torch.equal(again.blocks[1].ffn.router.bias_E, torch.zeros(4))
    with torch.no_grad():
        assert torch.equal(again(_tokens(2)).logits, ours(_tokens(2)).logits)


_V3 = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    routed_scaling_factor=2.5,
    rope_theta=10000,
    rope_scaling=dict(
        type="yarn",
        factor=40,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    max_position_embeddings=163840,
)
# The architecture keys of the published config.json files: DeepSeek-V3 (671B total, 37B active per token without its
# MTP layer) and Kimi K2 (1T total, 32B active; the same class, 64 heads, 384 experts, one group, YaRN with equal betas)
PUBLISHED = {
    "deepseek_v3": (_V3, (671, 37)),
    "kimi_k2": (
        {
            **_V3,
            "vocab_size": 163840,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "n_routed_experts": 384,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.827,
            "rope_theta": 50000.0,
            "rope_scaling": dict(
                type="yarn",
                factor=32.0,
                original_max_position_embeddings=4096,
                beta_fast=1.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            "max_position_embeddings": 131072,
        },
        (1026, 32),
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_count_what_transformers_builds(name):
    """The published DeepSeek-V3 and Kimi K2 configs map to models of exactly transformers' parameter count (both on
    the meta device), which are the published sizes (billions, total and active per token)."""
    from moe_dist.models.decoder import param_counts

    hf, (total, active) = PUBLISHED[name]
    ours = param_counts(config_from_hf({"model_type": "deepseek_v3", **hf}))
    with torch.device("meta"):
        theirs = sum(
            p.numel() for p in transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf)).parameters()
        )
    print(f"{name}: ours {ours['params_total']:,} ({ours['params_active']:,} active), transformers {theirs:,}")
    assert ours["params_total"] == theirs
    assert (theirs // 10**9, ours["params_active"] // 10**9) == (total, active)  # whole billions, as published
