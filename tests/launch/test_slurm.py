"""launch/slurm/ under a real Slurm: the torchrun-form batch job trains like torchrun itself, a SIGUSR1 to the
batch shell stops it with a checkpoint, requeues it and it resumes to the same end, and an allocation that does
not fit the layout is one line and exit 2.

The `slurm` fixture installs Debian's Slurm daemons and munge when they are missing (root and apt-get; it skips
with the reason otherwise) and builds a cluster on this machine as tests/netns_cluster.sh builds its nodes: a
controller (slurmctld) and two compute nodes (slurmd) in three network namespaces on a private bridge, each daemon
with its own host name (a UTS namespace), its own munge daemon and key, all state in a temporary directory. No
port is opened in the host's own network namespace. Everything is torn down afterwards.

The signal: `scancel --signal=USR1 --batch` sends SIGUSR1 to the batch shell alone, exactly what
`#SBATCH --signal=B:USR1@300` does 300 s before the limit; Slurm checks time limits about once a minute, so a short
`--time` would make the test minutes longer and its timing loose.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from support import DEBUG_CONFIG, ONE_THREAD, train_records

REPO = Path(__file__).resolve().parents[2]
NETNS = REPO / "tests" / "netns_cluster.sh"
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]  # Debian's slurm-wlm, less what a test needs not
PROGRAMS = ["slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun", "munged", "mungekey"]
SUBNET = "10.213.9"  # inside the namespaces only (netns_cluster.sh's default is 10.213.7)
NODES = 2
TRAIN_ARGS = ["--config", DEBUG_CONFIG, "--set", ONE_THREAD]  # the session's debug_run("torchrun") arguments

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _install() -> None:
    """Debian's packages when a program is missing; skip where that cannot be done here."""
    if not [p for p in PROGRAMS if shutil.which(p) is None]:
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"Slurm is not installed and there is no apt-get to install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    tic = time.perf_counter()
    proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:  # a machine whose package lists were never fetched
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env, timeout=300)
        proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    print(f"apt-get install {' '.join(PACKAGES)}: {time.perf_counter() - tic:.0f} s")


