"""The memory plan (moe_dist/planning/memory.py, `launch/train.py --dry-run --world-size N`): its activation terms
against what autograd really keeps for each layer kind, and the dry-run's output. (Against measured peak memory of
real runs: benchmarks/studies/memory_check.py, docs/memory.md.)"""

import json
import sys
from pathlib import Path

import pytest
import torch

from moe_dist.config import ConfigError, load_config
from moe_dist.models.decoder import build_model, lm_loss, materialize_whole
from moe_dist.planning.capacity import device_capacity_bytes, planned_capacity
from moe_dist.planning.memory import GB, activation_bytes, expert_rows_factor, memory_plan

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
    "layers",
    [("A", "D"), ("M", "D"), ("A", "E"), ("M", "E"), ("A", "D", "gated"), ("A", "D", "relu2"), ("A", "E", "relu2")],
    ids=lambda p: "".join(p),
)
def test_activation_terms_match_what_autograd_keeps(one_thread, layers):
    gated = ["model.attention.output_gate=true"] if "gated" in layers else []  # Qwen3-Next's gated attention
    gated += ["model.ffn_activation=relu2"] if "relu2" in layers else []  # Nemotron-H's FFNs: no gate
    cfg = load_config(
        "configs/debug.json", [*SMALL, f"model.mixer_pattern={layers[0]}", f"model.ffn_pattern={layers[1]}", *gated]
    )
    planned, kept = activation_bytes(cfg)["total"], _kept_bytes(cfg)
    assert planned == pytest.approx(kept, rel=0.05), (planned, kept)


@pytest.mark.parametrize(
    "extra",
    [
        ["model.attention.qk_norm=head"],  # Qwen3
        ["model.attention.qk_norm=full"],  # OLMoE
        ["model.attention.rope_fraction=0.25"],  # Qwen3-Next's partial RoPE
        ["model.attention.qk_norm=head", "model.attention.rope_fraction=0.25", "model.attention.output_gate=true"],
    ],
    ids=["qk_head", "qk_full", "partial_rope", "qwen3_next"],
)
def test_attention_options_match_what_autograd_keeps(one_thread, extra):
    cfg = load_config("configs/debug.json", [*SMALL, "model.mixer_pattern=A", "model.ffn_pattern=D", *extra])
    assert activation_bytes(cfg)["total"] == pytest.approx(_kept_bytes(cfg), rel=0.05)


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


H200 = 143_771 * 2**20  # bytes: torch.cuda.mem_get_info's total on an H200 (150.75 GB, 140.4 GiB)
# Mixtral on one node: its shipped tp 1 · ep 8 plans over (docs/memory.md, "The shipped big configs").
ONE_NODE_MIXTRAL = ["parallel.tp=4", "parallel.ep=2", "parallel.sequence_parallel=true"]
ONE_NODE_GRANITE = ONE_NODE_MIXTRAL  # the same one-node layout (docs/models.md)
# One node whose full-size fp32 accumulation buffer (ZeRO 1, one reduction per step) does not fit beside the rest
# reduces every micro-batch instead (ZeRO 2: in-node, docs/memory.md "The shipped big configs").
IN_NODE_ZERO2 = ["deepspeed.zero_stage=2"]
DOCUMENTED = [  # (config, GPUs, overrides): the layouts docs/memory.md documents as fitting
    *[("mixtral_8x7b", n, []) for n in (16, 64, 256)],
    ("mixtral_8x7b", 8, [*ONE_NODE_MIXTRAL, *IN_NODE_ZERO2]),
    ("jamba_v0.1", 8, IN_NODE_ZERO2),
    *[("jamba_v0.1", n, []) for n in (16, 64, 256)],
    ("nemotron3_nano_30b_a3b", 8, []),
    ("granite4_h_small", 16, []),
    ("granite4_h_small", 8, ONE_NODE_GRANITE),
    ("qwen3_next_80b_a3b", 32, []),
    ("qwen3_5_35b_a3b", 8, IN_NODE_ZERO2),
    ("qwen3_5_35b_a3b", 16, []),
]


