"""The host snapshot of an asynchronous save: this rank's share copied into pageable host memory, reused from save
to save, through one staging buffer of bounded size (`train.save_staging_mb`), pinned when the source is on a GPU.

Pinned memory is what lets a device-to-host copy run without the host waiting on it, but the page-locked memory
of a whole share (tens of GB per rank at Mixtral size) would be taken from the host for the whole run; the staging
buffer bounds it. The buffer is two halves used in turn: while one half's copy from the device is in flight, the
other half's landed bytes are copied on the host into the snapshot.

Invariant: a half is the target of a new device-to-host copy only after its previous copy's event has completed
and its bytes have been copied out to the snapshot (`_land`, on this thread), so the pinned memory is never
reused while a copy into it may still run; `copy` returns once every byte of the tensor is in the snapshot, so the
training step that follows may change the source. On the CPU the same code runs with a pageable staging buffer
and no events (the copies are synchronous).
"""

from __future__ import annotations

import torch

ALIGN = 16  # bytes: the staging halves can be viewed as any dtype up to 16-byte elements


class HostSnapshot:
    """Pageable host copies of tensors, by name, filled through a staging buffer of at most `staging_bytes`."""

    def __init__(self, staging_bytes: int):
        self.staging_bytes = staging_bytes // (2 * ALIGN) * (2 * ALIGN)
        if self.staging_bytes == 0:
            raise ValueError(f"checkpoint staging buffer: {staging_bytes} bytes is below {2 * ALIGN}")
        self._buffers: dict[str, torch.Tensor] = {}
        self._staging: torch.Tensor | None = None  # uint8, staging_bytes; allocated at the first copy
        self.staged_copies = 0  # device-to-staging copies made so far (one per half-buffer of a tensor)

    @property
    def staging(self) -> torch.Tensor | None:
        return self._staging

    def _stage_buffer(self, pinned: bool) -> torch.Tensor:
        if self._staging is None or self._staging.is_pinned() != pinned:
            self._staging = None  # the old one is freed before the new one exists: one buffer at a time
            self._staging = torch.empty(self.staging_bytes, dtype=torch.uint8, pin_memory=pinned)
        return self._staging

    def copy(self, name: str, v: torch.Tensor) -> torch.Tensor:
        """The snapshot of `v` under `name` (its pageable host tensor, overwritten), complete when this returns."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
            buf = self._buffers[name] = torch.empty(v.shape, dtype=v.dtype)
        if v.numel() == 0:
            return buf
        on_gpu = v.is_cuda
        src, dst = v.detach().reshape(-1), buf.view(-1)
        step = self.staging_bytes // 2 // v.element_size()
        halves = self._stage_buffer(on_gpu).view(v.dtype).split(step)[:2]
        pending: list[tuple | None] = [None, None]  # per half: (event or None, snapshot slice it lands in)
        for i, lo in enumerate(range(0, src.numel(), step)):
            k = i % 2
            self._land(pending[k], halves[k])
            n = min(step, src.numel() - lo)
            halves[k][:n].copy_(src[lo : lo + n], non_blocking=on_gpu)
            event = None
            if on_gpu:
                event = torch.cuda.Event()
                event.record()
            pending[k] = (event, dst[lo : lo + n])
            self.staged_copies += 1
        first = (i + 1) % 2  # the older of the two in flight lands first
        for k in (first, 1 - first):
            self._land(pending[k], halves[k])
        return buf

    @staticmethod
    def _land(pending: tuple | None, half: torch.Tensor) -> None:
        """Wait for a half's copy from the device, then copy its bytes into the snapshot (the half is free after)."""
        if pending is None:
            return
        event, dst = pending
        if event is not None:
            event.synchronize()
        dst.copy_(half[: dst.numel()])
