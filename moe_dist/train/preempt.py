"""Stopping on request: a scheduler's warning signal ends the run at the next step boundary with a checkpoint.

Slurm's `--signal=B:USR1@300` (launch/slurm/) warns the job before its time limit; the batch script forwards the
signal to the training processes. Here each rank only notes it (the handler sets a flag and nothing else, so it is
safe wherever the signal lands); the ranks agree on it in the step boundary's one host all-reduce
(guard.NonFiniteGuard.boundary_step), so every rank stops after the same step, however many of them got the
signal and whenever. The loop then saves that step's checkpoint, and the process exits with EXIT_STOPPED: the batch
script requeues the job, and `--resume` continues from the checkpoint (docs/reliability.md, "Preemption").

SIGTERM is not caught: torchrun and the deepspeed launcher end the surviving ranks with it when one rank fails,
and Slurm sends it to every process of the job at the limit itself, with no time left for a step and a save.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

EXIT_STOPPED = 3  # the run stopped on request after saving a checkpoint; distinct from 1 (failed), 2 (bad input)
STOP_SIGNALS = (signal.SIGUSR1,)


class Stopped(RuntimeError):
    """The run stopped on request at a step boundary, after its checkpoint was published (every rank)."""


class StopRequest:
    """Whether a stop signal reached this process (`requested`), and which (`name`)."""

    def __init__(self):
        self.name: str | None = None

    @property
    def requested(self) -> bool:
        return self.name is not None

    def _handle(self, signum, _frame) -> None:
        self.name = signal.Signals(signum).name


@contextmanager
def stop_signals():
    """Catch STOP_SIGNALS in the block (a StopRequest), restoring the previous handlers after it. Launchers are
    started with the signal ignored (launch/slurm/common.sh), and an ignored disposition is inherited: installing
    a handler here is what makes the training process, and only it, react. Handlers can only be installed from
    the main thread; elsewhere (a test calling train() from a thread) the block runs with nothing caught."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.signal(s, stop._handle) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        # Restart interrupted system calls (SA_RESTART): a blocking read inside gloo or NCCL must not fail with
        # EINTR because the signal arrived while it waited.
        signal.siginterrupt(s, False)
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
