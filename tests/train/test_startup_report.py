"""Start-up's report (moe_dist/train/startup.py): the versions and kernels lines in a real run's output, and the
slow-path warnings a CUDA run would print, decided from the config and the model built for CUDA (no GPU needed:
the choice is made when the model is built for its device)."""

import platform
from importlib import metadata

import pytest
import torch

from moe_dist.config import load_config
from moe_dist.models.decoder import build_model
from moe_dist.train.startup import slow_paths

CONFIG = "configs/debug.json"
WINDOW = "attention with a sliding window shorter than the sequence takes SDPA with an explicit mask"


def test_a_run_prints_its_versions_and_kernels_once(debug_run):
    """configs/debug.json's single-process run (shared with the other tests): one line each, on CPU no warning."""
    debug_run("python")
    lines = debug_run.stderr["python"].splitlines()
    versions = [line for line in lines if line.startswith("versions: ")]
    assert versions == [
        f"versions: python {platform.python_version()}, torch {torch.__version__}, "
        f"triton {metadata.version('triton')}, deepspeed {metadata.version('deepspeed')}, cpu"
    ]
    kernels = [line for line in lines if line.startswith("kernels: ")]
    assert kernels == ["kernels: attention sdpa, permutation torch, experts grouped_mm, scan torch"]
    assert not [line for line in lines if "slow path" in line]


@pytest.mark.parametrize(
    "overrides, warnings",
    [
        ([], ["grouped GEMM: its cuda kernel takes bfloat16, not float32; the experts run one matmul per expert"]),
        (["train.dtype=bf16"], []),
        (
            ["train.dtype=bf16", "data.document_masking=true", "model.attention.impl=torch"],
            ["attention with documents takes SDPA with an explicit mask (model.attention.impl='torch')"],
        ),
        (
            ["train.dtype=bf16", "data.document_masking=true", "model.attention.sliding_window=8"],
            [f"{WINDOW} (no fast kernel here takes a sliding window)"],
        ),
        (["train.dtype=bf16", "model.attention.sliding_window=32"], []),  # not shorter than train.seq_len 32
        # Context parallelism: the query-offset kernels decide (causal pieces take ours, not SDPA's causal kernel)
        (["train.dtype=bf16", "parallel.cp=2"], []),
        (
            ["train.dtype=bf16", "parallel.cp=2", "model.attention.impl=torch"],
            [
                "attention with a causal mask under context parallelism takes SDPA with an explicit mask "
                "(model.attention.impl='torch')"
            ],
        ),
        (
            ["train.dtype=bf16", "model.d_ff=100"],
            ["grouped GEMM: widths [100] are not multiples of 16 bytes; " + "the experts run one matmul per expert"],
        ),
    ],
)
def test_the_slow_paths_a_cuda_run_warns_of(overrides, warnings):
    cfg = load_config(CONFIG, overrides)
    model = build_model(cfg.model, "cuda")
    assert slow_paths(cfg, model, torch.device("cuda")) == [f"warning: slow path: {w}" for w in warnings]
    assert slow_paths(cfg, build_model(cfg.model, "cpu"), torch.device("cpu")) == []
