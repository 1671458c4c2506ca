"""Sparse upcycling (`launch/convert.py upcycle`): a dense model (ours, or a Hugging Face Llama/Qwen3 built
locally) becomes an MoE run whose experts copy the dense FFNs; with zero noise and renormalized weights its
step-0 logits are the dense model's, with noise the experts differ."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hf.test_hf import _cli, _max_diff, _perturb, _tokens

from moe_dist.config import load_config
from moe_dist.hf import load_checkpoint_model, load_hf_model, write_initial_checkpoint
from moe_dist.models.decoder import build_model, materialize_whole

DENSE = ["model.ffn_pattern=D", "model.mixer_pattern=AM"]  # debug.json's attention/Mamba model, dense FFNs


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """One of our dense checkpoints (RUN_DIR) and its model."""
    cfg = load_config("configs/debug.json", DENSE)
    model = materialize_whole(build_model(cfg.model), "cpu", seed=3).eval()
    _perturb(model, 5)
    run = tmp_path_factory.mktemp("dense")
    write_initial_checkpoint(model, cfg, run)
    return run, model


@torch.no_grad()
def _logit_diff(a, b, tokens) -> float:
    return (a.eval()(tokens).logits - b.eval()(tokens).logits).abs().max().item()


def test_zero_noise_upcycling_keeps_the_dense_logits(dense_run, tmp_path, capsys):
    src, dense = dense_run
    run = tmp_path / "moe"
    args = ["upcycle", str(src), str(run), "--experts", "4", "--top-k", "2", "--set", "model.moe.capacity_factor=null"]
    assert _cli("convert.py")(args) == 0
    assert "--resume" in capsys.readouterr().out
    moe, cfg = load_checkpoint_model(run)
    assert (cfg.model.ffn_pattern, cfg.model.moe.num_experts, cfg.model.moe.top_k) == ("E", 4, 2)
    w13 = moe.blocks[0].ffn.experts.w13
    assert all(torch.equal(w13[e], w13[0]) for e in range(4))
    torch.testing.assert_close(w13[0][:, :128], dense.blocks[0].ffn.w1.weight.t())
    assert moe.blocks[0].ffn.router.weight.abs().sum() > 0  # a fresh router, not zeros
    diff = _logit_diff(moe, dense, _tokens(0, (2, 24)))
    print(f"upcycled vs dense max |logit difference| = {diff:.2e}")
    assert diff <= 1e-5
    assert json.loads((run / "config.json").read_text())["model"]["moe"]["capacity_factor"] is None


def test_noise_makes_experts_differ(dense_run, tmp_path):
    src, dense = dense_run
    run = tmp_path / "noisy"
    args = ["upcycle", str(src), str(run), "--experts", "4", "--top-k", "2", "--noise", "0.1"]
    assert _cli("convert.py")(args) == 0
    moe, _ = load_checkpoint_model(run, dropless=True)
    w2, dense_w2 = moe.blocks[0].ffn.experts.w2, dense.blocks[0].ffn.w2.weight.t()
    rel = [((w2[e] - dense_w2).std() / dense_w2.std()).item() for e in range(4)]
    assert rel == pytest.approx([0.1] * 4, rel=0.1) and not torch.equal(w2[0], w2[1])
    assert _logit_diff(moe, dense, _tokens(0, (2, 24))) > 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hugging_face_dense_models_upcycle(kind, tmp_path):
    cls, cfg_cls = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
    }[kind]
    torch.manual_seed(0)
    hf_cfg = cfg_cls(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    hf_model = cls(hf_cfg).eval()
    _perturb(hf_model, 6)
    hf_model.save_pretrained(tmp_path / "hf")
    tokens = _tokens(1)
    assert _max_diff(hf_model, load_hf_model(tmp_path / "hf"), tokens) <= 1e-5  # the dense import itself
    args = ["upcycle", str(tmp_path / "hf"), str(tmp_path / "run"), "--experts", "2", "--top-k", "1"]
    assert _cli("convert.py")([*args, "--set", "model.moe.capacity_factor=null"]) == 0
    moe, _ = load_checkpoint_model(tmp_path / "run")
    assert _max_diff(hf_model, moe, tokens) <= 1e-5


def test_bad_upcycling_input_is_refused(dense_run, tmp_path, capsys):
    src, _ = dense_run
    convert = _cli("convert.py")
    assert convert(["upcycle", str(src), str(tmp_path / "a"), "--experts", "4", "--top-k", "5"]) == 2
    assert "--top-k: must be in [1, --experts=4]" in capsys.readouterr().err
    moe_run = tmp_path / "b"
    assert convert(["upcycle", str(src), str(moe_run), "--experts", "4", "--top-k", "2"]) == 0
    assert convert(["upcycle", str(moe_run), str(tmp_path / "c"), "--experts", "4", "--top-k", "2"]) == 2
    assert "no dense FFN layer to upcycle" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c" / "checkpoints").exists()
