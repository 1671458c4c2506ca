"""The learning-rate schedules and the AdamW epsilon: values worked out by hand, the config's rules, and a wsd
run resumed with more train.steps continuing its stable phase (through launch/train.py)."""

from __future__ import annotations

import pytest
import torch
from support import DEBUG_CONFIG, ONE_THREAD, train_records

from moe_dist.config import ConfigError, load_config
from moe_dist.train.optim import build_optimizer, lr_lambda


def _factors(overrides: list[str], upto: int) -> list[float]:
    factor = lr_lambda(load_config(None, overrides))
    return [factor(s) for s in range(upto + 1)]


def test_cosine_is_unchanged():
    # warmup 2: (s + 1) / 2; then 0.1 + 0.9 · (1 + cos(π · (s - 2) / 8)) / 2; s = 6 is half way: 0.1 + 0.45.
    got = _factors(["train.steps=10", "train.warmup_steps=2", "train.min_lr_ratio=0.1"], 10)
    assert got[0] == pytest.approx(0.5) and got[1] == pytest.approx(1.0) and got[2] == pytest.approx(1.0)
    assert got[6] == pytest.approx(0.55) and got[10] == pytest.approx(0.1)


def test_wsd_holds_then_decays_linearly_over_the_last_fraction():
    # 10 steps, decay_fraction 0.3: the last 3 decay, from 1 at s = 7 to 0.1 at s = 10 (0.3 of the way a step).
    cfg = ["train.lr_schedule=wsd", "train.steps=10", "train.warmup_steps=2", "train.decay_fraction=0.3"]
    assert _factors([*cfg, "train.min_lr_ratio=0.1"], 11) == pytest.approx(
        [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.4, 0.1, 0.1]
    )
    # min_lr_ratio 0: to zero; decay_fraction 0.25 of 10 = 2.5 steps rounds half up to 3.
    cfg = ["train.lr_schedule=wsd", "train.steps=10", "train.warmup_steps=0", "train.decay_fraction=0.25"]
    assert _factors([*cfg, "train.min_lr_ratio=0"], 10) == pytest.approx([1.0] * 8 + [2 / 3, 1 / 3, 0.0])


def test_wsd_resumed_with_more_steps_continues_the_stable_phase():
    # 10 steps (decay_fraction 0.2: s = 8..10 decay) resumed as 20 (s = 16..20 decay): s = 10..16 are stable again.
    cfg = ["train.lr_schedule=wsd", "train.warmup_steps=2", "train.decay_fraction=0.2", "train.min_lr_ratio=0.1"]
    first = _factors([*cfg, "train.steps=10"], 10)
    assert first[8:] == pytest.approx([1.0, 0.55, 0.1])
    resumed = _factors([*cfg, "train.steps=20"], 20)
    assert resumed[10:] == pytest.approx([1.0] * 7 + [0.775, 0.55, 0.325, 0.1])


def test_adam_eps_reaches_the_optimizer():
    model = torch.nn.Linear(2, 2)
    opt, _ = build_optimizer(model, load_config(None))
    assert {g["eps"] for g in opt.param_groups} == {1e-8}  # the default is the former hard-coded value
    opt, _ = build_optimizer(model, load_config(None, ["train.adam_eps=1e-6"]))
    assert {g["eps"] for g in opt.param_groups} == {1e-6}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.lr_schedule=linear"], "train.lr_schedule: expected one of ['cosine', 'wsd'], got 'linear'"),
        (["train.adam_eps=0"], "train.adam_eps: must be positive, got 0.0"),
        (["train.adam_eps=-1e-8"], "train.adam_eps: must be positive, got -1e-08"),
        (["train.decay_fraction=0"], "train.decay_fraction: must be in (0, 1], got 0.0"),
        (["train.decay_fraction=1.5"], "train.decay_fraction: must be in (0, 1], got 1.5"),
        (
            ["train.lr_schedule=wsd", "train.steps=10", "train.warmup_steps=5", "train.decay_fraction=0.6"],
            "train.decay_fraction: 0.6 of train.steps=10 is 6 decay steps; wsd needs at least 1 and "
            "train.warmup_steps=5 + them <= train.steps",
        ),
        (
            ["train.lr_schedule=wsd", "train.steps=4", "train.warmup_steps=0", "train.decay_fraction=0.1"],
            "train.decay_fraction: 0.1 of train.steps=4 is 0 decay steps; wsd needs at least 1 and "
            "train.warmup_steps=0 + them <= train.steps",
        ),
    ],
)
def test_schedule_errors_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value) == message


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wsd_run_resumed_with_twice_the_steps_logs_stable_lr(tmp_path, run_train, metrics):
    """4 steps of configs/debug.json (lr 0.003, warmup 1, the last quarter decaying), then --resume with 8: the
    logged lr (the lr of the next step) drops to 0.1 × lr at step 4, is back at 0.003 for steps 5 and 6 (stable),
    and decays over steps 7 and 8 (the last quarter of 8)."""
    run_dir = tmp_path / "run"
    base = ["--config", DEBUG_CONFIG, "--run-dir", str(run_dir), "--set", ONE_THREAD, "train.lr_schedule=wsd"]
    base += ["train.warmup_steps=1", "train.decay_fraction=0.25", "train.save_every=0", "train.eval_every=0"]
    run_train("fork", 1, [*base, "train.steps=4"])
    first = [r["lr"] for r in train_records(metrics(run_dir))]
    assert first == pytest.approx([0.003, 0.003, 0.003, 0.0003])
    run_train("fork", 1, [*base, "train.steps=8", "--resume"])
    records = train_records(metrics(run_dir))
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["lr"] for r in records][4:] == pytest.approx([0.003, 0.003, 0.00165, 0.0003])
