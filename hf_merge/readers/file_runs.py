"""Byte provenance: which file range holds a piece of a tensor, as the reader that mapped it says.

Rank files are memory-mapped whole (``torch.load(mmap=True)``, or a reader's own
``UntypedStorage.from_file``): each storage is a slice of that one mapping at its zip record's data
offset. Handing such a view to ``pwrite`` makes the kernel fault in and walk every source page;
copying the same bytes through the file descriptor (``copy_file_range`` into the output file,
``preadv`` into a buffer) skips that, and took 2-3x less system time on the benchmark checkpoint.

A reader keeps one :class:`MappedFile` per file it mapped (the file open by descriptor for the
reader's lifetime, and the address range of the mapping, found from the zip records the reader has
already parsed). Its ``read_rows`` then hands out a :class:`FileRun` (descriptor, file offset, byte
count, and the same bytes as a tensor view) for every run that is the file's bytes unchanged, and a
plain tensor for every run it converted or computed. Transforms that pass runs through unchanged
keep the :class:`FileRun`; consumers that want values take :func:`values`.
"""

from __future__ import annotations

import mmap
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Union

if TYPE_CHECKING:  # torch is imported by whoever hands tensors in; pread/pwrite need none
    import torch

    from .torch_zip import Record



@dataclass(frozen=True, eq=False)
class FileRun:
    """``nbytes`` bytes of the open file ``fd`` from ``offset``; ``tensor`` is the same bytes as a
    contiguous view of the file's mapping (valid while the reader is open; never modify it)."""

    fd: int
    offset: int
    nbytes: int
    tensor: "torch.Tensor"

    def rows(self, first: int, n: int, row_bytes: int) -> "FileRun":
        """Rows ``first .. first + n`` of this run (rows of ``row_bytes`` bytes)."""
        if first < 0 or n < 0 or (first + n) * row_bytes > self.nbytes:
            raise ValueError(f"rows {first}+{n} of {row_bytes} bytes are outside a run of {self.nbytes} bytes")
        tensor = self.tensor[first : first + n] if self.tensor is not None else None
        return FileRun(self.fd, self.offset + first * row_bytes, n * row_bytes, tensor)

    def piece(self, tensor: "torch.Tensor") -> "Piece":
        """``tensor`` (a view of this run's tensor: rows or bytes of it) as a run of the same file
        when it is contiguous and inside the run, else itself."""
        at = tensor.data_ptr() - self.tensor.data_ptr()
        n = tensor.numel() * tensor.element_size()
        if not n or not tensor.is_contiguous() or at < 0 or at + n > self.nbytes:
            return tensor
        return FileRun(self.fd, self.offset + at, n, tensor)


@dataclass(frozen=True, eq=False)
class RowGather:
    """The rows of the file run ``run`` in another order: row ``i`` of this piece is row
    ``order[i]`` of ``run`` (a q/k projection's rotary rows un-permuted, one head per piece). A
    writer reads ``run`` once and copies its rows in order; ``tensor`` is the rows gathered."""

    run: FileRun
    order: tuple[int, ...]

    @property
    def tensor(self) -> "torch.Tensor":
        import torch

        return self.run.tensor[torch.tensor(self.order)]


@dataclass(frozen=True, eq=False)
class ColumnGather:
    """Rows whose columns lie in several file runs: row ``i`` of this piece is row ``i`` of each of
    ``runs`` side by side (a TP>1 row-parallel weight: each rank's chunk holds a slice of every
    row). Each run holds ``rows`` whole rows of its slice. A writer reads each run once and
    interleaves them; ``tensor`` is the runs' tensors joined along dim 1."""

    runs: tuple[FileRun, ...]
    rows: int

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.runs)

    @property
    def tensor(self) -> "torch.Tensor":
        import torch

        return torch.cat([r.tensor for r in self.runs], dim=1)


#: what ``read_rows`` yields after the first row: file bytes with their provenance (a run, a run's
#: rows in another order, rows side by side in several runs), or values
Piece = Union[FileRun, RowGather, ColumnGather, "torch.Tensor"]

#: what receives a file run's bytes where a loader placed them: (descriptor, file offset, bytes)
#: (:meth:`hf_merge.readers.record_crc.Placed.place`)
OnPlaced = Callable[[int, int, memoryview], None]


def values(piece: Piece) -> "torch.Tensor":
    """The tensor of ``piece``."""
    return piece.tensor if isinstance(piece, (FileRun, RowGather, ColumnGather)) else piece


def run_of(piece: Piece) -> FileRun | None:
    """``piece`` when it is file bytes, else None."""
    return piece if isinstance(piece, FileRun) else None


