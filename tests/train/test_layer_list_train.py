"""A layer list with every kind (both new mixers, single-sublayer layers) trains through launch/train.py in one
process: 3 steps of configs/debug.json with finite losses."""

import math

from support import DEBUG_CONFIG, ONE_THREAD

LAYERS = '["attention+moe","mamba2","gdn+mlp","mamba1+moe"]'
TINY = [
    "model.mixer_pattern=A",
    "model.ffn_pattern=E",
    f"model.layers={LAYERS}",
    "model.mamba2.head_dim=16",
    "model.mamba2.d_state=16",
    "model.mamba2.chunk_size=16",
    "model.gdn.head_k_dim=16",
    "model.gdn.head_v_dim=16",
    "model.gdn.chunk_size=16",
    "train.steps=3",
    "train.save_every=0",
    "train.eval_every=0",
    "train.eval_batches=1",
]


def test_every_layer_kind_trains_three_steps(tmp_path, run_train, metrics):
    args = ["--config", DEBUG_CONFIG, "--run-dir", str(tmp_path / "run"), "--set", ONE_THREAD]
    for override in TINY:
        args += ["--set", override]
    run_train("python", 1, args)
    losses = [row["loss"] for row in metrics(tmp_path / "run") if "loss" in row]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses
