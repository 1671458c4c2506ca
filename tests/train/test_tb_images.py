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
from moe_dist.train.expert_images import (
    CELL,
    LABEL_W,
    TITLE_H,
    colormap,
    heatmap_size,
    history_cells,
    history_size,
    label_every,
)
from moe_dist.train.metrics import PER_EXPERT_SCALARS, MetricsLogger, dropped_per_expert

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
    history = {f"moe/layer{i}/load_history" for i in range(len(TPE))}
    assert set(acc.Tags()["images"]) == {"moe/expert_load", "moe/drop_rate"} | history
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


def _moe_record(step: int, tokens_LE: np.ndarray) -> dict:
    layers = [
        {"tokens_per_expert": t.tolist(), "drop_fraction": 0.0, "max_over_mean_load": float(t.max() / t.mean())}
        for t in tokens_LE
    ]
    for layer in layers:
        layer["bias"] = [0.01 * e for e in range(len(layer["tokens_per_expert"]))]
    return {"step": step, "loss": 1.0, "moe": layers}


def test_load_history_image_holds_each_logged_steps_share_in_its_column(tmp_path):
    """Layer 0 sends every token of step s to expert s % 4, layer 1 is balanced: in the history image of layer 0
    column t (the t-th logged step) is hot at that expert only; layer 1 is uniform at mid-scale."""
    E, steps = 4, list(range(1, 7))
    logger = MetricsLogger(tmp_path, True, histogram_every=0, image_every=6)
    for s in steps:
        hot = np.zeros(E)
        hot[s % E] = 64
        logger.log(_moe_record(s, np.stack([hot, np.full(E, 16.0)])))
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("moe/layer0/load_history")] == [1, 6]
    img0, img1 = (_decode(acc.Images(f"moe/layer{i}/load_history")[-1]) for i in range(2))
    assert img0.shape[:2] == history_size(E, len(steps))
    cell_h, cell_w = history_cells(E, len(steps))
    for t, s in enumerate(steps):
        for e in range(E):
            y, x = TITLE_H + e * cell_h + cell_h // 2, LABEL_W + t * cell_w + cell_w // 2
            assert np.array_equal(img0[y, x], colormap(1.0 if e == s % E else 0.0)), (t, e)
            assert np.array_equal(img1[y, x], colormap(0.25 / 0.5)), (t, e)  # share 1/E on a 0..2/E scale


@pytest.mark.parametrize("E", [64, 512])
def test_fine_grained_moe_keeps_per_expert_values_out_of_scalars_but_in_jsonl_and_images(tmp_path, E):
    rng = np.random.default_rng(0)
    logger = MetricsLogger(tmp_path, True, histogram_every=0, image_every=5)
    for s in range(1, 11):
        logger.log(_moe_record(s, rng.integers(0, 40, size=(2, E)).astype(np.float64)))
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    per_expert_tags = [t for t in acc.Tags()["scalars"] if "/expert" in t]
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {chart.title for chart in layout.category[2].chart}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records[-1]["moe"][1]["tokens_per_expert"]) == E and len(records[-1]["moe"][1]["bias"]) == E
    assert "moe/layer1/max_over_mean_load" in acc.Tags()["scalars"]
    if E <= PER_EXPERT_SCALARS:
        assert len(per_expert_tags) == 2 * 2 * E and "token share per expert" in charts
        assert "moe/per_expert/text_summary" not in acc.Tags()["tensors"]
    else:
        assert per_expert_tags == [] and charts == {"drop fraction and imbalance", "router entropy"}
        assert "moe/per_expert/text_summary" in acc.Tags()["tensors"]  # the omission is said, not silent
    # the pictures stay within a few thousand pixels and draw every expert
    img = _decode(acc.Images("moe/layer1/load_history")[-1])
    assert img.shape[:2] == history_size(E, 10) and img.shape[0] <= TITLE_H + 1024 + 16
    assert _decode(acc.Images("moe/expert_load")[-1]).shape[1] <= LABEL_W + 1536 + 52


def test_axis_labels_thin_out_so_they_never_overlap():
    for cell in (2, 3, 6, 12, 24):
        for label_px in (6, 18, 36):
            k = label_every(cell, label_px)
            assert k * cell >= label_px + 4 and str(k)[0] in "125" and set(str(k)[1:]) <= {"0"}
            assert k == 1 or (k // 2 if str(k)[0] != "5" else k * 2 // 5) * cell < label_px + 4  # the smallest


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


def test_tb_report_reads_expert_shares_from_jsonl_when_tensorboard_has_none(tmp_path):
    pytest.importorskip("matplotlib")
    E = 96
    tokens = np.arange(2 * E, dtype=np.float64).reshape(2, E)
    logger = MetricsLogger(tmp_path, True, histogram_every=0, image_every=0)
    for s in (1, 2, 3):
        logger.log(_moe_record(s, tokens * s))
    logger.close()
    module = runpy.run_path(str(REPO / "benchmarks" / "tb_report.py"), run_name="launch_script")
    assert len(module["share_matrix"](module["read_scalars"](tmp_path / "tb"))[0]) == 0  # none in TensorBoard
    share, steps, experts = module["share_matrix_from_jsonl"](tmp_path / "metrics.jsonl")
    assert experts == [E, E] and steps.tolist() == [1, 2, 3] and share.shape == (2 * E, 3)
    assert np.allclose(share[E + 5, 2], tokens[1, 5] / tokens[1].sum())
    assert module["main"]([str(tmp_path)]) == 0 and (tmp_path / "tb_report.png").exists()
    by_kind, steps = module["event_bytes"](tmp_path / "tb")
    assert steps == 3 and by_kind["scalar"] > 0 and "per-expert scalar" not in by_kind and "image" not in by_kind
