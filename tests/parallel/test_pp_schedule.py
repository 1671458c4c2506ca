"""The pipeline schedules (torch.distributed.pipelining over the mesh's pp groups; pp_schedule_worker.py) equal one
process with gradient accumulation on an fp64 hybrid of every mixer with capacity-dropping MoE layers: every
parameter's gradient (the MoE aux and z losses reaching the routers through the injection in each stage's own
backward), the micro-batches' LM losses, and tokens and drops per expert of every MoE layer. 1F1B and interleaved
1F1B at pp = 2 (with tied embeddings too) and pp = 4 (8 stages: one with only an MoE FFN, one with no MoE layer)."""

from pathlib import Path

import pytest
from support import worker_results

WORKER = Path(__file__).with_name("pp_schedule_worker.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


CASES = [(2, "1f1b"), (2, "interleaved"), (2, "tied"), (4, "1f1b"), (4, "interleaved")]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, forks) -> dict[int, list[dict]]:
    """One spawned world per pipeline size, shared by its cases."""
    return {pp: worker_results(WORKER, tmp_path_factory.mktemp(f"pp{pp}"), nproc=pp, forks=forks) for pp in (2, 4)}


@pytest.mark.parametrize("pp, case", CASES, ids=[f"pp{pp}-{c}" for pp, c in CASES])
def test_pipeline_step_equals_one_process(worlds, pp, case):
    per_rank = worlds[pp]
    stages = sorted(s for r in per_rank for s in r[case]["stages"])
    assert stages == list(range(pp * (2 if case == "interleaved" else 1)))
    names = set()
    for rank, r in enumerate(per_rank):
        c = r[case]
        for name, e in c["grads"].items():
            # fp64 model; the router and the LM loss compute in fp32 (seen: ~1e-7 of the scale)
            assert e["err"] <= 2e-6 * e["scale"] + 1e-12, (rank, name, e)
            names.add(name.split(":", 1)[1])
        for got, want in c["tokens_per_expert"]:
            assert got == want, (rank, got, want)
        for got, want in c["dropped"]:
            assert got == want, (rank, got, want)
    assert any("router" in n for n in names)  # the aux and z losses' gradients reached the routers
    moe_layers = sorted(i for r in per_rank for i in r[case]["moe_layers"])
    assert moe_layers == [0, 2, 4, 5, 6]  # every MoE layer counted once, on its stage
    last = per_rank[-1][case] if case != "interleaved" else per_rank[pp - 1][case]
    assert len(last["lm"]) == 4
    for got, want in last["lm"]:
        assert abs(got - want) <= 1e-6 * abs(want), (got, want)
