"""The all-to-all dispatcher on 2 gloo ranks (torchrun) against one process, with adversarial routings (a rank
that receives nothing, a rank that keeps nothing), in fp32 and bf16, with experts sharded over EP and with expert
parallelism folded across TP (parallel.etp = 1). One spawned world runs every case."""

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import run_torchrun_worker

from moe_dist.config import load_config
from moe_dist.layers.moe import MoE
from moe_dist.models.decoder import build_model, materialize_whole

WORKER = Path(__file__).with_name("dispatch_worker.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _worker_module():
    spec = importlib.util.spec_from_file_location("dispatch_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# (dtype, rtol, atol): bf16 expert gradients are sums over rows in another order (per rank, then across ranks)
TOLERANCES = {"fp32": (1e-5, 1e-6), "bf16": (2e-2, 2e-3)}


@pytest.fixture(scope="module")
def results(tmp_path_factory, forks) -> Path:
    out = tmp_path_factory.mktemp("dispatch")
    run_torchrun_worker(WORKER, out, forks=forks)
    return out


def _reference(scenario: str, dtype: str):
    """One process, all experts local: per-rank outputs and router grads, expert grads summed over ranks."""
    worker = _worker_module()
    cfg = load_config(None, worker.layer_config(dtype))
    model = materialize_whole(build_model(cfg.model), "cpu", seed=0).to(worker.DTYPES[dtype])
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    worker.route_by_dimension(moe)
    per_rank = []
    for rank in range(2):
        moe.router.weight.grad = None  # per rank; the expert gradients accumulate over both ranks' tokens
        x = worker.scenario_inputs(scenario, rank, cfg.model.d_model).to(worker.DTYPES[dtype])
        per_rank.append(worker.forward_backward(moe, x))
    expert_grads = {n: getattr(moe.experts, n).grad for n in ("w13", "w2")}
    return per_rank, expert_grads


CASES = [(d, 1) for d in ("fp32", "bf16")] + [("fp32", c) for c in (2, 3, 4, 8)]  # dispatch_worker.CHUNKS


@pytest.mark.parametrize("dtype, chunks", CASES, ids=[f"{d}-chunks{c}" for d, c in CASES])
@pytest.mark.parametrize("scenario", ["all_to_other_rank", "rank_routes_nothing_locally", "rank_has_no_tokens"])
def test_all_to_all_dispatch_matches_one_process(results, scenario, dtype, chunks):
    """Chunked (parallel.a2a_chunks > 1; 8 chunks of 6 tokens leave two chunks empty on every rank) or not."""
    name = _worker_module().case_name(scenario, dtype, chunks)
    got = [load_file(str(results / f"{name}_rank{rank}.safetensors")) for rank in range(2)]
    per_rank, expert_grads = _reference(scenario, dtype)
    rtol, atol = TOLERANCES[dtype]
    for rank in range(2):
        for key in ("out", "x_grad", "router_grad"):
            torch.testing.assert_close(
                got[rank][key], per_rank[rank][key], rtol=rtol, atol=atol, msg=f"{key} rank {rank}"
            )
        for name, full in expert_grads.items():
            shard = full[2 * rank : 2 * rank + 2]  # rank r holds experts 2r, 2r+1
            torch.testing.assert_close(
                got[rank][f"{name}_grad"], shard, rtol=rtol, atol=atol, msg=f"{name} rank {rank}"
            )
    if scenario == "rank_has_no_tokens":
        assert got[1]["out"].shape == (0, 8 if dtype == "fp32" else 32)
        assert torch.count_nonzero(got[1]["router_grad"]) == 0 and torch.count_nonzero(got[1]["w13_grad"]) > 0
    if scenario == "all_to_other_rank":
        # experts 0 and 1 received no token anywhere: rank 0's expert gradients exist and are exactly zero
        assert all(torch.count_nonzero(got[0][f"{n}_grad"]) == 0 for n in ("w13", "w2"))
        assert torch.count_nonzero(got[1]["w13_grad"]) > 0


def _folded_reference(scenario: str, dtype: str) -> dict:
    """One process, all experts local, on the tokens both TP ranks of the folded layout hold."""
    worker = _worker_module()
    cfg = load_config(None, worker.layer_config(dtype))
    model = materialize_whole(build_model(cfg.model), "cpu", seed=0).to(worker.DTYPES[dtype])
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    worker.route_by_dimension(moe)
    return worker.forward_backward(moe, worker.folded_inputs(scenario, cfg.model.d_model).to(worker.DTYPES[dtype]))


@pytest.mark.parametrize("dtype, chunks", CASES, ids=[f"{d}-chunks{c}" for d, c in CASES])
@pytest.mark.parametrize("scenario", ["all_to_one_rank", "one_slice_empty", "no_tokens"])
def test_folded_dispatch_matches_one_process(results, scenario, dtype, chunks):
    """(dp, ep, tp, etp) = (1, 2, 2, 1): each TP rank dispatches its half of the same tokens to whole experts; the
    sum where the output leaves the TP region gives every token once (output, input and router gradients equal
    one process on both ranks), and each rank's experts get exactly their tokens' gradients. Chunked or not."""
    name = _worker_module().case_name(scenario, dtype, chunks)
    got = [load_file(str(results / f"folded_{name}_rank{rank}.safetensors")) for rank in range(2)]
    ref = _folded_reference(scenario, dtype)
    rtol, atol = TOLERANCES[dtype]
    for rank in range(2):
        for key in ("out", "x_grad", "router_grad"):
            torch.testing.assert_close(got[rank][key], ref[key], rtol=rtol, atol=atol, msg=f"{key} rank {rank}")
        for name in ("w13_grad", "w2_grad"):  # rank r holds experts 2r, 2r+1, whole
            shard = ref[name][2 * rank : 2 * rank + 2]
            torch.testing.assert_close(got[rank][name], shard, rtol=rtol, atol=atol, msg=f"{name} rank {rank}")
    row = 8 * got[0]["out"].element_size() if dtype == "fp32" else 32 * 2
    if scenario == "all_to_one_rank":  # rank 0 sends its 3 tokens' 6 rows to rank 1 and receives nothing
        assert all(torch.count_nonzero(got[0][n]) == 0 for n in ("w13_grad", "w2_grad"))
        assert got[0]["sent_bytes"].item() == 6 * row and got[1]["sent_bytes"].item() == 0
    if scenario == "one_slice_empty":  # rank 1 dispatches nothing; rank 0 keeps its token's rows local
        assert all(torch.count_nonzero(got[1][n]) == 0 for n in ("w13_grad", "w2_grad"))
        assert torch.count_nonzero(got[0]["w13_grad"]) > 0
        assert got[0]["sent_bytes"].item() == got[1]["sent_bytes"].item() == 0
    if scenario == "no_tokens":
        assert got[0]["out"].shape[0] == got[1]["out"].shape[0] == 0


@pytest.mark.parametrize("case", ["uneven", "one_empty", "all_empty"])
def test_uneven_row_collectives_and_their_gradients(results, case):
    """gather_rows: every rank gets all blocks in rank order; its backward sums each rank's block of the output
    gradients over ranks (rank r weighted its output by r + 1: 1 + 2 = 3). reduce_scatter_rows: rank r gets block r
    of the sum over ranks (rank r's input is arange · (r + 1)); its backward hands every rank the gradient 2."""
    worker = _worker_module()
    sizes = worker.ROW_SIZES[case]
    everyone = torch.cat([worker.row_inputs(sizes, r) for r in range(2)])
    summed = torch.arange(sum(sizes) * 4.0).view(-1, 4) * (1.0 + 2.0)
    for rank in range(2):
        got = load_file(str(results / f"rows_{case}_rank{rank}.safetensors"))
        assert torch.equal(got["gathered"], everyone)
        assert torch.equal(got["x_grad"], torch.full((sizes[rank], 4), 3.0))
        start = sum(sizes[:rank])
        assert torch.equal(got["scattered"], summed[start : start + sizes[rank]])
        assert torch.equal(got["y_grad"], torch.full((sum(sizes), 4), 2.0))
