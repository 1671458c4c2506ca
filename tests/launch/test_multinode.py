"""Multi-node runs across network namespaces (tests/netns_cluster.sh), and failure to reach the master.

The two-node test needs root (network namespaces); it skips with the reason where they cannot be created. The
unreachable-master drills run on localhost and need nothing special.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import console_script, free_port, train_records

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
NETNS = str(REPO / "tests" / "netns_cluster.sh")
STEPS = 4
# ep = 4 on a 4-rank world: every MoE all-to-all spans both nodes. On two nodes the dispatch is deduplicated per node
# (a token crosses once per node it reaches), on one node it is the plain one (one block: nothing to deduplicate),
# under routing limited to one group of two experts (the experts of one node) per token.
ARGS = [
    "--config",
    "configs/debug.json",
    "--set",
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "train.save_every=0",
    "train.eval_batches=4",
    "parallel.ep=4",
    "parallel.a2a_dedup=node",
    "model.moe.n_groups=2",
    "model.moe.topk_groups=1",
    "parallel.timeout_s=120",
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def netns():
    proc = subprocess.run(["bash", NETNS, "--check"], capture_output=True, text=True, timeout=60)
    if proc.returncode == 77:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr


def _two_nodes(tmp_path: Path, args: list[str], nproc: int, launchers: tuple[str, ...]):
    """Run `args` on 2 network-namespace nodes × `nproc` processes under each launcher; (process, seconds)."""
    tic = time.perf_counter()
    proc = subprocess.run(
        [
            "bash",
            NETNS,
            "--nodes",
            "2",
            "--nproc",
            str(nproc),
            "--launchers",
            ",".join(launchers),
            "--run-dir",
            str(tmp_path / "two_nodes"),
            "--port",
            str(free_port()),
            "--timeout",
            "600",
            "--",
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    return proc, time.perf_counter() - tic


def _same_as_one_node(proc, tmp_path: Path, ref: list[dict], launchers: tuple[str, ...], metrics) -> None:
    """Each launcher's two-node run equals the one-node run step by step, its gloo traffic crossed the veth links,
    and the namespaces are gone."""
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    for launcher in launchers:
        got = train_records(metrics(tmp_path / "two_nodes" / launcher))
        assert [r["step"] for r in got] == [r["step"] for r in ref], launcher
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-6), launcher
        for g, r in zip(got, ref, strict=True):
            assert [m["tokens_per_expert"] for m in g["moe"]] == [m["tokens_per_expert"] for m in r["moe"]]
        # Gloo traffic crossed the veth links: every node sent and received (MBs of all-to-all and gradients).
        for node in (0, 1):
            m = re.search(rf"\[{launcher}\] node {node} veth0: sent (\d+) B, received (\d+) B", proc.stdout)
            assert m and int(m[1]) > 100_000 and int(m[2]) > 100_000, (launcher, node, m)
    names = set(re.findall(r"(mdc\d+-(?:n\d+|hub))", proc.stdout))
    assert names, proc.stdout[:2000]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not names & set(re.findall(r"\S+", left)), left


def test_two_nodes_equal_one_node(tmp_path, netns, run_train, metrics):
    tic = time.perf_counter()
    run_train("fork", 4, [*ARGS, "--run-dir", str(tmp_path / "one_node")])  # the reference: tests/forklaunch.py
    one_node_s = time.perf_counter() - tic
    ref = train_records(metrics(tmp_path / "one_node"))
    assert len(ref) == STEPS
    launchers = ("deepspeed", "torchrun")
    proc, two_nodes_s = _two_nodes(tmp_path, ARGS, 2, launchers)
    print(f"1 node x 4 processes (forked): {one_node_s:.1f} s end to end")
    print(f"2 nodes x 2 processes, deepspeed --no_ssh then torchrun (incl. namespace set-up): {two_nodes_s:.1f} s")
    print("\n".join(ln for ln in proc.stdout.splitlines() if "status" in ln or "veth0" in ln))
    _same_as_one_node(proc, tmp_path, ref, launchers, metrics)


def test_pipeline_spanning_two_nodes_equals_one_node(tmp_path, netns, run_train, metrics):
    """parallel.pp = 2 with one stage per node: the stage-to-stage transfers cross the link; the run equals the
    same pipeline on one node step by step."""
    args = [*ARGS[: ARGS.index("parallel.ep=4")], "parallel.pp=2", "parallel.timeout_s=120"]
    run_train("fork", 2, [*args, "--run-dir", str(tmp_path / "one_node")])
    ref = train_records(metrics(tmp_path / "one_node"))
    assert len(ref) == STEPS
    proc, _ = _two_nodes(tmp_path, args, 1, ("torchrun",))
    _same_as_one_node(proc, tmp_path, ref, ("torchrun",), metrics)


def _drills(tmp_path: Path, timeout_s: int) -> dict[str, tuple[list[str], str]]:
    """case -> (command, what the error must name); 2 nodes × 1 process on localhost, one node never started."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")

    def args(name):
        return [
            TRAIN,
            *f"--config configs/debug.json --set parallel.timeout_s={timeout_s} --run-dir".split(),
            str(tmp_path / name),
        ]

    def ds(rank, port):
        opts = f"--no_ssh --node_rank {rank} --master_addr 127.0.0.1 --master_port {port}"
        return [console_script("deepspeed"), "--hostfile", str(hostfile), *opts.split()]

    def tr(rank, port):
        opts = (
            f"--nnodes 2 --nproc_per_node 1 --node_rank {rank} --master_addr 127.0.0.1 --master_port {port} "
            f"--rdzv_conf timeout={timeout_s}"
        )
        return [console_script("torchrun"), *opts.split()]

    def acc(rank, port):
        opts = (
            f"launch --multi_gpu --num_machines 2 --machine_rank {rank} --num_processes 2 --main_process_ip "
            f"127.0.0.1 --main_process_port {port} --rdzv_conf timeout={timeout_s} --mixed_precision no "
            "--dynamo_backend no"
        )
        return [console_script("accelerate"), *opts.split()]

    p = {name: free_port() for name in ("a", "b", "c", "d", "e")}
    return {
        # Nothing listens on the master port (wrong port, or the master node is down): the client gives up.
        "deepspeed: master unreachable": ([*ds(1, p["a"]), *args("a")], f"127.0.0.1, {p['a']}"),
        "torchrun: master unreachable": ([*tr(1, p["b"]), *args("b")], f"127.0.0.1, {p['b']}"),
        "accelerate: master unreachable": ([*acc(1, p["e"]), *args("e")], f"127.0.0.1, {p['e']}"),
        # The master is up but the other node never comes: the master gives up waiting for it.
        "deepspeed: node missing": ([*ds(0, p["c"]), *args("c")], "1/2"),
        "torchrun: node missing": ([*tr(0, p["d"]), *args("d")], "1/2"),
    }


