"""The memory plan under pipeline parallelism (moe_dist/planning/memory.py `pipeline_share`): each pipeline rank's
weights, the micro-batches in flight under 1F1B and interleaved 1F1B, and the plan of the rank that needs most."""

from pathlib import Path

import pytest

from moe_dist.config import ConfigError, load_config
from moe_dist.models.decoder import build_model
from moe_dist.planning.memory import activation_bytes, memory_plan

REPO = Path(__file__).resolve().parents[2]
MIXTRAL = REPO / "configs" / "mixtral_8x7b.json"


def _total_params(cfg) -> int:
    return sum(p.numel() for p in build_model(cfg.model, "meta").parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_every_parameter_is_on_one_pipeline_rank(tied):
    cfg = load_config(MIXTRAL, ["parallel.pp=4", "parallel.ep=1", f"model.tie_embeddings={str(tied).lower()}"])
    held = [memory_plan(cfg, 4, pp_rank=r)["params_local"] for r in range(4)]
    embedding = cfg.model.vocab_size * cfg.model.d_model
    # a tied embedding is held by the first rank (the lookup) and the last (the head)
    assert sum(h["dense"] + h["expert"] for h in held) == _total_params(cfg) + (embedding if tied else 0)
    middle = held[1]["dense"] + held[1]["expert"]
    assert held[2]["dense"] + held[2]["expert"] == middle  # 8 identical layers each
    assert held[0]["dense"] + held[0]["expert"] == middle + embedding


def test_micro_batches_in_flight_follow_the_schedule():
    cfg = load_config(MIXTRAL, ["parallel.pp=4"])
    assert [memory_plan(cfg, 64, pp_rank=r)["layout"]["micro_batches_in_flight"] for r in range(4)] == [4, 3, 2, 1]
    cfg = load_config(MIXTRAL, ["parallel.pp=4", "parallel.pp_virtual=2"])
    flight = [memory_plan(cfg, 64, pp_rank=r)["layout"]["micro_batches_in_flight"] for r in range(4)]
    assert flight == [4 + 3 / 2, 4 + 1 / 2, 4 - 1 / 2, 4 - 3 / 2]  # ((v-1)·pp + 2(pp-1-r) + 1) / v
    few = load_config(MIXTRAL, ["parallel.pp=4", "train.global_batch_size=32"])  # 2 micro-batches per pipeline
    with pytest.raises(ConfigError, match="gives 2 micro-batches per pipeline, fewer than parallel.pp=4 stages need"):
        memory_plan(few, 64, pp_rank=0)  # 1F1B cannot fill the pipeline: refused, not planned


def test_activations_split_over_the_ranks_add_up_to_the_whole_model():
    """Per micro-batch, the pipeline ranks' activations (less the point-to-point buffers) are the whole model's."""
    one = load_config(MIXTRAL, [])
    cfg = load_config(MIXTRAL, ["parallel.pp=4"])
    whole = activation_bytes(one)["total"]
    parts = 0.0
    for r in range(4):
        plan = memory_plan(cfg, 64, pp_rank=r)
        gb, flight = plan["memory_per_rank_gb"]["activations"], plan["layout"]["micro_batches_in_flight"]
        p2p = 2 * cfg.train.micro_batch_size * cfg.train.seq_len * cfg.model.d_model * 2  # bf16
        parts += (gb * 1e9 - p2p * flight) / flight
    assert parts == pytest.approx(whole, rel=1e-9)


def test_the_plan_is_of_the_rank_that_needs_most_and_dry_run_shows_it(forks):
    cfg = load_config(MIXTRAL, ["parallel.pp=4"])
    plan = memory_plan(cfg, 64)
    totals = plan["pipeline"]["total_gb_by_pp_rank"]
    assert plan["memory_per_rank_gb"]["total"] == max(totals) and plan["pipeline"]["stage_starts"] == [0, 8, 16, 24]
    assert (
        plan["memory_per_rank_gb"]["params"]
        < memory_plan(load_config(MIXTRAL, []), 64)["memory_per_rank_gb"]["params"] / 3
    )
    proc = forks.script(
        REPO / "launch" / "train.py", ["--config", MIXTRAL, "--dry-run", "--world-size", "64", "--set", "parallel.pp=4"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "layout: world 64 = pp 4 x dp 16 x tp 1" in out
    assert "pipeline: 4 stages starting at layers [0, 8, 16, 24]" in out
