"""Inference: the KV cache / Mamba state path against full recomputation, sampling filters, the CLI."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

from moe_dist.config import load_config
from moe_dist.hf import write_initial_checkpoint
from moe_dist.models.decoder import build_model, generate, materialize_whole, sample_next

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


HYBRID = {"mixer_pattern": "AM", "ffn_pattern": "ED", "attention": {"n_heads": 4, "n_kv_heads": 2, "sliding_window": 5}}
MIXTRAL = {"mixer_pattern": "A", "ffn_pattern": "E", "attention": {"n_heads": 4, "n_kv_heads": 1, "rope_theta": 1e6}}
JAMBA = {
    "mixer_pattern": "MMAM",
    "ffn_pattern": "DE",
    "attention": {"n_heads": 4, "n_kv_heads": 2, "rope": False},
    "mamba": {"d_state": 8, "d_conv": 3, "inner_norms": True, "proj_bias": True},
    "moe": {"renormalize": False},
}


def _model(layout: dict, vocab: int = 256, seed: int = 0):
    raw = {"vocab_size": vocab, "d_model": 32, "n_layers": 4, "d_ff": 64, **layout}
    raw["moe"] = {"num_experts": 4, "top_k": 2, "capacity_factor": None, **layout.get("moe", {})}
    cfg = load_config(None, [f"model={json.dumps(raw)}"])
    model = materialize_whole(build_model(cfg.model), "cpu", seed).eval()
    with torch.no_grad():  # larger weights than the init: well-separated logits, so greedy has no near-ties
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(4.0)
    return model, cfg


def _tokens(shape, seed=0):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", [HYBRID, MIXTRAL, JAMBA], ids=["hybrid", "mixtral", "jamba"])
@torch.no_grad()
def test_cached_logits_equal_full_forward(layout):
    model, _ = _model(layout)
    tokens = _tokens((2, 17))
    full = model(tokens).logits
    cache = model.new_cache(2, 17)
    chunks = [model(piece, cache).logits for piece in tokens.split([7, 1, 1, 8], dim=1)]  # prefill, steps, chunk
    assert cache.length == 17
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("layout", [HYBRID, MIXTRAL, JAMBA], ids=["hybrid", "mixtral", "jamba"])
def test_cached_greedy_equals_recomputed_greedy(layout):
    model, _ = _model(layout)
    prompt = _tokens((2, 6), seed=1)
    cached = generate(model, prompt, 24, temperature=0)
    recomputed = generate(model, prompt, 24, temperature=0, use_cache=False)
    assert cached.shape == (2, 30) and torch.equal(cached[:, :6], prompt)
    assert torch.equal(cached, recomputed)


def test_generate_needs_a_dropless_model():
    cfg = load_config("configs/debug.json")  # capacity_factor 1.25
    model = materialize_whole(build_model(cfg.model), "cpu", 0)
    with pytest.raises(ValueError, match="capacity_factor=null"):
        generate(model, _tokens((1, 3)), 2)


def test_sample_next_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert sample_next(logits, temperature=0).item() == 0

    def draws(**kw):
        gen = torch.Generator().manual_seed(0)
        return torch.cat([sample_next(logits.expand(500, -1), generator=gen, **kw) for _ in range(4)])

    assert set(draws(top_k=2).tolist()) == {0, 1}
    assert set(draws(top_p=0.75).tolist()) == {0, 1}  # 0.5 < 0.75 ≤ 0.5 + 0.3
    assert set(draws(top_p=0.85).tolist()) == {0, 1, 2}
    assert set(draws(top_p=1e-9).tolist()) == {0}  # the most likely token always stays
    free = draws()
    assert set(free.tolist()) == {0, 1, 2, 3}
    assert (free == 0).float().mean().item() == pytest.approx(0.5, abs=0.05)
    hot = draws(temperature=100.0)  # flattened towards uniform
    assert (hot == 3).float().mean().item() == pytest.approx(0.25, abs=0.05)


def test_seeded_sampling_is_reproducible():
    model, _ = _model(HYBRID)
    prompt = _tokens((1, 4), seed=2)

    def sample(seed):
        return generate(model, prompt, 16, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(sample(3), sample(3)) and not torch.equal(sample(3), sample(4))


def test_generate_cli(tmp_path, capsys):
    main = runpy.run_path(str(REPO / "launch" / "generate.py"), run_name="launch_script")["main"]
    model, cfg = _model(HYBRID)
    write_initial_checkpoint(model, cfg, tmp_path / "run")
    args = ["--checkpoint", str(tmp_path / "run"), "--prompt", "def f(", "--max-new-tokens", "12", "--temperature", "0"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def f(") and "tokens/s (KV/SSM cache" in out.err
    assert main([*args, "--no-cache"]) == 0
    again = capsys.readouterr()
    assert again.out == out.out and "no cache" in again.err

    wide, wide_cfg = _model(MIXTRAL, vocab=300)
    write_initial_checkpoint(wide, wide_cfg, tmp_path / "wide")
    assert main(["--checkpoint", str(tmp_path / "wide"), "--prompt", "hi"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err
    assert (
        main(
            [
                "--checkpoint",
                str(tmp_path / "wide"),
                "--prompt-ids",
                "1,299,7",
                "--max-new-tokens",
                "3",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    ids = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    assert ids[:3] == [1, 299, 7] and len(ids) == 6 and max(ids) < 300