class Cluster:
    """A controller and NODES compute daemons in network namespaces; clients run in the controller's."""

    def __init__(self, root: Path):
        self.root, self.tag = root, f"msl{os.getpid()}"
        self.hub = f"{self.tag}-hub"
        self.nodes = [f"{self.tag}-n{k}" for k in range(NODES)]
        self.namespaces: list[str] = []
        self.daemons: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def _daemon(self, ns: str, hostname: str, cmd: str, log: str) -> None:
        # nsenter joins the network namespace only (`ip netns exec` would remount /sys, hiding the cgroup file
        # systems slurmd reads); unshare --uts gives the daemon the host name Slurm knows it by. Both exec, so the
        # pid is the daemon's.
        with (self.root / log).open("w") as out:
            self.daemons.append(
                subprocess.Popen(
                    [
                        "nsenter",
                        f"--net=/run/netns/{ns}",
                        "unshare",
                        "--uts",
                        "sh",
                        "-c",
                        f"hostname {hostname}; {cmd}",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
            )

    def up(self) -> None:
        r = self.root
        for d in ("state", "log", *(f"spool/n{k}" for k in range(NODES))):
            (r / d).mkdir(parents=True)
        subprocess.run(["mungekey", "--create", "--keyfile", str(r / "munge.key")], check=True, timeout=60)
        munged = [
            "munged",
            "--force",  # as root, with the key and socket in a private temporary directory
            f"--socket={r / 'munge.sock'}",
            f"--key-file={r / 'munge.key'}",
            f"--pid-file={r / 'munged.pid'}",
            f"--log-file={r / 'log' / 'munged.log'}",
            f"--seed-file={r / 'munge.seed'}",
        ]
        subprocess.run(munged, check=True, timeout=60)  # daemonizes; stopped by its pid file
        nodes = "\n".join(f"NodeName=n{k} NodeAddr={SUBNET}.{k + 1} CPUs={os.cpu_count()}" for k in range(NODES))
        (r / "slurm.conf").write_text(
            f"""ClusterName=moedist
SlurmctldHost=ctl({SUBNET}.254)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r / "munge.sock"}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}/%n
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "slurmd"}-%n.pid
SlurmctldLogFile={r / "log"}/slurmctld.log
SlurmdLogFile={r / "log"}/slurmd-%n.log
# Every process of a step is signalled (torchrun starts its workers in sessions of their own); no cgroups.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
ReturnToService=2
JobRequeue=1
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )
        self._ip("netns", "add", self.hub)
        self.namespaces.append(self.hub)
        self._ip("-n", self.hub, "link", "set", "lo", "up")
        self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.hub, "addr", "add", f"{SUBNET}.254/24", "dev", "br0")
        self._ip("-n", self.hub, "link", "set", "br0", "up")
        for k, ns in enumerate(self.nodes):
            self._ip("netns", "add", ns)
            self.namespaces.append(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", self.hub, "link", "add", f"p{k}", "type", "veth", "peer", "name", "veth0", "netns", ns)
            self._ip("-n", self.hub, "link", "set", f"p{k}", "master", "br0", "up")
            self._ip("-n", ns, "addr", "add", f"{SUBNET}.{k + 1}/24", "dev", "veth0")
            self._ip("-n", ns, "link", "set", "veth0", "up")
        self._daemon(self.hub, "ctl", "exec slurmctld -D -i", "slurmctld.out")
        for k, ns in enumerate(self.nodes):
            self._daemon(ns, f"n{k}", "exec slurmd -D", f"slurmd{k}.out")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            idle = self.client("sinfo", "-h", "-t", "idle", "-o", "%D", check=False).stdout.strip()
            if idle == str(NODES):
                return
            time.sleep(1)
        logs = "\n".join(f"{p.name}: {p.read_text()[-1500:]}" for p in sorted((r / "log").glob("*.log")))
        raise AssertionError(f"the Slurm nodes did not come up:\n{logs}")

    def client(self, *cmd: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        """A Slurm command, run where the controller's address is reachable."""
        full = ["nsenter", f"--net=/run/netns/{self.hub}", *cmd]
        proc = subprocess.run(full, capture_output=True, text=True, env={**self.env, **(env or {})}, timeout=60)
        assert not check or proc.returncode == 0, f"{cmd}: {proc.stdout}{proc.stderr}"
        return proc

    def submit(self, script: str, args: list[str], out: Path, *sbatch: str, env: dict | None = None) -> str:
        """sbatch from the repository root with CPU processes, gloo on the nodes' veth link; the job id."""
        job_env = {"NPROC_PER_NODE": "1", "GLOO_SOCKET_IFNAME": "veth0", "PYTHONUNBUFFERED": "1", **(env or {})}
        cmd = ["sbatch", "--parsable", "--gpus-per-node=0", f"--output={out}", *sbatch]
        return self.client(*cmd, f"launch/slurm/{script}", *args, env=job_env).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        text = self.client("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, until, timeout: float = 600) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if until(job):
                return job
            time.sleep(1)
        raise AssertionError(f"job {job_id} still {self.job(job_id)} after {timeout} s")

    def down(self) -> None:
        self.client("scancel", "--user=root", check=False)
        for ns in self.namespaces:  # the daemons, the job steps and training processes inside the nodes
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
        for proc in self.daemons:
            proc.wait(timeout=30)
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pid_file = self.root / "munged.pid"
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), 15)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("not root: starting Slurm's daemons and network namespaces needs root")
    check = subprocess.run(["bash", str(NETNS), "--check"], capture_output=True, text=True, timeout=60)
    if check.returncode == 77:
        pytest.skip(check.stderr.strip())
    _install()
    tic = time.perf_counter()
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.up()
        print(f"Slurm up (controller + {NODES} nodes in network namespaces): {time.perf_counter() - tic:.1f} s")
        yield cluster
    finally:
        cluster.down()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert cluster.tag not in left, left


def _finished(job: dict) -> bool:
    return job["JobState"] in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def _same_run(got: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-6)
    for g, r in zip(got, ref, strict=True):
        assert [m["tokens_per_expert"] for m in g["moe"]] == [m["tokens_per_expert"] for m in r["moe"]]


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_job_equals_torchrun(slurm, tmp_path, debug_run, metrics, launcher):
    """2 nodes x 1 process under sbatch, one torchrun or one `deepspeed --no_ssh` per node, equal 2 processes
    under torchrun on one node, step by step (one reference run for both)."""
    ref = train_records(metrics(debug_run("torchrun")))
    tic = time.perf_counter()
    args = [*TRAIN_ARGS, "--run-dir", str(tmp_path / "run")]
    job_id = slurm.submit(f"train_{launcher}.sbatch", args, tmp_path / "out")
    job = slurm.wait(job_id, _finished)
    print(f"Slurm job, {launcher}, 2 nodes x 1 process: {time.perf_counter() - tic:.1f} s from sbatch to the end")
    log = (tmp_path / "out").read_text()
    print("\n".join(line for line in log.splitlines() if line.startswith("moe_dist:")))
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert f"2 nodes x 1 processes = world 2, {launcher}, master {SUBNET}.1:" in log
    _same_run(train_records(metrics(tmp_path / "run")), ref)


def test_usr1_stops_with_a_checkpoint_requeues_and_resumes(slurm, tmp_path, debug_run, metrics):
    """SIGUSR1 to the batch shell once step 1 is logged: the ranks stop after a step before the last, save it,
    the job is requeued and resumes from it to the end; the losses equal an uninterrupted run's."""
    ref = train_records(metrics(debug_run("torchrun")))
    run, out = tmp_path / "run", tmp_path / "out"
    tic = time.perf_counter()
    job_id = slurm.submit("train_torchrun.sbatch", [*TRAIN_ARGS, "--run-dir", str(run)], out)
    deadline = time.monotonic() + 600
    while not ((run / "metrics.jsonl").exists() and '"step": 1,' in (run / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline and not _finished(slurm.job(job_id)), out.read_text()[-3000:]
        time.sleep(0.2)
    slurm.client("scancel", "--signal=USR1", "--batch", job_id)
    # Slurm holds a requeued job about two minutes (BeginTime); the test waits 3 s. Not 0: the nodes revoked the
    # job's credentials when it was requeued, and a credential issued in the same second counts as revoked.
    slurm.wait(job_id, lambda j: j["Restarts"] == "1" and j["JobState"] == "PENDING")
    slurm.client("scontrol", "update", f"JobId={job_id}", "StartTime=now+3")
    job = slurm.wait(job_id, _finished)
    print(f"Slurm job stopped, requeued and resumed: {time.perf_counter() - tic:.1f} s from sbatch to the end")
    log = out.read_text()
    print("\n".join(ln for ln in log.splitlines() if ln.startswith("moe_dist:") or "stopped on request" in ln))
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-4000:]
    stopped = re.findall(r"^step (\d+): stopped on request", log, re.MULTILINE)
    assert len(stopped) == 1 and 1 <= int(stopped[0]) < ref[-1]["step"], log[-4000:]
    assert f"resuming from {run / 'checkpoints' / f'step_{stopped[0]}'} (step {stopped[0]})" in log
    assert "moe_dist: job " + job_id + " (restart 1)" in log
    _same_run(train_records(metrics(run)), ref)


@pytest.mark.parametrize(
    "case, sbatch, env, names",
    [
        ("two tasks per node", ["--ntasks-per-node=2"], {}, "4 tasks on 2 nodes (SLURM_TASKS_PER_NODE=2(x2))"),
        ("world 2, ep 4", [], {}, "2 nodes x 1 processes = world size 2 does not fit the job: parallel.ep: 4"),
        ("no GPUs, no NPROC_PER_NODE", [], {"NPROC_PER_NODE": ""}, "the allocation has no GPUs"),
    ],
)
def test_an_allocation_that_does_not_fit_is_one_line_and_exit_2(slurm, tmp_path, case, sbatch, env, names):
    args = [*TRAIN_ARGS, *(["parallel.ep=4"] if case.startswith("world") else []), "--run-dir", str(tmp_path / "run")]
    job_id = slurm.submit("train_torchrun.sbatch", args, tmp_path / "out", *sbatch, env=env)
    job = slurm.wait(job_id, _finished, timeout=300)
    log = (tmp_path / "out").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error")]
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "2:0"), log
    assert len(errors) == 1 and errors[0].startswith("error: slurm allocation: "), log
    assert names in errors[0], errors[0]
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
