"""Saving checkpoints: `Checkpointer` (every rank gathers what it holds a replica of, writes its share through a
bounded buffer, rank 0 publishes), `save_checkpoint` (one synchronous save) and `write_whole_checkpoint` (one
process holding every tensor). The format and the save's protocol: this package's docstring (__init__.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from moe_dist.config import JobConfig, config_to_dict
from moe_dist.parallel.comm import broadcast_bytes, gather_bytes, monitored_barrier
from moe_dist.parallel.mesh import Mesh, new_gloo_group
from moe_dist.train.checkpoint.format import FORMAT_VERSION
from moe_dist.train.checkpoint.io import FileWriterThread, TensorFileWriter, fsync
from moe_dist.train.checkpoint.plan import (
    STATE_KEYS,
    pipeline_rank_of,
    plan_pipeline_writers,
    plan_writers,
    stored_name,
    tensors_in_order,
)
from moe_dist.train.checkpoint.snapshot import HostSnapshot
from moe_dist.train.checkpoint.state import (
    Stored,
    adam_step,
    ensure_optimizer_state,
    full_state,
    inner_optimizer,
    link_optimizer_state,
    pipeline_whole,
    stored_buffers,
    stored_params,
)
from moe_dist.train.disk import is_no_space, no_space
from moe_dist.train.guard import TrainingError, operation


def _write_manifest(tmp: Path, meta: dict, cfg: JobConfig) -> None:
    """config.json, then meta.json: the manifest is written last, after every file it lists."""
    for name, text in (
        ("config.json", json.dumps(config_to_dict(cfg), indent=2)),
        ("meta.json", json.dumps(meta, indent=2)),
    ):
        (tmp / name).write_text(text + "\n")
        fsync(tmp / name)


def _publish(tmp: Path, final: Path) -> None:
    """Make the finished checkpoint visible under its final name in one rename."""
    if final.exists():  # left by an earlier trajectory of this run (resumed from an older checkpoint)
        doomed = final.with_name(f".{final.name}.deleting")  # unpublished first: never a half-deleted step_N/
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(final, doomed)
        shutil.rmtree(doomed)
    os.replace(tmp, final)
    fsync(final.parent)


class CheckpointSaveError(TrainingError):
    """A save failed or a rank did not finish it within train.save_timeout_s; the message names both."""


class Checkpointer:
    """Saves the checkpoints of one run (see the module docstring). Construct on every rank at the same point
    (it creates the checkpoint process group); `save` and `wait` are collectives.

    Every collective of finishing a save (writers' barrier, digests, the publish verdict) runs on a gloo group of
    its own whose timeout is train.save_timeout_s, so it is independent of parallel.timeout_s and may run in a
    background thread (asynchronous saves) beside the training's collectives: saves are serialized (the next one
    waits for the previous), so that group carries the same collectives in the same order on every rank."""

    def __init__(self, cfg: JobConfig, mesh: Mesh, ckpt_root: Path, on_published=None):
        t = cfg.train
        self.cfg, self.mesh, self.root = cfg, mesh, ckpt_root
        self.timeout_s, self.buffer = t.save_timeout_s, t.save_buffer_mb << 20
        self.asynchronous = t.async_save
        self.on_published = on_published  # rank 0, called with (path, step) after each publish (pruning)
        self.group = new_gloo_group(t.save_timeout_s)
        self._plan: dict[str, int] | None = None
        # asynchronous saves: pageable host copies reused from save to save, through a bounded staging buffer
        self.snapshot = HostSnapshot(int(t.save_staging_mb * 2**20)) if t.async_save else None
        self._background: threading.Thread | None = None
        self._error: BaseException | None = None
        self.bytes_written = 0  # by this rank in its latest save (tensor file size)

    @contextmanager
    def _phase(self, step: int, what: str, training_groups: bool = False):
        """A failed collective inside names the save, the phase and, past a monitored barrier, the late ranks.
        `training_groups`: the phase runs collectives of the training's groups, which get the save's limit while
        it runs (parallel.timeout_s again after it; the checkpoint group has its own)."""
        what = f"checkpoint save of step {step}: {what}"
        limit = {"restore_s": self.cfg.parallel.timeout_s, "keep": (self.group,)} if training_groups else {}
        try:
            with operation(what, self.timeout_s, "train.save_timeout_s", **limit):
                yield
        except RuntimeError as e:  # CollectiveError, or gloo's own monitored-barrier error (no "timed out" in it)
            late = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(e))
            if late is None:
                raise
            ranks = late.group(1).strip().rstrip(",")
            raise CheckpointSaveError(
                f"{what}: rank{'s' if ',' in ranks else ''} {ranks} did not finish within "
                f"train.save_timeout_s={self.timeout_s:g}"
            ) from e

    def wait(self) -> None:
        """Collective: finish the previous asynchronous save (written and published) or raise its error."""
        if self._background is not None:
            self._background.join()
            self._background = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def save(self, engine, model: nn.Module, scheduler, step: int, extra_meta: dict | None = None) -> Path:
        """Collective: checkpoint `step` into ckpt_root/step_N. Synchronous: published when it returns.
        Asynchronous: returns once this rank's tensors are snapshotted; written and published in the background."""
        self.wait()
        mesh, final, tmp = self.mesh, self.root / f"step_{step}", self.root / f".step_{step}.tmp"
        if mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        with self._phase(step, "creating the directory"):
            monitored_barrier(self.group, self.timeout_s)
        if not any(inner_optimizer(engine).state.values()):  # no update applied yet (every step skipped so far)
            ensure_optimizer_state(engine, 0)  # what Adam's lazy init would create: zero moments, step 0
        link_optimizer_state(engine)
        stored = stored_params(model, mesh)
        entries = [st.entry(mesh) for st in stored]
        # Under pipeline parallelism a rank holds its stages' tensors; every rank plans the whole model's, stage by
        # stage over each stage's ranks, and the first rank of each stage writes its buffers.
        whole = pipeline_whole(model)
        stage_size = mesh.world_size // mesh.pp
        if whole is not None:
            entries = whole[0]
        if self._plan is None:
            if whole is None:
                self._plan = plan_writers(entries, mesh.replicas, mesh.ep, mesh.tp, mesh.etp)
            else:
                self._plan = plan_pipeline_writers(
                    entries, whole[2], mesh.pp, mesh.replicas, mesh.ep, mesh.tp, mesh.etp
                )
        plan, rank = self._plan, mesh.rank
        specs = [(name, e.shape) for name, e, _ in tensors_in_order(entries) if plan[name] == rank]
        buffers = stored_buffers(model)
        writes_buffers = rank % stage_size == 0
        if writes_buffers:  # after the parameters, in the order they are queued below
            specs += [(name, tuple(b.shape)) for name, b in buffers.items()]
        path = tmp / f"rank{rank:05d}.safetensors"
        writer = TensorFileWriter(path, specs, {"step": str(step)}) if specs else None
        thread = FileWriterThread(writer, None if self.asynchronous else self.buffer)
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            "adam_step": adam_step(engine),
            "lr": scheduler.get_last_lr()[0],
            "layout": {"dp": mesh.dp, "cp": mesh.cp, "ep": mesh.ep, "tp": mesh.tp, "etp": mesh.etp, "pp": mesh.pp},
            **(extra_meta or {}),
        }
        if rank == 0:  # the index: a rank resuming opens only the files it reads (verify_checkpoint)
            if whole is None:
                owners = {n: (0, list(b.shape)) for n, b in buffers.items()}
            else:
                owners = {
                    n: (pipeline_rank_of(n, whole[2], mesh.pp) * stage_size, list(shape))
                    for n, shape in whole[1].items()
                }
            files = {r: f"rank{r:05d}.safetensors" for r in {*plan.values(), 0, *(o for o, _ in owners.values())}}
            meta["tensors"] = {n: [files[plan[n]], list(e.shape)] for n, e, _ in tensors_in_order(entries)}
            meta["tensors"].update({n: [files[o], shape] for n, (o, shape) in owners.items()})
        # The gathers are the training groups' collectives, under the save's limit while they run (a peer may be
        # waiting for its disk through the bounded buffer).
        try:
            with self._phase(step, "gathering tensors (ZeRO and tensor-parallel collectives)", training_groups=True):
                self._gather(engine, stored, plan, thread, mesh)
                if writes_buffers:  # copies: the routers update their buffers in place every step
                    for name, b in buffers.items():
                        thread.reserve(b.numel() * 4)
                        thread.put(b.numel() * 4, [(name, b.detach().to("cpu", torch.float32, copy=True))])
        except BaseException:
            thread.finish_quietly()
            if mesh.rank == 0:  # the job stops here: leave no partial save holding space
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not self.asynchronous:
            self._finish(thread, path, tmp, final, meta)
            return final

        def finish_in_background():
            try:
                self._finish(thread, path, tmp, final, meta)
            except BaseException as e:  # raised in the training thread by the next save or wait()
                self._error = e

        self._background = threading.Thread(target=finish_in_background, name="checkpoint-publish", daemon=True)
        self._background.start()
        return final

    def _gather(self, engine, stored: list[Stored], plan: dict, thread: FileWriterThread, mesh: Mesh) -> None:
        """Every rank gathers every tensor it holds a replica of; each queues the ones the plan gives it."""
        for st in stored:
            numel = math.prod(st.full_shape(mesh)) * len(st.names)
            for key in STATE_KEYS:
                thread.reserve(numel * 4)  # before gathering: the buffer bounds what is held
                value = st.whole(full_state(engine, st.param, key), mesh).detach().float()
                parts = value.unbind(0) if st.stacked else [value]
                names = [stored_name(key, n) for n in st.names]
                pieces = [(n, v) for n, v in zip(names, parts) if plan[n] == mesh.rank]
                if not pieces:
                    del value, parts
                    thread.release(numel * 4)
                    continue
                if self.asynchronous:  # the snapshot, complete on return: training may change the source after
                    pieces = [(n, self.snapshot.copy(n, v)) for n, v in pieces]
                thread.put(numel * 4, pieces)
                del value, parts, pieces  # the writer's references are the only ones: the buffer accounts them

    def _finish(self, thread: FileWriterThread, path: Path, tmp: Path, final: Path, meta: dict) -> None:
        """Collective on the checkpoint group: wait for every writer, gather the digests, publish on rank 0."""
        step, error, digest = meta["step"], "", None
        try:
            digest = thread.finish()
        except Exception as e:  # reported to rank 0 with the digests, so every rank takes the same branch
            error = f"rank {self.mesh.rank}: {self._write_error(path, e)}"
        self.bytes_written = digest[1] if digest else 0
        with self._phase(step, "waiting for every rank to write its tensor file"):
            monitored_barrier(self.group, self.timeout_s)
        report = {"error": error, "file": path.name, "sha256": digest[0]} if digest else {"error": error}
        with self._phase(step, "gathering the files' sha256"):
            reports = [json.loads(r) for r in gather_bytes(json.dumps(report).encode(), self.group)]
        verdict = ""
        if self.mesh.rank == 0:
            verdict = next((r["error"] for r in reports if r["error"]), "")
            if not verdict:
                try:
                    files = {r["file"]: r["sha256"] for r in reports if "file" in r}
                    _write_manifest(tmp, {**meta, "files": dict(sorted(files.items()))}, self.cfg)
                    _publish(tmp, final)
                    if self.on_published is not None:
                        self.on_published(final, step)
                except OSError as e:
                    verdict = f"rank 0: publishing {final}: {self._write_error(final, e)}"
        with self._phase(step, "publishing"):
            verdict = broadcast_bytes(verdict.encode(), 0, self.group).decode()
        if verdict:
            if self.mesh.rank == 0:  # every writer has finished (the barrier above): the partial save holds space
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSaveError(
                f"checkpoint save of step {step} failed (nothing published; earlier checkpoints intact): {verdict}"
            )

    def _write_error(self, path: Path, e: BaseException) -> str:
        """One line for a failed write; a full disk says what to free (train/disk.py)."""
        if is_no_space(e):
            return str(no_space(path, self.root.parent))
        return f"writing {path}: {' '.join(str(e).split())}"


def save_checkpoint(
    engine,
    model: nn.Module,
    scheduler,
    ckpt_root: Path,
    step: int,
    cfg: JobConfig,
    mesh: Mesh,
    extra_meta: dict | None = None,
) -> Path:
    """Collective: one synchronous save (a Checkpointer used once). `extra_meta` goes into meta.json."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, async_save=False))
    return Checkpointer(cfg, mesh, ckpt_root).save(engine, model, scheduler, step, extra_meta)


def write_whole_checkpoint(
    ckpt_root: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict, cfg: JobConfig
) -> Path:
    """One process holding every tensor (imported weights): the files, manifest and atomic publish of
    `save_checkpoint`, in one tensor file. `meta` holds the fields besides "format" and "files"."""
    final, tmp = ckpt_root / f"step_{step}", ckpt_root / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = TensorFileWriter(tmp / "rank00000.safetensors", [(k, tuple(v.shape)) for k, v in tensors.items()])
    for name, value in tensors.items():
        writer.write(name, value.float())
    files = {"rank00000.safetensors": writer.close()[0]}
    _write_manifest(tmp, {"format": FORMAT_VERSION, "step": step, **meta, "files": files}, cfg)
    _publish(tmp, final)
    return final
