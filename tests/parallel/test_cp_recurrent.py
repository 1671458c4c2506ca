"""Context parallelism of the recurrent mixers by state passing (Mamba-1, Mamba-2, Gated DeltaNet) on 4 gloo
ranks (torchrun): with a SeqShard (cp = 2 and 4, and tp = 2 × cp = 2 with the mixers split by the real TP
sharding), each mixer equals the whole sequence in one process, outputs, the input's gradient and every
parameter's gradient, with documents off and on (a boundary at a piece edge, a piece that is one whole document,
a start inside a piece, pieces shorter than d_conv − 1). One spawned world runs every case
(cp_recurrent_worker.py)."""

from pathlib import Path

import pytest
from support import worker_results

WORKER = Path(__file__).with_name("cp_recurrent_worker.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CASES = [
    f"{kind}_{layout}_s{seqlen}_{docs}"
    for kind in ("mamba", "mamba2", "gdn")
    for layout, seqlen in (("cp2", 16), ("cp4", 16), ("cp4", 8), ("tp2_cp2", 16))
    for docs in ("nodocs", "docs")
]


@pytest.fixture(scope="module")
def results(tmp_path_factory, forks) -> list[dict]:
    return worker_results(WORKER, tmp_path_factory.mktemp("cp_recurrent"), nproc=4, forks=forks)


@pytest.mark.parametrize("case", CASES)
def test_sharded_mixer_equals_whole_sequence(results, case):
    for rank, got in enumerate(results):
        out_err, dx_err, param_err, scale = got[case]
        assert scale > 0.1, (rank, case)  # the outputs are not trivially small
        # fp64 throughout: only summation order differs from the one-process run
        assert out_err < 1e-12 * scale, (rank, case, out_err)
        assert dx_err < 1e-12 * scale, (rank, case, dx_err)
        assert param_err < 1e-11 * scale, (rank, case, param_err)