class MappedFile:
    """One source file mapped whole at ``base`` (``size`` bytes), open by descriptor until
    :meth:`close` (or until this object is dropped)."""

    def __init__(self, path: "str | os.PathLike[str]", base: int, size: int):
        self.fd = os.open(path, os.O_RDONLY)
        self.base, self.size = base, size
        self._closer = weakref.finalize(self, os.close, self.fd)

    @classmethod
    def from_records(
        cls, path: "str | os.PathLike[str]", tensors: Iterable["torch.Tensor"], records: Mapping[str, "Record"]
    ) -> "MappedFile | None":
        """The mapping that ``tensors`` (loaded from ``path`` with ``torch.load(mmap=True)``, one
        storage per record of ``records``) are views of, or None when their storages do not line up
        with the records (not memory-mapped, or not this file)."""
        storages: dict[int, int] = {}
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes() and t.device.type == "cpu":
                storages[s.data_ptr()] = s.nbytes()
        if not storages:
            return None
        sizes = {r.data_start: r.size for r in records.values()}
        low = min(storages)
        # The mapping starts at a page boundary and every storage is a whole record of it: the base
        # that lines them all up, when exactly one does and the memory there holds the file's bytes.
        bases = [
            low - start for start, size in sizes.items()
            if size == storages[low] and (low - start) % mmap.PAGESIZE == 0
            and all(sizes.get(ptr - (low - start)) == n for ptr, n in storages.items())
        ]
        if len(bases) != 1:
            return None
        mapped = cls(path, bases[0], os.path.getsize(path))
        if all(mapped._holds(ptr, n) for ptr, n in storages.items()):
            return mapped
        mapped.close()  # not this file's bytes after all: never trusted
        return None

    def _holds(self, ptr: int, nbytes: int) -> bool:
        """Whether the memory at ``ptr`` begins with the file's bytes there."""
        import ctypes

        n = min(64, nbytes)
        return os.pread(self.fd, n, ptr - self.base) == bytes((ctypes.c_char * n).from_address(ptr))

    def offset(self, tensor: "torch.Tensor") -> int | None:
        """The file offset of a CPU tensor's first byte, when it lies in this mapping."""
        if not self._closer.alive or tensor.device.type != "cpu":
            return None
        at = tensor.data_ptr() - self.base
        return at if 0 <= at and at + tensor.numel() * tensor.element_size() <= self.size else None

    def run(self, tensor: "torch.Tensor") -> FileRun | None:
        """``tensor`` as a :class:`FileRun`, or None when it is not a contiguous view of this file."""
        if not tensor.numel() or not tensor.is_contiguous():
            return None
        at = self.offset(tensor)
        return None if at is None else FileRun(self.fd, at, tensor.numel() * tensor.element_size(), tensor)

    def piece(self, tensor: "torch.Tensor") -> Piece:
        """``tensor`` as a :class:`FileRun` where it is this file's bytes, else itself."""
        return self.run(tensor) or tensor

    def storage_span(self, tensor: "torch.Tensor") -> tuple[int, int, int] | None:
        """``(fd, offset, nbytes)`` of the file bytes of ``tensor``'s whole storage."""
        storage = tensor.untyped_storage()
        if not storage.nbytes() or not self._closer.alive or tensor.device.type != "cpu":
            return None
        at = storage.data_ptr() - self.base
        return (self.fd, at, storage.nbytes()) if 0 <= at and at + storage.nbytes() <= self.size else None

    def close(self) -> None:
        self._closer()


@dataclass(frozen=True)
class PrivateMapping:
    """A whole file mapped copy-on-write, as one uint8 tensor; ``source`` says where its views'
    bytes are in the file (open until the reader closes it)."""

    buffer: mmap.mmap
    whole: "torch.Tensor"
    source: MappedFile


def map_private(path: "str | os.PathLike[str]") -> PrivateMapping | None:
    """``path`` mapped copy-on-write (views of it are ``torch.frombuffer`` of ``buffer`` at any
    byte offset); None for an empty file or a file system without ``mmap``."""
    import torch

    try:
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        whole = torch.frombuffer(buffer, dtype=torch.uint8)
    except (OSError, ValueError):  # an empty file, a file system without mmap
        return None
    return PrivateMapping(buffer, whole, MappedFile(path, whole.data_ptr(), whole.numel()))


def source_of(tensor: "torch.Tensor", files: Iterable[MappedFile]) -> MappedFile | None:
    """The one of ``files`` whose mapping holds ``tensor``'s storage, or None."""
    return next((f for f in files if f.storage_span(tensor) is not None), None)


def read_into(piece: Piece, out: "torch.Tensor") -> None:
    """Fill ``out`` (the piece's shape, any dtype and strides) with the piece's values: a
    :class:`FileRun` into a contiguous CPU ``out`` of its dtype with ``preadv``, else ``copy_``."""
    import torch

    run = run_of(piece)
    if run is not None and out.device.type == "cpu" and out.is_contiguous() and out.dtype == run.tensor.dtype:
        pread_exact(run.fd, memoryview(out.reshape(-1).view(torch.uint8).numpy()), run.offset)
    else:
        out.copy_(values(piece))


def pread_exact(fd: int, out: memoryview, offset: int) -> None:
    """Fill ``out`` with the bytes of ``fd`` from ``offset`` (``preadv``, partial reads continued)."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n


def pwrite_exact(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` to ``fd`` at ``offset`` (``pwrite``, partial writes continued)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
