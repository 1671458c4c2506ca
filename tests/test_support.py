"""The test harness's torchrun runner: one retry for the known gloo teardown abort, and no retry for anything else."""

import textwrap

import pytest
from support import TEARDOWN_ABORT, run_torchrun_worker

pytestmark = pytest.mark.slow

WORKER = """
import os, sys
from pathlib import Path
marker = Path(sys.argv[1]) / "started"
first = not marker.exists()
marker.touch()
if first or {always}:
    sys.stderr.write({message!r} + "\\n")
    sys.stderr.flush()
    os.abort()
(Path(sys.argv[1]) / "done").touch()
"""


def _worker(tmp_path, message: str, always: bool):
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(WORKER.format(message=message, always=always)))
    return path


def test_teardown_abort_is_retried_once(tmp_path):
    run_torchrun_worker(_worker(tmp_path, TEARDOWN_ABORT, always=False), tmp_path, nproc=1)
    assert (tmp_path / "done").exists()


@pytest.mark.parametrize(
    "message, always", [(TEARDOWN_ABORT, True), ("some other failure", False)], ids=["abort_twice", "other_failure"]
)
def test_other_failures_fail(tmp_path, message, always):
    with pytest.raises(AssertionError, match=message):
        run_torchrun_worker(_worker(tmp_path, message, always), tmp_path, nproc=1)
    assert not (tmp_path / "done").exists()
