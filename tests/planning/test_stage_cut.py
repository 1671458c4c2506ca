"""The pipeline's stage cut (moe_dist/planning/stage_cut.py): by per-layer cost, optimal, overridable, refused when
no cut is even enough."""

import itertools
import random
from pathlib import Path

import pytest

from moe_dist.config import ConfigError, load_config
from moe_dist.planning.stage_cut import _best_cut, layer_costs, stage_costs, stage_starts

DEBUG = Path(__file__).resolve().parents[2] / "configs" / "debug.json"
# Two attention+MoE layers then four dense MLPs: by layer count the first half holds both costly layers.
FRONT_HEAVY = [
    "model.mixer_pattern=A",
    "model.ffn_pattern=E",
    "model.n_layers=6",
    'model.layers=["attention+moe","attention+moe","mlp","mlp","mlp","mlp"]',
]


def test_layers_cost_by_kind():
    layers, head = layer_costs(load_config(DEBUG, FRONT_HEAVY))
    assert layers[0] == layers[1] > 2 * layers[2] and layers[2:] == [layers[2]] * 4
    cfg = load_config(DEBUG, FRONT_HEAVY)
    assert head == 2.0 * cfg.model.vocab_size * cfg.model.d_model  # the LM head's matmul


def test_cost_cut_beats_the_even_cut():
    cfg = load_config(DEBUG, [*FRONT_HEAVY, "parallel.pp=2"])
    starts = stage_starts(cfg)
    assert starts == [0, 2]
    assert max(stage_costs(cfg, starts)) < max(stage_costs(cfg, [0, 3]))


def test_explicit_cut_is_taken_as_given():
    cfg = load_config(DEBUG, [*FRONT_HEAVY, "parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_cut=[1,3,5]"])
    assert stage_starts(cfg) == [0, 1, 3, 5]
    assert stage_starts(load_config(DEBUG)) == [0]


def test_uneven_stages_are_refused_in_one_line():
    # a 65,536-token vocabulary's LM head outweighs the four small layers: 4 stages cannot balance it
    cfg = load_config(DEBUG, ["parallel.pp=4", "model.vocab_size=65536"])
    with pytest.raises(
        ConfigError, match=r"^parallel.pp: 4 stages of model.n_layers=4 cannot be cut evenly enough"
    ) as e:
        stage_starts(cfg)
    assert "\n" not in str(e.value) and "parallel.pp_cut" in str(e.value)


def test_the_cut_is_optimal():
    """Against every contiguous cut of random costs: no cut has a cheaper costliest stage."""
    rng = random.Random(0)
    for n, stages in [(5, 2), (7, 3), (8, 4), (6, 6)]:
        costs = tuple(rng.uniform(0.1, 3.0) for _ in range(n))
        bottleneck, starts = _best_cut(costs, stages)
        assert starts[0] == 0 and len(starts) == stages and starts == sorted(set(starts))
        ends = [*starts[1:], n]
        assert max(sum(costs[a:b]) for a, b in zip(starts, ends)) == pytest.approx(bottleneck)
        brute = min(
            max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, n)))
            for cut in itertools.combinations(range(1, n), stages - 1)
        )
        assert bottleneck == pytest.approx(brute)
