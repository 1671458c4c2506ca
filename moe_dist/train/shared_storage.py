"""Multi-node runs need one run directory that every node sees: checkpoints are written by ranks on every node
and published by rank 0, and resume reads them all from anywhere. A node-local path (a /tmp, a scratch disk)
would scatter each checkpoint over the nodes, and rank 0 would publish manifests of files it cannot see.

`check_shared_run_dir`, at start-up before anything of the run is written: one rank per node writes a probe file
named by a token rank 0 drew for this start; rank 0 checks that it sees every node's; the verdict is broadcast,
so every rank stops with the same one-line error naming the directory and the nodes that do not share it.
"""

from __future__ import annotations

import json
import secrets
import socket
from pathlib import Path

from moe_dist.parallel.comm import barrier, broadcast_bytes, gather_bytes
from moe_dist.parallel.mesh import Mesh


class RunDirNotShared(ValueError):
    """The run directory is not the same directory on every node (bad input: nothing was written)."""


def check_shared_run_dir(run_dir: Path, mesh: Mesh) -> None:
    """Collective. Raises RunDirNotShared on every rank when some node does not see rank 0's run directory."""
    if mesh.local_world_size >= mesh.world_size:  # one node: nothing to compare
        return
    token = broadcast_bytes(secrets.token_hex(8).encode() if mesh.rank == 0 else b"").decode()
    node = mesh.rank // mesh.local_world_size
    probe = run_dir / f".node_probe_{token}_{node}"
    writer = mesh.local_rank == 0
    error = ""
    if writer:
        try:
            probe.write_text(json.dumps({"node": node, "rank": mesh.rank, "host": socket.gethostname()}) + "\n")
        except OSError as e:
            error = f"{run_dir}: node {node} cannot write there ({e.strerror})"
    barrier()
    report = {"node": node, "host": socket.gethostname(), "error": error}
    nodes = gather_bytes(json.dumps(report).encode() if writer else b"")
    verdict = ""
    if mesh.rank == 0:
        reports = list(map(json.loads, filter(None, nodes)))
        verdict = next((r["error"] for r in reports if r["error"]), "")
        expected = {r["node"]: r["host"] for r in reports}
        missing = sorted(n for n in expected if not (run_dir / f".node_probe_{token}_{n}").is_file())
        if missing and not verdict:
            listed = ", ".join(f"node {n} ({expected[n]}, ranks {n * mesh.local_world_size}+)" for n in missing)
            verdict = (
                f"{run_dir}: not shared by every node: {listed} wrote probe files there that rank 0 (node 0) does not "
                f"see; use a run directory on storage every node mounts at the same path"
            )
    verdict = broadcast_bytes(verdict.encode()).decode()
    if writer:
        probe.unlink(missing_ok=True)
    barrier()
    if verdict:
        raise RunDirNotShared(verdict)