@pytest.mark.parametrize(
    "name, world, overrides", DOCUMENTED, ids=[f"{n}-{w}{'-one-node' if o else ''}" for n, w, o in DOCUMENTED]
)
def test_shipped_configs_fit_an_h200_at_their_documented_layouts(name, world, overrides):
    """With the fragmentation margin and dropless routing planned at its worst (the config's defaults)."""
    cfg = load_config(REPO / f"configs/{name}.json", overrides)
    plan = memory_plan(cfg, world_size=world, capacity_bytes=H200)
    mem, cap = plan["memory_per_rank_gb"], plan["capacity"]
    assert cap["fits"] and mem["total"] <= 0.9 * H200 / 1e9, (name, world, mem)
    assert mem["runtime"] > 3  # context + NCCL: world and dp/tp rings, the expert all-to-all
    assert mem["total"] > mem["params"] + mem["optimizer"] + mem["activations"] + mem["runtime"]


def test_plan_of_the_shipped_big_configs_on_one_h200_node():
    for name, overrides in (("mixtral_8x7b", [*ONE_NODE_MIXTRAL, *IN_NODE_ZERO2]), ("jamba_v0.1", IN_NODE_ZERO2)):
        cfg = load_config(REPO / f"configs/{name}.json", overrides)
        mem = memory_plan(cfg, world_size=8, capacity_bytes=H200)["memory_per_rank_gb"]
        off = [*overrides, "train.activation_checkpointing=none"]
        without = memory_plan(load_config(REPO / f"configs/{name}.json", off), 8, capacity_bytes=H200)
        assert without["memory_per_rank_gb"]["activations"] > 2.5 * mem["activations"]
        wider = memory_plan(cfg, world_size=64)["memory_per_rank_gb"]
        assert wider["optimizer"] == pytest.approx(mem["optimizer"] / 8, rel=0.05)  # ZeRO over 8x the replicas
    # Mixtral's shipped ep 8 on one node: over at the routing bound (4x), inside at 2x the mean (docs/memory.md).
    shipped = load_config(REPO / "configs/mixtral_8x7b.json", IN_NODE_ZERO2)
    assert not memory_plan(shipped, 8, capacity_bytes=H200)["capacity"]["fits"]
    measured = load_config(REPO / "configs/mixtral_8x7b.json", ["plan.expert_imbalance=2", *IN_NODE_ZERO2])
    assert memory_plan(measured, 8, capacity_bytes=H200)["capacity"]["fits"]


def test_fragmentation_margin_is_a_fraction_of_capacity_and_decides_the_fit():
    gib = 2**30
    cfg = load_config("configs/debug.json", ["plan.fragmentation_margin=0.25"])
    total = memory_plan(cfg, 1, capacity_bytes=4 * gib)["memory_per_rank_gb"]["total"] * 1e9
    for capacity, fits in ((int(total / 0.75) + 1, True), (int(total / 0.75) - 1, False)):
        cap = memory_plan(cfg, 1, capacity_bytes=capacity)["capacity"]
        assert cap["fits"] is fits  # total ≤ 3/4 of capacity, to the byte
        assert cap["margin_gb"] == pytest.approx(capacity / 4 / 1e9)
        assert cap["usable_gb"] == pytest.approx(capacity * 3 / 4 / 1e9)
        assert cap["headroom_gb"] == pytest.approx((capacity * 3 / 4 - total) / 1e9)
    # The default margin, 10%, on an H200: 135.68 GB usable of 150.75 GB.
    cap = memory_plan(load_config("configs/debug.json"), 1, capacity_bytes=H200)["capacity"]
    assert cap["device_mib"] == 143_771 and cap["usable_gb"] == pytest.approx(135.679, abs=1e-3)
    assert memory_plan(cfg, 1, device="cpu")["capacity"] is None  # CPU ranks share the host's memory


def test_capacity_comes_from_the_config_or_the_device():
    mib = planned_capacity(load_config("configs/debug.json", ["plan.device_memory_mib=81559"]))
    assert mib == (81_559 * 2**20, "plan.device_memory_mib")
    own = planned_capacity(load_config("configs/debug.json"))[0]
    assert own == (device_capacity_bytes() if torch.cuda.is_available() else 143_771 * 2**20)
    for bad in ("plan.fragmentation_margin=1", "plan.expert_imbalance=0.5", "plan.device_memory_mib=0"):
        with pytest.raises(ConfigError, match=f"^{bad.split('=')[0]}: "):
            load_config("configs/debug.json", [bad])


def _moe_plan(*overrides):
    """Four MoE layers of 8 experts, top-2, D 64, F 96, fp32, T = 2 · 128 = 256 tokens, no recompute."""
    return load_config("configs/debug.json", [*SMALL, "model.mixer_pattern=A", "model.ffn_pattern=E", *overrides])


