"""State passing in one process: a mixer given a one-rank SeqShard (its two pieces, head and tail, run as separate
sequences from zero state, the tail's entering state and conv halo composed from the head's summary) equals the
mixer on the whole sequence: outputs and every gradient, documents off and on, pieces shorter than d_conv − 1.
The multi-rank cases are tests/parallel/test_cp_recurrent.py."""

import importlib.util
from pathlib import Path

import pytest
import torch

from moe_dist.layers.sequence_shard import SeqShard

_spec = importlib.util.spec_from_file_location(
    "cp_recurrent_worker", Path(__file__).with_name("cp_recurrent_worker.py")
)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)  # the multi-rank test's mixers and documents
DOCS, build, run = worker.DOCS, worker.build, worker.run


@pytest.mark.parametrize("kind", ["mamba", "mamba2", "gdn"])
@pytest.mark.parametrize("seqlen", [2, 4, 10])  # pieces of 1, 2 (both < d_conv − 1 = 3) and 5 positions
@pytest.mark.parametrize("docs", [False, True])
def test_one_rank_shard_equals_whole_sequence(kind, seqlen, docs):
    layer = build(kind)
    g = torch.Generator().manual_seed(seqlen)
    x = torch.randn(2, seqlen, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(2, seqlen, 8, generator=g, dtype=torch.float64)
    doc_ids = DOCS[:, :seqlen] if docs else None
    if docs and seqlen == 10:
        doc_ids = torch.tensor([[0] * 5 + [1] * 5, [0] * 3 + [1] * 7])  # a start at the piece edge; one inside
    ref = run(layer, x, weight, document_ids=doc_ids)
    got = run(layer, x, weight, document_ids=doc_ids, shard=SeqShard(1, 0, seqlen))
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-11, atol=1e-12)
    for name, grad in ref[2].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got[2][name], grad, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
