"""The default job (configs/mixtral_small.json, attention + Mamba, "AM") and Hugging Face: as shipped no family
expresses it, and the refusal is one short line naming the nearest family and its rule; with the README's three
settings it is a Jamba, which transformers loads with our logits."""

from __future__ import annotations

import pytest
import torch

from moe_dist.config import load_config
from moe_dist.hf import HFConfigError, save_hf_model
from moe_dist.hf.format import family_of
from moe_dist.models.decoder import build_model, materialize_whole

CONFIG = "configs/mixtral_small.json"
AS_JAMBA = ["model.attention.rope=false", "model.moe.renormalize=false", "model.mamba.inner_norms=true"]


def test_the_refusal_names_the_nearest_family_in_one_short_line():
    with pytest.raises(HFConfigError) as e:
        family_of(load_config(CONFIG).model)
    assert str(e.value) == (
        "model: not expressible as a Hugging Face checkpoint; nearest family mixtral (MixtralForCausalLM): "
        "every mixer must be attention"
    )


def test_a_rule_count_is_said_when_the_nearest_family_breaks_several():
    cfg = load_config(CONFIG, ["model.attention.rope=false"])  # Mixtral and Jamba now break two rules each
    with pytest.raises(HFConfigError) as e:
        family_of(cfg.model)
    assert str(e.value).endswith(
        "; nearest family mixtral (MixtralForCausalLM): every mixer must be attention (and 1 more rule)"
    )


def test_the_default_job_with_the_readme_settings_exports_as_jamba(tmp_path, one_thread):
    transformers = pytest.importorskip("transformers")
    cfg = load_config(CONFIG, [*AS_JAMBA, "model.moe.capacity_factor=null"]).model  # dropless, as transformers
    assert family_of(cfg).model_type == "jamba"
    ours = materialize_whole(build_model(cfg), "cpu", seed=0).eval()
    save_hf_model(ours, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "JambaForCausalLM"
    ids = torch.tensor([list(b"def main(args):\n    return args.x + 1\n")])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-5)
