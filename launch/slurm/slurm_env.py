"""What a Slurm allocation means for launch/train.py, checked against the job's layout before any task starts.

    python launch/slurm/slurm_env.py --config C [--set ...]     # inside an sbatch allocation (common.sh runs it)

Prints shell assignments for the launchers, or one `error:` line and exits 2. The mapping (one launcher task
per node; the launcher starts the node's training processes and sets RANK, LOCAL_RANK, WORLD_SIZE for them):

    NNODES          <- SLURM_NNODES (SLURM_JOB_NUM_NODES)            torchrun --nnodes; the deepspeed hostfile's lines
    NPROC_PER_NODE  <- $NPROC_PER_NODE if set (CPU processes), else SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE
                                                                     torchrun --nproc_per_node; hostfile slots
    MASTER_ADDR     <- the first host of SLURM_JOB_NODELIST (scontrol show hostnames), as its NodeAddr
                       (scontrol show node): the address slurmctld reaches it at, also where host names
                       do not resolve                                --master_addr (rank 0's node hosts the store)
    MASTER_PORT     <- $MASTER_PORT if set, else 20000 + SLURM_JOB_ID mod 10000: the same on every node,
                       different for jobs sharing a node             --master_port
    node rank       <- SLURM_NODEID, read by each task (node.sh)     --node_rank
    world size      =  SLURM_NTASKS (launcher tasks, one per node: SLURM_TASKS_PER_NODE 1 everywhere)
                       x NPROC_PER_NODE, checked against the layout (parallel.tp, parallel.ep, batch sizes)
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from moe_dist.config import ConfigError, load_config
from moe_dist.config.parallel_checks import check_layout


class AllocationError(ValueError):
    """The allocation cannot run this job as these scripts launch it; the message is one line."""


def tasks_per_node(spec: str) -> list[int]:
    """SLURM_TASKS_PER_NODE ("2(x3),1" = 2, 2, 2, 1) as one count per node."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise AllocationError(f"SLURM_TASKS_PER_NODE={spec!r}: not Slurm's format")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def _count(value: str, name: str) -> int:
    """A GPU count as Slurm writes it ("8", "h100:8")."""
    m = re.fullmatch(r"(?:[^:,]+:)?(\d+)", value.strip())
    if not m:
        raise AllocationError(f"{name}={value!r}: expected a count (N or TYPE:N)")
    return int(m[1])


def processes_per_node(env: dict[str, str]) -> int:
    """NPROC_PER_NODE where set (CPU processes), else one process per GPU of the node."""
    if env.get("NPROC_PER_NODE"):
        n = _count(env["NPROC_PER_NODE"], "NPROC_PER_NODE")
        if n < 1:
            raise AllocationError(f"NPROC_PER_NODE={n}: no processes to start on a node")
        return n
    name = next((n for n in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE") if env.get(n)), None)
    gpus = _count(env[name], name) if name else 0
    if gpus < 1:
        raise AllocationError(
            f"the allocation has no GPUs ({f'{name}={env[name]}' if name else 'SLURM_GPUS_ON_NODE unset'}): "
            f"request --gpus-per-node=N, or set NPROC_PER_NODE=N to start N CPU processes per node"
        )
    return gpus


def allocation(env: dict[str, str]) -> tuple[int, int]:
    """(nodes, processes per node) of the allocation; AllocationError where it is not one launcher per node."""
    if "SLURM_JOB_ID" not in env:
        raise AllocationError("not inside a Slurm allocation (SLURM_JOB_ID unset): submit with sbatch")
    nodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
    per_node = tasks_per_node(env.get("SLURM_TASKS_PER_NODE", "1"))
    ntasks = int(env.get("SLURM_NTASKS", sum(per_node)))
    if set(per_node) != {1} or ntasks != nodes:
        raise AllocationError(
            f"{ntasks} tasks on {nodes} nodes (SLURM_TASKS_PER_NODE={env.get('SLURM_TASKS_PER_NODE')}): these "
            f"scripts run one launcher task per node, which starts the node's processes; submit with "
            f"--ntasks-per-node=1"
        )
    return nodes, processes_per_node(env)


def check_world(cfg, nodes: int, nproc: int) -> int:
    """The world size of the allocation, or AllocationError naming the layout key it does not fit."""
    world = nodes * nproc
    try:
        check_layout(cfg, world)
    except ConfigError as e:
        raise AllocationError(
            f"{nodes} nodes x {nproc} processes = world size {world} does not fit the job: {e}"
        ) from None
    return world


def master_addr(nodelist: str) -> str:
    """The first node of the allocation, as the address Slurm reaches it at (its NodeAddr)."""
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    except FileNotFoundError:
        raise AllocationError("scontrol not found: run inside a Slurm allocation, with Slurm's commands") from None
    if hosts.returncode != 0 or not hosts.stdout.split():
        raise AllocationError(f"scontrol show hostnames {nodelist!r}: {' '.join(hosts.stderr.split())}")
    first = hosts.stdout.split()[0]
    node = subprocess.run(["scontrol", "show", "node", "-o", first], capture_output=True, text=True)
    m = re.search(r"\bNodeAddr=(\S+)", node.stdout)
    return m[1] if node.returncode == 0 and m else first


def parse_args(argv=None):
    """launch/train.py's own command line (the job's arguments, passed on unchanged), loaded under a private name."""
    spec = importlib.util.spec_from_file_location(
        "moe_dist_launch_train", Path(__file__).resolve().parents[1] / "train.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = dict(os.environ)
    try:
        cfg = load_config(args.config, args.set)
        nodes, nproc = allocation(env)
        world = check_world(cfg, nodes, nproc)
        master = master_addr(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
    except (ConfigError, AllocationError) as e:
        print(f"error: slurm allocation: {e}", file=sys.stderr)
        return 2
    port = env.get("MASTER_PORT") or str(20000 + int(env["SLURM_JOB_ID"]) % 10000)
    out = {"NNODES": nodes, "NPROC_PER_NODE": nproc, "WORLD": world, "MASTER_ADDR": master, "MASTER_PORT": port}
    print("\n".join(f"{k}={shlex.quote(str(v))}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
