"""Lazy reader of a ``torch.distributed.checkpoint`` folder (``.metadata`` + ``*.distcp``).

Used directly for plain DCP folders (accelerate FSDP ``SHARDED_STATE_DICT``, torchtitan, ...) and
as the storage layer of Megatron-Core ``torch_dist`` checkpoints (:mod:`hf_merge.readers.megatron`).

What the folder holds (checked against torch 2.13 ``torch/distributed/checkpoint/filesystem.py``
and Megatron-Core 0.16 saves):

- ``.metadata``: a pickled ``Metadata``. ``state_dict_metadata`` maps each key to a
  ``TensorStorageMetadata`` (global size, dtype, list of chunks ``(offsets, sizes)``) or a
  ``BytesStorageMetadata`` (opaque bytes: Megatron ``_extra_state``, rng state...).
  ``storage_data`` maps ``MetadataIndex(fqn, chunk offsets)`` to
  ``_StorageInfo(relative_path, offset, length, transform_descriptors)``.
- ``__<rank>_<i>.distcp``: data files. With the default ``TORCH_SAVE`` serialization each tensor
  chunk is a complete ``torch.save`` zip archive embedded at ``offset`` (records stored, never
  compressed). The archive's start in the file is *not* aligned.

How it is read here, without a process group and without ``torch.load`` of whole chunks (what
needs no tensor, the metadata and each chunk's archive, is :mod:`~hf_merge.readers.dcp_index`):

- ``.metadata`` is unpickled with an allowlist (the DCP dataclasses, ``torch.Size``, dtypes);
  anything else raises :class:`~hf_merge.errors.UnsafeCheckpointError`.
- For each chunk, the embedded zip's central directory and its tiny ``data.pkl`` are parsed once
  (again with an allowlisting unpickler that only records *where* the tensor lives: storage record,
  dtype, storage offset, size, stride). No tensor is materialised by unpickling.
- Reads are byte-range reads (``os.pread``) of exactly the elements a requested region needs,
  into a bounded buffer (``max_read_bytes``, default 64 MiB; larger regions are split), then
  ``copy_`` into the caller's ``out`` (which may be a view into a memory-mapped output file and may
  have another dtype). Memory stays flat in model size.

Regions: :meth:`DcpCheckpoint.read_region_into` reads any box ``[start, start + out.shape)`` of a
global tensor, so callers can read one layer of a stacked ``[L, ...]`` tensor, or one row range of
a fused tensor, without reading the rest.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import threading
from bisect import bisect_left
from pathlib import Path
from typing import Sequence

import torch

from .file_runs import ColumnGather, FileRun, PrivateMapping, map_private
from . import rank_pool, record_crc
from ..forks import helper_cpus
from ..checkpoint import ROW_CHUNK_BYTES, CheckpointInfo, LazyCheckpoint, check_out, row_runs
from ..errors import CorruptCheckpointError
from ..spec import TensorSpec, c_contiguous
from .dcp_index import METADATA_FILE, PARALLEL_CHUNKS, Chunk as _Chunk, ChunkLayout as _Layout, DcpFolder, is_dcp_dir, load_dcp_metadata, note_records, read_chunk
from .torch_zip import Record

DEFAULT_MAX_READ_BYTES = 64 << 20

__all__ = ["DcpCheckpoint", "is_dcp_dir", "load_dcp_metadata", "DEFAULT_MAX_READ_BYTES", "METADATA_FILE"]


def _read_file_chunks(job: tuple[str, list[tuple[str, _Chunk]]]) -> "tuple[tuple[int, ...], dict[int, tuple]] | None":
    """In a forked process (:mod:`~hf_merge.readers.rank_pool`): the chunk archives of one data file,
    ``(the file's version, {archive start: (records, layout)})`` as plain tuples (:func:`_from_tuples`
    makes them again); a chunk that fails is left out (the reader reads it again and says why); None
    when the file changed while it was read."""
    path, chunks = job
    fd = os.open(path, os.O_RDONLY)
    try:
        version = record_crc.file_version(os.fstat(fd))
        out = {}
        for name, chunk in chunks:
            try:
                records, lay = read_chunk(fd, chunk, f"{path} ({name})")
            except Exception:  # noqa: BLE001 - read again by the reader, which raises its own error
                continue
            out[chunk.start] = (
                [(r.name, r.data_start, r.size, r.crc) for r in records],
                (lay.data_start, lay.storage_nbytes, str(lay.dtype).removeprefix("torch."), lay.storage_offset, lay.size, lay.stride, lay.crc),
            )
        return (version, out) if record_crc.file_version(os.fstat(fd)) == version else None
    finally:
        os.close(fd)


def _from_tuples(read: tuple) -> tuple[list[Record], _Layout]:
    """:func:`_read_file_chunks`' tuples of one chunk as its records and layout."""
    records, lay = read
    return [Record(*r) for r in records], _Layout(lay[0], lay[1], getattr(torch, lay[2]), *lay[3:])


