"""Attention under context parallelism against the single-process whole-sequence layer.

Multi-process: cp_attention_worker.py on one world of 4 gloo ranks (cp = 2 and cp = 4), every mask kind, grouped-
query heads, documents with a boundary at a piece edge and a piece that is one whole document: outputs and every
gradient. Single-process: the SDPA query-offset path (`sdpa_offset`) of one piece against the whole-sequence
SDPA with the dense mask."""

import importlib.util
from pathlib import Path

import pytest
import torch
from support import worker_results

import moe_dist.layers.attention as attention
import moe_dist.layers.sdpa as sdpa_module
from moe_dist.layers.sdpa import sdpa, sdpa_offset

WORKER = Path(__file__).with_name("cp_attention_worker.py")
_spec = importlib.util.spec_from_file_location("cp_attention_worker", WORKER)
WORKER_MODULE = importlib.util.module_from_spec(_spec)  # its cases and helpers (run in-process by the fast tests)
_spec.loader.exec_module(WORKER_MODULE)
CASES = list(WORKER_MODULE.CASES)


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory, forks) -> list[dict]:
    return worker_results(WORKER, tmp_path_factory.mktemp("cp_attention"), nproc=4, forks=forks)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_cp_attention_matches_whole_sequence(cp_results, case, cp):
    for rank, results in enumerate(cp_results):
        entries = {k: v for k, v in results.items() if k.startswith(f"{case}.cp{cp}.")}
        assert f"{case}.cp{cp}.out" in entries and f"{case}.cp{cp}.grad.x" in entries
        assert sum(".grad.w" in k for k in entries) >= 4, entries.keys()  # wq, wk, wv, wo
        payload = entries.pop(f"{case}.cp{cp}.payload")
        # K and V of the KV heads over the whole sequence, fp64: all-gathered in forward (payload: the gathered
        # tensor), reduce-scattered in backward (payload: the whole-sequence gradient), and nothing else
        w, kw = WORKER_MODULE, WORKER_MODULE.CASES[case][0]
        whole = 2 * w.B * w.S * kw["n_kv_heads"] * (w.D // kw["n_heads"]) * 8
        assert payload == {"all_gather": whole, "reduce_scatter": whole}, (case, payload)
        for name, e in entries.items():
            assert e["scale"] > 1e-3, name  # the reference is not trivially zero
            assert e["err"] <= 1e-10 * e["scale"], f"rank {rank} {name}: {e['err']:.3g} vs {e['scale']:.3g}"


def _documents(S: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * (S - 12), [0] * S])
    prefix = torch.zeros_like(ids, dtype=torch.bool)
    prefix[0, :2] = prefix[0, 5:9] = prefix[0, 12:14] = prefix[1, :6] = True
    return ids, prefix


@pytest.mark.parametrize("kind", ["causal", "window", "documents", "prefix", "window_prefix"])
def test_sdpa_offset_matches_dense_mask(kind, monkeypatch):
    """A piece of queries (positions 9..19) against keys 0..N−1 equals those rows of the whole-sequence SDPA with
    the dense mask, in 4-query blocks; forward and the gradients of q, k and v."""
    monkeypatch.setattr(sdpa_module, "BLOCK_SCORES", 2 * 4 * 24 * 4)
    S, start, M = 24, 9, 11
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, S, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    ids, prefix = _documents(S)
    masks = {
        "causal": {},
        "window": {"window": 4},
        "documents": {"document_ids": ids},
        "prefix": {"document_ids": ids, "prefix": prefix},
        "window_prefix": {"document_ids": ids, "prefix": prefix, "window": 3},
    }[kind]
    keys = S if "prefix" in masks else start + M
    cot = torch.randn(2, 4, M, 8, generator=g, dtype=torch.float64)
    ref = sdpa(q, k, v, **masks)[:, :, start : start + M]
    ref_grads = torch.autograd.grad((ref * cot).sum(), (q, k, v))
    got = sdpa_offset(q[:, :, start : start + M], k[:, :, :keys], v[:, :, :keys], start, **masks)
    grads = torch.autograd.grad((got * cot).sum(), (q, k, v))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["causal_gqa", "window_gqa", "prefix_gqa", "window_prefix_gqa", "recipes_documents"])
def test_one_rank_shard_matches_the_layer_without_cp(case):
    """On a one-rank SeqShard the local sequence is the whole one in two pieces (the second's queries at offset
    S/2 against all keys): the CP path (RoPE positions, piece offsets, masks) equals the layer without a shard."""
    w = WORKER_MODULE
    kwargs, docs, pfx = w.CASES[case]
    layer = w.build(kwargs)
    ids, prefix = w.documents()
    masks = {"document_ids": ids if docs else None, "prefix": prefix if pfx else None}
    g = torch.Generator().manual_seed(1)
    x, cot = (torch.randn(w.B, w.S, w.D, generator=g, dtype=torch.float64) for _ in range(2))
    shard = attention.SeqShard(1, 0, w.S)
    for got, want in zip(w.run(layer, x, cot, shard, **masks), w.run(layer, x, cot, **masks)):
        for a, b in zip(*(t.values() if isinstance(t, dict) else [t] for t in (got, want))):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
