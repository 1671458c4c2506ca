"""Hugging Face interop against the transformers implementation itself: tiny random Mixtral and Jamba models
are built and saved locally (nothing is downloaded), imported, compared logit for logit, exported back,
converted to and from training checkpoints, and trained from."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency (pyproject.toml): a missing one fails here, it never skips the module
from safetensors import safe_open

from moe_dist.config import ModelConfig, load_config
from moe_dist.data.batches import TokenDataset, micro_batches
from moe_dist.data.sources import load_tokens
from moe_dist.hf import (
    HFConfigError,
    config_from_hf,
    export_run_to_hf,
    import_hf_to_run,
    load_checkpoint_model,
    load_hf_model,
    save_hf_model,
)
from moe_dist.models.decoder import build_model, generate, lm_loss, materialize_whole

REPO = Path(__file__).resolve().parents[2]
# fp32 logits of size ~1-3 agree to ~1e-6 here (measured: Mixtral 7e-7, Jamba 9e-7); 2e-5 leaves headroom for
# other CPUs' summation orders while still catching any real mapping error (those show up at 1e-2 and above).
ATOL = 2e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Move norm weights, D and biases off their init values (ones / zeros) so a mix-up cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name or name.endswith(".D")):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def mixtral_dir(path, **overrides):
    cfg = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=500.0,
        sliding_window=6,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**cfg, **overrides})).eval()
    _perturb(model, 1)
    model.save_pretrained(path)
    return model


def jamba_dir(path, **overrides):
    cfg = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_expand=2,
        mamba_dt_rank=3,
        mamba_conv_bias=True,
        mamba_proj_bias=True,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        use_mamba_kernels=False,
    )
    torch.manual_seed(0)
    model = transformers.JambaForCausalLM(transformers.JambaConfig(**{**cfg, **overrides})).eval()
    _perturb(model, 2)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    return mixtral_dir(path), path


@pytest.fixture(scope="module")
def jamba(tmp_path_factory):
    path = tmp_path_factory.mktemp("jamba")
    return jamba_dir(path), path


def _tokens(seed: int = 0, shape=(2, 20)) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _max_diff(hf_model, ours, tokens) -> float:
    return (hf_model(tokens).logits - ours.eval()(tokens).logits).abs().max().item()


def test_mixtral_config_mapping(mixtral):
    _, path = mixtral
    cfg = load_hf_model(path).cfg
    assert (cfg.mixer_pattern, cfg.ffn_pattern, cfg.n_layers, cfg.d_model, cfg.d_ff) == ("A", "E", 2, 32, 48)
    a, moe = cfg.attention, cfg.moe
    assert (a.n_heads, a.n_kv_heads, a.rope, a.rope_theta, a.sliding_window) == (4, 2, True, 500.0, 6)
    assert (moe.num_experts, moe.top_k, moe.renormalize, moe.capacity_factor) == (4, 2, True, None)
    assert cfg.norm_eps == 1e-5 and not cfg.tie_embeddings


def test_mixtral_logits_match_transformers(mixtral):
    hf_model, path = mixtral
    ours = load_hf_model(path)
    tokens = _tokens()  # 20 positions > sliding_window 6: the window is exercised
    diff = _max_diff(hf_model, ours, tokens)
    print(f"Mixtral max |logit difference| = {diff:.2e}")
    assert diff < ATOL


def test_jamba_config_mapping(jamba):
    _, path = jamba
    cfg = load_hf_model(path).cfg
    assert (cfg.mixer_pattern, cfg.ffn_pattern) == ("MMAM", "DE")
    m, a, moe = cfg.mamba, cfg.attention, cfg.moe
    assert (m.d_state, m.d_conv, m.expand, m.dt_rank, m.conv_bias, m.proj_bias, m.inner_norms) == (
        8,
        3,
        2,
        3,
        True,
        True,
        True,
    )
    assert not a.rope and a.n_kv_heads == 2
    assert (moe.renormalize, moe.capacity_factor, moe.num_experts) == (False, None, 4)
    assert cfg.norm_eps == 1e-6


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "mamba_conv_bias": False,
            "mamba_proj_bias": False,
            "num_experts_per_tok": 1,
        },
    ],
)
def test_jamba_logits_match_transformers(tmp_path, overrides):
    hf_model = jamba_dir(tmp_path, **overrides)
    ours = load_hf_model(tmp_path)
    diff = _max_diff(hf_model, ours, _tokens(1))
    print(f"Jamba {overrides or 'default'} max |logit difference| = {diff:.2e}")
    assert diff < ATOL


def test_tied_embeddings(tmp_path):
    hf_model = mixtral_dir(tmp_path, tie_word_embeddings=True, sliding_window=None)
    ours = load_hf_model(tmp_path)
    assert ours.cfg.tie_embeddings and ours.head is None
    assert _max_diff(hf_model, ours, _tokens(2)) < ATOL
    save_hf_model(ours, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def _same_tensors(original: dict, exported_dir) -> None:
    """The exported directory holds exactly `original`'s tensors, bit for bit."""
    exported = _tensors(exported_dir)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)


