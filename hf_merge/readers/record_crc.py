"""The CRC-32 of every zip record a merge reads, checked before its bytes are used.

``torch.save`` archives (FSDP rank files, DeepSpeed and legacy Megatron ``.pt`` files, the archives
inside a DCP ``.distcp``) carry a CRC-32 per record in their central directory. A flipped bit on the
storage would otherwise go straight into the output.

How a record is checked, once per process (cached per record: file device, inode, mtime and the
record's offset):

- **as its bytes stream past**: where a writer copies a record whole and in order through its own
  buffer (the ``O_DIRECT`` path, :class:`Stream` in :mod:`hf_merge.write.engine`'s sink, also in
  the CLI's head-start child), the CRC-32 (:func:`~hf_merge.readers.torch_zip.crc32`) runs over
  the bytes already in the buffer: no extra read. The reader only notes the record
  (:func:`deferred`). A record whose bytes pass in pieces out of order (a DeepSpeed partition
  cut into parameters, written in the output's order) has each piece's CRC-32 taken in the
  buffer as well. The writers of a merge's files keep one account of these pieces (a
  :class:`Placed` per :func:`~hf_merge.write.shards.write_shards`; a forked writer hands its
  pieces of records it did not finish to the parent, :meth:`Placed.hand_over`): after the last
  file, before the folder is committed, each record's pieces from all files are combined and
  only the bytes no piece covered are read (padding, small parameters copied from memory: 0.2-2 %
  of the checked bytes for the tests' ZeRO fixtures in 6-8 files, 0 for 2.5 GB of partitions in 5
  files; before, each file read what it had not copied itself: 46-96 %, per forked writer);
- otherwise **in full, the first time any of its bytes are used** (a ``Shard(1)`` column piece, a
  DeepSpeed parameter that is a slice of a flat partition, a DCP box, the page-cache copy path,
  ``from_sharded_pretrained``): over a read-only mapping of the record (no copy), then used as
  before (from the page cache where it fits).

A record whose CRC differs raises :class:`SourceCrcError` naming the file and the record, before the
output folder is renamed into place.

Readers call :func:`add_archive` (or :func:`mapped_file`) when they open a file, and
:func:`check_tensor` / :func:`check_record` before handing out bytes. A tensor is mapped to its
record through the reader's :class:`~hf_merge.readers.file_runs.MappedFile` (where its storage lies in its
file); a tensor that is not file-backed (copied into memory) is not checked here.

:func:`skipping` turns the checks off (``--no-source-crc``, ``source_crc=False``).
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from ..errors import CorruptCheckpointError
from .torch_zip import crc32, crc32_combine

if TYPE_CHECKING:
    from concurrent.futures import Executor

    import torch

    from .file_runs import MappedFile
    from .torch_zip import Record

#: bytes per ``pread`` of a record being checked
CHUNK = 8 << 20
#: bytes per CRC-32 call over bytes already in memory (:meth:`Placed.place`): each call releases the
#: GIL and takes it back, which costs a thread switch while another thread runs Python (a load's
#: import of the model code beside its prefetch, :mod:`hf_merge.load.prefetch`)
PLACED_CHUNK = 1 << 30


class SourceCrcError(CorruptCheckpointError):
    """A zip record of a source file does not have the CRC-32 its central directory records."""


@dataclass
class _Archive:
    where: str  # the file's name, for messages
    starts: list[int]  # data_start of each record, sorted
    records: list["Record"]


_lock = threading.Lock()
_archives: dict[tuple[int, ...], _Archive] = {}  # file key (_key) -> its records
_checked: set[tuple[int, ...]] = set()  # file key + data_start of records found good
_busy: dict[tuple[int, ...], threading.Lock] = {}
_skip = 0  # > 0 inside skipping()
_stats = {"records": 0, "bytes": 0, "streamed": 0}
_local = threading.local()  # .pending: records noted inside deferred() on this thread; .placed: their pieces


def _key(st: os.stat_result) -> tuple[int, ...]:
    """One version of one file. The change time is in it because writing a file in place and then
    setting its modification time back (``cp -p``, ``rsync -t``, ``os.utime``; a re-copy that reuses
    the inode) keeps device, inode and modification time: without it a long-lived process (a notebook
    merging or loading twice) would take the new bytes for records already found good, unchecked."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


file_version = _key  # a file's version as the records found good are remembered by


