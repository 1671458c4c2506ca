"""The suite's fork launcher (tests/forklaunch.py): what each rank sees, how a failing or hanging world ends, and a
forked world trains exactly as torchrun's does."""

import json
import subprocess
import textwrap

import pytest
from support import DEBUG_CONFIG, ONE_THREAD, free_port, train_records

RANK_SCRIPT = """
import json, os, sys
from pathlib import Path
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "MINE")
seen = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in keys}, "path0": sys.path[0]}
Path(sys.argv[1], f"rank{os.environ.get('RANK', 'alone')}.json").write_text(json.dumps(seen))
print("out of", os.environ.get("RANK", "alone"))
print("err of", os.environ.get("RANK", "alone"), file=sys.stderr)
if os.environ.get("RANK") == "1" and len(sys.argv) > 2:
    sys.exit(int(sys.argv[2]))
if os.environ.get("RANK") == "0" and len(sys.argv) > 3:
    import time
    time.sleep(float(sys.argv[3]))
"""


def _script(tmp_path):
    path = tmp_path / "scripts" / "rank_script.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(RANK_SCRIPT))
    return path


def test_each_rank_sees_the_environment_a_launcher_gives_it(tmp_path, forks):
    port = free_port()
    proc = forks.run(
        2, [str(tmp_path)], {"MINE": "x", "PATH": "/usr/bin"}, port, 60, script=_script(tmp_path), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "MINE": "x",  # the request's environment replaces the server's
        }
        assert seen["argv"] == [str(tmp_path)] and seen["cwd"] == str(tmp_path)
        assert seen["path0"] == str(tmp_path / "scripts")  # as `python scripts/rank_script.py` has it
        assert f"out of {rank}" in proc.stdout and f"err of {rank}" in proc.stderr


def test_one_process_gets_no_launcher_variables(tmp_path, forks):
    proc = forks.script(_script(tmp_path), [tmp_path], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == "out of alone\n"
    assert json.loads((tmp_path / "rankalone.json").read_text())["env"]["RANK"] is None


def test_a_failing_rank_fails_the_world_and_its_exit_status_is_returned(tmp_path, forks):
    """Rank 1 exits 3 while rank 0 would sleep for 10 minutes: rank 0 is stopped and the world's status is 3."""
    proc = forks.run(2, [str(tmp_path), "3", "600"], {}, free_port(), 300, script=_script(tmp_path), cwd=tmp_path)
    assert proc.returncode == 3 and "err of 1" in proc.stderr


def test_a_world_past_its_timeout_is_killed_and_reported(tmp_path, forks):
    with pytest.raises(subprocess.TimeoutExpired):
        forks.run(2, [str(tmp_path), "0", "600"], {}, free_port(), 2, script=_script(tmp_path), cwd=tmp_path)
    proc = forks.script(_script(tmp_path), [tmp_path], cwd=tmp_path)  # the server serves the next request
    assert proc.returncode == 0


@pytest.mark.slow
def test_a_forked_world_trains_as_torchrun_does(tmp_path, debug_run, run_train, metrics):
    """configs/debug.json on 2 forked ranks: every loss and gradient norm equals the torchrun run's, bitwise."""
    run_train("fork", 2, ["--config", DEBUG_CONFIG, "--run-dir", str(tmp_path / "run"), "--set", ONE_THREAD])
    got, ref = train_records(metrics(tmp_path / "run")), train_records(metrics(debug_run("torchrun")))
    assert len(got) == len(ref) > 0
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in ref]
