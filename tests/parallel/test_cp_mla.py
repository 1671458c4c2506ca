"""MLA under context parallelism against the single-process whole-sequence layer (cp_mla_worker.py on one world of 4
gloo ranks, cp = 2 and cp = 4): outputs and every gradient, and what the CP path sends: only the latent and the RoPE
key, C + dr values per position, all-gathered in forward and reduce-scattered in backward."""

from pathlib import Path

import pytest
from support import worker_results

WORKER = Path(__file__).with_name("cp_mla_worker.py")
CASES = ["q_lora_yarn", "full_q_documents", "q_lora_prefix", "norope_documents"]
B, S, C, DR, H, DQ, DV = 2, 32, 6, 4, 4, 8, 3  # cp_mla_worker.py's shapes


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory, forks) -> list[dict]:
    return worker_results(WORKER, tmp_path_factory.mktemp("cp_mla"), nproc=4, forks=forks)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_cp_mla_matches_whole_sequence(cp_results, case, cp):
    for rank, results in enumerate(cp_results):
        entries = {k: v for k, v in results.items() if k.startswith(f"{case}.cp{cp}.")}
        assert f"{case}.cp{cp}.out" in entries and f"{case}.cp{cp}.grad.x" in entries
        assert sum(".grad.w" in k for k in entries) >= 4, entries.keys()  # wkv_a, wkv_b, wo and the query's
        payload = entries.pop(f"{case}.cp{cp}.payload")
        # the whole sequence's latent and RoPE key, fp64; per-head keys and values would be H · (dq + dv) per position
        whole = B * S * (C + DR) * 8
        assert payload == {"all_gather": whole, "reduce_scatter": whole}, (case, payload)
        assert whole < B * S * H * (DQ + DV) * 8
        for name, e in entries.items():
            assert e["scale"] > 1e-3, name  # the reference is not trivially zero
            assert e["err"] <= 1e-10 * e["scale"], f"rank {rank} {name}: {e['err']:.3g} vs {e['scale']:.3g}"
