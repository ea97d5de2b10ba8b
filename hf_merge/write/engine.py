"""The file-writing engine: one output file written front to back through a few aligned buffers.

- The output's bytes are gathered **in file order** into page-aligned buffers of :data:`CHUNK`
  bytes: rank-file bytes with ``preadv`` from their files (:func:`file_bytes` says where they
  are), converted runs and small tensors by copying their memory.
- A full buffer goes to :data:`WRITERS` writer threads. Where the output was opened with
  ``O_DIRECT`` (:func:`open_output`) they write it straight to the disk: no page-cache copy, no
  dirty pages, no writeback later; the last partial buffer, and every buffer once the file system
  refuses an ``O_DIRECT`` write (``EINVAL``) or refused ``O_DIRECT`` at open, go through the page cache.
- A tensor too large to read into memory that comes without row runs (:meth:`Sink.add_region`) is
  read into a mapping of its place in the output file, through the page cache; the buffers then
  go on from the block boundary below its end.
- The checksum (:class:`_Checksum`, :mod:`~hf_merge.write.digest`) is computed in file order,
  never by reading the output back except for such a mapped region.

Memory: ``BUFFERS`` x ``CHUNK`` (48 MB) plus one converted run, plus at most :data:`HASH_BACKLOG`
of computed bytes waiting for the hashing thread. Measurements: docs/write-path.md. This module
imports no torch (the head start's child uses the sink).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..readers import file_runs
from .plan import FilePlan
from ..readers import record_crc
from . import digest as digests

if TYPE_CHECKING:
    from ..checkpoint import LazyCheckpoint

#: bytes per buffer (a multiple of every block size O_DIRECT asks for)
CHUNK = 8 << 20
#: buffers in flight: the one being filled and those queued or being written
BUFFERS = 6
#: threads writing full buffers (two keep a second write queued at the disk)
WRITERS = 2
#: bytes per read or copy into a buffer (and per read of the hashing thread)
PIECE = 256 << 10
#: computed bytes (casts, fusions) handed to the hashing thread and not hashed yet, at most
HASH_BACKLOG = 64 << 20
#: bytes per buffer those computed bytes are copied into for the hashing thread (reused: a fresh
#: 32 MB ``bytes`` per run cost 5x the copy itself in page faults)
HASH_PIECE = 4 << 20
#: file offsets of O_DIRECT writes are multiples of this (the largest logical block size in use)
BLOCK = 4096
#: how much lower than the sha256 thread the head start's filling thread runs (docs/write-path.md)
HASHING_NICE = 5

ProgressFn = Callable[[int], None]


def file_bytes(piece: "file_runs.Piece") -> "file_runs.FileRun | None":
    """Where a piece of a tensor lives in a file (the reader said so: a
    :class:`~hf_merge.readers.file_runs.FileRun`), or None (then its bytes are copied from memory). The
    engine's only question about where bytes live."""
    return file_runs.run_of(piece)


