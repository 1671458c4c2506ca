"""TensorBoard pictures: expert-load and drop-rate heatmaps, the custom-scalars layout, generic scalars, the
per-expert drop recovery they draw from, and benchmarks/tb_report.py."""

from __future__ import annotations

import io
import json
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from moe_dist.config import MoEConfig
from moe_dist.layers.router import Router
from moe_dist.train.metrics import CELL, LABEL_W, TITLE_H, MetricsLogger, colormap, dropped_per_expert, heatmap_size

REPO = Path(__file__).resolve().parents[2]
TPE = [[10, 50, 200, 60], [80, 80, 80, 80], [0, 0, 320, 0]]  # tokens per expert, 3 MoE layers × 4 experts
DPE = [[0, 0, 100, 0], [0, 0, 0, 0], [0, 0, 160, 0]]  # dropped per expert


def _record(step: int) -> dict:
    layers = [
        {
            "tokens_per_expert": t,
            "dropped_per_expert": d,
            "drop_fraction": sum(d) / 320,
            "max_over_mean_load": max(t) / 80,
            "router_entropy": 1.0,
            "a2a_bytes_per_rank": 0.0,
            "capacity": 100.0,
        }  # a key added by someone else: must become a scalar too
        for t, d in zip(TPE, DPE, strict=True)
    ]
    return {
        "step": step,
        "loss": 5.0 - step * 0.1,
        "lm_loss": 4.9 - step * 0.1,
        "aux_loss": 1.0,
        "z_loss": 0.5,
        "mfu": 0.25,
        "moe": layers,
        **({"eval_loss": 5.0 - step * 0.1} if step % 2 == 0 else {}),
    }


def _log(run_dir: Path, steps, **kw) -> EventAccumulator:
    logger = MetricsLogger(run_dir, True, histogram_every=0, **kw)
    for step in steps:
        logger.log(_record(step))
    logger.close()
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _decode(event) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))


def _cell(img: np.ndarray, layer: int, expert: int) -> np.ndarray:
    return img[TITLE_H + layer * CELL + CELL // 2, LABEL_W + expert * CELL + CELL // 2]


def test_expert_load_images_in_the_event_file(tmp_path):
    acc = _log(tmp_path, range(1, 5), image_every=2)
    assert set(acc.Tags()["images"]) == {"moe/expert_load", "moe/drop_rate"}
    height, width = heatmap_size(len(TPE), len(TPE[0]))
    share = np.array(TPE) / np.array(TPE).sum(axis=1, keepdims=True)
    rate = np.array(DPE) / np.maximum(np.array(TPE), 1)
    for tag, values, vmax in (("moe/expert_load", share, share.max()), ("moe/drop_rate", rate, 1.0)):
        events = acc.Images(tag)
        assert [e.step for e in events] == [1, 2, 4]  # step 1, then every image_every
        for e in events:
            img = _decode(e)
            assert (e.height, e.width) == (height, width) and img.shape == (height, width, 3)
            for layer in range(len(TPE)):
                for expert in range(len(TPE[0])):
                    assert np.array_equal(_cell(img, layer, expert), colormap(values[layer, expert] / vmax)), (
                        tag,
                        layer,
                        expert,
                    )
    # the hottest cells are the two ends of the colour scale
    img = _decode(acc.Images("moe/drop_rate")[0])
    assert np.array_equal(_cell(img, 1, 0), colormap(0.0)) and not np.array_equal(_cell(img, 2, 2), colormap(0.0))


def test_every_numeric_key_is_a_scalar_and_the_layout_groups_moe_layers(tmp_path):
    acc = _log(tmp_path, range(1, 4), image_every=0)
    assert acc.Tags()["images"] == []
    scalars = set(acc.Tags()["scalars"])
    assert {
        "train/loss",
        "train/mfu",
        "eval/eval_loss",
        "moe/layer2/capacity",
        "moe/layer0/drop_fraction",
        "moe/layer1/expert3_token_share",
    } <= scalars
    assert [e.value for e in acc.Scalars("train/mfu")] == [0.25] * 3
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    titles = [c.title for c in layout.category]
    assert titles[:2] == ["training", "moe: all layers"] and titles[2:] == [f"moe layer {i}" for i in range(3)]
    layer1 = {chart.title: list(chart.multiline.tag) for chart in layout.category[3].chart}
    assert layer1["token share per expert"] == [r"moe/layer1/expert\d+_token_share"]


def test_image_period_comes_from_the_run_config(tmp_path):
    """The training loop builds MetricsLogger(run_dir, enabled, histogram_every, resume_step=...): the image
    period is then train.image_every of the resolved config the loop wrote into the run directory."""
    (tmp_path / "config.json").write_text(json.dumps({"train": {"image_every": 3}}))
    acc = _log(tmp_path, range(1, 7))
    assert [e.step for e in acc.Images("moe/expert_load")] == [1, 3, 6]


@pytest.mark.parametrize("policy", ["position", "probability"])
@pytest.mark.parametrize("capacity_factor,min_capacity", [(0.5, 0), (1.0, 0), (0.75, 40), (None, 0)])
def test_dropped_per_expert_recovers_the_routers_drops(policy, capacity_factor, min_capacity):
    cfg = MoEConfig(
        num_experts=8, top_k=2, capacity_factor=capacity_factor, min_capacity=min_capacity, drop_policy=policy
    )
    router = Router(16, cfg, init_std=0.5)
    torch.manual_seed(0)
    router.init_weights()
    with torch.no_grad():
        router.weight[0] += 1.0  # a favourite expert, so some experts overflow and others do not
    routing, stats = router(torch.randn(200, 16))
    true_drops = stats.tokens_per_expert_E - routing.tokens_per_expert_E.double()
    got = dropped_per_expert(stats.tokens_per_expert_E, stats.dropped.item())
    assert torch.equal(got, true_drops.double())
    assert (got.sum() > 0) == (capacity_factor is not None)  # the favourite overflows every capacity here


def test_tb_report_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _log(tmp_path, range(1, 6), image_every=0)
    main = runpy.run_path(str(REPO / "benchmarks" / "tb_report.py"), run_name="launch_script")["main"]
    assert main([str(tmp_path)]) == 0
    img = Image.open(tmp_path / "tb_report.png")
    assert img.format == "PNG" and img.size == (1000, 1100)
    assert main([str(tmp_path / "nothing")]) == 2
    assert "no TensorBoard directory" in capsys.readouterr().err
