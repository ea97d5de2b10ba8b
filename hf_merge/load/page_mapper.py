"""CPU tensors whose pages are the rank files' own pages: a sharded tensor loaded without a copy.

``from_pretrained`` of a safetensors folder keeps each weight as a view of the memory-mapped file:
no copy, and the page cache's pages are mapped only when first used. A tensor split over several
rank files (FSDP's ``Shard(0)`` rows) is not contiguous in any one file, so it used to be copied
into fresh anonymous memory, and on the benchmark machine that copy (3.1 GB: the kernel's page
faults and zeroing of new memory) cost more than all of ``from_pretrained``.

:class:`Mapper` builds the tensor in one reserved address range instead, and maps each rank's piece
into its place with ``mmap(MAP_PRIVATE | MAP_FIXED)`` of the rank file: copy-on-write pages of the
page cache, exactly what ``safe_open``'s ``MAP_PRIVATE`` mapping gives ``from_pretrained``. A page
can only come from one file at one page-aligned offset, so a piece is mapped where its file offset
and its place in the tensor agree modulo the page size (torch.save's 64-byte alignment makes every
piece of a tensor agree when the pieces' byte sizes are multiples of the page, as large matrices
are); the pages a piece shares with its neighbour, and pieces that do not agree, are read into the
anonymous pages of the range with ``preadv`` (a piece read whole has its pages populated first,
:func:`populate`: one ``madvise`` per 32 MiB instead of a page fault per page). Bytes equal the file's either way. Where the pieces
lie at different page phases (each Megatron TP rank's archive in its own file, at an offset the
archives before it decide), the tensor starts at the phase most of its bytes agree with
(:func:`best_shift`), never at one that would misalign its elements.

Like any memory-mapped weight (``from_pretrained``'s too), the pages read the file when first
touched: truncating or rewriting a rank file while the model lives changes or faults its weights.
Linux only (``mmap`` with ``MAP_FIXED``); the pieces it maps are the runs a reader hands out as
:class:`~hf_merge.readers.file_runs.FileRun`\\ s. Elsewhere :meth:`Mapper.tensor` returns None and the caller copies.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import threading
import weakref
from typing import Iterable

import torch

from ..readers.file_runs import FileRun, OnPlaced, Piece, pread_exact, run_of, values

PAGE = mmap.PAGESIZE
MIN_MAPPED_PAGES = 16  # a run of fewer whole pages is read (a mapping per 64 KB is not worth it)
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"

_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # Linux; the mmap module does not export it
_FAILED = ctypes.c_void_p(-1).value
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; the mmap module exports it only from Python 3.13 (a constant there too)
POPULATE_MIN_BYTES = 1 << 20  # smaller reads fault their few pages in as they go
# Per call. The call holds the process's mmap lock for reading, so another thread's mmap() (the
# import beside the prefetch: every new pymalloc arena and shared library is one) waits for the
# whole chunk, and the page faults queued behind that writer wait too. meg-L8 with the prefetch
# (docs/loading.md): 32 MiB slowed the import beside it from 1.3 s to 1.8-2.3 s; 1 MiB does not.
POPULATE_CHUNK = 1 << 20
_populates = True  # until the kernel says it has no MADV_POPULATE_WRITE


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_LIBC = _libc() if hasattr(os, "preadv") and os.path.exists(MAX_MAP_COUNT) else None


def _mmap(addr: int | None, length: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    got = _LIBC.mmap(addr, length, _PROT_RW, flags, fd, offset)
    if got in (None, _FAILED):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return got


def _unmap(addr: int, length: int) -> None:
    _LIBC.munmap(addr, length)


def populate(addr: int, length: int) -> bool:
    """Fault in the whole pages of ``[addr, addr + length)`` of an anonymous range for writing, in one
    call (``MADV_POPULATE_WRITE``, Linux >= 5.14) instead of one page fault per page as ``preadv``
    first writes them. False where the kernel does not have it (then the pages fault in as before)."""
    global _populates
    lo, hi = -(-addr // PAGE) * PAGE, (addr + length) // PAGE * PAGE
    if not _populates or hi - lo < POPULATE_MIN_BYTES:
        return False
    for at in range(lo, hi, POPULATE_CHUNK):  # the call holds the mmap lock: other threads' mmap() wait
        if _LIBC.madvise(at, min(POPULATE_CHUNK, hi - at), _MADV_POPULATE_WRITE) != 0:
            if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM):  # an older kernel: stop asking
                _populates = False
            return False
    return True


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU with its pages faulted in first (:func:`populate`),
    for a tensor that is read into right after: a scattered read (a TP column piece per row)
    otherwise takes a page fault in the middle of its copies for every page."""
    out = torch.empty(shape, dtype=dtype)
    if _LIBC is not None:
        populate(out.data_ptr(), out.numel() * out.element_size())
    return out


def _map_count() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def best_shift(runs: list[tuple[int, Piece]], row_bytes: int, itemsize: int) -> int:
    """Where a tensor made of ``runs`` (``(first row, piece)``) should start in its first page:
    the page phase the most file bytes agree with, so those are mapped (pieces written apart,
    like a TP rank's archive in its own file, often start at other phases; the rest is read).
    A phase that would misalign the tensor's elements is never chosen (0 then)."""
    weights: dict[int, int] = {}
    for row, piece in runs:
        located = run_of(piece)
        if located is not None and located.nbytes >= MIN_MAPPED_PAGES * PAGE:
            phase = (located.offset - row * row_bytes) % PAGE
            if phase % itemsize == 0:
                weights[phase] = weights.get(phase, 0) + located.nbytes
    return max(weights, key=weights.__getitem__) if weights else 0


