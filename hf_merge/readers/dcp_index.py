"""What a ``torch.distributed.checkpoint`` folder's files say, read without importing torch.

:class:`DcpFolder` is the part of the DCP reader that needs no tensor: the ``.metadata`` pickle
(global shapes, dtypes, and which byte range of which ``.distcp`` file holds each chunk's embedded
``torch.save`` archive), checked (chunks tile their tensor, files exist and are long enough), and
each chunk archive's records and tensor layout, parsed on demand. Both pickles are read by the
package's one policy with every class bound to an inert stand-in
(:mod:`~hf_merge.readers.dcp_metadata`) and the rebuild function to a recorder.

- :class:`~hf_merge.readers.dcp.DcpCheckpoint` (torch dtypes) reads tensors on top of it.
- :class:`DcpIndex` (``named``: dtypes are :class:`~hf_merge.spec.DTypeName`\\ s and the pickles may
  name only :data:`~hf_merge.readers.safe_pickle.NAMED_DTYPES`) gives the same row runs as file
  ranges, which the CLI's head start (:mod:`hf_merge.write.head_start`) copies while torch loads.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from . import contained, record_crc
from ..errors import CorruptCheckpointError, PickleRefusedError, SourceNotFoundError, UnsafeCheckpointError, UnsupportedCheckpointError
from ..spec import DTypeName, TensorSpec, c_contiguous
from .dcp_metadata import check_tensor_properties, metadata_substitutes
from .file_runs import ColumnGather, FileRun
from .safe_pickle import DCP_METADATA, Allowlist, load_pickle, named_torch, torch_names
from .torch_zip import Record, Window, checked_pickle, read_records

METADATA_FILE = ".metadata"

#: what to do about a .metadata that holds what torch.distributed.checkpoint never writes
NOT_DCP = "the file is damaged (re-copy it from the training run) or was not written by torch.distributed.checkpoint"

__all__ = ["METADATA_FILE", "Chunk", "ChunkLayout", "DcpFolder", "DcpIndex", "is_dcp_dir", "load_dcp_metadata", "read_chunk"]


def is_dcp_dir(path: Path) -> bool:
    """True if ``path`` is a folder with a DCP ``.metadata`` file."""
    return Path(path).is_dir() and (Path(path) / METADATA_FILE).is_file()


# --------------------------------------------------------------------------------------------
# .metadata: allowlisted unpickling
# --------------------------------------------------------------------------------------------


def _is_torch_dtype(value: Any) -> bool:
    import torch

    return isinstance(value, torch.dtype)


def _is_named_dtype(value: Any) -> bool:
    return isinstance(value, DTypeName)


@functools.cache
def _named_metadata_policy() -> tuple[Allowlist, dict]:
    names, subs = named_torch(lambda dtype: ("storage_type", dtype))
    return names, {**metadata_substitutes(), **subs}


def load_dcp_metadata(path: Path, *, named: bool = False) -> Any:
    """Unpickle ``<path>/.metadata`` under :data:`~hf_merge.readers.safe_pickle.DCP_METADATA`, its
    classes as inert stand-ins (:mod:`~hf_merge.readers.dcp_metadata`; no torch.distributed import);
    ``named``: its dtypes as :class:`~hf_merge.spec.DTypeName`\\ s, no torch import at all."""
    meta_path = Path(path) / METADATA_FILE
    if not meta_path.is_file():
        raise SourceNotFoundError(f"{path}: no {METADATA_FILE} file; not a torch.distributed.checkpoint folder")
    names, subs = _named_metadata_policy() if named else (None, metadata_substitutes())
    with open(contained.check(meta_path), "rb") as f:
        try:
            md = load_pickle(f, DCP_METADATA, str(meta_path), substitutes=subs, names=names)
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
class ChunkLayout:
    """Where a chunk's elements are, in the data file: ``data_start`` is the byte of element 0 of
    the storage; the chunk is ``as_strided(size, stride, storage_offset)`` of that storage."""

    data_start: int
    storage_nbytes: int
    dtype: Any  # torch.dtype, or a DTypeName when read without torch
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    crc: int = 0  # the storage record's CRC-32, from the archive's zip directory


@dataclass
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int  # byte offset of the embedded torch.save archive
    length: int
    layout: ChunkLayout | None = None
    view: Any = None  # the DCP reader's tensor view of the chunk in its mapped file, once made


class _RebuildRecord:
    """What ``torch._utils._rebuild_tensor_v2`` would have built, without building it."""

    def __init__(self, storage: tuple, storage_offset: int, size: Sequence[int], stride: Sequence[int], *rest: Any):
        self.storage = storage
        self.storage_offset = int(storage_offset)
        self.size = tuple(int(s) for s in size)
        self.stride = tuple(int(s) for s in stride)


def _storage_dtype(name: str) -> Any:
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
def _chunk_policy(named: bool) -> tuple[Allowlist | None, dict]:
    """``(names, substitutes)`` of the chunk pickles (the same for every chunk: made once; the
    unpickler copies them): storage classes as ``("storage_type", dtype)``."""
    subs: dict[tuple[str, str], Any] = {("torch._utils", "_rebuild_tensor_v2"): _RebuildRecord}
    if named:
        names, stand_ins = named_torch(lambda dtype: ("storage_type", dtype))
        return names, {**stand_ins, **subs}
    for module, name in torch_names().names:
        if _storage_dtype(name) is not None:
            subs[(module, name)] = ("storage_type", _storage_dtype(name))
    return None, subs


def _persistent_load(named: bool):
    is_dtype = _is_named_dtype if named else _is_torch_dtype

    def load(pid: Any) -> Any:
        # ('storage', storage_type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsupportedCheckpointError(f"DCP chunk pickle has an unexpected persistent id {str(pid)[:60]}")
        _, stype, key, _location, numel = pid
        dtype = stype[1] if isinstance(stype, tuple) else stype
        if not is_dtype(dtype) or not isinstance(numel, int) or numel < 0:
            raise UnsupportedCheckpointError(f"DCP chunk storage type {str(stype)[:60]} is not understood")
        return (str(key), dtype, int(numel))

    return load


#: chunk pickles already read, by their bytes: the chunks of same-shaped tensors (every layer's)
#: pickle the same bytes, so a 64-layer model's 1,542 chunks hold a few dozen distinct pickles
_CHUNK_PICKLES: dict[tuple[bool, bytes], Any] = {}
_CHUNK_PICKLES_MAX = 1 << 16


def _chunk_pickle(data: bytes, where: str, named: bool) -> Any:
    """A chunk's ``data.pkl`` read under :data:`_CHUNK_PICKLE` (the policy's walk and refusals as
    always), once per distinct pickle: the same bytes give the same recorder, which is only read."""
    known = _CHUNK_PICKLES.get((named, data))
    if known is None:
        names, subs = _chunk_policy(named)
        known = load_pickle(data, _CHUNK_PICKLE, where, substitutes=subs, persistent_load=_persistent_load(named), names=names)
        if len(_CHUNK_PICKLES) < _CHUNK_PICKLES_MAX:
            _CHUNK_PICKLES[(named, data)] = known
    return known


#: chunk archives in all from which the DCP reader's first tensor read has them read by a forked
#: process per CPU (~0.15 ms of checks each: 4,096 is ~0.6 s on one core)
PARALLEL_CHUNKS = 4096

#: bytes read up front at each end of a chunk's archive: its small records before the tensor's data
#: (~1 KB: data.pkl, byteorder, ...) and its central directory after it (~1 KB), in one read each
_ARCHIVE_ENDS = 4096


def note_records(fd: int, chunk: Chunk, records: Iterable[Record], tensor: str) -> None:
    """``records`` of ``chunk``'s archive, for the writer's CRC checks; every chunk archive has an
    "archive/data/0": their names say whose it is."""
    whose = f" of {tensor[:80]} (archive at byte {chunk.start})"
    record_crc.add_archive(fd, {r.name: Record(r.name + whose, r.data_start, r.size, r.crc) for r in records}, chunk.file)


def read_chunk(fd: int, chunk: Chunk, where: str, *, named: bool = False) -> tuple[list[Record], ChunkLayout]:
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
    rec = _chunk_pickle(data, f"{where}, chunk at byte {chunk.start}", named)
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
    layout = ChunkLayout(data_start, nbytes, dtype, rec.storage_offset, rec.size, rec.stride, info.crc)
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


# --------------------------------------------------------------------------------------------
# The folder
# --------------------------------------------------------------------------------------------


class DcpFolder:
    """A DCP folder's ``.metadata``, checked against its data files: ``tensors`` (every tensor entry
    under its DCP key: global shape and dtype), ``byte_keys`` (opaque byte entries, never read),
    ``chunks`` (per key) and ``file_sizes`` (every data file the metadata names).

    ``named``: dtypes are :class:`~hf_merge.spec.DTypeName`\\ s and torch is never imported."""

    def __init__(self, path: Path, *, named: bool = False):
        self.path = Path(path)
        self.named = named
        md = load_dcp_metadata(self.path, named=named)
        self.tensors: dict[str, TensorSpec] = {}
        self.byte_keys: list[str] = []
        self.chunks: dict[str, list[Chunk]] = {}
        try:
            files = self._read_metadata(md)
        except (AttributeError, TypeError, ValueError, KeyError, IndexError, OverflowError) as e:  # fields of the wrong kind
            raise CorruptCheckpointError(
                f"{self.path / METADATA_FILE}: malformed DCP metadata ({type(e).__name__}: {str(e)[:100]}); "
                f"{NOT_DCP}"
            ) from None
        self.file_sizes: dict[str, int] = {}
        for rel in sorted(files):
            p = contained.check(self.path / rel)
            if not p.is_file():
                raise CorruptCheckpointError(
                    f"{self.path}: data file {rel} listed in {METADATA_FILE} is missing; copy it from the training run "
                    f"(if it was never written there, {METADATA_FILE} is damaged or not of this folder)"
                )
            self.file_sizes[rel] = p.stat().st_size
        for key, chunks in self.chunks.items():
            for c in chunks:
                if c.start + c.length > self.file_sizes[c.file]:
                    raise CorruptCheckpointError(
                        f"{self.path / c.file}: truncated (ends at byte {self.file_sizes[c.file]}, "
                        f"{key} needs bytes up to {c.start + c.length}); re-copy it from the training run"
                    )

    def _read_metadata(self, md: Any) -> set[str]:
        """Specs and chunks from the unpickled ``Metadata``; returns the data files it names."""
        is_dtype = _is_named_dtype if self.named else _is_torch_dtype
        storage: dict[tuple[str, tuple[int, ...]], Any] = {}
        for idx, sinfo in md.storage_data.items():
            off = tuple(idx.offset) if idx.offset is not None else None
            storage[(idx.fqn, off)] = sinfo
        files: set[str] = set()
        for key, entry in md.state_dict_metadata.items():
            if not hasattr(entry, "chunks"):
                self.byte_keys.append(key)
                continue
            dtype = entry.properties.dtype
            if not isinstance(key, str) or not is_dtype(dtype):
                raise TypeError(f"entry {str(key)[:60]} has dtype {str(dtype)[:40]}")
            shape = tuple(int(s) for s in entry.size)
            self.tensors[key] = TensorSpec(key, shape, dtype)
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
                chunks.append(Chunk(offsets, sizes, rel, int(sinfo.offset), int(sinfo.length)))
            self._check_cover(key, shape, chunks)
            self.chunks[key] = chunks
        return files

    def _check_cover(self, key: str, shape: tuple[int, ...], chunks: list[Chunk]) -> None:
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
            clash = first_overlap(chunks)
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

    def parse_chunk(self, fd: int, name: str, chunk: Chunk) -> ChunkLayout:
        """``chunk``'s layout, its archive parsed and its records noted for the writer's CRC checks."""
        records, layout = read_chunk(fd, chunk, f"{self.path / chunk.file} ({name})", named=self.named)
        note_records(fd, chunk, records, name)
        return self.check_dtype(name, chunk, layout)

    def row_bands(self, key: str) -> list[Chunk] | None:
        """The non-empty chunks of ``key`` in row order when they are bands of whole rows (cut along
        dim 0 only); None when a chunk cuts another dimension."""
        shape = self.tensors[key].shape
        bands = sorted((c for c in self.chunks[key] if math.prod(c.sizes)), key=lambda c: c.offsets)
        if any(c.offsets[1:] != (0,) * (len(shape) - 1) or c.sizes[1:] != shape[1:] for c in bands):
            return None
        return bands

    def row_slices(
        self, key: str, chunks: Iterable[Chunk], index: tuple[int, ...], first: int, rows: int, max_band: int = 32 << 20,
    ) -> "list[tuple[int, int, list[Chunk]]] | None":
        """Where rows ``first .. first + rows`` of ``key[index]`` lie: ``(lo, hi, chunks)`` in row
        order, ``chunks`` holding rows ``lo .. hi`` side by side by column (one chunk when none cuts
        the columns; then the band is as long as the chunk allows, else at most ``max_band`` bytes).
        None when a chunk cuts a dimension after the columns or a band's chunks do not tile its rows."""
        shape, k = self.tensors[key].shape, len(index)
        near = [c for c in chunks if math.prod(c.sizes) and all(o <= i < o + n for i, o, n in zip(index, c.offsets, c.sizes))
                and c.offsets[k] < first + rows and c.offsets[k] + c.sizes[k] > first]
        if any(c.offsets[k + 2:] != (0,) * len(shape[k + 2:]) or c.sizes[k + 2:] != shape[k + 2:] for c in near):
            return None
        cuts = sorted({first, first + rows} | {b for c in near for b in (c.offsets[k], c.offsets[k] + c.sizes[k]) if first < b < first + rows})
        width = shape[k + 1] if len(shape) > k + 1 else None
        row_bytes = math.prod(shape[k + 1:]) * self.tensors[key].dtype.itemsize
        out: list[tuple[int, int, list[Chunk]]] = []
        for lo, hi in zip(cuts, cuts[1:]):
            held = sorted((c for c in near if c.offsets[k] <= lo and hi <= c.offsets[k] + c.sizes[k]),
                          key=lambda c: c.offsets[k + 1] if width is not None else 0)
            if not held:  # rows no chunk holds (the metadata's tiling check makes this unreachable)
                return None
            at = 0
            for c in held:
                if width is None or c.offsets[k + 1] != at:
                    if width is None and len(held) == 1:
                        break
                    return None
                at += c.sizes[k + 1]
            if width is not None and at != width:
                return None
            step = hi - lo if len(held) == 1 else max(1, max_band // max(1, row_bytes))
            out.extend((a, min(a + step, hi), held) for a in range(lo, hi, step))
        return out

    def check_dtype(self, name: str, chunk: Chunk, layout: ChunkLayout) -> ChunkLayout:
        if layout.dtype != self.tensors[name].dtype:
            raise CorruptCheckpointError(
                f"{self.path / chunk.file}: {name} chunk has dtype {layout.dtype}, metadata says {self.tensors[name].dtype}"
            )
        return layout


class DcpIndex(DcpFolder):
    """A DCP folder read without torch, its tensors under the names ``table`` gives (new name ->
    DCP key; :func:`~hf_merge.readers.dcp_sources.model_table`): ``specs()`` and ``read_rows``
    whose runs are :class:`~hf_merge.readers.file_runs.FileRun`\\ s (no tensor), what
    :func:`hf_merge.write.engine.byte_recipe` and the engine's sink take. A tensor whose chunks are
    not bands of whole rows in C order (or that asks for another dtype) is not offered (None)."""

    def __init__(self, path: Path):
        super().__init__(path, named=True)
        self.fds = {rel: os.open(self.path / rel, os.O_RDONLY) for rel in self.file_sizes}
        self.table: dict[str, str] = {key: key for key in self.tensors}

    def select(self, table: Mapping[str, str]) -> None:
        self.table = dict(table)

    def specs(self) -> dict[str, TensorSpec]:
        return {name: TensorSpec(name, self.tensors[key].shape, self.tensors[key].dtype) for name, key in self.table.items()}

    def read_rows(self, name: str, dtype: Any, max_bytes: int = 0) -> Iterator[tuple[int, FileRun | ColumnGather]] | None:
        """The tensor's rows as file runs (:meth:`file_rows` of all of them), each chunk's archive
        parsed when its run is reached (a write copies the first tensors meanwhile); None, from the
        metadata alone, when a chunk cuts a dimension after the columns or ``dtype`` is another. A
        chunk stored in another order than C raises (DCP saves contiguous chunks; the merge then
        writes the file itself). ``max_bytes`` (the read_rows contract's bound on converted runs)
        does not apply: runs are file bytes."""
        key = self.table[name]
        spec = self.tensors[key]
        if dtype != spec.dtype or not spec.shape or not spec.shape[0]:
            return None
        bands = self._bands(key, (), 0, spec.shape[0])
        if bands is None:
            return None

        def runs() -> Iterator[tuple[int, FileRun | ColumnGather]]:
            for lo, hi, held in bands:
                piece = self._piece(key, (), lo, hi, held)
                if piece is None:
                    raise UnsupportedCheckpointError(f"{self.path}: a chunk of {key} is not stored in C order")
                yield lo, piece

        return runs()

    def file_rows(self, name: str, index: tuple[int, ...], first: int, rows: int) -> list[tuple[int, FileRun | ColumnGather]] | None:
        """Rows ``first .. first + rows`` of ``name[index]`` as file runs, as the DCP reader's
        ``file_rows`` gives them (``(row counted from first, run)`` in row order); the chunks they
        lie in are parsed now; rows whose columns several chunks hold are a
        :class:`~hf_merge.readers.file_runs.ColumnGather`. None when a chunk cuts a later dimension."""
        key = self.table[name]
        spec, k = self.tensors[key], len(index)
        if k >= len(spec.shape) or first < 0 or first + rows > spec.shape[k]:
            raise ValueError(f"{name}: rows {first}+{rows} of {list(index)} are outside shape {list(spec.shape)}")
        bands = self._bands(key, index, first, rows)
        if bands is None:
            return None
        runs = [(lo - first, self._piece(key, index, lo, hi, held)) for lo, hi, held in bands]
        if not runs or any(piece is None for _, piece in runs):
            return None
        return runs if sum(r.nbytes for _, r in runs) == rows * math.prod(spec.shape[k + 1:]) * spec.dtype.itemsize else None

    def _bands(self, key: str, index: tuple[int, ...], first: int, rows: int) -> "list[tuple[int, int, list[Chunk]]] | None":
        from ..checkpoint import ROW_CHUNK_BYTES  # the DCP reader's band bound: the same runs, the same recipe

        return self.row_slices(key, self.chunks[key], index, first, rows, ROW_CHUNK_BYTES)

    def _piece(self, key: str, index: tuple[int, ...], lo: int, hi: int, held: list[Chunk]) -> "FileRun | ColumnGather | None":
        """Rows ``lo .. hi`` of ``key[index]`` in the chunks ``held`` (side by side) as file bytes,
        each chunk's archive parsed now; None when a chunk is not stored in C order."""
        k, size = len(index), self.tensors[key].dtype.itemsize
        parts = []
        for chunk in held:
            if chunk.layout is None:
                chunk.layout = self.parse_chunk(self.fds[chunk.file], key, chunk)
            if not c_contiguous(chunk.layout.size, chunk.layout.stride):
                return None
            stride = [math.prod(chunk.sizes[d + 1:]) for d in range(k + 1)]  # C order (size-1 dims' strides are free)
            at = sum((i - o) * st for i, o, st in zip(index, chunk.offsets, stride)) + (lo - chunk.offsets[k]) * stride[k]
            parts.append(FileRun(self.fds[chunk.file], chunk.layout.data_start + at * size, (hi - lo) * stride[k] * size, None))
        return parts[0] if len(parts) == 1 else ColumnGather(tuple(parts), hi - lo)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


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


def first_overlap(chunks: list[Chunk]) -> tuple[Chunk, Chunk] | None:
    """Two non-empty chunks whose boxes intersect, or None.

    Splits into slabs one dimension at a time while the chunks' intervals along it are disjoint
    or equal (a MoE weight ``[L, E, 2F, H]`` chunked per layer and expert: per layer, then per
    expert), so that only chunks in the same slab are compared; a dimension where intervals
    cross is swept pairwise (:func:`_swept_overlap`)."""
    return _overlap_from(sorted((c for c in chunks if all(s > 0 for s in c.sizes)), key=lambda c: c.offsets), 0)


def _overlap_from(boxes: list[Chunk], dim: int) -> tuple[Chunk, Chunk] | None:
    """:func:`first_overlap` of ``boxes`` (sorted by offsets), which agree on dimensions < ``dim``."""
    if len(boxes) < 2:
        return None
    if dim == len(boxes[0].offsets):  # the same box twice
        return boxes[0], boxes[1]
    slabs: dict[tuple[int, int], list[Chunk]] = {}
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


def _swept_overlap(boxes: list[Chunk]) -> tuple[Chunk, Chunk] | None:
    """Two intersecting boxes of ``boxes`` (sorted by offsets), or None: sweep along dim 0."""
    active: list[Chunk] = []
    for c in boxes:
        lo = c.offsets[0] if c.offsets else 0
        active = [a for a in active if not a.offsets or a.offsets[0] + a.sizes[0] > lo]
        for a in active:
            if all(ao < co + cs and co < ao + as_ for ao, as_, co, cs in zip(a.offsets, a.sizes, c.offsets, c.sizes)):
                return a, c
        active.append(c)
    return None
