"""Write one planned file front to back through a few aligned buffers, with ``O_DIRECT``.

The page-cache path (:func:`hf_merge.writer.write_file`) copies rank-file bytes into the output
file's pages with ``copy_file_range`` and reads them back for the sha256. On this kind of machine
(a virtual machine's shared disk) the kernel's cost of filling the page cache is both large and
unsteady: the same ``cat`` of 4.98 GB took 1.5 s of system time in one minute and 8.5 s in another.
This path does not put the output in the page cache at all:

- the output's bytes are gathered **in file order** into page-aligned buffers of
  :data:`CHUNK` bytes: rank-file bytes with ``preadv`` from their files (:mod:`hf_merge.filemap`),
  converted runs and small tensors by copying their memory;
- the sha256 is computed in file order and the output file is never read back: where the writer
  has a second core (:func:`hash_apart`) on a thread of its own (:class:`_Hasher`), which reads
  the rank-file bytes again into its own small buffer (clean page-cache pages, hashed in its
  core's cache) and hashes computed bytes from a copy; otherwise each piece is hashed on the
  filling thread as soon as it lands, while it is still in the CPU cache;
- a full buffer goes to :data:`WRITERS` writer threads that write it with ``O_DIRECT`` (the disk
  reads it from the buffer; no page-cache copy, no dirty pages, no writeback later), and the last
  partial buffer is written through the page cache (as is everything once a file system that
  opened the file with ``O_DIRECT`` refuses a write with ``EINVAL``).

It applies to a file whose every large tensor comes as row runs (``read_rows``); other files, a
file system that refuses ``O_DIRECT`` at open (tmpfs before Linux 6.6, some FUSE mounts) and
``HF_MERGE_DIRECT_IO=0`` use the page-cache path. Memory: ``BUFFERS`` x ``CHUNK`` (48 MB) plus one converted run,
plus at most :data:`HASH_BACKLOG` of computed bytes waiting for the hashing thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from . import filemap
from .plan import FilePlan
from .readers import record_crc

if TYPE_CHECKING:  # the sink itself runs without torch (hf_merge.head_start)
    import torch

    from .checkpoint import LazyCheckpoint

#: bytes per buffer (a multiple of every block size O_DIRECT asks for)
CHUNK = 8 << 20
#: buffers in flight: the one being filled and those queued or being written
BUFFERS = 6
#: threads writing full buffers (two keep a second write queued at the disk)
WRITERS = 2
#: bytes per read or copy into a buffer (and per read of the hashing thread)
PIECE = 256 << 10
ENV = "HF_MERGE_DIRECT_IO"
#: ``1``: hash on a thread of its own; ``0``: on the filling thread, as each piece lands; unset: see hash_apart
HASH_THREAD_ENV = "HF_MERGE_HASH_THREAD"
#: computed bytes (casts, fusions) handed to the hashing thread and not hashed yet, at most
HASH_BACKLOG = 64 << 20

ProgressFn = Callable[[int], None]
Runs = Iterator[tuple[int, "torch.Tensor"]]


def _switch(name: str) -> bool | None:
    """An on/off environment switch: None when unset or empty, False for 0/off/false/no, else True."""
    value = os.environ.get(name, "").strip().lower()
    return None if not value else value not in ("0", "off", "false", "no")


def enabled() -> bool:
    return _switch(ENV) is not False


def hash_apart(cores: int) -> bool:
    """Whether a writer that may use ``cores`` CPUs hashes on a thread of its own: where it has a
    second core (one writer on 2 cores: 3.27 vs 3.73 s for 3.1 GB); not where every core already
    has a writer (two on 2 cores: as fast, +1.1 s of CPU for the second read). ``HF_MERGE_HASH_THREAD``
    (``1`` / ``0``) decides instead when set."""
    forced = _switch(HASH_THREAD_ENV)
    return cores >= 2 if forced is None else forced


def plan_runs(ckpt: LazyCheckpoint, plan: FilePlan, whole_limit: int) -> dict[str, Runs | None] | None:
    """Every tensor's row runs (None for a small tensor read whole), or None when a tensor larger
    than ``whole_limit`` has no runs (then this file takes the page-cache path)."""
    runs: dict[str, Runs | None] = {}
    for spec in plan.specs:
        if spec.nbytes == 0:
            continue
        rows = ckpt.read_rows(spec.name, spec.dtype) if spec.shape else None
        if rows is None and spec.nbytes > whole_limit:
            return None
        runs[spec.name] = rows
    return runs


def open_direct(path: Path) -> int | None:
    """A write descriptor of a new file with ``O_DIRECT``, or None where it is refused."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise


class _Sink:
    """Bytes appended in file order; full buffers written by the writer threads."""

    def __init__(self, direct_fd: int, path: Path, sha256: bool, progress: ProgressFn | None, unreported: int = 0,
                 hash_thread: bool = False):
        self._direct = direct_fd
        self._direct_refused = False
        self._hash = hashlib.sha256() if sha256 else None
        self._hasher: _Hasher | None = None  # started last, once nothing else here can fail
        self._progress = progress
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._full: queue.SimpleQueue = queue.SimpleQueue()
        self._buffers = [mmap.mmap(-1, CHUNK) for _ in range(BUFFERS)]  # page-aligned
        self._buffered = os.open(path, os.O_WRONLY)  # the last partial buffer, and any O_DIRECT refuses
        for b in self._buffers[1:]:
            self._free.put(b)
        self._buf = self._buffers[0]
        self._view = memoryview(self._buf)
        self._crc = record_crc.Stream()  # the source records' CRC-32, over the bytes as they land
        self._fill = 0
        self._offset = 0  # file offset of the current buffer
        self._written = 0  # bytes the writers finished (under _lock)
        self._reported = unreported  # the first bytes (the header) are not part of the progress
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._write_loop, name=f"direct {path.name} {i}", daemon=True)
                         for i in range(WRITERS)]
        for t in self._threads:
            t.start()
        if self._hash is not None and hash_thread:
            self._hasher = _Hasher(self._hash)

    # -- filling -----------------------------------------------------------------------------
    def add_file(self, fd: int, offset: int, n: int) -> None:
        if self._hasher is not None:
            self._hasher.add_file(fd, offset, n)
        while n:
            k = min(n, PIECE, CHUNK - self._fill)
            filemap.pread_exact(fd, self._view[self._fill : self._fill + k], offset)
            self._crc.feed(fd, offset, self._view[self._fill : self._fill + k])
            self._landed(k)
            offset += k
            n -= k

    def add_memory(self, data: memoryview) -> None:
        if self._hasher is not None:
            self._hasher.add_memory(data)
        done = 0
        while done < len(data):
            k = min(len(data) - done, PIECE, CHUNK - self._fill)
            self._view[self._fill : self._fill + k] = data[done : done + k]
            self._landed(k)
            done += k

    def _landed(self, k: int) -> None:
        if self._hash is not None and self._hasher is None:
            self._hash.update(self._view[self._fill : self._fill + k])
        self._fill += k
        if self._fill == CHUNK:
            self._hand_over()

    def _hand_over(self) -> None:
        self._raise()
        self._full.put((self._buf, self._fill, self._offset))
        self._offset += self._fill
        self._view.release()
        while True:  # the next free buffer; a writer's error ends the wait
            try:
                self._buf = self._free.get(timeout=0.2)
                break
            except queue.Empty:
                self._raise()
        self._view = memoryview(self._buf)
        self._fill = 0
        self.report()

    # -- writing -----------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._full.get()
            if item is None:
                return
            buf, n, offset = item
            try:
                if self._error is None:
                    view = memoryview(buf)
                    try:
                        self._write(view[:n], offset)
                    finally:
                        view.release()
                    with self._lock:
                        self._written += n
            except BaseException as e:  # noqa: BLE001 - raised on the filling thread
                with self._lock:
                    if self._error is None:
                        self._error = e
            finally:
                self._free.put(buf)

    def _write(self, data: memoryview, offset: int) -> None:
        if not self._direct_refused:
            try:
                filemap.pwrite_exact(self._direct, data, offset)
                return
            except OSError as e:  # a file system that opens O_DIRECT files but refuses the writes
                if e.errno != errno.EINVAL:
                    raise
                self._direct_refused = True
        filemap.pwrite_exact(self._buffered, data, offset)

    def report(self) -> None:
        if self._progress is not None:
            with self._lock:
                now = self._written
            if now > self._reported:
                self._progress(now - self._reported)
                self._reported = now

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error
        if self._hasher is not None:
            self._hasher.check()

    def finish(self) -> str | None:
        """Write the last partial buffer (through the page cache: its length need not be aligned),
        wait for the writers, return the digest."""
        self._stop()
        self._raise()
        if self._fill:
            filemap.pwrite_exact(self._buffered, self._view[: self._fill], self._offset)
            with self._lock:
                self._written += self._fill
        self.report()
        if self._hasher is not None:
            self._hasher.finish()
        return self._hash.hexdigest() if self._hash is not None else None

    def cancel(self) -> None:
        with self._lock:
            if self._error is None:
                self._error = RuntimeError("cancelled")
        if self._hasher is not None:
            self._hasher.cancel()
        self._stop()

    def _stop(self) -> None:
        for _ in self._threads:
            self._full.put(None)
        for t in self._threads:
            t.join()
        self._threads = []

    def close(self) -> None:
        os.close(self._buffered)
        with contextlib.suppress(BufferError):
            self._view.release()
        for b in self._buffers:
            with contextlib.suppress(BufferError):  # a view still held by an error's traceback: freed with it
                b.close()


