"""configs/qwen3_235b_a22b.json: Qwen3-235B-A22B as published (its config.json on the Hugging Face hub,
Qwen/Qwen3-235B-A22B), counted as transformers builds it, and the layout docs/memory.md plans at 64 and 256 H200s
("Qwen3-235B-A22B on H200s")."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from moe_dist.config import load_config
from moe_dist.hf.format import config_from_hf, config_to_hf
from moe_dist.planning.memory import memory_plan

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "qwen3_235b_a22b.json"
H200 = 143_771 * 2**20  # bytes: torch.cuda.mem_get_info's total on an H200
# The published config.json's architecture keys (token ids, dtype and cache flags left out).
PUBLISHED = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 1536,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 94,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_the_model_is_the_published_one():
    """Every model key equals what the Hugging Face import makes of the published config.json, except the balancing
    loss, which the import leaves at our defaults: Qwen3's router_aux_loss_coef and no z-loss."""
    ours = load_config(CONFIG).model
    imported = config_from_hf(PUBLISHED)
    imported.moe.aux_loss_coef, imported.moe.z_loss_coef = PUBLISHED["router_aux_loss_coef"], 0.0
    assert dataclasses.asdict(ours) == dataclasses.asdict(imported)


def test_dry_run_counts_what_transformers_builds(capsys):
    """`--dry-run` (in this process) against transformers' own model built on the meta device from the
    config.json our export writes: within 0.2% (the same architecture: exact)."""
    sys.path.insert(0, str(REPO / "launch"))
    import train as launcher

    assert launcher.main(["--config", str(CONFIG), "--dry-run"]) == 0  # the smallest world the layout takes: 64
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    layout = "layout: world 64 = pp 8 x dp 2 x tp 4 + SP, ep 8 of whole experts (etp 1), ZeRO 1"
    assert any(line.startswith(layout) for line in lines)
    assert out["capacity"]["fits"] and any(line.startswith("fits: yes: total ") for line in lines)
    hf = config_to_hf(load_config(CONFIG).model, {"model_type": "qwen3_moe"})
    exported = set(PUBLISHED) & set(hf) - {"max_position_embeddings"}  # not ours: a template key (32768 without one)
    assert len(exported) > 15 and {k: hf[k] for k in exported} == {k: PUBLISHED[k] for k in exported}
    cls = transformers.Qwen3MoeForCausalLM
    with torch.device("meta"):
        theirs = sum(p.numel() for p in cls(cls.config_class(**hf)).parameters())
    assert abs(out["params_total"] - theirs) <= 0.002 * theirs
    assert out["params_total"] == theirs == 235_093_634_560 and out["params_active"] == 22_190_763_520


@pytest.mark.parametrize("world, most", [(64, 120.0), (256, 87.0)])
def test_the_shipped_layout_fits_h200s_at_64_and_256(world, most):
    """pp 8 · tp 4 with sequence parallelism · ep 8 of whole experts (etp 1), ZeRO 1, full recompute, the busiest
    expert rank at 3x the mean; every pipeline rank fits, rank 0 (8 micro-batches in flight) needing most."""
    plan = memory_plan(load_config(CONFIG), world, capacity_bytes=H200)
    totals = plan["pipeline"]["total_gb_by_pp_rank"]
    assert plan["capacity"]["fits"] and max(totals) == totals[0] == plan["memory_per_rank_gb"]["total"] < most
    assert plan["layout"]["micro_batches_in_flight"] == 8 and plan["layout"]["expert_rows_factor"] == 3.0


def test_the_sweep_plans_the_pipeline_layout_and_h100_differs_only_in_memory():
    """`scaling.py predict --config configs/qwen3_235b_a22b.json`: the config's pipeline layout is judged by the memory
    plan (the rough per-device figure knows no stages) and is the fastest that fits at 64 GPUs; at 32 a stage has 4
    ranks, too few for ep 8. The H100 profile predicts the H200's step time (same peak and links) and differs in the
    memory a layout must fit: Megatron-LM's published layout (docs/perf_model.md) fits the H200's plan, not the
    H100's."""
    from moe_dist.planning import cluster
    from moe_dist.planning.perfmodel import predict_step
    from moe_dist.planning.workload import Layout

    cfg = load_config(CONFIG)
    rows = cluster.scaling_sweep(cfg, cluster.h200_cluster(), gpu_counts=(32, 64), chunk_options=(4,))
    own = [r for r in rows if r["family"].startswith("config's layout")]
    assert [r["gpus"] for r in own] == [64] and own[0]["layout"] == "pp8-dp2-ep8-tp4-etp1"
    assert own[0]["memory_gb"] == pytest.approx(memory_plan(cfg, 64)["memory_per_rank_gb"]["total"])
    assert cluster.recommend(rows)[64]["family"] == own[0]["family"] and 32 not in cluster.recommend(rows)
    published = ["parallel.pp=8", "parallel.pp_virtual=4", "parallel.tp=2", "parallel.ep=32", "parallel.etp=1"]
    meg = load_config(CONFIG, [*published, "parallel.sequence_parallel=true"])
    layout = Layout(dp=16, ep=32, tp=2, etp=1, pp=8)
    h100, h200 = cluster.h100_cluster(), cluster.h200_cluster()
    assert predict_step(meg, layout, h100).step_s == predict_step(meg, layout, h200).step_s
    total = memory_plan(meg, 256, capacity_bytes=int(h200.memory_bytes))["memory_per_rank_gb"]["total"] * 1e9
    assert cluster.fits(meg, total, h200) and not cluster.fits(meg, total, h100)
