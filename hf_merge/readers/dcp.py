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

How it is read here, without a process group and without ``torch.load`` of whole chunks:

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

import functools
import itertools
import math
import mmap
import os
import re
import threading
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from .file_runs import FileRun, MappedFile
from . import contained, rank_pool, record_crc
from ..forks import helper_cpus
from ..checkpoint import ROW_CHUNK_BYTES, CheckpointInfo, LazyCheckpoint, check_out, row_runs
from ..errors import (
    CorruptCheckpointError,
    PickleRefusedError,
    SourceNotFoundError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from ..spec import TensorSpec, c_contiguous
from .safe_pickle import DCP_METADATA, Allowlist, load_pickle, torch_names
from .dcp_metadata import check_tensor_properties, metadata_substitutes
from .torch_zip import Record, Window, checked_pickle, read_records

METADATA_FILE = ".metadata"
#: what to do about a .metadata that holds what torch.distributed.checkpoint never writes
NOT_DCP = "the file is damaged (re-copy it from the training run) or was not written by torch.distributed.checkpoint"
DEFAULT_MAX_READ_BYTES = 64 << 20

__all__ = ["DcpCheckpoint", "is_dcp_dir", "load_dcp_metadata", "DEFAULT_MAX_READ_BYTES"]


def is_dcp_dir(path: Path) -> bool:
    """True if ``path`` is a folder with a DCP ``.metadata`` file."""
    return Path(path).is_dir() and (Path(path) / METADATA_FILE).is_file()


# --------------------------------------------------------------------------------------------
# .metadata: allowlisted unpickling
# --------------------------------------------------------------------------------------------

def load_dcp_metadata(path: Path) -> Any:
    """Unpickle ``<path>/.metadata`` under :data:`~hf_merge.readers.safe_pickle.DCP_METADATA`, its
    classes as inert stand-ins (:mod:`~hf_merge.readers.dcp_metadata`; no torch.distributed import)."""
    meta_path = Path(path) / METADATA_FILE
    if not meta_path.is_file():
        raise SourceNotFoundError(f"{path}: no {METADATA_FILE} file; not a torch.distributed.checkpoint folder")
    with open(contained.check(meta_path), "rb") as f:
        try:
            md = load_pickle(f, DCP_METADATA, str(meta_path), substitutes=metadata_substitutes())
        except PickleRefusedError as e:  # the same refusal; DCP writes nothing outside the allowlist
            raise PickleRefusedError(e.where, e.what, advice=NOT_DCP.capitalize()) from None
    if not hasattr(md, "state_dict_metadata") or not hasattr(md, "storage_data"):
        raise CorruptCheckpointError(f"{meta_path}: unpickled object is not DCP Metadata ({type(md).__name__}); {NOT_DCP}")
    check_tensor_properties(md, str(meta_path))
    return md


# --------------------------------------------------------------------------------------------
# Chunks: where one piece of a tensor lives in a .distcp file
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Where a chunk's elements are, in the data file: ``data_start`` is the byte of element 0 of
    the storage; the chunk is ``as_strided(size, stride, storage_offset)`` of that storage."""

    data_start: int
    storage_nbytes: int
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    crc: int = 0  # the storage record's CRC-32, from the archive's zip directory


@dataclass
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int  # byte offset of the embedded torch.save archive
    length: int
    layout: _Layout | None = None
    view: torch.Tensor | None = None  # the chunk as a view of its mapped file (read_rows), once made


@dataclass(frozen=True)
class _Mapped:
    """A ``.distcp`` file mapped copy-on-write, as one uint8 tensor; ``source`` says where its views'
    bytes are in the file (:class:`~hf_merge.readers.file_runs.MappedFile`, open until ``close()``)."""

    buffer: mmap.mmap
    whole: torch.Tensor
    source: MappedFile


class _RebuildRecord:
    """What ``torch._utils._rebuild_tensor_v2`` would have built, without building it."""

    def __init__(self, storage: tuple, storage_offset: int, size: Sequence[int], stride: Sequence[int], *rest: Any):
        self.storage = storage
        self.storage_offset = int(storage_offset)
        self.size = tuple(int(s) for s in size)
        self.stride = tuple(int(s) for s in stride)


def _storage_dtype(name: str) -> torch.dtype | None:
    """``"FloatStorage"`` -> ``torch.float32`` (the legacy storage class names torch.save pickles)."""
    if not name.endswith("Storage"):
        return None
    try:
        from torch.storage import _get_dtype_from_pickle_storage_type

        return _get_dtype_from_pickle_storage_type(name)
    except Exception:
        return None


#: A chunk's ``data.pkl`` is read under this allowlist, with the rebuild function replaced by a
#: recorder (no tensor is built) and storage classes by their dtype.
_CHUNK_PICKLE = Allowlist.of(calls=[("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict")])


@functools.cache
def _chunk_substitutes() -> dict[tuple[str, str], Any]:
    """The chunk pickles' stand-ins (the same for every chunk: made once; the unpickler copies them)."""
    subs: dict[tuple[str, str], Any] = {("torch._utils", "_rebuild_tensor_v2"): _RebuildRecord}
    for module, name in torch_names().names:
        if _storage_dtype(name) is not None:
            subs[(module, name)] = ("storage_type", _storage_dtype(name))
    return subs


def _chunk_persistent_load(pid: Any) -> Any:
    # ('storage', storage_type, key, location, numel)
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise UnsupportedCheckpointError(f"DCP chunk pickle has an unexpected persistent id {str(pid)[:60]}")
    _, stype, key, _location, numel = pid
    dtype = stype[1] if isinstance(stype, tuple) else stype
    if not isinstance(dtype, torch.dtype) or not isinstance(numel, int) or numel < 0:
        raise UnsupportedCheckpointError(f"DCP chunk storage type {str(stype)[:60]} is not understood")
    return (str(key), dtype, int(numel))


#: chunk pickles already read, by their bytes: the chunks of same-shaped tensors (every layer's)
#: pickle the same bytes, so a 64-layer model's 1,542 chunks hold a few dozen distinct pickles
_CHUNK_PICKLES: dict[bytes, Any] = {}
_CHUNK_PICKLES_MAX = 1 << 16


def _chunk_pickle(data: bytes, where: str) -> Any:
    """A chunk's ``data.pkl`` read under :data:`_CHUNK_PICKLE` (the policy's walk and refusals as
    always), once per distinct pickle: the same bytes give the same recorder, which is only read."""
    known = _CHUNK_PICKLES.get(data)
    if known is None:
        known = load_pickle(data, _CHUNK_PICKLE, where, substitutes=_chunk_substitutes(), persistent_load=_chunk_persistent_load)
        if len(_CHUNK_PICKLES) < _CHUNK_PICKLES_MAX:
            _CHUNK_PICKLES[data] = known
    return known


#: chunk archives in all from which the first tensor read has them read by a forked process per CPU
#: (~0.15 ms of checks each: 4,096 is ~0.6 s on one core)
PARALLEL_CHUNKS = 4096

#: bytes read up front at each end of a chunk's archive: its small records before the tensor's data
#: (~1 KB: data.pkl, byteorder, ...) and its central directory after it (~1 KB), in one read each
_ARCHIVE_ENDS = 4096


def _parse_chunk(fd: int, chunk: _Chunk, where: str, tensor: str = "") -> _Layout:
    """Parse the embedded torch.save archive of ``chunk``: find its storage record and layout; its
    records' CRC-32 are noted for the writer's checks (:func:`_read_chunk`)."""
    records, layout = _read_chunk(fd, chunk, where)
    _note_records(fd, chunk, records, tensor)
    return layout


def _note_records(fd: int, chunk: _Chunk, records: Iterable[Record], tensor: str) -> None:
    """``records`` of ``chunk``'s archive, for the writer's CRC checks; every chunk archive has an
    "archive/data/0": their names say whose it is."""
    whose = f" of {tensor[:80]} (archive at byte {chunk.start})"
    record_crc.add_archive(fd, {r.name: Record(r.name + whose, r.data_start, r.size, r.crc) for r in records}, chunk.file)


def _read_chunk(fd: int, chunk: _Chunk, where: str) -> tuple[list[Record], _Layout]:
    """The embedded torch.save archive of ``chunk``, checked: ``(its records, the tensor's
    layout)``. The archive's records are checked first
    (:func:`~hf_merge.readers.torch_zip.read_records`: stored, local headers agree with the central
    directory, records tile the archive)."""
    window = Window(fd, chunk.start, chunk.length, ends=_ARCHIVE_ENDS)
    records = read_records(window, f"{where}, chunk at byte {chunk.start}", base=chunk.start)
    pkl = [n for n in records if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        raise CorruptCheckpointError(f"{where}: chunk at byte {chunk.start} has no single data.pkl record")
    prefix = pkl[0][: -len("data.pkl")]
    order = records.get(prefix + "byteorder")
    if order is not None and window.pread(min(order.size, 16), order.data_start - chunk.start).strip() not in (b"little", b""):
        raise UnsupportedCheckpointError(f"{where}: big-endian tensor data is not supported")
    rec_info = records[pkl[0]]
    data = checked_pickle(window.pread(rec_info.size, rec_info.data_start - chunk.start), rec_info, f"{where}, chunk at byte {chunk.start}")
    rec = _chunk_pickle(data, f"{where}, chunk at byte {chunk.start}")
    if not isinstance(rec, _RebuildRecord) or not isinstance(rec.storage, tuple):
        raise UnsupportedCheckpointError(f"{where}: chunk at byte {chunk.start} does not hold a single tensor")
    key, dtype, numel = rec.storage
    info = records.get(f"{prefix}data/{key}")
    if info is None:
        raise CorruptCheckpointError(f"{where}: chunk at byte {chunk.start} lacks storage record data/{key[:40]}")
    data_start = info.data_start
    nbytes = numel * dtype.itemsize
    if info.size != nbytes:
        raise CorruptCheckpointError(
            f"{where}: storage record of chunk at byte {chunk.start} has {info.size} bytes, expected {nbytes}"
        )
    layout = _Layout(data_start, nbytes, dtype, rec.storage_offset, rec.size, rec.stride, info.crc)
    if layout.size != chunk.sizes:
        raise CorruptCheckpointError(
            f"{where}: chunk at byte {chunk.start} holds shape {layout.size}, metadata says {chunk.sizes}"
        )
    # DCP saves each chunk as a tensor owning exactly its storage (torch clones views first), so
    # the tensor is dense over the whole storage from offset 0; anything else is a damaged pickle.
    if layout.storage_offset != 0 or math.prod(layout.size) != numel or not _dense(layout.size, layout.stride):
        raise CorruptCheckpointError(
            f"{where}: chunk at byte {chunk.start} has storage offset {layout.storage_offset}, strides "
            f"{list(layout.stride)[:8]} for shape {list(layout.size)[:8]} over {numel} elements; not a dense DCP chunk, "
            "the file is damaged"
        )
    return list(records.values()), layout


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
                records, lay = _read_chunk(fd, chunk, f"{path} ({name})")
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
        md = load_dcp_metadata(self.path)
        self._specs: dict[str, TensorSpec] = {}
        self._byte_keys: list[str] = []
        self._chunks: dict[str, list[_Chunk]] = {}
        self._chunk_index: dict[str, tuple[list[tuple[int, ...]], list[_Chunk], tuple[int, ...]]] = {}
        try:
            files = self._read_metadata(md)
        except (AttributeError, TypeError, ValueError, KeyError, IndexError, OverflowError) as e:  # fields of the wrong kind
            raise CorruptCheckpointError(
                f"{self.path / METADATA_FILE}: malformed DCP metadata ({type(e).__name__}: {str(e)[:100]}); "
                f"{NOT_DCP}"
            ) from None
        self._file_sizes = {}
        for rel in sorted(files):
            p = contained.check(self.path / rel)
            if not p.is_file():
                raise CorruptCheckpointError(
                    f"{self.path}: data file {rel} listed in {METADATA_FILE} is missing; copy it from the training run "
                    f"(if it was never written there, {METADATA_FILE} is damaged or not of this folder)"
                )
            self._file_sizes[rel] = p.stat().st_size
        for key, chunks in self._chunks.items():
            for c in chunks:
                if c.start + c.length > self._file_sizes[c.file]:
                    raise CorruptCheckpointError(
                        f"{self.path / c.file}: truncated (ends at byte {self._file_sizes[c.file]}, "
                        f"{key} needs bytes up to {c.start + c.length}); re-copy it from the training run"
                    )
        self._fds: dict[str, int] = {}
        self._maps: dict[str, _Mapped | None] = {}
        self._lock = threading.Lock()
        self._opened_by = os.getpid()  # forked writers parse their own chunks, as they need them
        self._prefetched: dict[tuple[str, int], tuple] | None = None  # chunk archives read by other processes
        self._prefetch_lock = threading.Lock()
        ranks = {int(m.group(1)) for f in files if (m := _DISTCP_RANK.search(f))}
        self.info = info or CheckpointInfo(
            format="dcp",
            path=self.path,
            world_size=(max(ranks) + 1) if ranks else None,
            details={"files": len(files), "tensors": len(self._specs), "byte_entries": len(self._byte_keys)},
        )

    # ---- metadata ---------------------------------------------------------------------------

    def _read_metadata(self, md: Any) -> set[str]:
        """Specs and chunks from the unpickled ``Metadata``; returns the data files it names."""
        storage: dict[tuple[str, tuple[int, ...]], Any] = {}
        for idx, sinfo in md.storage_data.items():
            off = tuple(idx.offset) if idx.offset is not None else None
            storage[(idx.fqn, off)] = sinfo
        files: set[str] = set()
        for key, entry in md.state_dict_metadata.items():
            if not hasattr(entry, "chunks"):
                self._byte_keys.append(key)
                continue
            dtype = entry.properties.dtype
            if not isinstance(key, str) or not isinstance(dtype, torch.dtype):
                raise TypeError(f"entry {str(key)[:60]} has dtype {str(dtype)[:40]}")
            shape = tuple(int(s) for s in entry.size)
            self._specs[key] = TensorSpec(key, shape, dtype)
            chunks = []
            for c in entry.chunks:
                offsets, sizes = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
                sinfo = storage.get((key, offsets))
                if sinfo is None:
                    raise CorruptCheckpointError(
                        f"{self.path / METADATA_FILE}: {key} chunk at {list(offsets)} has no storage entry; {NOT_DCP}"
                    )
                if getattr(sinfo, "transform_descriptors", None):
                    raise UnsupportedCheckpointError(
                        f"{self.path}: {key} is stored with transforms {list(sinfo.transform_descriptors)} "
                        "(e.g. compression); hf_merge reads untransformed DCP chunks only"
                    )
                rel = sinfo.relative_path
                if not isinstance(rel, str):
                    raise CorruptCheckpointError(
                        f"{self.path}: {key} chunk at {list(offsets)} has a relative_path that is a "
                        f"{type(rel).__name__}, not a file name, in {METADATA_FILE}; re-copy the checkpoint"
                    )
                if os.path.isabs(rel) or ".." in Path(rel).parts:
                    raise UnsafeCheckpointError(f"{self.path}: storage path {rel!r} escapes the checkpoint folder")
                files.add(rel)
                if int(sinfo.offset) < 0 or int(sinfo.length) < 0:
                    raise ValueError(f"{key} chunk has a negative byte range")
                chunks.append(_Chunk(offsets, sizes, rel, int(sinfo.offset), int(sinfo.length)))
            self._check_cover(key, shape, chunks)
            self._chunks[key] = chunks
        return files


    def _check_cover(self, key: str, shape: tuple[int, ...], chunks: list[_Chunk]) -> None:
        """The chunks must tile the tensor exactly (inside it, no overlap, no hole), from the
        metadata alone: overlapping chunks whose sizes still add up would leave a hole unread."""
        total = 0
        for c in chunks:
            if len(c.offsets) != len(shape) or len(c.sizes) != len(shape) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, shape)
            ):
                raise CorruptCheckpointError(
                    f"{self.path / METADATA_FILE}: {key} chunk {list(c.offsets)[:8]}+{list(c.sizes)[:8]} lies outside "
                    f"shape {list(shape)}; {NOT_DCP}"
                )
            total += math.prod(c.sizes)
        numel = math.prod(shape)
        if total == numel:
            clash = _first_overlap(chunks)
            if clash is None:
                return
            a, b = clash
            raise CorruptCheckpointError(
                f"{self.path}: chunks {list(a.offsets)[:8]} and {list(b.offsets)[:8]} of {key} overlap (their sizes add "
                f"up, so part of the tensor would be left unread); the {METADATA_FILE} is damaged"
            )
        raise CorruptCheckpointError(
            f"{self.path}: chunks of {key} cover {total} of {numel} elements; the checkpoint is incomplete"
            if total < numel
            else f"{self.path}: chunks of {key} overlap ({total} elements for {numel}); the {METADATA_FILE} is damaged"
        )

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def byte_keys(self) -> list[str]:
        """Keys of opaque byte entries (``_extra_state``, rng state...); never read."""
        return list(self._byte_keys)

    def zip_archives(self) -> list[tuple[Path, int, int]]:
        """``(file, start, length)`` of every embedded torch.save archive (for CRC checks)."""
        return sorted({(self.path / c.file, c.start, c.length) for cs in self._chunks.values() for c in cs})

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
        if chunk.layout is None:
            read = self._prefetch().pop((chunk.file, chunk.start), None)
            if read is not None:
                records, chunk.layout = _from_tuples(read)
                _note_records(self._fd(chunk.file), chunk, records, name)
            else:
                chunk.layout = _parse_chunk(self._fd(chunk.file), chunk, f"{self.path / chunk.file} ({name})", name)
            if chunk.layout.dtype != self._specs[name].dtype:
                raise CorruptCheckpointError(
                    f"{self.path / chunk.file}: {name} chunk has dtype {chunk.layout.dtype}, "
                    f"metadata says {self._specs[name].dtype}"
                )
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
        another dimension, a file that cannot be mapped) are read box by box (the default)."""
        spec = self._spec(name)
        views = self._row_views(name, spec) if spec.shape and spec.shape[0] else None
        if views is None:
            return super().read_rows(name, dtype, max_bytes)

        def runs():
            for first, view, chunk in views:
                self._checked_layout(name, chunk)  # its record's CRC-32 (noted, when a writer streams it)
                yield from row_runs(view, first, dtype, max_bytes, self._maps[chunk.file].source)

        return runs()

    def file_rows(self, name: str, index: tuple[int, ...], first: int, rows: int) -> list[tuple[int, FileRun]] | None:
        """Rows ``first .. first + rows`` of ``name[index]`` (``index`` fixes the leading dims, e.g.
        the layer of a stacked ``[L, rows, H]`` tensor) as the file runs that hold them:
        ``(row, run)`` in row order, ``row`` counted from ``first``. None when a chunk cuts a
        trailing dim (its rows are not contiguous bytes) or a file does not map. Each chunk's
        record is noted for its CRC-32 check (:func:`~hf_merge.readers.record_crc.check_record`)."""
        spec, k = self._spec(name), len(index)
        start = (*index, first) + (0,) * (len(spec.shape) - k - 1)
        size = (1,) * k + (rows,) + spec.shape[k + 1:]
        if k >= len(spec.shape) or any(s < 0 or s + n > d for s, n, d in zip(start, size, spec.shape)):
            raise ValueError(f"{name}: rows {first}+{rows} of {list(index)} are outside shape {list(spec.shape)}")
        runs = []
        for chunk in self._chunks_near(name, start, size):
            lo, hi = max(first, chunk.offsets[k]), min(first + rows, chunk.offsets[k] + chunk.sizes[k])
            if lo >= hi or any(not o <= i < o + n for i, o, n in zip(index, chunk.offsets, chunk.sizes)):
                continue
            if chunk.offsets[k + 1:] != start[k + 1:] or chunk.sizes[k + 1:] != size[k + 1:]:
                return None
            view = self._view(name, chunk)
            if view is None:
                return None
            sub = view[tuple(i - o for i, o in zip(index, chunk.offsets))][lo - chunk.offsets[k] : hi - chunk.offsets[k]]
            run = self._maps[chunk.file].source.run(sub)
            if run is None:
                return None
            self._checked_layout(name, chunk)
            runs.append((lo - first, run))
        runs.sort(key=lambda r: r[0])
        return runs if sum(len(r.tensor) for _, r in runs) == rows else None

    def _row_views(self, name: str, spec: TensorSpec) -> list[tuple[int, torch.Tensor, _Chunk]] | None:
        """``(first row, chunk view, chunk)`` of every non-empty chunk in row order, when the chunks are
        bands of whole rows stored in C order and their files map; else None."""
        rest = (0,) * (len(spec.shape) - 1)
        bands = sorted((c for c in self._chunks[name] if math.prod(c.sizes)), key=lambda c: c.offsets)
        if any(c.offsets[1:] != rest or c.sizes[1:] != spec.shape[1:] for c in bands):
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

    def _map(self, rel: str) -> _Mapped | None:
        with self._lock:
            if rel not in self._maps:
                self._maps[rel] = None
                try:
                    with open(self.path / rel, "rb") as f:
                        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                    whole = torch.frombuffer(buffer, dtype=torch.uint8)
                except (OSError, ValueError):  # an empty file, a file system without mmap
                    return None
                source = MappedFile(self.path / rel, whole.data_ptr(), whole.numel())
                self._maps[rel] = _Mapped(buffer, whole, source)
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


def _dense(size: Sequence[int], stride: Sequence[int]) -> bool:
    """True if ``size``/``stride`` covers a storage of ``prod(size)`` elements exactly once (C
    order or any permutation of the dimensions)."""
    if len(size) != len(stride) or any(s < 0 for s in stride):
        return False
    expect = 1
    for n, st in sorted(((n, st) for n, st in zip(size, stride) if n != 1), key=lambda x: x[1]):
        if st != expect:
            return False
        expect *= n
    return True


def _first_overlap(chunks: list[_Chunk]) -> tuple[_Chunk, _Chunk] | None:
    """Two non-empty chunks whose boxes intersect, or None.

    Splits into slabs one dimension at a time while the chunks' intervals along it are disjoint
    or equal (a MoE weight ``[L, E, 2F, H]`` chunked per layer and expert: per layer, then per
    expert), so that only chunks in the same slab are compared; a dimension where intervals
    cross is swept pairwise (:func:`_swept_overlap`)."""
    return _overlap_from(sorted((c for c in chunks if all(s > 0 for s in c.sizes)), key=lambda c: c.offsets), 0)


def _overlap_from(boxes: list[_Chunk], dim: int) -> tuple[_Chunk, _Chunk] | None:
    """:func:`_first_overlap` of ``boxes`` (sorted by offsets), which agree on dimensions < ``dim``."""
    if len(boxes) < 2:
        return None
    if dim == len(boxes[0].offsets):  # the same box twice
        return boxes[0], boxes[1]
    slabs: dict[tuple[int, int], list[_Chunk]] = {}
    for c in boxes:
        slabs.setdefault((c.offsets[dim], c.sizes[dim]), []).append(c)
    spans = sorted(slabs)
    if any(o + s > next_o for (o, s), (next_o, _) in zip(spans, spans[1:])):
        return _swept_overlap(boxes)
    for span in spans:
        clash = _overlap_from(slabs[span], dim + 1)
        if clash is not None:
            return clash
    return None


def _swept_overlap(boxes: list[_Chunk]) -> tuple[_Chunk, _Chunk] | None:
    """Two intersecting boxes of ``boxes`` (sorted by offsets), or None: sweep along dim 0."""
    active: list[_Chunk] = []
    for c in boxes:
        lo = c.offsets[0] if c.offsets else 0
        active = [a for a in active if not a.offsets or a.offsets[0] + a.sizes[0] > lo]
        for a in active:
            if all(ao < co + cs and co < ao + as_ for ao, as_, co, cs in zip(a.offsets, a.sizes, c.offsets, c.sizes)):
                return a, c
        active.append(c)
    return None


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


def iter_regions(shape: Sequence[int], axis: int = 0) -> Iterable[tuple[int, ...]]:
    """Starts of the unit slices of ``shape`` along ``axis`` (helper for layer-by-layer reads)."""
    for i in range(shape[axis]):
        yield tuple(i if d == axis else 0 for d in range(len(shape)))
