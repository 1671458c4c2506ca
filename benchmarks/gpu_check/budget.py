"""What the GPU check's driver and its part modules share: the time budgets and the subprocesses they bound."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class BudgetSpent(BaseException):
    """A part's time is up. Not an Exception (like KeyboardInterrupt): code that reports an Exception as a failure
    (a benchmark that failed, a library's fallback) must let the alarm through."""


class Budget:
    """A part's time budget. In-process work is interrupted by SIGALRM (`interrupting`); subprocesses are ended
    by `finish` when it is spent."""

    def __init__(self, part: str, seconds: float):
        self.part, self.seconds, self.start = part, seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def check(self, doing: str) -> None:
        if self.left() <= 0:
            raise BudgetSpent(f"budget of {self.seconds:.0f} s spent before {doing}")

    def interrupting(self):
        return _Alarm(self)


class _Alarm:
    def __init__(self, budget: Budget):
        self.budget = budget

    def _fire(self, _signum, frame):
        # Never inside an import: a module left half-initialized (sympy, imported lazily by autograd) breaks every
        # later part of the run. Try again a moment later, once the import is done.
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib"):
                signal.setitimer(signal.ITIMER_REAL, 0.05)
                return
            frame = frame.f_back
        raise BudgetSpent(f"budget of {self.budget.seconds:.0f} s spent")

    def __enter__(self):
        self.previous = signal.signal(signal.SIGALRM, self._fire)
        signal.setitimer(signal.ITIMER_REAL, max(self.budget.left(), 0.001))

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)


# ----------------------------------------------------------------------------------------------- subprocesses


def _kill(proc: subprocess.Popen) -> None:
    """End a process we started and everything it started (its own session, so its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:  # a file, not a pipe: no process blocks on its output
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def finish(procs: dict[str, subprocess.Popen], budget: Budget) -> dict[str, int]:
    """Wait for every process until the budget is spent; then end the rest and raise BudgetSpent naming them."""
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(budget.left(), 0.01))
        except subprocess.TimeoutExpired:
            late = [n for n, p in procs.items() if n not in codes and p.poll() is None]
            for n in late:
                _kill(procs[n])
            done = {n: p.returncode for n, p in procs.items() if n not in late}
            raise BudgetSpent(
                f"budget of {budget.seconds:.0f} s spent while {', '.join(late)} "
                f"{'was' if len(late) == 1 else 'were'} running (ended)"
                + (f"; finished: {', '.join(f'{n} exit {c}' for n, c in done.items())}" if done else "")
            ) from None
    return codes


def tail(log: Path, n: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").strip().splitlines()[-n:])
