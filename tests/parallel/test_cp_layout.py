"""Context parallelism's layout and refusals (fast, one process): the rank order and groups of `parallel.cp`
beside dp/ep/tp, and each bad input a one-line error naming the key, exit status 2, nothing written."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from support import DEBUG_CONFIG

from moe_dist.config import ConfigError, load_config
from moe_dist.config.parallel_checks import check_layout
from moe_dist.layers.registry import kind as layer_kind
from moe_dist.layers.registry import kinds
from moe_dist.layers.sequence_shard import SeqShard, takes_shard
from moe_dist.models.decoder import Decoder, check_context_parallel
from moe_dist.parallel.mesh import ep_rank_of, layout_groups

TRAIN = str(Path(__file__).resolve().parents[2] / "launch" / "train.py")


def test_cp_groups_sit_between_tp_and_dp():
    """world 16 = dp 2 × cp 2 × tp 4: rank = (dp_rank·cp + cp_rank)·tp + tp_rank; a CP group is tp apart inside
    a block of cp·tp ranks (one node of 8); the replicas of a tp_rank (ZeRO's group) are dp × cp ranks."""
    g = layout_groups(2, 2, 4, None, cp=2)
    assert g["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["cp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["dp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert all(r // 8 == grp[0] // 8 for grp in g["cp"] for r in grp)  # inside a node of 8
    # ep = 2 over the replicas: the EP group of rank 0 is its CP group (EP spans CP)
    assert [0, 4] in g["ep"] and [0, 8] in g["edp"]
    assert [ep_rank_of(r, 2, 4, 4) for r in (0, 4, 8, 12)] == [0, 1, 0, 1]
    # with whole experts (etp = 1) EP runs over consecutive ranks, as without CP
    assert layout_groups(2, 4, 2, 1, cp=2)["ep"][0] == [0, 1, 2, 3]
    # every rank in exactly one group of each kind
    for kind in ("tp", "cp", "dp", "ep", "edp"):
        assert sorted(r for grp in g[kind] for r in grp) == list(range(16)), kind


def test_without_cp_the_layout_is_unchanged():
    g = layout_groups(4, 2, 2, None, cp=1)
    assert "cp" not in g and g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]] and g["ep"] == [[0, 2], [4, 6], [1, 3], [5, 7]]


def _cfg(*overrides: str):
    return load_config(DEBUG_CONFIG, list(overrides))


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["parallel.cp=3", "train.seq_len=36"],
            4,
            r"^parallel\.cp: 3 does not divide world size / parallel\.tp = 4 / 1 = 4$",
        ),
        (["parallel.cp=2", "parallel.tp=2"], 6, r"^parallel\.cp: 2 does not divide world size / parallel\.tp"),
        (["parallel.cp=2", "parallel.ep=4"], 2, r"^parallel\.ep: 4 must divide the data-parallel degree 2 .*dp × cp"),
    ],
)
def test_layout_refusals(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(_cfg(*overrides), world)


def test_ep_may_span_dp_and_cp():
    assert check_layout(_cfg("parallel.cp=2", "parallel.ep=2"), 2) == 1  # dp = 1, EP over the CP pair
    assert check_layout(_cfg("parallel.cp=2", "parallel.tp=2", "parallel.ep=4", "parallel.etp=1"), 8) == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.cp=2", "train.seq_len=30"], r"^parallel\.cp: train\.seq_len=30 must be divisible by 2·cp = 4"),
        (["parallel.cp=4", "train.seq_len=36"], r"^parallel\.cp: train\.seq_len=36 must be divisible by 2·cp = 8"),
        (["parallel.cp=0"], r"^parallel\.cp: must be >= 1, got 0$"),
        (["parallel.cp=2", "model.moe.drop_policy=probability"], r"^model\.moe\.drop_policy: 'probability' is not"),
        (["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"], r"^parallel\.sequence_parallel: "),
        (["parallel.cp=2", "train.compile=true"], r"^train\.compile: not supported with parallel\.cp > 1"),
        (
            ["parallel.cp=2", "parallel.tp=2", 'model.layers=["mamba2+moe","moe"]', "model.n_layers=2"]
            + ["model.mixer_pattern=A", "model.ffn_pattern=E", "model.mamba2.head_dim=16", "model.mamba2.n_groups=1"],
            r"^model\.mamba2\.n_groups: 1 < parallel\.tp=2 is not supported with parallel\.cp > 1",
        ),
    ],
)
def test_config_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)


