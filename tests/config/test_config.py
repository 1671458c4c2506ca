"""Config loading: every shipped file loads, errors are one line naming the dotted path, overrides work."""

import dataclasses
import json
from pathlib import Path

import pytest

from moe_dist.config import (
    ConfigError,
    JobConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    load_config,
)
from moe_dist.config.parallel_checks import check_layout

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_round_trips(path):
    cfg = load_config(path)
    assert isinstance(cfg, JobConfig)
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg


def _write(tmp_path, raw):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(raw))
    return p


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"model": {"moe": {"num_expert": 4}}},
            "model.moe.num_expert: unknown config key (did you mean 'model.moe.num_experts'?)",
        ),
        ({"trian": {}}, "trian: unknown config key (did you mean 'train'?)"),
        ({"train": {"steps": "10"}}, "train.steps: expected int, got str '10'"),
        ({"train": {"steps": 1.5}}, "train.steps: expected int, got float 1.5"),
        ({"train": {"lr": True}}, "train.lr: expected float, got bool True"),
        (
            {"model": {"moe": {"drop_policy": "random"}}},
            "model.moe.drop_policy: expected one of ['position', 'probability'], got 'random'",
        ),
        ({"model": {"attention": 3}}, "model.attention: expected an object, got int 3"),
        ({"model": {"moe": {"top_k": 9}}}, "model.moe.top_k: must be in [1, num_experts=8], got 9"),
        (
            {"model": {"mixer_pattern": "AX"}},
            "model.mixer_pattern: letters A (attention), L (mla), M (mamba1) only, got 'AX'",
        ),
        ({"model": {"n_layers": 3, "ffn_pattern": "DE"}}, "model.ffn_pattern: length 2 must divide model.n_layers=3"),
        (
            {"train": {"global_batch_size": 6, "micro_batch_size": 4}},
            "train.global_batch_size: must be a multiple of train.micro_batch_size=4, got 6",
        ),
        # keys and values of the retired compiled CPU kernels and host tuning
        *[
            (
                {"train": {key: value}},
                f"train.{key}: unknown config key (valid keys: "
                + ", ".join(f.name for f in dataclasses.fields(TrainConfig))
                + ")",
            )
            for key, value in (("cpu_hugepages", True), ("flush_denormal", True), ("cpu_malloc", "keep"))
        ],
        (
            {"model": {"mamba": {"impl": "cpu"}}},
            "model.mamba.impl: expected one of ['auto', 'torch', 'triton'], got 'cpu'",
        ),
        ({"model": {"mamba2": {"chunk_size": 48}}}, "model.mamba2.chunk_size: must be a power of two, got 48"),
        (
            {"model": {"mamba2": {"n_heads": 6, "n_groups": 4}}},
            "model.mamba2.n_groups: must divide model.mamba2.n_heads=6, got 4",
        ),
        (
            {"model": {"mamba2": {"dt_limit": [0.1, 0.01]}}},
            "model.mamba2.dt_limit: expected [low, high] with 0 <= low < high, or null, got [0.1, 0.01]",
        ),
    ],
)
def test_errors_are_one_line_and_name_the_key(tmp_path, raw, message):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, raw))
    assert str(e.value) == message and "\n" not in str(e.value)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.json: config file not found"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train": {"steps": 3,}}')
    with pytest.raises(ConfigError, match=r"bad.json: invalid JSON at line 1"):
        load_config(bad)


def test_overrides_use_dotted_paths_and_json_values(tmp_path):
    cfg = load_config(
        REPO / "configs/debug.json",
        [
            "train.steps=50",
            "model.moe.capacity_factor=null",
            "model.moe.drop_policy=probability",
            "train.betas=[0.8,0.9]",
        ],
    )
    assert cfg.train.steps == 50 and cfg.model.moe.capacity_factor is None
    assert cfg.model.moe.drop_policy == "probability" and cfg.train.betas == [0.8, 0.9]
    assert cfg.model.d_model == 64  # untouched keys keep the file's values
    with pytest.raises(ConfigError, match=r"^train.stepz: unknown config key \(did you mean 'train.steps'\?\)$"):
        load_config(None, ["train.stepz=3"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["train.steps"])
    with pytest.raises(ConfigError, match="^train.steps.x: 'train.steps' is not a section$"):
        load_config(None, ["train.steps.x=1"])


def test_layout_checks_against_world_size():
    cfg = load_config(REPO / "configs/debug.json")
    assert check_layout(cfg, 2) == 2
    with pytest.raises(ConfigError, match="not divisible among 8 data-parallel ranks"):
        check_layout(cfg, 8)
    assert check_layout(load_config(REPO / "configs/debug.json", ["parallel.a2a_chunks=3"]), 2) == 2
    with pytest.raises(ConfigError, match=r"^parallel.a2a_chunks: must be at least 1, got 0$"):
        check_layout(load_config(REPO / "configs/debug.json", ["parallel.a2a_chunks=0"]), 2)


# A layer list with both new mixers (Mamba-2: 8 heads of 16 channels), for their tensor-parallel rules.
_SSM_LAYERS = [
    "model.mixer_pattern=A",
    "model.ffn_pattern=E",
    'model.layers=["mamba2+mlp","gdn+moe","attention+moe","mamba2+mlp"]',
    "model.mamba2.head_dim=16",
]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.attention.n_heads=3", "model.attention.n_kv_heads=3", "model.attention.head_dim=16"],
            "model.attention.n_heads: query heads 3 is not divisible by parallel.tp=2",
        ),
        (
            ["model.attention.n_kv_heads=1"],
            "model.attention.n_kv_heads: key/value heads 1 is not divisible by parallel.tp=2",
        ),
        (
            ["model.d_model=65", "model.mamba.expand=1", "model.attention.head_dim=16", "model.mixer_pattern=M"],
            "model.mamba.expand: d_inner = expand * d_model = 65 is not divisible by parallel.tp=2",
        ),
        (["model.d_ff=130"], "model.d_ff: the dense FFN hidden size 130 is not divisible by parallel.tp=4"),
        (["model.moe.d_ff=31"], "model.moe.d_ff: the expert hidden size 31 is not divisible by parallel.tp=2"),
        (
            ["model.vocab_size=257"],
            "model.vocab_size: the vocabulary (split across tensor-parallel ranks) 257 is not divisible by "
            "parallel.tp=2",
        ),
        (
            ["parallel.sequence_parallel=true", "train.seq_len=33"],
            "train.seq_len: with parallel.sequence_parallel, the sequence length 33 is not divisible by parallel.tp=2",
        ),
        (
            ["model.mamba.proj_bias=true"],
            "model.mamba.proj_bias: biases of Mamba's in/out projections are not supported with parallel.tp > 1",
        ),
        (
            [*_SSM_LAYERS, "model.mamba2.n_heads=3", "model.mamba2.n_groups=1"],
            "model.mamba2.n_heads: the 3 Mamba-2 heads (n_heads, or expand * d_model / head_dim) are not divisible "
            "by parallel.tp=2",
        ),
        (  # 12 heads, which tp = 4 splits, in 3 groups, which it cannot
            [*_SSM_LAYERS, "model.mamba2.n_heads=12", "model.mamba2.n_groups=3"],
            "model.mamba2.n_groups: 3 groups must be a multiple or a divisor of parallel.tp=4",
        ),
        (
            [*_SSM_LAYERS, "model.mamba2.n_groups=1", "model.mamba2.d_state=5"],
            "model.mamba2.d_state: 5 is not divisible by parallel.tp / n_groups = 2 (each group's B and C are split "
            "over that many ranks)",
        ),
        (
            [*_SSM_LAYERS, "model.mamba2.proj_bias=true"],
            "model.mamba2.proj_bias: biases of Mamba-2's in/out projections are not supported with parallel.tp > 1",
        ),
        (
            [*_SSM_LAYERS, "model.gdn.n_k_heads=1", "model.gdn.n_v_heads=4"],
            "model.gdn.n_k_heads: Gated DeltaNet key heads 1 is not divisible by parallel.tp=2",
        ),
    ],
)
def test_tensor_parallel_divisibility_errors_name_the_key(overrides, message):
    tp = message.split("parallel.tp=")[1] if "parallel.tp=" in message else "2"
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/debug.json", [f"parallel.tp={tp}", "model.attention.n_kv_heads=4", *overrides])
    assert str(e.value) == message


