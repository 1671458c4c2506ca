"""Failures inside a training step: non-finite steps and collectives that fail or hang.

Non-finite steps: every rank flags a NaN/Inf loss or reduced gradient, one all-reduce of the flags decides, so every
rank skips the same steps; a skipped step leaves parameters and optimizer state (Adam moments and step count)
exactly as they were, while data and the LR schedule, functions of the step, move on. Skipping is not zeroing the
gradients (Adam would still decay its moments): it goes through private_api.step_without_update, per optimizer.
Collectives: `operation` re-raises torch's RuntimeError as a one-line CollectiveError naming the step and the
operation (on NCCL: the DistBackendError of a communicator the watchdog aborted, mesh.NCCL_ASYNC_ERROR_HANDLING);
with `restore_s` it is the only place the group timeouts change (mesh.group_timeouts). The mechanism per ZeRO
stage and the timeouts: docs/reliability.md, sections "Non-finite steps" and "Hangs and timeouts".
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.distributed as dist

from moe_dist.parallel import private_api
from moe_dist.parallel.comm import all_reduce_sum
from moe_dist.parallel.mesh import Mesh, group_timeouts
from moe_dist.train.preempt import StopRequest


class TrainingError(RuntimeError):
    """The run cannot go on; the message is one line. Exit non-zero so that a launcher can restart the job."""


class CollectiveError(TrainingError):
    """A collective failed or timed out: a rank died or stopped responding."""


class NonFiniteError(TrainingError):
    """Too many optimizer steps in a row were skipped for non-finite loss or gradients."""


_COMM_FAILURE = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "gloo", "nccl")


@contextmanager
def operation(
    what: str, timeout_s: float, setting: str = "parallel.timeout_s", *, restore_s: float | None = None, keep=()
):
    """Re-raise a failed collective inside the block as CollectiveError("<what>: ..."), naming the `setting` that
    bounds it. Without `restore_s` the groups already time out after `timeout_s` (parallel.timeout_s, set at
    start-up). With it, the block applies its own limit: every process group but those in `keep` times out after
    `timeout_s` inside it and after `restore_s` once it ends, groups made inside included (mesh.group_timeouts)."""
    limit = nullcontext() if restore_s is None else group_timeouts(timeout_s, restore_s, keep)
    try:
        with limit:
            yield
    except TrainingError:
        raise
    except RuntimeError as e:
        text = " ".join(str(e).split())
        if not (isinstance(e, dist.DistError) or any(s in text.lower() for s in _COMM_FAILURE)):
            # After the NCCL watchdog aborted a group (mesh.NCCL_ASYNC_ERROR_HANDLING) its collectives' outputs are
            # garbage, and an op that reads them (a split by received counts) may fail before the next collective
            # raises: the abort is the cause.
            aborted = private_api.aborted_nccl_groups()
            if not aborted:
                raise
            text = f"NCCL communicator of group {', '.join(aborted)} aborted by the watchdog, then: {text}"
        kind = "timed out" if "time" in text.lower() else "failed"
        raise CollectiveError(
            f"{what}: collective {kind} ({setting}={timeout_s:g}; a rank died or stopped responding): {text}"
        ) from e


def _local_grads(engine) -> list[torch.Tensor]:
    """This rank's reduced gradients after the accumulation boundary's backward."""
    partitions = private_api.reduced_gradient_partitions(engine.optimizer)  # ZeRO 1/2: this rank's partition
    if partitions is not None:
        return partitions
    return [p.grad for p in engine.module.parameters() if p.grad is not None]


class NonFiniteGuard:
    """Runs the boundary's optimizer step, or skips it on every rank (docs/reliability.md, "Non-finite steps")."""

    def __init__(
        self,
        engine,
        scheduler,
        mesh: Mesh,
        max_in_row: int,
        warn: Callable[[str], None],
        skipped_total: int = 0,
        stop: StopRequest | None = None,
    ):
        self.engine, self.scheduler, self.mesh = engine, scheduler, mesh
        self.max_in_row, self.warn = max_in_row, warn
        self.skipped_total = skipped_total  # over the whole run, carried in checkpoints
        self.in_row = 0
        self._bad_loss = torch.zeros((), dtype=torch.bool)
        # A stop request rides on the boundary's all-reduce (preempt.py): no collective of its own.
        self.stop = stop
        self.stop_agreed = False  # some rank had a stop request at the last boundary: every rank stops after it

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Called with every micro-batch's loss; no host sync (read once, at the boundary)."""
        self._bad_loss = self._bad_loss.to(loss.device) | ~torch.isfinite(loss.detach()).all()

    def boundary_step(self, step: int) -> bool:
        """Call instead of `engine.step()` after the backward of the step's last micro-batch; True if skipped.
        Collective; it also sets `stop_agreed`. Raises NonFiniteError when this makes train.max_nonfinite_steps
        skips in a row."""
        grads = _local_grads(self.engine)
        bad_grad = bool(grads) and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        world, rank = self.mesh.world_size, self.mesh.rank
        flags = torch.zeros(2 * world + 1, dtype=torch.float64)
        flags[rank], flags[world + rank] = float(self._bad_loss), float(bad_grad)
        flags[-1] = float(self.stop is not None and self.stop.requested)
        all_reduce_sum(flags)  # the one decision every rank takes alike
        self._bad_loss = torch.zeros((), dtype=torch.bool)
        self.stop_agreed = bool(flags[-1])
        loss_ranks = flags[:world].nonzero().flatten().tolist()
        grad_ranks = flags[world : 2 * world].nonzero().flatten().tolist()
        decided = bool(loss_ranks or grad_ranks)
        if decided:
            self._skip()
        else:
            self.engine.step()
        if not self.engine.was_step_applied():
            self.scheduler.step()  # DeepSpeed holds the schedule on a skipped step; ours follows the step count
        if not decided and self.engine.was_step_applied():
            self.in_row = 0
            return False
        self.skipped_total += 1
        self.in_row += 1
        causes = [
            f"{what} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
            for what, r in (("non-finite loss", loss_ranks), ("non-finite gradient", grad_ranks))
            if r
        ]
        cause = "; ".join(causes) or "DeepSpeed overflow (fp16 loss scaling)"
        limit = self.max_in_row
        self.warn(
            f"warning: step {step}: {cause}; optimizer step skipped on every rank ({self.in_row} in a row, "
            f"{self.skipped_total} in total; train.max_nonfinite_steps={limit})"
        )
        if limit > 0 and self.in_row >= limit:
            raise NonFiniteError(
                f"step {step}: {self.in_row} optimizer steps in a row skipped ({cause}), "
                f"train.max_nonfinite_steps={limit}: stopping; parameters are those after step "
                f"{step - self.in_row}. Lower train.lr or check the data, then resume"
            )
        return True

    def _skip(self) -> None:
        if not private_api.step_without_update(self.engine):
            raise TrainingError(
                "DeepSpeed applied an optimizer step that had to be skipped (non-finite values); "
                "this DeepSpeed version is not supported"
            )