@contextlib.contextmanager
def skipping(skip: bool = True) -> Iterator[None]:
    """Within the block (when ``skip``), no record's CRC-32 is checked."""
    global _skip
    with _lock:
        _skip += int(skip)
    try:
        yield
    finally:
        with _lock:
            _skip -= int(skip)


def add_archive(path: "str | Path | int", records: "dict[str, Record]", where: str | None = None) -> None:
    """Make ``records`` (data offsets absolute in the file ``path``, or the open descriptor)
    checkable by :func:`check_tensor` and :class:`Stream`."""
    try:
        st = os.fstat(path) if isinstance(path, int) else os.stat(path)
    except OSError:
        return
    ordered = sorted(records.values(), key=lambda r: r.data_start)
    starts = [r.data_start for r in ordered]
    with _lock:
        known = _archives.get(_key(st))
        if known is None:
            _archives[_key(st)] = _Archive(where or Path(str(path)).name, starts, ordered)
            return
        # another archive in the same file (a DCP chunk: a .distcp holds one per tensor piece, tens of
        # thousands for a large MoE): its records go in place, in one slice where they fall between
        # two known records (lookups bisect under this lock); copying the lists per archive was
        # quadratic (20,000 chunks: 8.1 s)
        if where:
            known.where = where
        i = bisect.bisect_left(known.starts, starts[0]) if starts else 0
        fits = i == len(known.starts) or known.starts[i] > starts[-1]
        if fits:
            known.starts[i:i] = starts
            known.records[i:i] = ordered
            return
        for rec in ordered:
            i = bisect.bisect_left(known.starts, rec.data_start)
            if i == len(known.starts) or known.starts[i] != rec.data_start:
                known.starts.insert(i, rec.data_start)
                known.records.insert(i, rec)


def mapped_file(
    path: "str | Path", tensors: "Iterable[torch.Tensor]", records: "dict[str, Record] | None" = None, where: str | None = None
) -> "MappedFile | None":
    """The file ``tensors`` were memory-mapped from (``torch.load(mmap=True)``), open by descriptor,
    its records (read from its zip directory when not given) made checkable; None when the tensors
    are not views of its mapping."""
    from .file_runs import MappedFile
    from .torch_zip import read_records

    where = where or Path(path).name
    if records is None:
        with open(path, "rb") as f:
            records = read_records(f, where)
    source = MappedFile.from_records(path, tensors, records)
    if source is not None:
        add_archive(path, records, where)
    return source


def check_tensor(tensor: "torch.Tensor", source: "MappedFile | None") -> None:
    """Check the record holding ``tensor``'s storage (once per record), ``source`` being the file
    the reader mapped it from; a tensor that is not file-backed, or whose file was not added, is
    let through."""
    if _skip or source is None:
        return
    span = source.storage_span(tensor)
    if span is None:
        return
    fd, offset, nbytes = span
    st = os.fstat(fd)
    archive, rec = _record_at(st, offset)
    if rec is None:
        return
    if offset + nbytes > rec.data_start + rec.size:
        raise CorruptCheckpointError(
            f"{archive.where}: a tensor's bytes {offset}..{offset + nbytes} run past zip record "
            f"{rec.name[:60]!r}; the file is damaged, re-copy it from the training run"
        )
    _check_or_note(fd, st, rec, f"{archive.where}: zip record {rec.name[:160]!r}")


def _check_or_note(fd: int, st: os.stat_result, rec: "Record", where: str) -> None:
    pending = getattr(_local, "pending", None)
    key = _key(st) + (rec.data_start,)
    if pending is not None:  # a writer's stream may check it as it copies; else at the end of deferred()
        if key not in _checked:
            pending.setdefault(key, (fd, st, rec, where))  # fd: the reader's, open while it is
        return
    _check(fd, st, rec.data_start, rec.size, rec.crc, where)


@contextlib.contextmanager
def deferred(check_at_end: bool = True, pending: "dict | None" = None, into: "Placed | None" = None) -> Iterator[None]:
    """Within the block, :func:`check_tensor` on this thread only notes the records it would check
    (into ``pending`` when given: a :class:`Placed`'s, shared by the threads of a load).

    ``into``: a :class:`Placed` that keeps the noted records and the pieces the streams saw across
    several blocks (the files of one merge); its owner calls :meth:`Placed.finish`, not this block.

    At the end of the block (when it ends without an error), every noted record that a
    :class:`Stream` did not check as its bytes passed is checked: from the CRC-32s of the pieces
    of it the streams of this thread saw out of order (combined, as :class:`Placed` does), reading
    only the bytes no piece covered; unless ``check_at_end`` is False (the caller has another party check them: the head-start child, for its file; a
    :class:`Placed`, at :meth:`Placed.finish`).
    """
    outer, outer_placed = getattr(_local, "pending", None), getattr(_local, "placed", None)
    if into is not None:  # its owner finishes it
        placed = into
    elif check_at_end:  # the pieces the streams see out of order, combined at the end of this block
        placed = Placed()
        if pending is not None:
            placed.pending = pending
    else:
        placed = None
    pending = placed.pending if placed is not None else ({} if pending is None else pending)
    _local.pending, _local.placed = pending, placed
    try:
        yield
        if placed is not None and into is None:
            placed.finish()
    finally:
        _local.pending, _local.placed = outer, outer_placed


