"""What every shipped config (configs/*.json) promises beyond its layout: a long run checkpoints on the way."""

from pathlib import Path

import pytest

from moe_dist.config import load_config

REPO = Path(__file__).resolve().parents[2]
LONG = 1000  # steps: a run longer than this must not put all its progress on the final save


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.json")), ids=lambda p: p.stem)
def test_long_shipped_runs_save_periodically_in_the_background(path):
    t = load_config(path).train
    if t.steps <= LONG:
        return
    assert 0 < t.save_every <= LONG, (path.name, t.save_every)  # 0 would save only at the end
    assert t.async_save, path.name  # a multi-GB save must not stop training for its writes
    assert t.keep_last > 0, path.name  # steps / save_every checkpoints of the full model would not fit a disk


def test_the_big_configs_are_long_runs():
    """The test above is not vacuous: the full-size configs run far longer than LONG steps."""
    assert all(load_config(REPO / f"configs/{n}.json").train.steps > LONG for n in ("mixtral_8x7b", "jamba_v0.1"))