@torch.no_grad()
def _transformers_reloads_to(exported_dir, hf_model, seed: int) -> None:
    """transformers loads what we exported, offline, to the source model's logits exactly."""
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported_dir).eval()
    tokens = _tokens(seed)
    assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)


def _greedy_as_transformers(ours, hf_model, prompt, n: int) -> None:
    """Our greedy decoding (KV cache, recurrent state) gives transformers' tokens, n new ones each."""
    theirs = hf_model.generate(
        prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    assert torch.equal(generate(ours, prompt, n, temperature=0), theirs)


@pytest.mark.parametrize("arch", ["mixtral", "jamba"])
def test_export_import_round_trip_is_the_identity(arch, request, tmp_path):
    hf_model, path = request.getfixturevalue(arch)
    ours = load_hf_model(path)
    save_hf_model(ours, tmp_path / "exported")
    original, exported = _tensors(path), _tensors(tmp_path / "exported")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    src, out = (json.loads((p / "config.json").read_text()) for p in (path, tmp_path / "exported"))
    assert config_from_hf(out) == config_from_hf(src)
    again = load_hf_model(tmp_path / "exported")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    tokens = _tokens(3)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)


def test_sharded_export_loads(mixtral, tmp_path):
    hf_model, path = mixtral
    save_hf_model(load_hf_model(path), tmp_path / "sharded", shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    tokens = _tokens(4)
    with torch.no_grad():  # both loaders read every shard: the source model's logits, exactly and to ATOL
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)
    assert _max_diff(hf_model, load_hf_model(tmp_path / "sharded"), tokens) < ATOL


def _jamba_style(**model) -> ModelConfig:
    raw = {
        "vocab_size": 256,
        "d_model": 32,
        "n_layers": 4,
        "d_ff": 64,
        "mixer_pattern": "MA",
        "ffn_pattern": "ED",
        "attention": {"n_heads": 4, "n_kv_heads": 2, "rope": False},
        "mamba": {"d_state": 8, "inner_norms": True},
        "moe": {"num_experts": 4, "top_k": 2, "renormalize": False, "capacity_factor": None},
        **model,
    }
    return load_config(None, [f"model={json.dumps(raw)}"]).model


def test_our_models_export_to_transformers(tmp_path):
    ours = materialize_whole(build_model(_jamba_style()), "cpu", seed=0).eval()
    _perturb(ours, 3)
    save_hf_model(ours, tmp_path / "jamba")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "jamba").eval()
    assert type(hf_model).__name__ == "JambaForCausalLM"
    assert _max_diff(hf_model, ours, _tokens(5)) < ATOL


