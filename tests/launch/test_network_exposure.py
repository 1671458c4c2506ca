"""What a running job listens on, read from the kernel's socket tables (/proc/net/tcp, tcp6) while it trains: a
job whose ranks all live on this node listens on loopback only, the rendezvous store (rank 0's, under the
deepspeed launcher) included. (Multi-node runs bind the launcher's MASTER_ADDR: the two-node runs of
test_multinode.py rendezvous through it.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from support import DEBUG_CONFIG, ONE_THREAD, console_script, free_port

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        text = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four little-endian 32-bit words
        text = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return text, int(port, 16)


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by one of `pids`."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                out.append(_address(fields[1]))
    return out


def session_pids(sid: int) -> set[int]:
    """Processes of the session the launcher leads (start_new_session): the launcher and all its workers."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    found.add(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_one_node_job_listens_on_loopback_only(tmp_path, nproc):
    port = free_port()
    cmd = [console_script("deepspeed"), "--num_gpus", str(nproc), "--master_port", str(port), TRAIN]
    cmd += ["--config", DEBUG_CONFIG, "--run-dir", str(tmp_path / "run"), "--set", "train.steps=1000", ONE_THREAD]
    cmd += ["train.save_every=0", "train.eval_every=0"]
    log = (tmp_path / "log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not (tmp_path / "run" / "metrics.jsonl").exists():  # training: every group and store is up
            assert proc.poll() is None, (tmp_path / "log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no training step within 400 s"
            time.sleep(0.5)
        sockets = listening(session_pids(proc.pid))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    print(f"\ndeepspeed, {nproc} process(es): listening on {sorted(sockets)}")
    assert ("127.0.0.1", port) in sockets  # the rendezvous store, on loopback
    if nproc > 1:
        assert len(sockets) > 1  # and gloo's listeners, also found (one per rank per group)
    assert all(host in ("127.0.0.1", "::1") for host, _ in sockets), sockets