def check_ranges(ranges: "list[tuple[int, int, int]]") -> None:
    """Check every record that ``(fd, offset, n)`` byte ranges touch (once per record): what a
    writer that copies ranges it planned itself calls after copying them through a :class:`Stream`."""
    if _skip:
        return
    for fd, offset, n in ranges:
        st, archive, records = _touched(fd, offset, n)
        for rec in records:
            _check(fd, st, rec.data_start, rec.size, rec.crc, f"{archive.where}: zip record {rec.name[:160]!r}")


def _touched(fd: int, offset: int, n: int) -> "tuple[os.stat_result, _Archive | None, list[Record]]":
    """The records of ``fd``'s archive (none when it is not a known one) that its bytes
    ``offset .. offset + n`` overlap, in file order."""
    st = os.fstat(fd)
    records = []
    with _lock:  # add_archive inserts in place
        archive = _archives.get(_key(st))
        if archive is None:
            return st, None, []
        i = max(0, bisect.bisect_right(archive.starts, offset) - 1)
        while i < len(archive.records) and archive.records[i].data_start < offset + n:
            rec = archive.records[i]
            if rec.data_start + rec.size > offset:
                records.append(rec)
            i += 1
    return st, archive, records


def _record_at(st: os.stat_result, offset: int) -> "tuple[_Archive | None, Record | None]":
    """The archive of the file ``st`` is a version of, and its last record starting at or before
    ``offset`` (None, None when the file is not a known archive)."""
    with _lock:  # add_archive inserts in place
        archive = _archives.get(_key(st))
        if archive is None:
            return None, None
        i = bisect.bisect_right(archive.starts, offset) - 1
        return archive, (archive.records[i] if i >= 0 else None)


class Stream:
    """Checks the records whose bytes pass through a writer's buffer whole and in order.

    The writer calls :meth:`feed` with each piece of file bytes it has just read into its buffer
    (the descriptor, the file offset, the bytes). A piece that starts a known record (and
    the pieces that follow it without a gap) are run through the CRC-32; at the record's last
    byte its CRC is compared and the record is marked checked, or :class:`SourceCrcError` raised.
    Pieces that start elsewhere in a record, and a record left part-way, go as pieces (their
    CRC-32s) to the :class:`Placed` of this thread's :func:`deferred` block, which combines them at
    its end; outside such a block (or with ``check_at_end=False``) they are dropped and the record
    is checked in full. Pieces that follow each other in one record (a DeepSpeed parameter copied
    256 KiB at a time) are one run: one CRC-32 carried on, one piece handed over when the run ends,
    not a record look-up and a ``crc32_combine`` per 256 KiB.
    """

    def __init__(self) -> None:
        self._fd = -1
        self._first = -1  # file offset where the current run began (the record's start: streamed whole)
        self._next = -1
        self._end = 0
        self._crc = 0
        self._rec: "tuple | None" = None  # (key, record, where)

    def feed(self, fd: int, offset: int, data: memoryview) -> None:
        if _skip:
            return
        if self._rec is None or fd != self._fd or offset != self._next:
            self._hand_over()
            self._start(fd, offset)
        if self._rec is None or self._next + len(data) > self._end:
            self._hand_over()  # not within one record: kept as pieces, for the check at the end
            placed = getattr(_local, "placed", None)
            if placed is not None:
                placed.place(fd, offset, data)
            return
        self._crc = crc32(data, self._crc)
        self._next += len(data)
        if self._next == self._end:
            key, rec, where = self._rec
            if self._first != rec.data_start:
                self._hand_over()
                return
            self._rec = None
            _conclude(key, where, rec.crc, self._crc, rec.size, streamed=True)

    def end(self) -> None:
        """The writer's last bytes are in: a record streamed part-way goes to the check as a piece."""
        self._hand_over()

    def _hand_over(self) -> None:
        """The run so far (a record's first bytes, or bytes from inside it) did not cover the
        record: its CRC-32 goes to the check at the end of :func:`deferred`, as a piece."""
        placed = getattr(_local, "placed", None)
        if self._rec is not None and placed is not None and self._next > self._first:
            placed.add(self._rec[0], self._first, self._next - self._first, self._crc)
        self._rec = None

    def _start(self, fd: int, offset: int) -> None:
        """A run from ``offset``: at a record's start, or (when a :class:`Placed` takes the
        pieces) inside one."""
        self._rec = None
        st = os.fstat(fd)
        archive, rec = _record_at(st, offset)
        if rec is None:
            return
        if offset >= rec.data_start + rec.size or (offset != rec.data_start and getattr(_local, "placed", None) is None):
            return
        key = _key(st) + (rec.data_start,)
        if key in _checked:
            return
        self._rec = (key, rec, f"{archive.where}: zip record {rec.name[:160]!r}")
        self._fd, self._first, self._next, self._end, self._crc = fd, offset, offset, rec.data_start + rec.size, 0