class Mapper:
    """Builds mapped tensors, within a share of the kernel's per-process mapping limit
    (``vm.max_map_count``; every mapped piece is one or two mappings) so the process keeps room
    for its own. ``mapped_bytes`` / ``read_bytes`` count what was mapped and what was read."""

    def __init__(self, share: float = 0.5):
        self.available = _LIBC is not None
        self.mapped_bytes = self.read_bytes = 0
        self._lock = threading.Lock()
        self._budget = 0
        if self.available:
            try:
                with open(MAX_MAP_COUNT) as f:
                    limit = int(f.read())
                self._budget = max(0, int(limit * share) - _map_count())
            except (OSError, ValueError):
                self.available = False

    def _take(self, mappings: int) -> bool:
        with self._lock:
            if mappings > self._budget:
                return False
            self._budget -= mappings
            return True

    @staticmethod
    def worth(nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` is big enough to be worth mapping."""
        return nbytes >= MIN_MAPPED_PAGES * PAGE

    def maps(self, piece: Piece) -> bool:
        """Whether :meth:`tensor` would map ``piece`` (a run of a tensor): file bytes, on Linux."""
        return self.available and self._budget > 2 and run_of(piece) is not None

    def tensor(
        self, shape: tuple[int, ...], dtype: torch.dtype, runs: Iterable[tuple[int, Piece]],
        placed: "OnPlaced | None" = None,
    ) -> torch.Tensor:
        """The tensor of ``shape`` / ``dtype`` made of ``runs`` (``(first row, rows)``, as
        :meth:`LazyCheckpoint.read_rows` yields them, in order, covering it), its file-backed runs
        mapped where the page offsets allow, the rest read or copied into anonymous pages.
        ``placed(fd, offset, bytes)`` is called with each file-backed run's bytes as the tensor
        holds them (:meth:`hf_merge.readers.record_crc.Placed.place`). Call it when :meth:`maps`
        is true of the first run."""
        runs = iter(runs)
        total = dtype.itemsize * int(torch.Size(shape).numel())
        row_bytes = total // shape[0]
        ahead: list[tuple[int, Piece]] = []  # the file runs up to the first computed one (valid until the next)
        for row, piece in runs:
            ahead.append((row, piece))
            if run_of(piece) is None:
                break
        shift = best_shift(ahead, row_bytes, dtype.itemsize)
        length = -(-(shift + total) // PAGE) * PAGE
        self._take(1)  # the range itself
        addr = _mmap(None, length, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer = (ctypes.c_char * total).from_address(addr + shift)
        finalizer = weakref.finalize(buffer, _unmap, addr, length)
        finalizer.atexit = False
        try:
            view = memoryview(buffer).cast("B")
            covered, files = 0, []
            for row, piece in itertools.chain(ahead, runs):
                rows = values(piece)
                start, nbytes = row * row_bytes, rows.numel() * rows.element_size()
                if rows.dtype != dtype or start != covered or start + nbytes > total:
                    raise ValueError(f"rows {row}.. do not continue the tensor at byte {covered}")
                located = run_of(piece)
                if located is None:
                    populate(addr + shift + start, nbytes)
                    torch.frombuffer(view[start : start + nbytes], dtype=torch.uint8).copy_(
                        rows.reshape(-1).view(torch.uint8)
                    )
                    self.read_bytes += nbytes
                else:
                    self._place(addr, shift + start, nbytes, located, view, start)
                    files.append((located, start, nbytes))
                covered += nbytes
            if covered != total:
                raise ValueError(f"the runs cover {covered} of {total} bytes")
            for located, start, nbytes in files if placed is not None else ():
                placed(located.fd, located.offset, view[start : start + nbytes])
            del view
            return torch.frombuffer(buffer, dtype=dtype).view(shape)
        except BaseException:
            del buffer  # the finalizer unmaps the range
            raise

    def _place(self, addr: int, at: int, nbytes: int, located: FileRun, view: memoryview, start: int) -> None:
        """Bytes ``[at, at + nbytes)`` of the range (``[start, ...)`` of the tensor) from the file
        run ``located``: whole pages mapped where the offsets agree, the rest read."""
        fd, offset = located.fd, located.offset
        lo, hi = at, at + nbytes
        page_lo, page_hi = -(-lo // PAGE) * PAGE, hi // PAGE * PAGE
        mapped = False
        if (lo - offset) % PAGE == 0 and page_hi - page_lo >= max(1, MIN_MAPPED_PAGES) * PAGE and self._take(2):
            try:
                _mmap(addr + page_lo, page_hi - page_lo, mmap.MAP_PRIVATE | _MAP_FIXED, fd, offset + (page_lo - lo))
                mapped = True
            except OSError:  # a failed MAP_FIXED may have dropped the pages there: make them anonymous again
                _mmap(addr + page_lo, page_hi - page_lo, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED)
        if mapped:
            self.mapped_bytes += page_hi - page_lo
        else:
            page_lo = page_hi = hi
            populate(addr + lo, nbytes)  # all of it is read into fresh pages
        for a, b in ((lo, page_lo), (page_hi, hi)):  # the partial pages at either end (or everything)
            if b > a:
                pread_exact(fd, view[start + a - lo : start + b - lo], offset + a - lo)
                self.read_bytes += b - a
