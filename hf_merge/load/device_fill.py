"""Filling tensors on an accelerator from a lazy checkpoint: the bytes go through pinned buffers.

``from_sharded_pretrained(device_map="cuda")`` used to read each tensor into pageable host memory
and copy it over with one blocking ``copy_``: the disk, the host copy and the transfer ran one after
the other. A :class:`DeviceStager` streams a tensor as runs of rows (``LazyCheckpoint.read_rows``,
in the checkpoint's own dtype) through a small ring of page-locked buffers:

- a run's bytes are read straight from the rank file into a pinned buffer (``preadv`` through
  its descriptor where the run is a :class:`~hf_merge.readers.file_runs.FileRun`, else one host copy);
- the host-to-device copy of that buffer is queued on the stager's own stream (``non_blocking``),
  and the next run is read while it is in flight; a buffer is reused only once its copy is done
  (an event per buffer);
- where a load checks the zip records' CRC-32, a file run's bytes are run through it in the pinned
  buffer they were read into (:meth:`hf_merge.readers.record_crc.Placed.place`): the check reads
  nothing more;
- a cast (an fp32 checkpoint loaded as bf16) runs on the device, after the transfer: the values
  are the same as a host-side ``Tensor.to`` (round to nearest even on both), the transfer carries
  the source bytes, and the host does no arithmetic.

One stager per loading thread (its buffers and stream are its own); memory pinned is
``slots * slot_bytes`` per thread. Devices other than CUDA, and tensors without row runs (0-d
tensors), use a plain read and ``copy_``.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING

import torch

from ..readers.file_runs import OnPlaced, Piece, read_into, run_of, values

if TYPE_CHECKING:
    from ..checkpoint import LazyCheckpoint

SLOT_BYTES = 32 << 20
SLOTS = 3


class DeviceStager:
    """Host-to-device copies of row runs through ``slots`` pinned buffers of ``slot_bytes``."""

    def __init__(self, device: torch.device, *, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS):
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self._buffers = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
            self._done = [torch.cuda.Event() for _ in range(slots)]
        else:  # the same walk with plain buffers and synchronous copies (what tests on a CPU run)
            self.stream = None
            self._buffers = [torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(slots)]
            self._done = [None] * slots
        self._next = 0

    def fill(self, view: "LazyCheckpoint", name: str, out: torch.Tensor, placed: "OnPlaced | None" = None) -> None:
        """Read tensor ``name`` of ``view`` into ``out`` (on this stager's device, any dtype);
        ``placed(fd, offset, bytes)`` gets each file run as it was read into a buffer."""
        src_dtype = view.specs()[name].dtype
        runs = view.read_rows(name, src_dtype, self.slot_bytes) if out.dim() else None
        if runs is None:
            host = view.read(name)
            self._finish(lambda: out.copy_(host.to(self.device, non_blocking=False)))
            return
        for first, piece in runs:
            rows, run = values(piece), run_of(piece)
            row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
            if row_bytes > self.slot_bytes:  # one row larger than a buffer: copy it as it is
                self._finish(lambda r=rows, f=first: out[f : f + len(r)].copy_(r.to(self.device)))
                continue
            step = self.slot_bytes // max(1, row_bytes)
            for start in range(0, len(rows), step):
                part = rows[start : start + step]
                dst = out[first + start : first + start + min(step, len(rows) - start)]
                self._send(run.piece(part) if run else part, dst, placed)
        self._finish(lambda: None)

    def _send(self, piece: Piece, dst: torch.Tensor, placed: "OnPlaced | None" = None) -> None:
        rows = values(piece)
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        done = self._done[slot]
        if done is not None:
            done.synchronize()  # the buffer's previous transfer has finished
        host = self._buffers[slot][: rows.numel() * rows.element_size()].view(rows.dtype).view(rows.shape)
        read_into(piece, host)
        run = run_of(piece)
        if placed is not None and run is not None:
            placed(run.fd, run.offset, memoryview(host.reshape(-1).view(torch.uint8).numpy()))
        if not self.cuda:
            dst.copy_(host)
            return
        with torch.cuda.stream(self.stream):
            if dst.dtype == host.dtype:
                dst.copy_(host, non_blocking=True)
            else:  # transfer the source bytes, cast on the device
                moved = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                moved.copy_(host, non_blocking=True)
                dst.copy_(moved)
            done.record(self.stream)

    def _finish(self, last) -> None:
        """Run ``last`` on the stager's stream, then wait until every queued copy is done."""
        if not self.cuda:
            last()
            return
        with torch.cuda.stream(self.stream):
            last()
        self.stream.synchronize()


class StagerPool:
    """One :class:`DeviceStager` per (thread, device), made on first use."""

    def __init__(self, **kwargs):
        self._kwargs = kwargs
        self._local = threading.local()

    def fill(self, view: "LazyCheckpoint", name: str, out: torch.Tensor, placed: "OnPlaced | None" = None) -> None:
        stagers = getattr(self._local, "stagers", None)
        if stagers is None:
            stagers = self._local.stagers = {}
        key = str(out.device)
        if key not in stagers:
            stagers[key] = DeviceStager(out.device, **self._kwargs)
        stagers[key].fill(view, name, out, placed)


def stages(device) -> bool:
    """Whether tensors for ``device`` go through a stager (accelerators with pinned host memory)."""
    return torch.device(device).type == "cuda"
