"""The suite's launcher: one server process imports what launch/train.py imports (torch, DeepSpeed, torch._dynamo,
TensorBoard, moe_dist) once per session, then forks every rank of every world it is asked for from there: the
layout comparisons, the spawned workers, the bad-input table and other script runs (`python SCRIPT`, `python -m
MODULE`, or N ranks of either as torchrun would start them).

Why: on these 2-core machines each rank of a torchrun world spends about 4 s of CPU importing before its first step,
and a 6-step layout run trains for 2-3 s; the suite launches hundreds of processes. Forking skips the imports and
torchrun's own start-up; each rank still runs its script from `__main__` in a fresh process, with its own gloo
group, rendezvous store and DeepSpeed engine.

What a rank sees: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand, the
rendezvous path where rank 0 hosts the store (`moe_dist.parallel.mesh._own_store`, as under the deepspeed
launcher), and OMP_NUM_THREADS=1 as torchrun sets it; a world of one sets none of these, as `python
launch/train.py` does. What differs from torchrun: every rank shares the server's string-hash seed, so an order
that depends on set iteration agrees across ranks here when it might not under torchrun. The real launchers keep
their own tests (tests/launch/, tests/train/test_train_e2e.py, the Slurm and multi-node runs).

Protocol: the client writes one JSON request per line to the server's stdin and reads one JSON answer per line
from its stdout; the server's own prints go to its stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "launch" / "train.py")
# After the first rank fails, how long the others get to stop by themselves before they are killed (torchrun
# stops the rest of a world at once; a few seconds keep their last lines).
FAILURE_GRACE_S = 3.0


def _preimport() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as moe_dist.train.loop sets it before importing DeepSpeed
    # DeepSpeed's engine imports its Muon module to check the optimizer, which calls torch.compile at import:
    # torch._inductor, 2.5 s of the 4.5 s a 6-step rank took after the imports above on these CPUs.
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim imports it on first use)
    import torch.utils.tensorboard  # noqa: F401

    import moe_dist.train.loop  # noqa: F401


def _child(req: dict, rank: int) -> None:
    """Rank `rank` of the request's world: launch/train.py as __main__, then exit with its code. Never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: a kill reaches what it started too
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, req["stdout"], os.O_WRONLY | os.O_APPEND),
            (2, req["stderr"], os.O_WRONLY | os.O_APPEND),
        ):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        if os.environ.get("PYTHONFAULTHANDLER"):  # read at interpreter start-up, which a forked rank skips
            import faulthandler

            faulthandler.enable()
        nproc = req["nproc"]
        if nproc > 1:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(req["port"]),
            )
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        import atexit
        import runpy
        import traceback

        # The path `python SCRIPT` (or `python -m MODULE`) starts with: the script's folder (the working directory),
        # then PYTHONPATH's entries. Modules the server imported stay as imported.
        module, script = req.get("module"), req.get("script")
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:0] = [os.getcwd() if module else str(Path(script).parent), *extra]
        sys.argv = [module or script, *req["args"]]
        try:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        for t in threading.enumerate():  # as the interpreter does at exit: non-daemon threads finish first
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _run(req: dict) -> dict:
    pids = []
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            _child(req, rank)
        try:  # here too, so that a kill finds the group however early it comes
            os.setpgid(pid, pid)
        except (PermissionError, ProcessLookupError):
            pass  # the child set it already, or has exited
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline, failed_at, timed_out = time.monotonic() + req["timeout"], None, False
    while len(codes) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
                    if codes[rank] != 0 and failed_at is None:
                        failed_at = time.monotonic()
        now = time.monotonic()
        if len(codes) < len(pids) and (now > deadline or (failed_at is not None and now > failed_at + FAILURE_GRACE_S)):
            timed_out = timed_out or now > deadline
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass  # exited meanwhile: the next waitpid collects it
        time.sleep(0.02)
    failures = [c for c in codes.values() if c != 0]
    return {"returncode": failures[0] if failures else 0, "timed_out": timed_out}


def serve() -> None:
    # `python tests/forklaunch.py` put tests/ first on the path, where packages named as scripts' modules live
    # (tests/train/ beside launch/train.py): a rank sees the path `python launch/X.py` gives it.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the imports print must not reach the protocol
    # The server runs no torch op, so torch's intra-op (OpenMP) pool starts in each child, after the fork; the one
    # thread the imports start is OpenBLAS's, which re-forms itself in a child (as torch's DataLoader workers rely on).
    _preimport()
    protocol.write("ready\n")
    for line in sys.stdin:
        protocol.write(json.dumps(_run(json.loads(line))) + "\n")


class ForkServer:
    """The client: `run(nproc, args, env, port, timeout)` → a CompletedProcess of launch/train.py's world (or of
    `script`'s or `python -m module`'s, run in `cwd`), its ranks' stdout and stderr interleaved as a launcher passes
    them through. The server starts on first use."""

    def __init__(self, scratch: Path):
        self.scratch, self.proc, self.runs = scratch, None, 0

    def _start(self) -> None:
        self.log = open(self.scratch / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-u", __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            text=True,
        )
        if self.proc.stdout.readline() != "ready\n":
            raise RuntimeError(f"forklaunch server failed: {(self.scratch / 'server.log').read_text()[-3000:]}")

    def run(
        self,
        nproc: int,
        args: list[str],
        env: dict,
        port: int | None,
        timeout: float,
        script: str = TRAIN,
        cwd: Path = REPO,
        module: str | None = None,
    ) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.runs += 1
        out, err = self.scratch / f"run{self.runs}.out", self.scratch / f"run{self.runs}.err"
        out.write_text("")
        err.write_text("")
        what = {"module": module} if module else {"script": str(script)}
        req = dict(nproc=nproc, args=args, env=env, cwd=str(cwd), port=port, timeout=timeout, **what)
        command = ["-m", module] if module else [str(script)]
        self.proc.stdin.write(json.dumps({**req, "stdout": str(out), "stderr": str(err)}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        stdout, stderr = out.read_text(), err.read_text()
        out.unlink()
        err.unlink()
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired([*command, *args], timeout, stdout, stderr)
        return subprocess.CompletedProcess([*command, *args], answer["returncode"], stdout, stderr)

    def script(self, script, args, cwd: Path = REPO, env: dict | None = None, timeout: float = 300.0):
        """`python SCRIPT ARGS` in `cwd` as one forked process, in this process's environment plus `env`."""
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        return self.run(1, [str(a) for a in args], environ, None, timeout, script=script, cwd=cwd)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.log.close()


if __name__ == "__main__":
    serve()