class Placed:
    """Checks the records a load noted from the bytes it placed, where it placed them.

    The model loader maps rank-file pages into the model's tensors (:mod:`hf_merge.load.page_mapper`);
    a separate full pass over each record would fault every page in once more in its own mapping,
    and the forward pass again in the model's. Instead the load's threads note their records in
    :attr:`pending` (``deferred(check_at_end=False, pending=placed.pending)``) and call
    :meth:`place` with each piece of file bytes as the model holds it: its CRC-32 runs over the
    model's own pages (faulted in once, for good) in the thread that placed it. :meth:`finish`
    combines each record's pieces in file order (``crc32_combine``), reads only the bytes no piece
    covered (a partition's padding, a small tensor that was read) and compares, before the model is
    returned; a record no piece touched (a cast tensor) is checked in full, as before.
    """

    def __init__(self) -> None:
        self.pending: dict = {}  # key -> (fd, st, record, where), as deferred() notes them
        self._parts: dict[tuple, list[tuple[int, int, int]]] = {}  # key -> (file offset, bytes, crc)
        self._lock = threading.Lock()

    def place(self, fd: int, offset: int, data: memoryview) -> None:
        """``data`` is what the model now holds of the bytes of ``fd`` at ``offset``."""
        if _skip or not len(data):
            return
        end = offset + len(data)
        st, _archive, records = _touched(fd, offset, len(data))
        for rec in records:
            a, b = max(offset, rec.data_start), min(end, rec.data_start + rec.size)
            key = _key(st) + (rec.data_start,)
            if a >= b or key in _checked:
                continue
            crc = 0
            for j in range(a - offset, b - offset, PLACED_CHUNK):
                crc = crc32(data[j : min(j + PLACED_CHUNK, b - offset)], crc)
            self.add(key, a, b - a, crc)

    def add(self, key: tuple, offset: int, n: int, crc: int) -> None:
        """The CRC-32 of ``n`` bytes from ``offset`` of the record ``key`` (file key + data start);
        joined to the last piece when it follows it (a parameter's 256 KiB pieces: one entry)."""
        with self._lock:
            parts = self._parts.setdefault(key, [])
            if parts and parts[-1][0] + parts[-1][1] == offset:
                at, m, first = parts[-1]
                parts[-1] = (at, m + n, crc32_combine(first, crc, n))
            else:
                parts.append((offset, n, crc))

    def hand_over(self, inherited: "Iterable[int]") -> list[tuple]:
        """For the process that forked this one: the noted records not yet checked that have pieces
        here, read through a descriptor in ``inherited`` (open in that process too), each as
        ``(key, (fd, st, record, where), pieces)``; they are dropped from this account. The others
        stay, for :meth:`finish` here."""
        inherited = set(inherited)
        out = []
        with self._lock:
            for key, entry in list(self.pending.items()):
                if key not in _checked and key in self._parts and entry[0] in inherited:
                    out.append((key, entry, self._parts.pop(key)))
                    del self.pending[key]
        return out

    def take(self, handed: "Iterable[tuple]") -> None:
        """Add records and pieces another process's account handed over (:meth:`hand_over`)."""
        for key, entry, parts in handed:
            try:
                same = _key(os.fstat(entry[0])) == key[:-1]
            except OSError:
                same = False
            if not same:  # the forking process holds its readers' descriptors open until the end
                raise CorruptCheckpointError(f"{entry[3]}: its file changed during the merge; merge again")
            with self._lock:
                self.pending.setdefault(key, entry)
                self._parts.setdefault(key, []).extend(parts)

    def finish(self, pool: "Executor | None" = None) -> None:
        """Check every noted record (on ``pool``'s threads when given); raises
        :class:`SourceCrcError` for the first that differs."""
        todo = [(key, entry) for key, entry in self.pending.items() if key not in _checked]
        for _ in (pool.map(self._finish_one, todo) if pool is not None else map(self._finish_one, todo)):
            pass

    def _finish_one(self, item: tuple) -> None:
        key, (fd, st, rec, where) = item
        # in file order; of pieces at one offset (a tied tensor placed twice, joined pieces) the longest first
        parts = sorted(self._parts.get(key, ()), key=lambda p: (p[0], -p[1]))
        if not parts:
            _check(fd, st, rec.data_start, rec.size, rec.crc, where)
            return
        crc, at, end = 0, rec.data_start, rec.data_start + rec.size
        for start, n, part in parts + [(end, 0, 0)]:
            if start < at:
                continue  # overlaps bytes already counted (the same bytes placed twice)
            if start > at:  # bytes no piece covered: read them
                crc = crc32_combine(crc, _crc(fd, at, start - at, where), start - at)
            crc, at = crc32_combine(crc, part, n), start + n
        _conclude(key, where, rec.crc, crc, rec.size)