class _Hasher:
    """The file's sha256 on a thread of its own, fed the file's pieces in order.

    Rank-file bytes are read again, with ``preadv`` into this thread's own small buffer, and hashed
    there while they are in this core's cache; computed bytes (the header, casts, fusions) are
    copied when queued (at most :data:`HASH_BACKLOG` of them wait). The filling thread then only
    copies into the buffers, and the sha256 (the longest serial chain: ~2 GB/s on one core) runs
    beside it. Hashing the filled buffers instead (bytes another core just wrote: +0.9 s of CPU
    for 3.1 GB) or the files' mapped pages (1.4 GB/s) was slower than hashing on the filling thread.
    """

    def __init__(self, digest: "hashlib._Hash"):
        self._digest = digest
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._backlog = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="sha256", daemon=True)
        self._thread.start()

    def add_file(self, fd: int, offset: int, n: int) -> None:
        self.check()
        self._items.put((fd, offset, n))

    def add_memory(self, data: memoryview) -> None:
        n = data.nbytes
        with self._cond:
            while self._backlog and self._backlog + n > HASH_BACKLOG and self._error is None:
                self._cond.wait(0.2)
            self._backlog += n
        self.check()
        self._items.put(bytes(data))  # a copy: the caller may reuse its memory once this returns

    def _loop(self) -> None:
        buf = bytearray(PIECE)
        view = memoryview(buf)
        while True:
            item = self._items.get()
            if item is None:
                return
            n = 0
            try:
                if isinstance(item, bytes):
                    n = len(item)
                    if self._error is None and not self._stopped:
                        self._digest.update(item)
                elif self._error is None and not self._stopped:
                    fd, offset, left = item
                    while left:
                        k = min(left, PIECE)
                        filemap.pread_exact(fd, view[:k], offset)
                        self._digest.update(view[:k])
                        offset += k
                        left -= k
            except BaseException as e:  # noqa: BLE001 - raised on the filling thread
                self._error = e
            finally:
                del item
                if n:
                    with self._cond:
                        self._backlog -= n
                        self._cond.notify_all()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        self._items.put(None)
        self._thread.join()
        self.check()

    def cancel(self) -> None:
        self._stopped = True
        self._items.put(None)
        self._thread.join()