def test_dropless_imbalance_plans_the_expert_side_at_the_busiest_rank():
    base = activation_bytes(_moe_plan("parallel.ep=2", "plan.expert_imbalance=1"))
    busy = activation_bytes(_moe_plan("parallel.ep=2", "plan.expert_imbalance=1.5"))
    # Per layer and token the experts keep their K input rows and K·4F activations: half as much again.
    assert busy["moe"] - base["moe"] == pytest.approx(4 * 256 * 2 * 0.5 * (64 + 4 * 96) * 4)
    assert busy["transient"]["layer_backward"] == pytest.approx(256 * 2 * 1.5 * 4 * 96 * 4)  # the experts' interior
    assert busy["transient"]["all_to_all"] == pytest.approx(256 * 2 * (1 + 1.5) * 64 * 4)  # rows sent, received
    for attention in ("attention", "head"):
        assert busy[attention] == base[attention]
    # The default (null) plans the most routing can send one rank, ep · min(K, E/ep) / K rows per K·T.
    assert expert_rows_factor(_moe_plan("parallel.ep=2")) == 2.0  # 2 ranks of 4 experts: both of K on one
    assert expert_rows_factor(_moe_plan("parallel.ep=8")) == 4.0  # 8 ranks of 1 expert: 8 · 1 / 2
    assert expert_rows_factor(_moe_plan("parallel.ep=8", "plan.expert_imbalance=3")) == 3.0
    assert expert_rows_factor(_moe_plan("parallel.ep=2", "plan.expert_imbalance=3")) == 2.0  # capped
    # All experts on the rank: K·T rows however they are spread; with a capacity factor: capacity bounds them.
    assert activation_bytes(_moe_plan("plan.expert_imbalance=3")) == activation_bytes(_moe_plan())
    assert expert_rows_factor(_moe_plan("parallel.ep=2", "model.moe.capacity_factor=1.25")) == 1.25


def test_moe_rows_under_tp_are_those_the_dispatch_keeps():
    """Under EP each TP rank dispatches its 1/tp token slice (parallel/dispatch.py): the combine keeps K·T/tp rows;
    experts split over TP meet the whole TP group's rows (K·ρ·T), whole experts (etp 1) this rank's own (K·ρ·T/tp).
    Measured against autograd's saved tensors on 4 gloo ranks (tp 2 · ep 2): docs/memory.md, "MoE rows under TP"."""
    T, D, F, K, a, layers = 256, 64, 96, 2, 4, 4
    full = ["parallel.ep=2", "plan.expert_imbalance=1.5", "train.activation_checkpointing=full"]
    one = activation_bytes(_moe_plan(*full))
    split = activation_bytes(_moe_plan(*full, "parallel.tp=2"), tp=2)
    whole = activation_bytes(_moe_plan(*full, "parallel.tp=2", "parallel.etp=1"), tp=2)
    assert one["moe"] - split["moe"] == pytest.approx(layers * T * K * D * a / 2)  # the token side halves
    assert split["moe"] - whole["moe"] == pytest.approx(layers * T * K * 1.5 * D * a / 2)  # and the expert side
    assert whole["transient"]["all_to_all"] == pytest.approx(T * K * (1 + 1.5) * D * a / 2)
    # Without recompute whole experts keep their full hidden width, for half the rows.
    plain = ["parallel.ep=2", "plan.expert_imbalance=1.5", "parallel.tp=2"]
    kept = activation_bytes(_moe_plan(*plain, "parallel.etp=1"), tp=2)
    assert kept["transient"]["layer_backward"] == pytest.approx(T * K * 1.5 / 2 * 4 * F * a)
    # Without EP every TP rank routes and runs all the micro-batch's rows.
    no_ep = activation_bytes(_moe_plan("parallel.tp=2", full[2]), tp=2)
    assert no_ep["moe"] == activation_bytes(_moe_plan(full[2]))["moe"]