def test_unrepresentable_configs_are_refused(mixtral, tmp_path):
    ours = materialize_whole(build_model(load_config("configs/debug.json").model), "cpu", seed=0)  # RoPE + Mamba
    nearest = r"nearest family mixtral \(MixtralForCausalLM\): every mixer must be attention \(and 1 more rule\)$"
    with pytest.raises(HFConfigError, match=nearest):
        save_hf_model(ours, tmp_path / "x")
    _, path = mixtral
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(HFConfigError, match="rope_type"):
        config_from_hf({**raw, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(HFConfigError, match="hidden_act"):
        config_from_hf({**raw, "hidden_act": "gelu"})
    with pytest.raises(HFConfigError, match="model_type"):
        config_from_hf({**raw, "model_type": "gpt2"})
    with pytest.raises(HFConfigError, match="n_kv_heads"):
        config_from_hf({**raw, "num_key_value_heads": 3})


@pytest.mark.parametrize("arch", ["mixtral", "jamba"])
def test_greedy_generation_matches_transformers(arch, request):
    hf_model, path = request.getfixturevalue(arch)
    _greedy_as_transformers(load_hf_model(path), hf_model, _tokens(6, (1, 5)), 12)


def test_converted_checkpoint_resumes_training(jamba, tmp_path, forks):
    """HF → step-0 checkpoint → `launch/train.py --resume`: the first step's LM loss is the HF model's loss on
    the same batch, the first AdamW update is lr·sign(g) (zero moments, adam_step 0 → bias-corrected step 1),
    and the trained checkpoint exports back to a model transformers loads with our logits."""
    hf_model, path = jamba
    run = tmp_path / "run"
    base = load_config(
        "configs/debug.json",
        [
            "train.steps=1",
            "train.eval_every=0",
            "train.save_every=1",
            "train.weight_decay=0.0",
            "train.grad_clip=0.0",
            "train.threads=1",
        ],
    )
    import_hf_to_run(path, run, base)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["moe"]["capacity_factor"] is None and cfg["train"]["steps"] == 1
    proc = forks.script(REPO / "launch" / "train.py", ["--config", run / "config.json", "--run-dir", run, "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1

    t = base.train
    train_tokens, _, _ = load_tokens(base.data, t.seq_len)
    batch = TokenDataset(train_tokens, t.seq_len, t.seed).global_batch(0, t.global_batch_size)
    with torch.no_grad():
        expected = [
            lm_loss(hf_model(mb[:, :-1]).logits, mb[:, 1:]).item()
            for mb in micro_batches(batch, t.micro_batch_size, 0, 1)
        ]
    assert record["lm_loss"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)

    before, _ = load_checkpoint_model(run / "checkpoints" / "step_0")
    after, _ = load_checkpoint_model(run / "checkpoints" / "step_1")
    assert json.loads((run / "checkpoints" / "step_1" / "meta.json").read_text())["adam_step"] == 1
    lr0 = t.lr / t.warmup_steps  # the schedule's factor at step 0
    # Adam's first step moves every weight with a gradient by lr·g/(|g| + eps) ≈ lr; stale moments or a
    # wrong step count would shrink or scale it (e.g. ~0.45·lr if the bias correction thought it was late).
    for name in ("embed.weight", "blocks.0.mixer.in_proj.weight", "blocks.1.ffn.experts.w13"):
        w0, w1 = before.get_parameter(name).detach(), after.get_parameter(name).detach()
        ratio = (w1 - w0).abs()[(w1 - w0) != 0] / lr0
        assert ratio.numel() > 0 and ratio.max() <= 1 + 1e-4, name
        assert ratio.median() == pytest.approx(1.0, abs=1e-3), name

    export_run_to_hf(run, tmp_path / "back")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert _max_diff(reloaded, after, _tokens(7)) < ATOL


def _cli(script: str):
    """The `main(argv)` of a launch/ script, run in this process (no interpreter start-up per call)."""
    return runpy.run_path(str(REPO / "launch" / script), run_name="launch_script")["main"]


def test_convert_cli(mixtral, tmp_path, capsys):
    _, path = mixtral
    run, convert = tmp_path / "run", _cli("convert.py")
    assert convert(["import", str(path), str(run), "--set", "train.steps=3"]) == 0
    assert "--resume" in capsys.readouterr().out
    assert (run / "checkpoints" / "step_0" / "meta.json").is_file() and (run / "hf" / "config.json").is_file()
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 3
    assert convert(["import", str(path), str(run)]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert convert(["export", str(run), str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["torch_dtype"] == "bfloat16" and exported["max_position_embeddings"] == 256  # kept from source
    assert _tensors(tmp_path / "hf")["model.embed_tokens.weight"].dtype == torch.bfloat16
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert reloaded.dtype == torch.bfloat16 and reloaded.config.sliding_window == 6
    assert convert(["export", str(tmp_path / "missing"), str(tmp_path / "hf2")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err


def test_generate_cli_uses_the_checkpoints_tokenizer(tmp_path, capsys):
    """A vocabulary other than bytes: text goes through the Hugging Face tokenizer saved next to the weights,
    in the Hugging Face directory itself or carried into RUN_DIR/hf/ by `convert.py import`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "def", "main", "(", ")", ":", "return", "x"] + [f"w{i}" for i in range(292)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_dir = tmp_path / "hf"
    mixtral_dir(hf_dir, vocab_size=300)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(hf_dir)
    import_hf_to_run(hf_dir, tmp_path / "run")
    generate_main = _cli("generate.py")
    capsys.readouterr()  # drop what building the models printed
    for checkpoint in (hf_dir, tmp_path / "run"):
        assert (
            generate_main(
                [
                    "--checkpoint",
                    str(checkpoint),
                    "--prompt",
                    "def main ( x )",
                    "--max-new-tokens",
                    "4",
                    "--temperature",
                    "0",
                ]
            )
            == 0
        )
        text = capsys.readouterr().out.split()
        assert text[:5] == ["def", "main", "(", "x", ")"] and len(text) == 9 and set(text) <= set(words)


@pytest.mark.parametrize("kind", ["mamba2", "gdn", "moe"])
def test_export_refuses_layers_no_family_has(kind):
    """Mamba-2, Gated DeltaNet and single-sublayer layers are in no exported family: refused, never dropped."""
    from moe_dist.hf.format import family_of

    layers = ["attention+moe", "mamba1+mlp", kind, "mamba1+mlp"]
    cfg = load_config(None, [f"model.layers={json.dumps(layers)}", "model.attention.rope=false"]).model
    cfg.mamba.inner_norms, cfg.moe.renormalize = True, False
    nearest = r"nearest family jamba \(JambaForCausalLM\): every layer must be attention or mamba1 with an FFN"
    with pytest.raises(HFConfigError, match=nearest):
        family_of(cfg)
    fits = load_config(None, [f"model.layers={json.dumps(['attention+moe', 'mamba1+mlp'] * 2)}"]).model
    fits.attention.rope, fits.mamba.inner_norms, fits.moe.renormalize = False, True, False
    assert family_of(fits).model_type == "jamba"  # the same model with Jamba's kinds only is exported