def write_file(
    ckpt: LazyCheckpoint,
    plan: FilePlan,
    path: Path,
    direct_fd: int,
    runs: dict[str, Runs | None],
    *,
    sha256: bool,
    progress: ProgressFn | None,
    cores: int = 1,
) -> str | None:
    """Write ``plan`` into ``path`` (opened as ``direct_fd`` by :func:`open_direct`; closed here)
    from ``runs`` (:func:`plan_runs`); return the sha256 when asked. ``cores``: the CPUs this
    writer may use (:func:`hash_apart`)."""
    try:
        sink = _Sink(direct_fd, path, sha256, progress, unreported=plan.data_start, hash_thread=hash_apart(cores))
    except BaseException:
        os.close(direct_fd)
        raise

    def fill() -> None:
        with record_crc.deferred():  # records the sink saw whole are checked as they passed, the rest here
            fill_all()

    def fill_all() -> None:
        sink.add_memory(memoryview(plan.header))
        for spec, start in plan.placed():
            if spec.nbytes == 0:
                continue
            rows = runs[spec.name]
            if rows is None:
                _add_tensor(sink, ckpt.read(spec.name, dtype=spec.dtype))
                continue
            row_bytes = spec.nbytes // spec.shape[0]
            at = start
            for first, run in rows:
                if start + first * row_bytes != at:
                    raise RuntimeError(f"{plan.name}: {spec.name}: row runs out of order at row {first}")
                at += _add_tensor(sink, run)
            if at != start + spec.nbytes:
                raise RuntimeError(f"{plan.name}: {spec.name}: row runs cover {at - start} of {spec.nbytes} bytes")
            sink.report()

    try:
        return fill_and_finish(sink, fill)
    finally:
        os.close(direct_fd)  # after the writer threads stopped (finish or cancel)


def fill_and_finish(sink: _Sink, fill: Callable[[], None]) -> str | None:
    """Run ``fill`` (which appends the file's bytes to ``sink``), then finish the sink and return
    its digest; on any error stop its threads first. The sink is closed either way."""
    try:
        fill()
        return sink.finish()
    except BaseException:
        sink.cancel()
        raise
    finally:
        sink.close()


def _add_tensor(sink: _Sink, piece: filemap.Piece) -> int:
    """Append ``piece``'s bytes: from its file when it is rank-file bytes, else from memory."""
    import torch

    run = filemap.run_of(piece)
    if run is not None:
        sink.add_file(run.fd, run.offset, run.nbytes)
        return run.nbytes
    sink.add_memory(memoryview(piece.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return piece.numel() * piece.element_size()


def join_range(ranges: list[list[int]], source: tuple[int, int], offset: int, n: int) -> None:
    """Append ``n`` bytes of the file ``source`` (``(st_dev, st_ino)``) from ``offset`` to
    ``ranges`` (``[st_dev, st_ino, offset, n]`` items), joined to the last range when they follow it."""
    last = ranges[-1] if ranges else None
    if last is not None and (last[0], last[1]) == source and last[2] + last[3] == offset:
        last[3] += n
    else:
        ranges.append([source[0], source[1], offset, n])


def byte_recipe(ckpt: LazyCheckpoint, plan: FilePlan, whole_limit: int) -> list[list[int]] | None:
    """What :func:`write_file` appends after ``plan``'s header, as rank-file byte ranges
    (:func:`join_range`), or None when some bytes would not be copied from a file (computed,
    converted, or a tensor read whole). Reads no tensor data."""
    runs = plan_runs(ckpt, plan, whole_limit)
    if runs is None:
        return None
    ranges: list[list[int]] = []
    sources: dict[int, tuple[int, int]] = {}
    for spec, _start in plan.placed():
        if spec.nbytes == 0:
            continue
        rows = runs[spec.name]
        if rows is None:
            return None
        for _first, run in rows:
            located = filemap.run_of(run)
            if located is None:
                return None
            if located.fd not in sources:
                st = os.fstat(located.fd)
                sources[located.fd] = (st.st_dev, st.st_ino)
            join_range(ranges, sources[located.fd], located.offset, located.nbytes)
    return ranges