def test_unreachable_master_fails_within_the_timeout(tmp_path):
    """parallel.timeout_s bounds the rendezvous under deepspeed (the processes meet directly); torchrun's and
    accelerate's agents meet first, bounded by --rdzv_conf timeout (default 900 s). Either way: a non-zero exit
    naming the problem, within about twice the timeout (the store client connects twice) plus start-up."""
    timeout_s = 5
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    drills = _drills(tmp_path, timeout_s)
    running = {}
    for i, (case, (cmd, _)) in enumerate(drills.items()):  # concurrently: they mostly wait
        log = tmp_path / f"drill{i}.log"
        with log.open("w") as f:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )  # its own process group: a hang is killed whole
            running[case] = (proc, log, time.perf_counter())
    finished: dict[str, float] = {}
    deadline = time.perf_counter() + 300  # the hang detector: far beyond the 5 s timeout and its retries
    while len(finished) < len(running) and time.perf_counter() < deadline:
        for case, (proc, _, tic) in running.items():
            if case not in finished and proc.poll() is not None:
                finished[case] = time.perf_counter() - tic
        time.sleep(0.2)
    failures = []
    for case, (proc, log, _) in running.items():
        if case not in finished:
            os.killpg(proc.pid, signal.SIGKILL)
            failures.append(f"{case}: still running after 300 s (hang)")
            continue
        text, must_name = log.read_text(), drills[case][1]
        print(f"{case}: exit {proc.returncode} after {finished[case]:.0f} s")
        if proc.returncode == 0:
            failures.append(f"{case}: exited 0")
        elif not re.search("timed out", text, re.IGNORECASE) or must_name not in text:
            failures.append(f"{case}: the error does not say 'timed out' and name {must_name!r}:\n{text[-2500:]}")
    assert not failures, "\n".join(failures)


def test_a_run_directory_not_shared_between_nodes_stops_every_rank_before_writing(tmp_path, netns):
    """Node 1's run directory is a private tmpfs (the same path, another directory): at start-up the ranks of
    both nodes stop with one line naming the directory and node 1, under deepspeed (whose store binds node 0's
    MASTER_ADDR) and torchrun, and nothing of the run is written on either side. Every rank raises the same
    error, but once one rank of a node has exited its launcher may stop the others before they print: each
    node's log holds at least one such line, and no other error."""
    run = tmp_path / "unshared"
    cmd = ["bash", NETNS, "--nodes", "2", "--nproc", "2", "--launchers", "deepspeed,torchrun", "--run-dir", str(run)]
    cmd += ["--port", str(free_port()), "--timeout", "300", "--private-run-dir", "1", "--", *ARGS]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0, proc.stdout[-3000:]
    for launcher in ("deepspeed", "torchrun"):
        out = run / launcher
        for node in (0, 1):
            text = (out / f"node{node}.log").read_text()
            errors = [line[line.index("error: ") :] for line in text.splitlines() if "error: " in line]
            assert errors, (launcher, node, text[-3000:])
            for line in errors:
                assert line.startswith(f"error: {out}: not shared by every node: node 1 ("), line
        assert sorted(p.name for p in out.iterdir()) == ["hostfile", "node0.log", "node1.log"]  # no run files
