"""benchmarks/studies/balancing.py end to end on the test model: two recipes, two steps each, table and plot
written, and a finished run summarized without retraining."""

from __future__ import annotations

import pytest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_balancing_study_runs_and_tabulates(tmp_path, capsys):
    from benchmarks.studies import balancing as study

    argv = ["--config", "configs/debug.json", "--out", str(tmp_path), "--steps", "2", "--only", "aux 0", "bias only"]
    argv += ["--set", "train.eval_every=2", "train.save_every=0"]
    assert study.main(argv) == 0
    table = (tmp_path / "table.md").read_text().splitlines()
    assert [row.split("|")[1].strip() for row in table[2:]] == ["aux 0", "bias only"]
    assert (tmp_path / "balancing.png").stat().st_size > 1000
    metrics = tmp_path / "bias_only" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    assert study.main(argv) == 0  # already finished: summarized, not retrained
    assert metrics.stat().st_mtime_ns == before
    assert "bias only" in capsys.readouterr().out
