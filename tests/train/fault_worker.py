"""launch/train.py with faults injected, for the reliability tests (a test helper, never used in training).

Run it exactly like launch/train.py (same arguments, under any launcher). Environment:

FAULT, a JSON object with any of
  "kill_in_save": [{"rank": R, "step": S, "where": "write" | "publish", "attempt": A}, ...]
      SIGKILL rank R inside the checkpoint save of step S, in launcher attempt A (TORCHELASTIC_RESTART_COUNT,
      0 for the first), so the restarted job runs clean. "write": once half of R's tensors are in its file (in
      the writer thread, so with train.async_save while training goes on); "publish": rank 0 after meta.json is
      complete in the temporary directory, just before the rename.
  "stall_in_save": [{"rank": R, "step": S, "seconds": T}, ...]
      Rank R's writer sleeps T seconds before closing its tensor file of step S (a slow or hung disk).
  "nonfinite": [{"rank": R, "step": S, "what": "grad" | "loss"}, ...]
      On rank R, in the first micro-batch of optimizer step S (1-based): "grad" puts a NaN into one element
      of the embedding gradient (the loss stays finite); "loss" makes the loss NaN (the gradients stay finite).
  "nccl_abort": [{"rank": R, "step": S}, ...]
      On rank R, in the first micro-batch of step S, the forward raises what a collective raises on NCCL once
      the watchdog has aborted the group's communicator after a timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=2): a
      DistBackendError with torch's message; first it prints the variable's value as the worker sees it.
SAMPLES_DIR: every rank appends {"step", "micro", "starts", "attempt"} for each training micro-batch it consumes
  (the token-stream offsets of its sequences) to SAMPLES_DIR/rank<R>.jsonl.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import moe_dist.train.checkpoint.io as checkpoint_io
import moe_dist.train.checkpoint.save as checkpoint_save
import moe_dist.train.loop as loop
from moe_dist.data.batches import TokenDataset

TRAIN = Path(__file__).resolve().parents[2] / "launch" / "train.py"
FAULT = json.loads(os.environ.get("FAULT") or "{}")
SAMPLES_DIR = os.environ.get("SAMPLES_DIR")
RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
state = {"step": 0, "micro": 0, "starts": []}  # step: the optimizer step in progress (1-based)


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_here(where: str, step: int) -> bool:
    return any(
        k["rank"] == RANK and k["step"] == step and k["where"] == where and k["attempt"] == ATTEMPT
        for k in FAULT.get("kill_in_save", [])
    )


_micro_batches, _starts = TokenDataset.micro_batches, TokenDataset._starts
_forward_loss = loop._forward_loss
_write, _close = checkpoint_io.TensorFileWriter.write, checkpoint_io.TensorFileWriter.close
_publish = checkpoint_save._publish


def starts_of(self, step, batch_size):
    out = _starts(self, step, batch_size)
    state["starts"] = [int(s) for s in out]
    return out


def micro_batches(self, step, batch_size, micro_batch_size, dp_rank, dp_size):
    state.update(step=step + 1, micro=0)
    out = _micro_batches(self, step, batch_size, micro_batch_size, dp_rank, dp_size)
    if SAMPLES_DIR:
        starts, mb = state["starts"], micro_batch_size
        with open(Path(SAMPLES_DIR) / f"rank{RANK}.jsonl", "a") as f:
            for m in range(dp_rank, batch_size // mb, dp_size):
                f.write(
                    json.dumps(
                        {"step": state["step"], "micro": m, "starts": starts[m * mb : (m + 1) * mb], "attempt": ATTEMPT}
                    )
                    + "\n"
                )
    return out


def forward_loss(ctx, batch):
    loss, lm, out = _forward_loss(ctx, batch)
    if not torch.is_grad_enabled():  # evaluation
        return loss, lm, out
    state["micro"] += 1
    for f in FAULT.get("nccl_abort", []):
        if f["rank"] == RANK and f["step"] == state["step"] and state["micro"] == 1:
            print(f"TORCH_NCCL_ASYNC_ERROR_HANDLING={os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING')}", flush=True)
            raise dist.DistBackendError(  # torch 2.13's text (NCCLComm::getNcclComm, WorkNCCL::checkTimeout)
                f"NCCL communicator was aborted on rank {RANK}. Original reason for failure was: [PG ID 0 PG GUID "
                f"0(default_pg) Rank {RANK}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41, "
                "OpType=ALLTOALL_BASE, NumelIn=64, NumelOut=64, Timeout(ms)=8000) ran for 8012 milliseconds before "
                "timing out."
            )
    for f in FAULT.get("nonfinite", []):
        if f["rank"] != RANK or f["step"] != state["step"] or state["micro"] != 1:
            continue
        if f["what"] == "loss":
            loss = loss + torch.tensor(float("nan"))  # a constant: the gradients stay finite
        else:
            hook = {}

            def poison(grad, hook=hook):  # called once, within this iteration: `hook` is this iteration's dict
                hook["handle"].remove()
                grad = grad.clone()
                grad.view(-1)[0] = float("nan")
                return grad

            hook["handle"] = ctx.engine.module.embed.weight.register_hook(poison)
    return loss, lm, out


def _step_of(writer) -> int:
    return int(writer.path.parent.name.split("_")[1].split(".")[0])  # .step_S.tmp/rankNNNNN.safetensors


def write(self, name, tensor):
    _write(self, name, tensor)
    if self._next == len(self._specs) // 2 and _kill_here("write", _step_of(self)):
        self._file.flush()
        _die()


def close(self):
    for f in FAULT.get("stall_in_save", []):
        if f["rank"] == RANK and f["step"] == _step_of(self):
            time.sleep(f["seconds"])
    return _close(self)


def publish(tmp, final):
    if _kill_here("publish", int(final.name.split("_")[1])):
        assert (tmp / "meta.json").is_file()
        _die()
    _publish(tmp, final)


TokenDataset.micro_batches, TokenDataset._starts = micro_batches, starts_of
loop._forward_loss = forward_loss
checkpoint_io.TensorFileWriter.write, checkpoint_io.TensorFileWriter.close = write, close
checkpoint_save._publish = publish

if __name__ == "__main__":
    sys.argv = [str(TRAIN), *sys.argv[1:]]
    runpy.run_path(str(TRAIN), run_name="__main__")