def lower_this_thread(nice: int) -> None:
    """Run the calling thread ``nice`` levels lower (Linux: a thread has its own nice value)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)


def hash_apart(cores: int, checksum: str | None) -> bool:
    """Whether a writer that may use ``cores`` CPUs takes the file's ``checksum`` on a thread of its
    own: a sha256 where it has a second core (one writer on 2 cores: 3.27 vs 3.73 s for 3.1 GB);
    not where every core already has a writer (two on 2 cores: as fast, +1.1 s of CPU for the
    second read); a CRC-32 never (it costs less than that second read)."""
    return checksum == "sha256" and cores >= 2


def open_output(path: Path) -> int:
    """A write descriptor of a new file: with ``O_DIRECT`` where the file system takes it, else
    plain (tmpfs before Linux 6.6, some FUSE mounts refuse it with ``EINVAL``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if getattr(os, "O_DIRECT", 0):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
    return os.open(path, flags, 0o644)


def _hash_file(digest, fd: int, offset: int, n: int, view: memoryview) -> None:
    """Hash ``n`` bytes of ``fd`` from ``offset``, read into ``view`` a piece at a time."""
    while n:
        k = min(n, len(view))
        file_runs.pread_exact(fd, view[:k], offset)
        digest.update(view[:k])
        offset += k
        n -= k


class _Checksum:
    """A file's checksum of ``kind``, fed in file order: on the filling thread, each piece as it lands
    in the buffer (still in that core's cache), or, ``apart`` (:func:`hash_apart`), on a thread of its
    own that reads the rank-file bytes again into its own small buffer and hashes computed bytes from
    a copy. Hashing the filled buffers on
    another core (+0.9 s CPU per 3.1 GB) or the files' mapped pages (1.4 GB/s) was slower than
    either (docs/write-path.md)."""

    def __init__(self, kind: str, apart: bool):
        self.digest = digests.new(kind)
        self._piece = memoryview(bytearray(PIECE))
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._copies: queue.SimpleQueue = queue.SimpleQueue()  # buffers for computed bytes, hashed and free again
        self._copy_size = max(1, min(HASH_PIECE, HASH_BACKLOG))
        self._copies_left = max(1, HASH_BACKLOG // self._copy_size)  # buffers not made yet
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=kind, daemon=True) if apart else None
        if self._thread is not None:
            self._thread.start()

    def ahead(self, fd: int, offset: int, n: int) -> None:
        """Rank-file bytes about to be copied into the buffer (hashed by the thread, from the file)."""
        if self._thread is not None:
            self.check()
            self._items.put((fd, offset, n))

    def ahead_memory(self, data: memoryview) -> None:
        """Computed bytes about to be copied (the thread hashes a copy, made in buffers it hands
        back once hashed: at most :data:`HASH_BACKLOG` bytes; waits for a free one)."""
        if self._thread is None:
            return
        for start in range(0, data.nbytes, self._copy_size):
            part = data[start : start + self._copy_size]
            copy = self._free_copy()
            copy[: part.nbytes] = part
            self._items.put((copy, part.nbytes))

    def _free_copy(self) -> memoryview:
        while True:
            self.check()
            try:
                return self._copies.get_nowait()
            except queue.Empty:
                pass
            if self._copies_left:
                self._copies_left -= 1
                return memoryview(bytearray(self._copy_size))
            with contextlib.suppress(queue.Empty):  # a hashing error ends the wait (check, above)
                return self._copies.get(timeout=0.2)

    def landed(self, view: memoryview) -> None:
        """Bytes just copied into the buffer (hashed here unless a thread hashes them)."""
        if self._thread is None:
            self.digest.update(view)

    def from_file(self, fd: int, offset: int, n: int) -> None:
        """Bytes hashed from a file in either case (a region mapped and filled in place)."""
        if self._thread is None:
            _hash_file(self.digest, fd, offset, n, self._piece)
        else:
            self.ahead(fd, offset, n)

    def _loop(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            try:
                if self._error is not None or self._stopped:
                    pass
                elif len(item) == 2:  # computed bytes, copied into one of the buffers
                    self.digest.update(item[0][: item[1]])
                else:
                    _hash_file(self.digest, *item, self._piece)
            except BaseException as e:  # noqa: BLE001 - raised on the filling thread
                self._error = e
            finally:
                if len(item) == 2:
                    self._copies.put(item[0])
                del item

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> str:
        if self._thread is not None:
            self._items.put(None)
            self._thread.join()
        self.check()
        return self.digest.hexdigest()

    def cancel(self) -> None:
        self._stopped = True
        if self._thread is not None:
            self._items.put(None)
            self._thread.join()


class Sink:
    """Bytes appended in file order; full buffers written by the writer threads. ``fd``: the file
    as :func:`open_output` opened it (``O_DIRECT`` or not); ``path`` opens it again for the page
    cache. ``checksum``: the digest's kind (:mod:`~hf_merge.write.digest`), or None for none.
    ``unreported``: leading bytes not counted as progress (the header)."""

    def __init__(self, fd: int, path: Path, checksum: str | None, progress: ProgressFn | None, unreported: int = 0,
                 hash_thread: bool = False):
        self._fd = fd
        self._path = path
        self._direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
        self._progress = progress
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._full: queue.SimpleQueue = queue.SimpleQueue()
        self._buffers = [mmap.mmap(-1, CHUNK) for _ in range(BUFFERS)]  # page-aligned
        self._buffered = os.open(path, os.O_WRONLY)  # the last partial buffer, and any O_DIRECT refuses
        self._mapped: int | None = None  # opened read-write for the first mapped region
        for b in self._buffers[1:]:
            self._free.put(b)
        self._buf = self._buffers[0]
        self._view = memoryview(self._buf)
        self._crc = record_crc.Stream()  # the source records' CRC-32, over the bytes as they land
        self._fill = 0
        self._old = 0  # bytes at the start of the buffer already written and counted (after a region)
        self._offset = 0  # file offset of the current buffer
        self._written = 0  # bytes finished (under _lock)
        self._reported = unreported
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._write_loop, name=f"write {path.name} {i}", daemon=True)
                         for i in range(WRITERS)]
        for t in self._threads:
            t.start()
        self._hash = _Checksum(checksum, hash_thread) if checksum else None  # last: its thread once nothing here can fail

    # -- filling -----------------------------------------------------------------------------
    def add_file(self, fd: int, offset: int, n: int) -> None:
        if self._hash is not None:
            self._hash.ahead(fd, offset, n)
        while n:
            k = min(n, PIECE, CHUNK - self._fill)
            file_runs.pread_exact(fd, self._view[self._fill : self._fill + k], offset)
            self._crc.feed(fd, offset, self._view[self._fill : self._fill + k])
            self._landed(k)
            offset += k
            n -= k

    def add_gather(self, gather: "file_runs.RowGather") -> None:
        """Append the rows of a file run in ``gather.order``: the run read once (its bytes checked
        against their record's CRC-32 in file order), then its rows copied in turn."""
        block = self._read_checked(gather.run)
        row = gather.run.nbytes // len(gather.order)
        for r in gather.order:
            self.add_memory(block[r * row : (r + 1) * row])

    def add_columns(self, gather: "file_runs.ColumnGather") -> None:
        """Append rows whose columns lie in ``gather.runs``: each run read once (checked against
        its record's CRC-32 in file order), the rows interleaved by numpy, then appended."""
        import numpy

        band = numpy.empty((gather.rows, gather.nbytes // gather.rows), dtype=numpy.uint8)
        at = 0
        for run in gather.runs:
            width = run.nbytes // gather.rows
            block = self._read_checked(run)
            band[:, at : at + width] = numpy.frombuffer(block, dtype=numpy.uint8).reshape(gather.rows, width)
            at += width
        self.add_memory(memoryview(band).cast("B"))

    def _read_checked(self, run: "file_runs.FileRun") -> memoryview:
        """``run``'s bytes read into fresh memory, fed to the source records' CRC-32 in file order."""
        block = memoryview(bytearray(run.nbytes))
        file_runs.pread_exact(run.fd, block, run.offset)
        self._crc.feed(run.fd, run.offset, block)
        return block

    def sources_done(self) -> None:
        """Every byte is appended: a source record whose first bytes streamed in order, and whose
        rest another file holds, is handed to the check as a piece (call it on the filling thread)."""
        self._crc.end()

    def add_memory(self, data: memoryview) -> None:
        if self._hash is not None:
            self._hash.ahead_memory(data)
        done = 0
        while done < len(data):
            k = min(len(data) - done, PIECE, CHUNK - self._fill)
            self._view[self._fill : self._fill + k] = data[done : done + k]
            self._landed(k)
            done += k

    def add_region(self, n: int, fill: Callable[[memoryview], None]) -> None:
        """Append ``n`` bytes that ``fill`` writes into a writable view of their place in the output
        file, mapped through the page cache: for a tensor that has no row runs and is too large to
        hold in memory. The buffer so far is written first; the region is hashed from the file."""
        self._raise()
        start = self._offset + self._fill
        self._write_partial()
        if self._mapped is None:
            self._mapped = os.open(self._path, os.O_RDWR)
        end = start + n
        if os.fstat(self._mapped).st_size < end:
            os.ftruncate(self._mapped, end)
        base = start - start % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(self._mapped, end - base, offset=base) as region:
            view = memoryview(region)
            try:
                fill(view[start - base :])
            finally:
                view.release()
        if self._hash is not None:
            self._hash.from_file(self._mapped, start, n)
        with self._lock:
            self._written += n
        # the next buffer starts at the block boundary below ``end`` (O_DIRECT offsets are aligned),
        # with the region's last bytes read back from the page cache
        self._offset = end - end % BLOCK
        self._fill = self._old = end - self._offset
        file_runs.pread_exact(self._mapped, self._view[: self._fill], self._offset)
        self.report()

    def _landed(self, k: int) -> None:
        if self._hash is not None:
            self._hash.landed(self._view[self._fill : self._fill + k])
        self._fill += k
        if self._fill == CHUNK:
            self._hand_over()

    def _hand_over(self) -> None:
        self._raise()
        self._full.put((self._buf, self._fill, self._offset, self._fill - self._old))
        self._offset += self._fill
        self._view.release()
        while True:  # the next free buffer; a writer's error ends the wait
            try:
                self._buf = self._free.get(timeout=0.2)
                break
            except queue.Empty:
                self._raise()
        self._view = memoryview(self._buf)
        self._fill = self._old = 0
        self.report()

    def _write_partial(self) -> None:
        """The current buffer through the page cache (its length need not be aligned); it is then free."""
        if self._fill:
            file_runs.pwrite_exact(self._buffered, self._view[: self._fill], self._offset)
            with self._lock:
                self._written += self._fill - self._old
            self._offset += self._fill
            self._fill = self._old = 0

    # -- writing -----------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._full.get()
            if item is None:
                return
            buf, n, offset, new = item
            try:
                if self._error is None:
                    view = memoryview(buf)
                    try:
                        self._write(view[:n], offset)
                    finally:
                        view.release()
                    with self._lock:
                        self._written += new
            except BaseException as e:  # noqa: BLE001 - raised on the filling thread
                with self._lock:
                    if self._error is None:
                        self._error = e
            finally:
                self._free.put(buf)

    def _write(self, data: memoryview, offset: int) -> None:
        if self._direct:
            try:
                file_runs.pwrite_exact(self._fd, data, offset)
                return
            except OSError as e:  # a file system that opens O_DIRECT files but refuses the writes
                if e.errno != errno.EINVAL:
                    raise
                self._direct = False
        file_runs.pwrite_exact(self._buffered, data, offset)

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
        if self._hash is not None:
            self._hash.check()

    def finish(self) -> str | None:
        """Write the last partial buffer, wait for the writers, return the digest."""
        self._stop()
        self._raise()
        self._write_partial()
        self.report()
        return self._hash.finish() if self._hash is not None else None

    def cancel(self) -> None:
        with self._lock:
            if self._error is None:
                self._error = RuntimeError("cancelled")
        if self._hash is not None:
            self._hash.cancel()
        self._stop()

    def _stop(self) -> None:
        for _ in self._threads:
            self._full.put(None)
        for t in self._threads:
            t.join()
        self._threads = []

    def close(self) -> None:
        os.close(self._buffered)
        if self._mapped is not None:
            os.close(self._mapped)
        with contextlib.suppress(BufferError):
            self._view.release()
        for b in self._buffers:
            with contextlib.suppress(BufferError):  # a view still held by an error's traceback: freed with it
                b.close()


def fill_and_finish(sink: Sink, fill: Callable[[], None]) -> str | None:
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


def join_range(ranges: list[list[int]], source: tuple[int, int], offset: int, n: int) -> None:
    """Append ``n`` bytes of the file ``source`` (``(st_dev, st_ino)``) from ``offset`` to
    ``ranges`` (``[st_dev, st_ino, offset, n]`` items), joined to the last range when they follow it."""
    last = ranges[-1] if ranges else None
    if last is not None and len(last) == 4 and (last[0], last[1]) == source and last[2] + last[3] == offset:
        last[3] += n
    else:
        ranges.append([source[0], source[1], offset, n])


def byte_recipe(ckpt: LazyCheckpoint, plan: FilePlan) -> list[list[int]] | None:
    """What the engine appends after ``plan``'s header, as rank-file byte ranges
    (:func:`join_range`; a :class:`~hf_merge.readers.file_runs.RowGather` is its run's range followed by
    its row order, a :class:`~hf_merge.readers.file_runs.ColumnGather` each run's range followed by
    minus its row count), or None when some bytes would not be copied from a file (computed,
    converted, or a tensor without row runs). Reads no tensor data."""
    ranges: list[list[int]] = []
    sources: dict[int, tuple[int, int]] = {}

    def source(fd: int) -> tuple[int, int]:
        if fd not in sources:
            st = os.fstat(fd)
            sources[fd] = (st.st_dev, st.st_ino)
        return sources[fd]

    for spec, _start in plan.placed():
        if spec.nbytes == 0:
            continue
        rows = ckpt.read_rows(spec.name, spec.dtype) if spec.shape else None
        if rows is None:
            return None
        for _first, run in rows:
            if isinstance(run, file_runs.ColumnGather):  # each run, then the band's row count (negative)
                ranges.extend([*source(part.fd), part.offset, part.nbytes, -run.rows] for part in run.runs)
            elif isinstance(run, file_runs.RowGather):  # a run's rows in another order: the run, then the order
                ranges.append([*source(run.run.fd), run.run.offset, run.run.nbytes, *run.order])
            else:
                located = file_bytes(run)
                if located is None:
                    return None
                join_range(ranges, source(located.fd), located.offset, located.nbytes)
    return ranges
