"""Model FLOPs utilisation (train/throughput.py): the FLOPs per token against a hand count, the peak table, the
per-device arithmetic, and the profiler's trace. The training log's MFU columns are checked on a real run in
train/test_train_e2e.py."""

from __future__ import annotations

import json

import pytest
import torch
from support import DEBUG_CONFIG

from moe_dist.config import load_config
from moe_dist.train.throughput import (
    Peak,
    Utilisation,
    device_peak,
    maybe_profile,
    model_flops_per_token,
    profile_trace_path,
    table_peak,
)


def test_flops_per_token_of_a_dense_attention_model_equal_a_hand_count(tmp_path):
    V, D, F, H, KV, S, L = 96, 32, 80, 4, 2, 24, 3
    model = {"vocab_size": V, "d_model": D, "d_ff": F, "n_layers": L, "layers": ["attention+mlp"] * L}
    model["attention"] = {"n_heads": H, "n_kv_heads": KV}
    path = tmp_path / "dense.json"
    path.write_text(json.dumps({"model": model, "train": {"seq_len": S}}))
    cfg = load_config(path)
    dh = D // H
    per_layer = D * H * dh + 2 * D * KV * dh + H * dh * D + 3 * D * F  # q, k, v, o; SwiGLU gate, up, down
    head = V * D  # the LM head; the embedding is a lookup
    attention = 2 * S * H * dh  # QKᵀ and AV per token, causal: half of 4·S·H·dh
    fwd = 2 * (L * per_layer + head) + L * attention
    assert model_flops_per_token(cfg) == pytest.approx(3 * fwd, rel=1e-12)


def test_routed_experts_count_at_top_k_over_e():
    dense = load_config(DEBUG_CONFIG, ["model.moe.num_experts=4", "model.moe.top_k=2"])
    sparse = load_config(DEBUG_CONFIG, ["model.moe.num_experts=8", "model.moe.top_k=2"])
    # twice the experts at the same top_k: the same FLOPs per token except the router's extra 4 columns
    router_extra = 2 * 4 * 64 * sum(ffn == "moe" for _, ffn in sparse.model.layer_kinds())
    assert model_flops_per_token(sparse) - model_flops_per_token(dense) == pytest.approx(3 * router_extra)


def test_the_peak_table_takes_the_most_specific_name_and_the_dtype():
    assert table_peak("NVIDIA H200", "bf16").flops_per_s == 989e12
    assert table_peak("NVIDIA H100 PCIe", "bf16").flops_per_s == 756e12  # not the SXM figure
    assert table_peak("NVIDIA H100 80GB HBM3", "fp32").flops_per_s == 494e12  # tf32
    assert table_peak("NVIDIA GH200 480GB", "bf16").flops_per_s == 989e12
    assert table_peak("Some Future GPU", "bf16") is None


def test_cpu_peak_is_measured_and_utilisation_is_per_device():
    threads = torch.get_num_threads()
    peak = device_peak(torch.device("cpu"), "fp32")
    assert peak.flops_per_s > 1e8 and peak.source.startswith("one thread's best 512^3 fp32 matmul of ")
    assert peak.source.endswith(f"on cpu, x {threads} threads")
    assert torch.get_num_threads() == threads  # measured on one thread, the run's count given back
    u = Utilisation(flops_per_token=6e9, devices=8, peak=Peak(1e15, "table"))
    got = u(tokens_per_s=4e5)  # 6e9 · 4e5 / 8 = 3e14 FLOP/s per device
    assert got["tflops_per_device"] == pytest.approx(300.0) and got["mfu"] == pytest.approx(0.3)


def test_a_given_peak_replaces_the_table_and_the_measurement():
    peak = device_peak(torch.device("cpu"), "fp32", given_tflops=0.25)
    assert peak == Peak(0.25e12, "train.peak_tflops=0.25")


def test_profiler_traces_only_the_chosen_step_and_ranks(tmp_path):
    a = torch.randn(64, 64)
    for step in (1, 2, 3):
        for rank in (0, 1):
            with maybe_profile(tmp_path, step, rank, steps=[2], ranks=[1], device=torch.device("cpu")):
                a @ a
    traces = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert traces == [profile_trace_path(tmp_path, 2, 1).name]
    events = json.loads(profile_trace_path(tmp_path, 2, 1).read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)


def test_profile_ranks_outside_the_world_are_refused_at_start_up():
    from moe_dist.config import ConfigError
    from moe_dist.config.parallel_checks import check_layout

    with pytest.raises(ConfigError, match=r"^train.profile_ranks: \[2\] outside the world's ranks 0..1$"):
        check_layout(load_config(DEBUG_CONFIG, ["train.profile_ranks=[0, 2]"]), 2)