@pytest.mark.parametrize("etp", [None, 1])
def test_relu2_ffns_plan_the_shards_apply_tp_holds(etp):
    """Squared-ReLU FFNs (Nemotron-H) under tp 2: the plan's parameters per rank are those `apply_tp` leaves on a rank
    (w1 and w2 split, no w3: dense FFN, shared expert and experts, or whole experts with etp 1 and ep 2), and each
    FFN keeps 2 activations per hidden unit of its 1/tp share (SwiGLU: 4)."""
    from moe_dist.layers.experts import Experts
    from moe_dist.parallel.expert_parallel import apply_ep
    from moe_dist.parallel.mesh import Mesh
    from moe_dist.parallel.tensor_parallel import apply_tp
    from moe_dist.planning.memory import local_param_counts

    relu2 = ["model.ffn_activation=relu2", "model.moe.n_shared_experts=1", "model.moe.shared_d_ff=64"]
    cfg = load_config("configs/debug.json", [*SMALL, "model.mixer_pattern=A", "model.ffn_pattern=DE", *relu2])
    ep = 2 if etp == 1 else 1
    mesh = Mesh(0, 2, 0, 2, torch.device("cpu"), 1, 0, ep, 0, None, None, f"ep_size_{ep}", tp=2, etp=etp)
    model = apply_tp(apply_ep(build_model(cfg.model, "meta"), mesh), mesh)
    experts = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
    held = (
        sum(p.numel() for p in model.parameters() if id(p) not in experts),
        sum(p.numel() for p in model.parameters() if id(p) in experts),
    )
    assert local_param_counts(cfg, tp=2, ep=ep, etp=etp) == held
    assert not any(name.endswith("w3.weight") or ".w13" in name for name, _ in model.named_parameters())
    swiglu = load_config("configs/debug.json", [*SMALL, "model.mixer_pattern=A", "model.ffn_pattern=DE"])
    dense_ffn = activation_bytes(swiglu, tp=2)["mlp"] - activation_bytes(cfg, tp=2)["mlp"]
    assert dense_ffn == pytest.approx(2 * 2 * 96 / 2 * 128 * 2 * 4)  # 2 layers · 2 fewer · F/tp units · T tokens, fp32


def test_dry_run_prints_the_plan_with_json_last(tmp_path, forks):
    train, cmd = REPO / "launch/train.py", ["--config", str(REPO / "configs/mixtral_8x7b.json")]
    proc = forks.script(train, [*cmd, "--dry-run", "--world-size", "64"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["params_total"] == 46_702_792_704 and out["params_active"] == 12_879_925_248
    assert set(out["memory_per_rank_gb"]) >= {"params", "grads", "optimizer", "activations", "runtime", "total"}
    assert any(line.startswith("layout: world 64 = dp 64 x tp 1, ep 8") for line in lines)
    assert out["capacity"]["fits"] and any(line.startswith("fits: yes: total ") for line in lines)
    cpu = forks.script(train, [*cmd, "--dry-run", "--world-size", "64", "--device", "cpu"])
    cpu_mem = json.loads(cpu.stdout.strip().splitlines()[-1])["memory_per_rank_gb"]
    gpu_mem = out["memory_per_rank_gb"]
    assert cpu_mem["runtime"] == pytest.approx(0.27) and gpu_mem["runtime"] > 1  # the framework's own memory
    assert gpu_mem["total"] - cpu_mem["total"] == pytest.approx(gpu_mem["runtime"] - cpu_mem["runtime"])
    assert json.loads(cpu.stdout.strip().splitlines()[-1])["capacity"] is None
    bad = forks.script(train, [*cmd, "--dry-run", "--world-size", "12"])
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: parallel.ep: 8 must divide")


def test_one_reduction_per_step_plans_the_unsharded_fp32_accumulation_buffer():
    """ZeRO 1 with bf16 weights (the shipped Mixtral): every local parameter's fp32 gradient sum lives until the
    step's one reduction, ≈29 GB per rank at ep 8 however many ranks; ZeRO 2 holds only its reduced partition."""
    for world in (16, 64):
        one = memory_plan(load_config(REPO / "configs/mixtral_8x7b.json"), world, capacity_bytes=H200)
        two = memory_plan(load_config(REPO / "configs/mixtral_8x7b.json", IN_NODE_ZERO2), world, capacity_bytes=H200)
        local = sum(one["params_local"].values())
        assert 7.0e9 < local < 7.5e9  # 1.6 B dense and 1/8 of the 45 B expert weights
        buffer = (one["memory_per_rank_gb"]["grads"] - two["memory_per_rank_gb"]["grads"]) * GB
        assert buffer == pytest.approx(4 * local, rel=1e-9)  # the reduced fp32 partition is in both
    fp32 = memory_plan(load_config(REPO / "configs/mixtral_8x7b.json", ["train.grad_accum_dtype=bf16"]), 64)
    assert fp32["memory_per_rank_gb"]["grads"] < one["memory_per_rank_gb"]["grads"] - 14  # bf16 p.grad: half