def test_probability_drops_without_capacity_are_fine_under_cp():
    _cfg("parallel.cp=2", "model.moe.drop_policy=probability", "model.moe.capacity_factor=null")


@pytest.mark.parametrize("kind", sorted(k.name for k in kinds("mixer")))
def test_a_mixer_without_a_shard_aware_forward_is_refused(kind):
    """Each mixer kind: accepted under CP exactly when its class's forward takes `shard=`; otherwise one line
    naming it (config check), and the model refuses a shard rather than run its local pieces as one sequence."""
    cfg = _cfg("model.mixer_pattern=A", "model.ffn_pattern=E", f'model.layers=["{kind}+moe","moe"]', "model.n_layers=2")
    if takes_shard(layer_kind(kind).module):
        check_context_parallel(cfg.model, 2)
        return
    with pytest.raises(ConfigError, match=rf"^parallel\.cp: 2 needs context-parallel support .*; {kind} has none"):
        check_context_parallel(cfg.model, 2)
    check_context_parallel(cfg.model, 1)
    model = Decoder(cfg.model)
    with pytest.raises(ValueError, match="has no shard-aware forward"):
        model(torch.zeros(1, 4, dtype=torch.long), shard=SeqShard(2, 0, 8))


def test_the_model_refuses_a_cache_or_a_whole_sequence_under_cp():
    """With a shard the model takes this rank's S / cp positions and no inference cache (refused before any
    collective, so one process shows it)."""
    cfg = _cfg("model.mixer_pattern=A", "model.ffn_pattern=E", 'model.layers=["moe","mlp"]', "model.n_layers=2")
    model = Decoder(cfg.model)
    model.to_empty(device="cpu")
    shard = SeqShard(2, 0, 8)
    with pytest.raises(ValueError, match="4 local positions expected, got 8"):
        model(torch.zeros(1, 8, dtype=torch.long), shard=shard)
    with pytest.raises(ValueError, match="no inference cache"):
        model(torch.zeros(1, 4, dtype=torch.long), model.new_cache(1, 8), shard=shard)


def test_an_ffn_only_model_runs_under_cp():
    cfg = _cfg("model.mixer_pattern=A", "model.ffn_pattern=E", 'model.layers=["moe","mlp"]', "model.n_layers=2")
    check_context_parallel(cfg.model, 4)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.cp=2", "train.seq_len=30"], "parallel.cp: train.seq_len=30 must be divisible by 2·cp = 4"),
        (["parallel.cp=2"], "parallel.cp: 2 does not divide world size / parallel.tp = 1 / 1 = 1"),
    ],
)
def test_bad_cp_input_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch, overrides, expected):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = tmp_path / "run"
    main = runpy.run_path(TRAIN)["main"]
    assert main(["--config", DEBUG_CONFIG, "--run-dir", str(run), "--set", *overrides]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and expected in err[0], err
    assert not run.exists()


def test_pipeline_stages_are_the_outermost_dimension():
    """world 16 = pp 2 × (dp 2 × tp 4), ep 2: stage p holds ranks 8p … 8p + 7, laid out inside as without pp; the pp
    groups link the same position of both stages; DeepSpeed's model-parallel group is tp × pp of one replica."""
    g, one = layout_groups(2, 2, 4, None, pp=2), layout_groups(2, 2, 4, None)
    for kind in ("tp", "dp", "ep", "edp"):
        assert g[kind] == one[kind] + [[r + 8 for r in grp] for grp in one[kind]], kind
        assert all(len({r // 8 for r in grp}) == 1 for grp in g[kind]), kind  # never straddles stages
    assert g["pp"] == [[r, r + 8] for r in range(8)]
    assert g["mp"] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert g["embed"] == g["pp"]  # two stages: the first and the last are the pipeline
    assert layout_groups(2, 1, 1, pp=4)["embed"] == [[0, 6], [1, 7]]  # the middle stages hold no embedding
    for kind in ("tp", "dp", "ep", "edp", "pp", "mp"):
        assert sorted(r for grp in g[kind] for r in grp) == list(range(16)), kind