def test_tensor_parallel_layout_against_world_size():
    cfg = load_config(REPO / "configs/debug.json", ["parallel.tp=2", "parallel.ep=2"])
    assert check_layout(cfg, 4) == 2  # dp = world / tp
    with pytest.raises(ConfigError, match=r"^parallel.tp: 2 does not divide the world size 3$"):
        check_layout(cfg, 3)
    with pytest.raises(
        ConfigError,
        match=r"^parallel.ep: 2 must divide the data-parallel degree 1 \(world 2 / tp 2; parallel.etp=1 lets it "
        r"divide dp × tp\)$",
    ):
        check_layout(cfg, 2)


def test_folded_expert_layout_against_world_size():
    """parallel.etp = 1: ep divides dp × tp (not dp), the experts' hidden size need not divide by tp; bad
    combinations fail in one line naming the keys."""
    debug = REPO / "configs/debug.json"
    folded = ["parallel.tp=2", "parallel.etp=1", "model.attention.n_kv_heads=4"]
    assert check_layout(load_config(debug, [*folded, "parallel.ep=2"]), 2) == 1  # the EP group is the TP group
    assert check_layout(load_config(debug, [*folded, "parallel.ep=4"]), 4) == 2
    assert check_layout(load_config(debug, ["parallel.tp=4", "parallel.etp=1", "parallel.ep=4", *folded[2:]]), 4) == 1
    load_config(debug, [*folded, "parallel.ep=2", "model.moe.d_ff=31"])  # whole experts: any hidden size
    with pytest.raises(ConfigError, match=r"^parallel.ep: 4 must divide dp × tp = world size 6 with parallel.etp=1"):
        check_layout(load_config(debug, [*folded, "parallel.ep=4"]), 6)
    with pytest.raises(ConfigError, match=r"^parallel.etp: must be 1 or parallel.tp=4 \(or null: tp\), got 2$"):
        load_config(debug, ["parallel.tp=4", "parallel.etp=2", "parallel.ep=2", *folded[2:]])
    with pytest.raises(ConfigError, match=r"^parallel.etp: 1 with parallel.tp=2 needs parallel.ep > 1 "):
        load_config(debug, folded)
    assert load_config(debug, ["parallel.tp=2", *folded[2:]]).parallel.etp is None  # default: experts split over TP


def test_dedup_dispatch_layout_checks():
    """parallel.a2a_dedup: whole experts only, unchunked; node blocks are each node's consecutive EP ranks."""
    from moe_dist.parallel.mesh import dedup_blocks

    debug = REPO / "configs/debug.json"
    assert (
        check_layout(load_config(debug, ["parallel.ep=4", "parallel.a2a_dedup=node", "train.eval_batches=4"]), 4) == 4
    )
    folded = [
        "parallel.tp=2",
        "parallel.etp=1",
        "model.attention.n_kv_heads=4",
        "parallel.ep=4",
        "train.eval_batches=4",
    ]
    assert check_layout(load_config(debug, [*folded, "parallel.a2a_dedup=rank"]), 4) == 2
    with pytest.raises(ConfigError, match=r"^parallel.a2a_dedup: 'node' takes parallel.a2a_chunks=1, got 2$"):
        check_layout(load_config(debug, ["parallel.ep=2", "parallel.a2a_dedup=node", "parallel.a2a_chunks=2"]), 2)
    with pytest.raises(ConfigError, match=r"^parallel.a2a_dedup: 'rank' needs whole experts: parallel.tp=1 or "):
        check_layout(load_config(debug, [*folded[:1], *folded[2:], "parallel.a2a_dedup=rank"]), 8)
    with pytest.raises(ConfigError, match=r"^parallel.a2a_dedup: expected one of"):
        load_config(debug, ["parallel.a2a_dedup=host"])
    assert dedup_blocks([0, 1, 2, 3], 2, "node") == [[0, 1], [2, 3]]
    assert dedup_blocks([4, 5, 6, 7], 4, "node") == [[4, 5, 6, 7]]
    assert dedup_blocks([0, 1, 2, 3], 2, "rank") == [[0], [1], [2], [3]]
    with pytest.raises(ConfigError, match=r"^parallel.a2a_dedup: 'node' needs the expert-parallel group's ranks in "):
        dedup_blocks([0, 2, 1, 3], 2, "node")  # a node's ranks apart in the group: its experts are not one block
    with pytest.raises(ConfigError, match=r"blocks \[\[2, 3\], \[4\]\]$"):
        dedup_blocks([2, 3, 4], 4, "node")  # unequal nodes


