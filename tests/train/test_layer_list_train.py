"""A layer list with every kind (both new mixers, single-sublayer layers) trains through launch/train.py in one
process: 3 steps of configs/debug.json with finite losses."""

import math

from support import DEBUG_CONFIG, LAYER_LIST, ONE_THREAD, SMALL_RECURRENT

LAYERS = '["attention+moe","mamba2","gdn+mlp","mamba1+moe"]'
TINY = [
    *LAYER_LIST,
    f"model.layers={LAYERS}",
    *SMALL_RECURRENT,
    "train.steps=3",
    "train.save_every=0",
    "train.eval_every=0",
    "train.eval_batches=1",
]


def test_every_layer_kind_trains_three_steps(tmp_path, run_train, metrics):
    args = ["--config", DEBUG_CONFIG, "--run-dir", str(tmp_path / "run"), "--set", ONE_THREAD]
    for override in TINY:
        args += ["--set", override]
    run_train("fork", 1, args)
    losses = [row["loss"] for row in metrics(tmp_path / "run") if "loss" in row]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses
