"""Failures inside a training step: non-finite steps and collectives that fail or hang.

Non-finite steps. Every rank flags a NaN/Inf loss in any of its micro-batches and a NaN/Inf in its gradients
after the accumulation boundary's reduction (this rank's ZeRO partition, or the full reduced gradients without
ZeRO; a non-finite local gradient on any rank is non-finite in the reduced sum). One all-reduce of the flags is
the decision, so every rank skips the same steps. A skipped step leaves parameters and optimizer state (Adam
moments and step count) exactly as they were, while data and the learning-rate schedule move on: both are
functions of the step (data.py, optim.lr_lambda), so a resumed run replays the same steps. Too many skips in a
row (train.max_nonfinite_steps) stop the run: nothing it could do next would be better.

Zeroing the gradients is not skipping: Adam would still decay its moments, bump its step count and apply weight
decay. What we do instead, per optimizer DeepSpeed builds from our config (private_api.step_without_update: it
rests on DeepSpeed internals):
- ZeRO 1/2 (DeepSpeedZeroOptimizer, fp32 or bf16): the boundary `engine.step()` runs with the optimizer's own
  overflow verdict forced. That is DeepSpeed's path for fp16/bf16 overflow: it frees the reduced gradient
  partitions, resets its micro-step bookkeeping, touches neither the fp32 master weights nor the Adam state, and
  `engine.was_step_applied()` turns false. (Left alone, DeepSpeed takes it for non-finite gradients but not for
  a non-finite loss with finite gradients, and under bf16 only when bf16.check_grad_overflow is on.)
- ZeRO 0 (the torch optimizer itself): the boundary `engine.step()` runs with the optimizer's `step` shadowed by
  a no-op for that call, so DeepSpeed does its bookkeeping (gradient clipping, zero_grad, LR, counters) and
  nothing is updated. (Dropping the gradients instead makes DeepSpeed's fp32 clipping fail on an empty list.)
Under fp16 loss scaling (deepspeed.extra) DeepSpeed's own overflow skips stay as DeepSpeed documents them (the
loss scale drops); they show up here as skipped steps too.

Collectives. torch raises a RuntimeError after parallel.timeout_s when a peer stops answering (gloo) or at once
when it dies; `operation` re-raises it as a one-line CollectiveError naming the step and the operation. The
caller then exits non-zero and the launcher's restart path takes over (launch/train.py). Checkpoint reads and
writes on the training groups run under train.save_timeout_s instead: `operation` with `restore_s` sets that limit
for its block and parallel.timeout_s again after it (mesh.group_timeouts), the only place limits change.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.distributed as dist

from moe_dist.parallel import private_api
from moe_dist.parallel.comm import all_reduce_sum
from moe_dist.parallel.mesh import Mesh, group_timeouts


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
            raise
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
    """Runs the accumulation boundary's optimizer step, or skips it on every rank (see the module docstring)."""

    def __init__(
        self, engine, scheduler, mesh: Mesh, max_in_row: int, warn: Callable[[str], None], skipped_total: int = 0
    ):
        self.engine, self.scheduler, self.mesh = engine, scheduler, mesh
        self.max_in_row, self.warn = max_in_row, warn
        self.skipped_total = skipped_total  # over the whole run, carried in checkpoints
        self.in_row = 0
        self._bad_loss = torch.zeros((), dtype=torch.bool)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Called with every micro-batch's loss; no host sync (read once, at the boundary)."""
        self._bad_loss = self._bad_loss.to(loss.device) | ~torch.isfinite(loss.detach()).all()

    def boundary_step(self, step: int) -> bool:
        """Call instead of `engine.step()` after the backward of the step's last micro-batch; True if skipped.
        Collective. Raises NonFiniteError when this makes train.max_nonfinite_steps skips in a row."""
        grads = _local_grads(self.engine)
        bad_grad = bool(grads) and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        world, rank = self.mesh.world_size, self.mesh.rank
        flags = torch.zeros(2 * world, dtype=torch.float64)
        flags[rank], flags[world + rank] = float(self._bad_loss), float(bad_grad)
        all_reduce_sum(flags)  # the one decision every rank takes alike
        self._bad_loss = torch.zeros((), dtype=torch.bool)
        loss_ranks, grad_ranks = flags[:world].nonzero().flatten().tolist(), flags[world:].nonzero().flatten().tolist()
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