def check_record(fd: int, data_start: int, size: int, crc: int, where: str) -> None:
    """Check one record of the file open as ``fd`` (once per record; inside :func:`deferred`, noted)."""
    if _skip:
        return
    from .torch_zip import Record

    _check_or_note(fd, os.fstat(fd), Record(where, data_start, size, crc), where)


def _check(fd: int, st: os.stat_result, data_start: int, size: int, crc: int, where: str) -> None:
    key = _key(st) + (data_start,)
    if key in _checked:
        return
    with _lock:
        busy = _busy.setdefault(key, threading.Lock())
    with busy:  # another thread checking the same record: wait for its answer
        if key in _checked:
            return
        _conclude(key, where, crc, _crc(fd, data_start, size, where), size)


def _conclude(key: tuple, where: str, expected: int, got: int, size: int, *, streamed: bool = False) -> None:
    """The verdict on one record, however its CRC-32 was taken (streamed, combined from pieces,
    read): :class:`SourceCrcError` unless ``got`` is what the zip directory says, else the record is
    remembered as found good."""
    if got != expected:
        raise _mismatch(where, expected, got, size)
    with _lock:
        _checked.add(key)
        _busy.pop(key, None)
        _stats["records"] += 1
        _stats["bytes"] += size
        _stats["streamed"] += streamed


def _mismatch(where: str, expected: int, got: int, size: int) -> SourceCrcError:
    return SourceCrcError(
        f"{where} fails its CRC-32 (the zip directory says {expected:08x}, its {size} bytes give {got:08x}); "
        "the file is damaged: re-copy it from the training run (--no-source-crc merges it anyway)"
    )


def _crc(fd: int, start: int, size: int, where: str) -> int:
    """The CRC-32 of ``size`` bytes of ``fd`` from ``start``: over a read-only mapping of them (no
    copy; the kernel maps cached pages 64 KiB at a time), else read in :data:`CHUNK` pieces."""
    if size == 0:
        return 0
    if start + size > os.fstat(fd).st_size:
        raise CorruptCheckpointError(f"{where}: the file ends inside the record; re-copy it from the training run")
    lead = start % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(fd, size + lead, access=mmap.ACCESS_READ, offset=start - lead)
    except (OSError, ValueError):
        return _crc_read(fd, start, size, where)
    try:
        with memoryview(mapped) as view:
            crc = 0
            for i in range(lead, lead + size, CHUNK):
                crc = crc32(view[i : min(i + CHUNK, lead + size)], crc)
            return crc
    finally:
        mapped.close()


def _crc_read(fd: int, start: int, size: int, where: str) -> int:
    buf = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buf)
    crc, done = 0, 0
    while done < size:
        n = os.preadv(fd, [view[: min(len(buf), size - done)]], start + done)
        if n <= 0:
            raise CorruptCheckpointError(f"{where}: the file ends inside the record; re-copy it from the training run")
        crc = crc32(view[:n], crc)
        done += n
    return crc


def stats() -> dict[str, int]:
    """Records and bytes checked in this process so far."""
    with _lock:
        return dict(_stats)
