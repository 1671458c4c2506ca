"""The memory plan (moe_dist/planning/memory.py, `launch/train.py --dry-run --world-size N`): its activation terms
against what autograd really keeps for each layer kind, and the dry-run's output. (Against measured peak memory of
real runs: benchmarks/memory_check.py, docs/memory.md.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_dist.config import load_config
from moe_dist.models.decoder import build_model, lm_loss, materialize_whole
from moe_dist.planning.memory import activation_bytes, memory_plan

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "model.d_model=64",
    "model.d_ff=96",
    "model.attention.n_heads=8",
    "model.attention.n_kv_heads=2",
    "model.attention.head_dim=16",
    "model.mamba.d_state=16",
    "model.mamba.expand=3",
    "model.moe.num_experts=8",
    "model.moe.top_k=2",
    "model.moe.capacity_factor=null",
    "model.vocab_size=512",
    "train.seq_len=128",
    "train.micro_batch_size=2",
]


def _kept_bytes(cfg) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one micro-batch (parameters excluded)."""
    model = materialize_whole(build_model(cfg.model), "cpu", 0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    t = cfg.train
    batch = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = model(batch[:, :-1])
        lm_loss(out.logits, batch[:, 1:]) + out.aux_loss
    return sum(kept.values())


@pytest.mark.parametrize(
    "layers", [("A", "D"), ("M", "D"), ("A", "E"), ("M", "E"), ("A", "D", "gated")], ids=lambda p: "".join(p)
)
def test_activation_terms_match_what_autograd_keeps(one_thread, layers):
    gated = ["model.attention.output_gate=true"] if "gated" in layers else []  # Qwen3-Next's gated attention
    cfg = load_config(
        "configs/debug.json", [*SMALL, f"model.mixer_pattern={layers[0]}", f"model.ffn_pattern={layers[1]}", *gated]
    )
    planned, kept = activation_bytes(cfg)["total"], _kept_bytes(cfg)
    assert planned == pytest.approx(kept, rel=0.05), (planned, kept)


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_activation_terms_of_the_new_mixers_match_what_autograd_keeps(one_thread, kind):
    """The per-token estimates of Mamba-2 and Gated DeltaNet layers (counted term by term, not exact: within 10%
    in fp32 at this shape, several heads and chunks)."""
    small = [*SMALL, "model.mamba2.head_dim=16", "model.mamba2.chunk_size=32"]
    small += ["model.gdn.head_k_dim=16", "model.gdn.head_v_dim=16", "model.gdn.chunk_size=32"]
    layers = "[" + ",".join([f'"{kind}+mlp"', '"attention+moe"'] * 2) + "]"
    cfg = load_config(
        "configs/debug.json", [*small, "model.mixer_pattern=A", "model.ffn_pattern=E", f"model.layers={layers}"]
    )
    planned = activation_bytes(cfg)
    assert planned[kind] > 0
    assert planned["total"] == pytest.approx(_kept_bytes(cfg), rel=0.10)


def test_dry_run_plans_a_model_with_every_layer_kind(capsys):
    """launch/train.py --dry-run, in this process: parameters from the meta model, the plan for the new kinds."""
    sys.path.insert(0, str(REPO / "launch"))
    import train as launcher

    layers = '["attention+moe","mamba2","gdn+mlp","mamba1+moe"]'
    argv = ["--config", str(REPO / "configs/debug.json"), "--dry-run", "--world-size", "2"]
    argv += ["--set", "model.mixer_pattern=A", "--set", "model.ffn_pattern=E", "--set", f"model.layers={layers}"]
    assert launcher.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = load_config(
        REPO / "configs/debug.json", ["model.mixer_pattern=A", "model.ffn_pattern=E", f"model.layers={layers}"]
    )
    assert out["params_total"] == sum(p.numel() for p in build_model(cfg.model, "meta").parameters())
    assert out["memory_per_rank_gb"]["activations"] > 0


def test_plan_of_the_shipped_big_configs_fits_an_h200_node():
    for name in ("mixtral_8x7b", "jamba_v0.1", "nemotron3_nano_30b_a3b", "granite4_h_small"):
        cfg = load_config(REPO / f"configs/{name}.json")
        plan = memory_plan(cfg, world_size=8)
        mem = plan["memory_per_rank_gb"]
        assert mem["total"] <= 141, (name, mem)  # H200: 141 GB, the CUDA context and NCCL's buffers included
        assert mem["runtime"] > 4  # context + NCCL: world and dp/tp rings, the expert all-to-all
        assert mem["total"] > mem["params"] + mem["optimizer"] + mem["activations"] + mem["runtime"]
        without = memory_plan(load_config(REPO / f"configs/{name}.json", ["train.activation_checkpointing=none"]), 8)
        assert without["memory_per_rank_gb"]["activations"] > 2.5 * mem["activations"]
        wider = memory_plan(cfg, world_size=64)["memory_per_rank_gb"]
        assert wider["optimizer"] == pytest.approx(mem["optimizer"] / 8, rel=0.05)  # ZeRO over 8x the replicas


def test_dry_run_prints_the_plan_with_json_last(tmp_path):
    cmd = [sys.executable, str(REPO / "launch/train.py"), "--config", str(REPO / "configs/mixtral_8x7b.json")]
    proc = subprocess.run([*cmd, "--dry-run", "--world-size", "64"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["params_total"] == 46_702_792_704 and out["params_active"] == 12_879_925_248
    assert set(out["memory_per_rank_gb"]) >= {"params", "grads", "optimizer", "activations", "runtime", "total"}
    assert any(line.startswith("layout: world 64 = dp 64 x tp 1, ep 8") for line in lines)
    cpu = subprocess.run([*cmd, "--dry-run", "--world-size", "64", "--device", "cpu"], capture_output=True, text=True)
    cpu_mem = json.loads(cpu.stdout.strip().splitlines()[-1])["memory_per_rank_gb"]
    gpu_mem = out["memory_per_rank_gb"]
    assert cpu_mem["runtime"] == pytest.approx(0.27) and gpu_mem["runtime"] > 1  # the framework's own memory
    assert gpu_mem["total"] - cpu_mem["total"] == pytest.approx(gpu_mem["runtime"] - cpu_mem["runtime"])
    bad = subprocess.run([*cmd, "--dry-run", "--world-size", "12"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: parallel.ep: 8 must divide")
