"""MoE telemetry: dead experts over a window of steps, the coefficient of variation of the load, and the
balancing bias per expert, in the step record (metrics.jsonl) and as TensorBoard scalars."""

from __future__ import annotations

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moe_dist.layers.router import RoutingStats
from moe_dist.models.decoder import DecoderOutput
from moe_dist.train.metrics import DeadExperts, MetricsLogger, StepAccumulator


def test_dead_experts_need_a_whole_window_without_a_token():
    dead = DeadExperts(n_moe_layers=1, num_experts=3, window=2, first_step=0)
    loads = [[5, 0, 1], [5, 0, 0], [5, 0, 0], [5, 0, 3]]
    got = []
    for step, load in enumerate(loads, start=1):
        record = {"step": step, "moe": [{"tokens_per_expert": load}]}
        dead.observe(record)
        got.append((record["moe"][0]["dead_experts"], record["moe"][0]["dead_expert_ids"]))
    # step 1: one step seen; 2: expert 1 idle for steps 1-2; 3: expert 2 idle for 2-3 too; 4: expert 2 is back
    assert got == [(0, []), (1, [1]), (2, [1, 2]), (1, [1])]
    resumed = DeadExperts(1, 3, window=2, first_step=10)  # after a resume, history starts at the checkpoint
    record = {"step": 11, "moe": [{"tokens_per_expert": [0, 0, 0]}]}
    resumed.observe(record)
    assert record["moe"][0]["dead_experts"] == 0


def test_dead_expert_history_continues_across_a_resume():
    loads = [[5, 0, 1], [5, 0, 0], [5, 0, 0], [5, 0, 3], [0, 0, 3]]

    def observe(dead, steps):
        out = []
        for step in steps:
            record = {"step": step, "moe": [{"tokens_per_expert": loads[step - 1]}]}
            dead.observe(record)
            out.append(record["moe"][0]["dead_expert_ids"])
        return out

    whole = observe(DeadExperts(1, 3, window=2, first_step=0), range(1, 6))
    before = DeadExperts(1, 3, window=2, first_step=0)
    head = observe(before, range(1, 3))  # a checkpoint at step 2 stores `last_seen()` in meta.json
    resumed = DeadExperts(1, 3, window=2, first_step=2, last_seen=before.last_seen())
    assert head + observe(resumed, range(3, 6)) == whole == [[], [1], [1, 2], [1], [1]]
    fresh = DeadExperts(1, 3, window=2, first_step=2)  # without the history expert 1 looks alive at step 3
    assert observe(fresh, range(3, 6)) != whole[2:]
    older = DeadExperts(1, 3, window=2, first_step=2, last_seen=[[0, 0]])  # another shape: history restarts
    assert observe(older, range(3, 6)) == observe(DeadExperts(1, 3, window=2, first_step=2), range(3, 6))


def test_load_cv_is_std_over_mean_of_the_global_load():
    acc = StepAccumulator(n_moe_layers=1, num_experts=4)
    stats = RoutingStats(
        tokens_per_expert_E=torch.tensor([1.0, 3.0, 5.0, 7.0]),
        dropped=torch.tensor(0.0),
        assignments=16,
        aux_loss=torch.tensor(1.0),
        z_loss=torch.tensor(0.0),
        entropy=torch.tensor(1.0),
    )
    out = DecoderOutput(torch.zeros(1), torch.tensor(1.0), torch.tensor(0.0), [stats])
    acc.add(torch.tensor(2.0), torch.tensor(1.0), out)
    layer = acc.reduce()["moe"][0]
    # mean 4, population std sqrt((9 + 1 + 1 + 9) / 4) = sqrt(5)
    assert layer["load_cv"] == pytest.approx(5**0.5 / 4)


def test_bias_dead_experts_and_cv_reach_tensorboard(tmp_path):
    logger = MetricsLogger(tmp_path, True, histogram_every=0, image_every=0)
    for step in (1, 2):
        layer = {"tokens_per_expert": [4, 0], "load_cv": 1.0, "dead_experts": step - 1, "bias": [0.01 * step, -0.02]}
        logger.log({"step": step, "loss": 1.0, "moe": [layer]})
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("moe/layer0/expert0_bias")] == pytest.approx([0.01, 0.02])
    assert [e.value for e in acc.Scalars("moe/layer0/expert1_bias")] == pytest.approx([-0.02, -0.02])
    assert [e.value for e in acc.Scalars("moe/layer0/dead_experts")] == [0.0, 1.0]
    assert {"moe/layer0/load_cv"} <= set(acc.Tags()["scalars"])
