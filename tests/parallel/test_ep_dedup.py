"""The deduplicated dispatcher (parallel.a2a_dedup) on 4 gloo ranks as two nodes of two, against one process: the
same outputs and gradients as all experts on one device, and each token sent once per block it reaches (counted
here from the routing, independently of the dispatcher). One spawned world runs every case."""

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import run_torchrun_worker

from moe_dist.config import load_config
from moe_dist.layers.moe import MoE
from moe_dist.models.decoder import build_model, materialize_whole

WORKER = Path(__file__).with_name("dedup_worker.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
TOLERANCES = {"fp32": (1e-5, 1e-6), "bf16": (2e-2, 2e-3)}  # sums in another order (bf16: a rounding per block)


def _worker():
    spec = importlib.util.spec_from_file_location("dedup_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def results(tmp_path_factory, forks) -> Path:
    out = tmp_path_factory.mktemp("dedup")
    run_torchrun_worker(WORKER, out, nproc=4, timeout=360, forks=forks)
    return out


def _reference(scenario: str, dtype: str, ranks: int = 4):
    """One process, all experts local: per rank (the tokens of `scenario_inputs(scenario, rank)`) its outputs,
    gradients and kept (token, expert) assignments; the expert gradients summed over the ranks."""
    worker = _worker()
    cfg = load_config(None, worker.layer_config(scenario, dtype))
    model = materialize_whole(build_model(cfg.model), "cpu", seed=0).to(worker.DTYPES[dtype])
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    worker.prepare(moe, scenario)
    per_rank = []
    for rank in range(ranks):
        moe.router.weight.grad = None  # per rank; the expert gradients accumulate over the ranks' tokens
        x = worker.scenario_inputs(scenario, rank, cfg.model.d_model).to(worker.DTYPES[dtype])
        with torch.no_grad():
            routing, _ = moe.router(x)
        rows = routing.rows_R
        kept = torch.stack([rows % max(x.shape[0], 1), torch.repeat_interleave(routing.tokens_per_expert_E)], 1)
        per_rank.append({**worker.forward_backward(moe, x), "kept": kept, "tokens": x.shape[0]})
    return per_rank, {n: getattr(moe.experts, n).grad for n in ("w13", "w2")}


@pytest.mark.parametrize("unit, scenario, dtype", _worker().CASES, ids=["-".join(c) for c in _worker().CASES])
def test_dedup_dispatch_matches_one_process_and_sends_each_token_once_per_block(results, unit, scenario, dtype):
    got = [load_file(str(results / f"{unit}_{scenario}_{dtype}_rank{r}.safetensors")) for r in range(4)]
    per_rank, expert_grads = _reference(scenario, dtype)
    rtol, atol = TOLERANCES[dtype]
    block_of = (lambda e: e // 4) if unit == "node" else (lambda e: e // 2)  # 2 experts per rank, 2 ranks per node
    for rank in range(4):
        ref = per_rank[rank]
        for key in ("out", "x_grad", "router_grad"):
            torch.testing.assert_close(got[rank][key], ref[key], rtol=rtol, atol=atol, msg=f"{key} rank {rank}")
        for name, full in expert_grads.items():
            shard = full[2 * rank : 2 * rank + 2]
            torch.testing.assert_close(got[rank][f"{name}_grad"], shard, rtol=rtol, atol=atol, msg=f"{name} {rank}")
        # Pairs sent to each block: the distinct (token, block) pairs of the kept assignments.
        tokens, experts = ref["kept"].unbind(1)
        pairs = {(int(t), block_of(int(e))) for t, e in zip(tokens, experts)}
        blocks = 2 if unit == "node" else 4
        expected = [sum(1 for _, b in pairs if b == n) for n in range(blocks)]
        assert got[rank]["pairs_sent"].tolist() == expected, rank
        assert len(pairs) <= len(tokens)  # never more rows than the plain dispatcher's one per assignment
        if scenario == "node_limited":  # each token reaches one node; per node, at most one row per token
            nodes = {(t, int(e) // 4) for t, e in zip(tokens.tolist(), experts)}
            assert len(nodes) == len({t for t, _ in nodes})
            if unit == "node":
                assert sum(expected) - expected[rank // 2] <= ref["tokens"]
    if scenario == "spread":  # top-3 of 8 puts tokens on two experts of one node: deduplication saves rows there
        assert any(len({(int(t), int(e) // 4) for t, e in r["kept"]}) < len(r["kept"]) for r in per_rank)
    if scenario == "one_node":  # node 0 receives nothing: its experts' gradients are exactly zero
        assert all(torch.count_nonzero(got[r][f"{n}_grad"]) == 0 for r in (0, 1) for n in ("w13", "w2"))
    if scenario == "no_tokens":
        assert got[3]["out"].shape[0] == 0 and got[3]["pairs_sent"].sum() == 0


@pytest.mark.parametrize("scenario", _worker().FOLDED)
def test_dedup_dispatch_under_folded_tensor_parallelism_matches_one_process(results, scenario):
    """(dp, ep, tp, etp) = (2, 4, 2, 1), node blocks = TP pairs: each TP rank sends its half of the pair's tokens
    once per node; after the TP region's sum both ranks hold every token's output and gradients (one process on
    the pair's tokens), and each rank's experts get exactly their tokens' gradients."""
    got = [load_file(str(results / f"folded_{scenario}_rank{r}.safetensors")) for r in range(4)]
    per_pair, expert_grads = _reference(scenario, "fp32", ranks=2)
    rtol, atol = TOLERANCES["fp32"]
    for rank in range(4):
        ref = per_pair[rank // 2]
        for key in ("out", "x_grad", "router_grad"):
            torch.testing.assert_close(got[rank][key], ref[key], rtol=rtol, atol=atol, msg=f"{key} rank {rank}")
        for name, full in expert_grads.items():
            shard = full[2 * rank : 2 * rank + 2]
            torch.testing.assert_close(got[rank][f"{name}_grad"], shard, rtol=rtol, atol=atol, msg=f"{name} {rank}")
