"""The whole decoder under context parallelism (4 gloo ranks, torchrun; cp_model_worker.py): a hybrid of every mixer
with capacity-dropping MoE layers equals the whole sequence in one process, for cp = 2 and 4, documents off and on
with the adversarial layouts (a document boundary exactly at a piece edge, a piece that is one whole document,
pieces shorter than d_conv − 1): this rank's logits, the loss and every parameter's gradient (summed over the CP
group, divided by cp: the loss as the training loop forms it), tokens and drops per expert (summed over the group)."""

from pathlib import Path

import pytest
from support import worker_results

WORKER = Path(__file__).with_name("cp_model_worker.py")
CASES = [f"cp{cp}_{docs}" for cp in (2, 4) for docs in ("nodocs", "docs")]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def results(tmp_path_factory, forks) -> list[dict]:
    return worker_results(WORKER, tmp_path_factory.mktemp("cp_model"), nproc=4, forks=forks)


@pytest.mark.parametrize("case", CASES)
def test_decoder_under_cp_equals_one_process(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank[case]
        # fp64 model: the logits to rounding; the LM loss and the router compute in fp32, so the loss and the
        # gradients through them (the routers' weights) to fp32 rounding (seen: 1.6e-7 of the scale)
        assert r["logits"]["err"] <= 1e-12 * r["logits"]["scale"], (rank, r["logits"])
        assert r["loss"]["err"] <= 2e-6 * r["loss"]["scale"], (rank, r["loss"])
        assert len(r["grads"]) > 40  # every parameter of the four mixers, the FFNs, norms, embedding and head
        for name, e in r["grads"].items():
            assert e["err"] <= 2e-6 * e["scale"] + 1e-12, (rank, name, e)
        for got, want in r["tokens_per_expert"] + r["dropped"]:
            assert got == want, (rank, got, want)
        assert sum(sum(want) for _, want in r["dropped"]) > 0  # the capacity dropped assignments: the order mattered