def test_cli_reports_bad_config_in_one_line_with_exit_2(tmp_path, forks):
    proc = forks.script(
        REPO / "launch/train.py",
        [
            "--config",
            str(REPO / "configs/debug.json"),
            "--set",
            "model.moe.num_expertz=3",
            "--run-dir",
            str(tmp_path / "run"),
        ],
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: model.moe.num_expertz: unknown config key (did you mean 'model.moe.num_experts'?)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "name, total, active",
    [
        ("mixtral_8x7b", 46.7e9, 12.9e9),  # published Mixtral-8x7B figures
        ("jamba_v0.1", 52e9, 12e9),  # published Jamba-v0.1 figures (rounded to 1B)
        ("nemotron3_nano_30b_a3b", 31.6e9, 3.6e9),  # NVIDIA's: 31.6B total, 3.6B active with embeddings
        ("granite4_h_small", 32e9, 9e9),  # IBM's: 32B total, 9B active
    ],
)
def test_dry_run_reports_published_parameter_counts(name, total, active, forks):
    proc = forks.script(REPO / "launch/train.py", ["--config", str(REPO / f"configs/{name}.json"), "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    tol = 0.05e9 if name.startswith("mixtral") else 0.5e9
    assert abs(counts["params_total"] - total) < tol and abs(counts["params_active"] - active) < tol, counts


# The README's main command starts one process per GPU: the default job must divide for 1, 2, 4 and 8 of them
# (1, 2 and 4 are launched in launch/test_launchers.py); the full-size configs for one and many 8-GPU nodes.
@pytest.mark.parametrize(
    "name, worlds",
    [
        ("mixtral_small", (1, 2, 4, 8)),
        ("mixtral_8x7b", (8, 64, 256)),
        ("jamba_v0.1", (8, 64, 256)),
        ("nemotron3_nano_30b_a3b", (8, 64)),
        ("granite4_h_small", (8, 64)),
    ],
)
def test_shipped_layouts_divide_for_their_world_sizes(name, worlds):
    cfg = load_config(REPO / f"configs/{name}.json")
    for world in worlds:
        dp = check_layout(cfg, world)
        assert dp * cfg.parallel.tp == world
        accum = cfg.train.grad_accum_steps(dp)
        assert accum >= 1 and accum * dp * cfg.train.micro_batch_size == cfg.train.global_batch_size, world
        assert cfg.train.eval_batches % dp == 0
        assert cfg.model.moe.num_experts % cfg.parallel.ep == 0 and dp % cfg.parallel.ep == 0
    if name != "mixtral_small":  # expert parallel inside an 8-GPU node: ep·tp ranks are consecutive
        assert cfg.parallel.ep * cfg.parallel.tp == 8


def test_layout_that_does_not_divide_fails_before_start_up(tmp_path, monkeypatch, capsys):
    """WORLD_SIZE as a launcher sets it: one line naming the key, the value and the world size, exit 2, and the
    run directory is not even created."""
    import runpy

    monkeypatch.setenv("WORLD_SIZE", "3")
    main = runpy.run_path(str(REPO / "launch/train.py"))["main"]
    run = tmp_path / "run"
    assert main(["--config", str(REPO / "configs/mixtral_small.json"), "--run-dir", str(run)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: train.global_batch_size: 16 sequences = 8 micro-batches of train.micro_batch_size=2, not divisible "
        "among 3 data-parallel ranks (world size 3 / parallel.tp=1)"
    ]
    assert not run.exists()
    with pytest.raises(ConfigError, match=r"^train.eval_batches: 6 is not divisible among 4 data-parallel ranks"):
        check_layout(load_config(REPO / "configs/mixtral_small.json", ["train.eval_batches=6"]), 4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.keep_last=-1"], "train.keep_last: must be >= 0, got -1"),
        (["train.save_timeout_s=0"], "train.save_timeout_s: must be > 0, got 0.0"),
        (["train.save_staging_mb=0"], "train.save_staging_mb: must be >= 1/1024 (1 KiB), got 0.0"),
        (["train.profile_steps=[0, 101]"], "train.profile_steps: [0, 101] outside the run's optimizer steps 1..100"),
        (['data.mixture=[{"paths": ["a.json"]}]'], "data.mixture: only the 'memmap' source takes a mixture"),
        (["data.source=text"], "data.paths: required when data.source is 'text'"),
        (
            ["data.source=memmap"],
            "data.paths: the memmap source needs shard-set sidecars (PREFIX.json) or data.mixture",
        ),
        (
            ["data.source=memmap", 'data.paths=["a.json"]', 'data.mixture=[{"paths": ["b.json"]}]'],
            "data.paths: give either data.paths or data.mixture, not both",
        ),
        (
            ["data.source=memmap", 'data.mixture=[{"paths": ["a.json"]}, {"paths": ["b.json"], "weight": 0}]'],
            "data.mixture[1].weight: must be positive, got 0.0",
        ),
    ],
)
def test_run_and_data_settings_are_checked_at_load(overrides, message):
    """The rules of the training loop's settings and of the data section that need no file: at load, before any
    data is read (the files themselves are checked where the data is read)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value) == message


def test_memmap_mixture_without_paths_loads():
    cfg = load_config(None, ["data.source=memmap", 'data.mixture=[{"paths": ["a.json"], "weight": 2}]'])
    assert cfg.data.mixture[0].weight == 2.0 and cfg.data.paths == []


def test_pipeline_layout_keys_are_checked():
    cfg = load_config(REPO / "configs/debug.json", ["parallel.pp=2", "parallel.ep=2"])
    assert check_layout(cfg, 4) == 2  # dp = world / pp
    with pytest.raises(ConfigError, match=r"^parallel.pp: 2 does not divide the world size 3$"):
        check_layout(cfg, 3)
    with pytest.raises(ConfigError, match=r"^parallel.ep: 2 must divide the data-parallel degree 1 "):
        check_layout(cfg, 2)  # an EP group never straddles stages: ep divides one stage's ranks
    n = load_config(REPO / "configs/debug.json").model.n_layers
    with pytest.raises(ConfigError, match=rf"^parallel.pp: pp × pp_virtual = {2 * n} stages for model.n_layers={n}"):
        load_config(REPO / "configs/debug.json", ["parallel.pp=2", f"parallel.pp_virtual={n}"])
    with pytest.raises(ConfigError, match=r"^parallel.pp_cut: \[2, 1, 3\] must be 3 increasing layer indices"):
        load_config(REPO / "configs/debug.json", ["parallel.pp=4", "model.n_layers=4", "parallel.pp_cut=[2,1,3]"])
    with pytest.raises(ConfigError, match=r"^parallel.pp_virtual: 2 needs parallel.pp > 1$"):
        load_config(REPO / "configs/debug.json", ["parallel.pp_virtual=2"])