# --------------------------------------------------------------------------------------------
# The lazy checkpoint
# --------------------------------------------------------------------------------------------

_HAVE_PREADV = hasattr(os, "preadv")


def _iov_max() -> int:
    """Buffers one ``preadv`` takes: the system's ``IOV_MAX`` up to 1024; 16 where it is not told
    (``sysconf`` gives -1 for "no fixed limit", or has no such name)."""
    try:
        told = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError, AttributeError):
        return 16
    return min(told, 1024) if told > 0 else 16


_IOV_MAX = _iov_max()
_MIN_ROW_BYTES = 256  # rows scattered into place by preadv from this size (smaller: read and copied)
_DISTCP_RANK = re.compile(r"__(\d+)_(\d+)\.distcp$")


class DcpCheckpoint(LazyCheckpoint):
    """A DCP folder as a :class:`~hf_merge.checkpoint.LazyCheckpoint` of its tensor entries.

    ``specs()`` lists every tensor entry (global shape and dtype) under its DCP key; byte entries
    (``BytesStorageMetadata``) are listed by :meth:`byte_keys` and never read. ``read_into`` and
    :meth:`read_region_into` assemble tensors from their chunks with bounded byte-range reads.

    Args:
        path: the folder holding ``.metadata``.
        max_read_bytes: largest single read buffer; bigger regions are read in pieces.
        info: overrides the default :class:`CheckpointInfo` (``format="dcp"``).
    """

    def __init__(self, path: Path, *, max_read_bytes: int = DEFAULT_MAX_READ_BYTES, info: CheckpointInfo | None = None):
        self.path = Path(path)
        self.max_read_bytes = max(int(max_read_bytes), 1)
        folder = DcpFolder(self.path)
        self._specs: dict[str, TensorSpec] = folder.tensors
        self._byte_keys: list[str] = folder.byte_keys
        self._chunks: dict[str, list[_Chunk]] = folder.chunks
        self._chunk_index: dict[str, tuple[list[tuple[int, ...]], list[_Chunk], tuple[int, ...]]] = {}
        self._file_sizes = folder.file_sizes
        self._folder = folder
        files = list(folder.file_sizes)
        self._fds: dict[str, int] = {}
        self._maps: dict[str, PrivateMapping | None] = {}
        self._lock = threading.Lock()
        self._opened_by = os.getpid()  # forked writers parse their own chunks, as they need them
        self._prefetched: dict[tuple[str, int], tuple] | None = None  # chunk archives read by other processes
        self._prefetch_lock = threading.Lock()
        self._read: set[tuple[str, int, int]] = set()  # the chunks read in this process (read_archives)
        ranks = {int(m.group(1)) for f in files if (m := _DISTCP_RANK.search(f))}
        self.info = info or CheckpointInfo(
            format="dcp",
            path=self.path,
            world_size=(max(ranks) + 1) if ranks else None,
            details={"files": len(files), "tensors": len(self._specs), "byte_entries": len(self._byte_keys)},
        )

    # ---- metadata ---------------------------------------------------------------------------

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def byte_keys(self) -> list[str]:
        """Keys of opaque byte entries (``_extra_state``, rng state...); never read."""
        return list(self._byte_keys)

    def zip_archives(self) -> list[tuple[Path, int, int]]:
        """``(file, start, length)`` of every embedded torch.save archive (for CRC checks)."""
        return sorted({(self.path / c.file, c.start, c.length) for cs in self._chunks.values() for c in cs})

    def read_archives(self) -> list[tuple[Path, int, int]]:
        """``(file, start, length)`` of the archives of the chunks read so far in this process:
        ``verify --against`` checks the CRC-32 of these only, the source bytes the merge uses (a
        damaged optimizer-state chunk, which no merge reads, fails nothing)."""
        return sorted((self.path / f, start, length) for f, start, length in self._read)

    def chunk_boxes(self, name: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``[(offsets, sizes)]`` of the stored chunks of ``name`` (e.g. to infer TP sharding)."""
        return [(c.offsets, c.sizes) for c in self._chunks[name]]

    # ---- reading ----------------------------------------------------------------------------

    def _fd(self, rel: str) -> int:
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                fd = os.open(self.path / rel, os.O_RDONLY)
                self._fds[rel] = fd
            return fd

    def _layout(self, name: str, chunk: _Chunk) -> _Layout:
        self._read.add((chunk.file, chunk.start, chunk.length))
        if chunk.layout is None:
            read = self._prefetch().pop((chunk.file, chunk.start), None)
            if read is not None:
                records, layout = _from_tuples(read)
                note_records(self._fd(chunk.file), chunk, records, name)
                chunk.layout = self._folder.check_dtype(name, chunk, layout)
            else:
                chunk.layout = self._folder.parse_chunk(self._fd(chunk.file), name, chunk)
        return chunk.layout

    def _prefetch(self) -> dict[tuple[str, int], tuple]:
        """The chunk archives other processes read, asked for once (by the first tensor read): where
        there are many (:data:`PARALLEL_CHUNKS`) in several files, and in the process that opened
        the checkpoint, the data files go to a forked process per CPU; a file's reads are taken
        only if it is still the version they read."""
        with self._prefetch_lock:
            if self._prefetched is None:
                self._prefetched = {}
                todo: dict[str, list[tuple[str, _Chunk]]] = {}
                for name, chunks in self._chunks.items():
                    for c in chunks:
                        if c.layout is None:
                            todo.setdefault(c.file, []).append((name, c))
                cpus = helper_cpus()
                if os.getpid() == self._opened_by and len(todo) > 1 and cpus > 1 and sum(map(len, todo.values())) >= PARALLEL_CHUNKS:
                    pool = rank_pool.RankPool({rel: (str(self.path / rel), items) for rel, items in todo.items()}, cpus,
                                              read=_read_file_chunks)
                    try:
                        for rel in todo:
                            got = pool.take(rel)
                            if got is not None and got[0] == record_crc.file_version(os.fstat(self._fd(rel))):
                                self._prefetched.update(((rel, start), read) for start, read in got[1].items())
                    finally:
                        pool.close()
            return self._prefetched

    def _checked_layout(self, name: str, chunk: _Chunk) -> _Layout:
        """The chunk's layout, its storage record's CRC-32 checked (once) before its bytes are used."""
        lay = self._layout(name, chunk)
        record_crc.check_record(
            self._fd(chunk.file), lay.data_start, lay.storage_nbytes, lay.crc,
            f"{chunk.file}: zip record of {name[:60]} (archive at byte {chunk.start})",
        )
        return lay

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        spec = self._spec(name)
        out = torch.empty(spec.shape, dtype=dtype or spec.dtype)
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        spec = self._spec(name)
        check_out(spec, out)
        self.read_region_into(name, (0,) * len(spec.shape), out)

    def read_region_into(self, name: str, start: Sequence[int], out: torch.Tensor) -> None:
        """Fill ``out`` with the box ``[start, start + out.shape)`` of tensor ``name``."""
        spec = self._spec(name)
        start = tuple(int(s) for s in start)
        size = tuple(out.shape)
        if len(start) != len(spec.shape) or len(size) != len(spec.shape) or any(
            s < 0 or s + n > d for s, n, d in zip(start, size, spec.shape)
        ):
            raise ValueError(f"{name}: region {list(start)}+{list(size)} is outside shape {list(spec.shape)}")
        if out.numel() == 0:
            return
        for chunk in self._chunks_near(name, start, size):
            lo = [max(s, o) for s, o in zip(start, chunk.offsets)]
            hi = [min(s + n, o + z) for s, n, o, z in zip(start, size, chunk.offsets, chunk.sizes)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            box_size = tuple(b - a for a, b in zip(lo, hi))
            src_start = tuple(a - o for a, o in zip(lo, chunk.offsets))
            dst = out[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))]
            self._copy_box(name, chunk, src_start, box_size, dst)

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        """Chunks that split dim 0 only (FSDP's ``Shard(0)``, as accelerate and torchtitan save) are
        runs of whole rows: views of the ``.distcp`` file mapped copy-on-write, handed out as
        :class:`~hf_merge.readers.file_runs.FileRun`\\ s, so the writer copies them file to file (``copy_file_range``)
        instead of reading them into a buffer and writing it out. Other layouts (a chunk cut along
        another dimension, a file that cannot be mapped) are read box by box (the default), except
        chunks cut along the columns only (a TP>1 row-parallel weight), whose rows are
        :class:`~hf_merge.readers.file_runs.ColumnGather`\\ s (:meth:`file_rows`)."""
        spec = self._spec(name)
        views = self._row_views(name) if spec.shape and spec.shape[0] else None
        if views is None:
            side_by_side = self.file_rows(name, (), 0, spec.shape[0]) if dtype == spec.dtype and spec.shape and spec.shape[0] else None
            return iter(side_by_side) if side_by_side is not None else super().read_rows(name, dtype, max_bytes)

        def runs():
            for first, view, chunk in views:
                self._checked_layout(name, chunk)  # its record's CRC-32 (noted, when a writer streams it)
                yield from row_runs(view, first, dtype, max_bytes, self._maps[chunk.file].source)

        return runs()

    def file_rows(self, name: str, index: tuple[int, ...], first: int, rows: int) -> list[tuple[int, FileRun]] | None:
        """Rows ``first .. first + rows`` of ``name[index]`` (``index`` fixes the leading dims, e.g.
        the layer of a stacked ``[L, rows, H]`` tensor) as the file runs that hold them:
        ``(row, run)`` in row order, ``row`` counted from ``first``. None when a chunk cuts a
        dim after the columns or a file does not map; rows whose columns several chunks hold (a TP>1
        row-parallel weight) are a :class:`~hf_merge.readers.file_runs.ColumnGather`. Each chunk's
        record is noted for its CRC-32 check (:func:`~hf_merge.readers.record_crc.check_record`)."""
        spec, k = self._spec(name), len(index)
        start = (*index, first) + (0,) * (len(spec.shape) - k - 1)
        size = (1,) * k + (rows,) + spec.shape[k + 1:]
        if k >= len(spec.shape) or any(s < 0 or s + n > d for s, n, d in zip(start, size, spec.shape)):
            raise ValueError(f"{name}: rows {first}+{rows} of {list(index)} are outside shape {list(spec.shape)}")
        bands = self._folder.row_slices(name, self._chunks_near(name, start, size), index, first, rows, ROW_CHUNK_BYTES)
        if bands is None:
            return None
        runs: list[tuple[int, FileRun | ColumnGather]] = []
        for lo, hi, held in bands:
            parts = []
            for chunk in held:
                view = self._view(name, chunk)
                if view is None:
                    return None
                sub = view[tuple(i - o for i, o in zip(index, chunk.offsets))][lo - chunk.offsets[k] : hi - chunk.offsets[k]]
                run = self._maps[chunk.file].source.run(sub)
                if run is None:
                    return None
                self._checked_layout(name, chunk)
                parts.append(run)
            runs.append((lo - first, parts[0] if len(parts) == 1 else ColumnGather(tuple(parts), hi - lo)))
        return runs if runs and sum(hi - lo for lo, hi, _ in bands) == rows else None

    def _row_views(self, name: str) -> list[tuple[int, torch.Tensor, _Chunk]] | None:
        """``(first row, chunk view, chunk)`` of every non-empty chunk in row order, when the chunks are
        bands of whole rows stored in C order and their files map; else None."""
        bands = self._folder.row_bands(name)
        if bands is None:
            return None
        views = []
        for chunk in bands:
            view = self._view(name, chunk)
            if view is None:
                return None
            views.append((chunk.offsets[0], view, chunk))
        return views

    def _view(self, name: str, chunk: _Chunk) -> torch.Tensor | None:
        """The chunk as a zero-copy tensor over its mapped file, or None when it is not C-ordered or
        the file does not map."""
        if chunk.view is None:
            lay = self._layout(name, chunk)
            mapped = self._map(chunk.file)
            if mapped is None or not c_contiguous(lay.size, lay.stride):
                return None
            # frombuffer at the chunk's byte offset: the archive's start in the file, hence its
            # data, is not aligned to the element size, which a view of ``whole`` would need.
            view = torch.frombuffer(mapped.buffer, dtype=lay.dtype, count=math.prod(lay.size),
                                    offset=lay.data_start).view(lay.size)
            chunk.view = view
        return chunk.view

    def _map(self, rel: str) -> PrivateMapping | None:
        with self._lock:
            if rel not in self._maps:
                self._maps[rel] = map_private(self.path / rel)
            return self._maps[rel]

    def _chunks_near(self, name: str, start: tuple[int, ...], size: tuple[int, ...]) -> list[_Chunk]:
        """The chunks that may overlap a box: a bisect on the chunks sorted by offsets, narrowed
        dimension by dimension while the box and the chunks pin that dimension to one index (a
        stacked ``[L, E, ...]`` tensor has L*E chunks or more; one expert must not scan them all)."""
        index = self._chunk_index.get(name)
        if index is None:
            chunks = sorted(self._chunks[name], key=lambda c: c.offsets)
            largest = tuple(max(c.sizes[d] for c in chunks) for d in range(len(start))) if chunks else ()
            index = self._chunk_index[name] = ([c.offsets for c in chunks], chunks, largest)
        offsets, chunks, largest = index
        lo: list[int] = []
        hi: list[int] = []
        for d in range(len(start)):
            first, last = max(0, start[d] - largest[d] + 1), start[d] + size[d] - 1
            lo.append(first)
            hi.append(last)
            if first != last:
                break
        if not lo:
            return chunks
        i = bisect_left(offsets, tuple(lo))
        j = bisect_left(offsets, tuple(hi[:-1]) + (hi[-1] + 1,))
        return chunks[i:j]

    def _copy_box(
        self, name: str, chunk: _Chunk, src_start: tuple[int, ...], size: tuple[int, ...], dst: torch.Tensor
    ) -> None:
        """Copy the box ``src_start + size`` of one chunk into ``dst`` with bounded reads."""
        lay = self._checked_layout(name, chunk)
        item = lay.dtype.itemsize
        first = lay.storage_offset + sum(s * st for s, st in zip(src_start, lay.stride))
        span = 1 + sum((n - 1) * st for n, st in zip(size, lay.stride))
        fd = self._fd(chunk.file)
        where = lay.data_start + first * item
        if dst.dtype == lay.dtype and dst.is_contiguous() and c_contiguous(size, lay.stride):
            # The box is one contiguous byte range and dst can take it as is: read straight into
            # dst (e.g. a view into the memory-mapped output file), no intermediate buffer.
            target = _writable_bytes(dst)
            if target is not None:
                self._pread_exact(fd, target, where, name, chunk)
                return
        if dst.dtype == lay.dtype and _HAVE_PREADV and c_contiguous(size, lay.stride):
            rows = _row_bytes(dst)
            if rows is not None:
                # dst's rows lie apart (a TP rank's columns of the caller's tensor): the box's one
                # byte range is scattered straight into them, no intermediate buffer
                self._pread_rows(fd, rows, where, name, chunk)
                return
        if span * item > self.max_read_bytes:
            # Split along the first dimension that has more than one index, and recurse.
            for d, n in enumerate(size):
                if n > 1:
                    step = max(1, n // max(2, -(-span * item // self.max_read_bytes)))
                    for a in range(0, n, step):
                        b = min(n, a + step)
                        sub_start = src_start[:d] + (src_start[d] + a,) + src_start[d + 1 :]
                        sub_size = size[:d] + (b - a,) + size[d + 1 :]
                        self._copy_box(name, chunk, sub_start, sub_size, dst.narrow(d, a, b - a))
                    return
        buf = bytearray(span * item)
        self._pread_exact(fd, memoryview(buf), where, name, chunk)
        src = torch.frombuffer(buf, dtype=lay.dtype).as_strided(size, lay.stride)
        dst.copy_(src)

    def _pread_rows(self, fd: int, rows: list[memoryview], offset: int, name: str, chunk: _Chunk) -> None:
        """Fill ``rows`` in order from the bytes of ``fd`` at ``offset`` (``preadv`` of up to
        ``IOV_MAX`` rows a call, short reads continued)."""
        i, part, at = 0, 0, offset
        while i < len(rows):
            n = os.preadv(fd, [rows[i][part:], *rows[i + 1 : i + _IOV_MAX]], at)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"{self.path / chunk.file}: short read of {name} (row {i} of {len(rows)} at byte {at})"
                )
            at, n = at + n, n + part
            while i < len(rows) and n >= len(rows[i]):
                n -= len(rows[i])
                i += 1
            part = n

    def _pread_exact(self, fd: int, target: memoryview, offset: int, name: str, chunk: _Chunk) -> None:
        done, total = 0, target.nbytes
        while done < total:
            if _HAVE_PREADV:
                n = os.preadv(fd, [target[done:]], offset + done)
            else:  # pragma: no cover - platforms without preadv
                data = os.pread(fd, min(total - done, 1 << 30), offset + done)
                n = len(data)
                target[done : done + n] = data
            if n <= 0:
                raise CorruptCheckpointError(
                    f"{self.path / chunk.file}: short read of {name} ({done} of {total} bytes at byte {offset})"
                )
            done += n

    def _spec(self, name: str) -> TensorSpec:
        try:
            return self._specs[name]
        except KeyError:
            hint = " (it is a byte entry, not a tensor)" if name in self._byte_keys else ""
            raise KeyError(f"{name!r} is not a tensor in {self.path}{hint}") from None

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
            maps, self._maps = self._maps, {}
        for chunks in self._chunks.values():
            for chunk in chunks:
                chunk.view = None
        for mapped in maps.values():
            if mapped is not None:
                mapped.source.close()
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def _row_bytes(t: torch.Tensor) -> list[memoryview] | None:
    """Writable byte views of the innermost rows of a CPU tensor whose rows are contiguous but lie
    apart, in C order; None for rows shorter than :data:`_MIN_ROW_BYTES` (a copy is cheaper than
    a buffer per row) or a tensor numpy cannot view."""
    if t.dim() < 2 or t.device.type != "cpu" or t.stride(-1) != 1 or t.shape[-1] * t.element_size() < _MIN_ROW_BYTES:
        return None
    try:
        arr = t.view(torch.uint8).numpy()
    except Exception:  # no numpy, or a view numpy cannot take
        return None
    return [memoryview(arr[index]) for index in itertools.product(*map(range, arr.shape[:-1]))]


def _writable_bytes(t: torch.Tensor) -> memoryview | None:
    """A writable byte view of a contiguous CPU tensor's memory (None if numpy is missing)."""
    try:
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
    except Exception:  # no numpy, or a tensor numpy cannot view
        return None
