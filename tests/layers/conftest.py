"""Fixtures of the layer tests."""

import pytest
import torch.nn.functional as F

import moe_dist.layers.experts as experts_mod


@pytest.fixture
def path_spy(monkeypatch):
    """Records every `_grouped_mm_ok` answer and every call into torch's grouped_mm."""
    answers, calls = [], []
    real_ok, real_gmm = experts_mod._grouped_mm_ok, F.grouped_mm

    def ok(x, w):
        answers.append(real_ok(x, w))
        return answers[-1]

    def gmm(*args, **kwargs):
        calls.append(1)
        return real_gmm(*args, **kwargs)

    monkeypatch.setattr(experts_mod, "_grouped_mm_ok", ok)
    monkeypatch.setattr(F, "grouped_mm", gmm)
    return answers, calls
