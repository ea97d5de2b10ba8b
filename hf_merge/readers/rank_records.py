"""verl FSDP rank files read without ``torch.distributed.tensor``: the pickle interpreted, not run.

A rank file is a ``torch.save`` zip whose ``data.pkl`` builds, per key, either a plain tensor
(``_rebuild_tensor_v2``) or a DTensor (``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor,
...)`` filled with its ``_local_tensor`` and ``_spec``: device mesh, placements, tensor meta).
Letting torch build real DTensors imports ``torch.distributed.tensor`` (~0.4 s, its op registry).
The merge only needs what the pickle *says*, so it is read here with the package's one pickle
policy (:func:`~hf_merge.readers.safe_pickle.load_pickle` under
:data:`~hf_merge.readers.safe_pickle.DTENSOR_FILE`), with every DTensor-related pair bound to an
inert stand-in that records its arguments and state, and every rebuild function bound to a
recorder. Nothing from the file is called; torch is used only for dtypes, ``torch.Size`` and
``torch.device`` (allowlisted) and, afterwards, by this module to view the memory-mapped storages
(exactly what ``torch.load(mmap=True)`` does: one private mapping of the file, each storage a
slice of it at its zip record's offset, each tensor ``set_`` on it after its extent is checked).

:func:`load_rank_records` returns ``{key: torch.Tensor | LocalDTensor}``.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from .file_runs import MappedFile
from ..spec import DTypeName, c_contiguous
from .safe_pickle import (
    DTENSOR_FILE, NAMED_DTYPES, Allowlist, Pair, StandIn, load_pickle, named_torch, stand_in, storage_reference, torch_names,
)
from . import contained, record_crc
from .torch_zip import Record, read_data_pickle

if TYPE_CHECKING:  # torch is imported where tensors are made; index_rank_file needs none
    import torch

__all__ = [
    "IndexedTensor", "LocalDTensor", "Placement", "index_rank_file", "load_local_records", "load_mapped_rank_records",
    "load_rank_records", "local_records", "LazyLocals", "RankRead",
]

_DT = "torch.distributed.tensor"


# --------------------------------------------------------------------------------------------
# Stand-ins: created by NEWOBJ, filled by BUILD; they keep what the pickle gave and run nothing
# --------------------------------------------------------------------------------------------


_DTensorClass = stand_in(_DT, "DTensor")
_Spec = stand_in(f"{_DT}._dtensor_spec", "DTensorSpec")
_TensorMeta = stand_in(f"{_DT}._dtensor_spec", "TensorMeta")
_ShardOrderEntry = stand_in(f"{_DT}._dtensor_spec", "ShardOrderEntry")
_Shard = stand_in(f"{_DT}.placement_types", "Shard")
_Replicate = stand_in(f"{_DT}.placement_types", "Replicate")
_Partial = stand_in(f"{_DT}.placement_types", "Partial")
_StridedShard = stand_in(f"{_DT}.placement_types", "_StridedShard")
_Mesh = stand_in("torch.distributed.device_mesh", "DeviceMesh")
_MeshLayout = stand_in("torch.distributed._mesh_layout", "_MeshLayout")
_FlatLayout = stand_in("torch.distributed._mesh_layout", "_FlatLayout")
_CLASSES = (_DTensorClass, _Spec, _TensorMeta, _ShardOrderEntry, _Shard, _Replicate, _Partial, _StridedShard, _Mesh, _MeshLayout, _FlatLayout)

#: the same classes as torch 2.4 pickles them (modules it had then)
_OLD_PAIRS: dict[Pair, type] = {
    ("torch.distributed._tensor.api", "DTensor"): _DTensorClass,
    ("torch.distributed._tensor.placement_types", "DTensorSpec"): _Spec,
    ("torch.distributed._tensor.placement_types", "TensorMeta"): _TensorMeta,
    ("torch.distributed._tensor.placement_types", "Shard"): _Shard,
}

_PLACEMENT_KINDS: dict[type, str] = {_Shard: "Shard", _Replicate: "Replicate", _Partial: "Partial", _StridedShard: "_StridedShard"}


@dataclass(frozen=True)
class _Storage:
    """A persistent id: storage record ``key`` of ``numel`` elements of ``dtype``."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _StorageType:
    """What a legacy ``torch.<X>Storage`` name stands for in a persistent id: its dtype."""

    dtype: torch.dtype


@dataclass(frozen=True)
class _TensorRecord:
    """What ``_rebuild_tensor_v2`` would have built: a strided view of one storage."""

    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _WrapperRecord:
    """What ``_rebuild_wrapper_subclass`` would have built: an empty DTensor of the global shape."""

    cls: Any
    dtype: torch.dtype
    size: tuple[int, ...]


@dataclass
class _DTensorRecord:
    wrapper: _WrapperRecord
    attrs: dict[str, Any]


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is tuple and all(type(v) is int for v in value):  # what a pickle gives, checked quickly
        return value
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{what} is {str(value)[:60]}, not a tuple of integers")
    return tuple(int(v) for v in value)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, *_rest: Any) -> _TensorRecord:
    if not isinstance(storage, _Storage):
        raise TypeError(f"tensor storage is a {type(storage).__name__}")
    if not isinstance(storage_offset, int) or isinstance(storage_offset, bool):
        raise TypeError(f"storage offset is {str(storage_offset)[:40]}")
    return _TensorRecord(storage, storage_offset, _ints(size, "tensor size"), _ints(stride, "tensor stride"))


def _rebuild_wrapper(cls: Any, dtype: Any, size: Any, *_rest: Any) -> _WrapperRecord:
    import torch

    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"DTensor dtype is {str(dtype)[:40]}")
    return _WrapperRecord(cls, dtype, _ints(size, "DTensor size"))


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> _DTensorRecord:
    if func not in (_rebuild_wrapper, _rebuild_wrapper_named) or new_type is not _DTensorClass or not isinstance(args, tuple):
        raise TypeError("a tensor subclass other than DTensor, or a DTensor rebuilt another way")
    attrs = StandIn()
    attrs.__setstate__(state)
    return _DTensorRecord(func(*args), attrs.__dict__["state"])


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    return data


def _rebuild_wrapper_named(cls: Any, dtype: Any, size: Any, *_rest: Any) -> _WrapperRecord:
    if not isinstance(dtype, DTypeName):
        raise TypeError(f"DTensor dtype is {str(dtype)[:40]}")
    return _WrapperRecord(cls, dtype, _ints(size, "DTensor size"))


def _recorders(wrapper: Any) -> dict[Pair, Any]:
    """The rebuild functions bound to recorders (``wrapper``: the DTensor wrapper's, by the kind of
    dtype the policy gives) and every DTensor-related pair of DTENSOR_FILE to its stand-in (a test
    checks none is left out)."""
    subs: dict[Pair, Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_wrapper_subclass"): wrapper,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    }
    for cls in _CLASSES:
        module, _, name = cls.__qualname__.rpartition(".")
        subs[(module, name)] = cls
    subs.update(_OLD_PAIRS)
    return subs


@functools.cache
def _substitutes() -> dict[Pair, Any]:
    subs = _recorders(_rebuild_wrapper)
    from torch.storage import _get_dtype_from_pickle_storage_type

    for module, name in torch_names().names:
        if name.endswith("Storage") and module == "torch":
            try:
                subs[(module, name)] = _StorageType(_get_dtype_from_pickle_storage_type(name))
            except (KeyError, AttributeError, RuntimeError):
                continue
    return subs


# --------------------------------------------------------------------------------------------
# What the reader gets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """A DTensor placement as pickled: ``kind`` ("Shard", "Replicate", "Partial", "_StridedShard")
    and its fields; ``repr`` is torch's."""

    kind: str
    fields: tuple[tuple[str, Any], ...] = ()

    @property
    def dim(self) -> Any:
        return dict(self.fields).get("dim")

    def __repr__(self) -> str:
        f = dict(self.fields)
        if self.kind == "Shard":
            return f"Shard(dim={f.get('dim')})"
        if self.kind == "_StridedShard":
            return f"_StridedShard(dim={f.get('dim')}, sf={f.get('split_factor')})"
        if self.kind == "Partial":
            return f"Partial({f.get('reduce_op')})"
        return "Replicate()"


@dataclass
class LocalDTensor:
    """One DTensor of a rank file, interpreted: global ``shape`` and ``dtype``, this rank's
    ``_local_tensor`` (a memory-mapped view), ``placements``, the device ``mesh`` (an int tensor of
    global ranks, one axis per mesh dimension), ``mesh_dim_names`` and the spec's ``meta_shape``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    _local_tensor: torch.Tensor
    placements: tuple[Placement, ...]
    mesh: torch.Tensor
    mesh_dim_names: tuple[str, ...] | None
    meta_shape: tuple[int, ...] | None = field(default=None)


class _Mapped:
    """The file mapped once (private, read-only use); storages are slices at their record offsets."""

    def __init__(self, path: Path, records: dict, prefix: str, where: str):
        self.path, self.records, self.prefix, self.where = path, records, prefix, where
        self._whole: torch.UntypedStorage | None = None
        self._storages: dict[str, torch.UntypedStorage] = {}
        self.meshes: dict[int, tuple[Any, torch.Tensor]] = {}  # id(mesh stand-in) -> (it, ranks): one per file

    def map_whole(self) -> torch.UntypedStorage:
        """The mapping of the whole file, made on first use."""
        import torch

        if self._whole is None:
            self._whole = torch.UntypedStorage.from_file(str(self.path), False, os.path.getsize(self.path))
        return self._whole

    def storage(self, s: _Storage, keep: bool = True) -> torch.UntypedStorage:
        """Storage ``s``: its record's slice of the mapping (kept for the next tensor of it unless ``keep`` is false)."""
        got = self._storages.get(s.key)
        if got is None:
            rec = self.records[f"{self.prefix}data/{s.key}"]
            got = self.map_whole()[rec.data_start : rec.data_start + rec.size]
            if keep:
                self._storages[s.key] = got
        return got

    @property
    def whole(self) -> torch.UntypedStorage | None:
        """The mapping of the whole file (None until a storage is used)."""
        return self._whole

    def tensor(self, rec: _TensorRecord, keep: bool = True) -> torch.Tensor:
        import torch

        _check_view(rec)
        t = torch.empty((0,), dtype=rec.storage.dtype)
        return t.set_(self.storage(rec.storage, keep), rec.offset, rec.size, rec.stride)


def _check_view(rec: _TensorRecord) -> None:
    """ValueError unless ``rec`` is a view inside its storage."""
    size, stride, offset = rec.size, rec.stride, rec.offset
    if len(size) != len(stride) or any(n < 0 for n in size) or any(s < 0 for s in stride) or offset < 0:
        raise ValueError(f"tensor size {list(size)[:8]}, stride {list(stride)[:8]}, offset {offset} is not a valid view")
    if math.prod(size):
        end = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
        if end > rec.storage.numel:
            raise ValueError(f"a view up to element {end} of a storage of {rec.storage.numel} elements")


class UnknownMeshLayout(Exception):
    """A DeviceMesh pickled in a form this reader does not know (not damage: another torch)."""


def _mesh_axes(layout: Any) -> list[tuple[list[int], list[int]]] | None:
    """Per mesh dim, the flattened (shapes, strides) of a ``_MeshLayout``'s modes, as each torch
    pickles it: torch >= 2.13 ``{'axes': (_FlatLayout{'shape', 'stride'}, ...)}``; torch 2.10-2.12
    ``{'shape': IntTuple, 'stride': IntTuple}`` (a CuTe layout: its top-level modes are the mesh
    dims, an int being one dim). None: neither (a layout this reader does not know)."""
    if not isinstance(layout, _MeshLayout):
        return None
    axes = layout.get("axes", layout.args[0] if layout.args else None)
    if axes is not None:
        if not isinstance(axes, (tuple, list)) or not all(isinstance(a, _FlatLayout) for a in axes):
            return None
        modes = [(a.get("shape"), a.get("stride")) for a in axes]
    elif "shape" in layout.state and "stride" in layout.state:
        shape, stride = layout.get("shape"), layout.get("stride")
        if isinstance(shape, (tuple, list)) != isinstance(stride, (tuple, list)):
            raise ValueError("device mesh layout has a shape and a stride of different nesting")
        modes = list(zip(shape, stride, strict=True)) if isinstance(shape, (tuple, list)) else [(shape, stride)]
    else:
        return None
    out = []
    for shape, stride in modes:
        s, t = _flat(shape), _flat(stride)
        if len(s) != len(t):
            raise ValueError("device mesh layout axis has mismatched shape and stride")
        out.append((s, t))
    return out


def _elements(rec: _TensorRecord) -> list[int]:
    """Storage positions of a small tensor's elements, row-major (checked inside its storage)."""
    pos = [rec.offset]
    for n, t in zip(rec.size, rec.stride, strict=True):
        pos = [p + i * t for p in pos for i in range(n)]
    if any(p < 0 or p >= rec.storage.numel for p in pos):
        raise ValueError("device mesh ranks lie outside their storage")
    return pos


def mesh_ranks(mesh: Any) -> tuple[_Storage, tuple[int, ...], list[int]]:
    """Where a DeviceMesh's ranks are: ``(storage, mesh shape, positions)``, the rank at row-major
    mesh coordinate ``j`` being element ``positions[j]`` of ``storage``. Pure Python (the torch
    reader and the torch-free index share it). Pickled as ``mesh`` (torch <= 2.9) or as
    ``_layout`` + ``_rank_map`` (torch >= 2.10: mesh dim ``i`` walks ``_rank_map`` along the
    ``i``-th mode of the layout, its nested modes row-major, as ``_MeshLayout.remap_to_tensor``).

    Raises:
        UnknownMeshLayout: neither form (a torch release this reader does not know).
        ValueError, TypeError: a known form with inconsistent values.
    """
    if not isinstance(mesh, _Mesh):
        raise TypeError("DTensor spec without a device mesh")
    full = mesh.get("mesh")
    if isinstance(full, _TensorRecord):
        if len(full.size) > 8 or math.prod(full.size) > 1 << 20:
            raise ValueError(f"device mesh of shape {list(full.size)[:8]}")
        return full.storage, full.size, _elements(full)
    layout, rank_map = mesh.get("_layout"), mesh.get("_rank_map")
    axes = _mesh_axes(layout)
    if axes is None or not isinstance(rank_map, _TensorRecord):
        if axes is not None:
            what = f"its layout comes with a {type(rank_map).__name__} rank map, not a tensor"
        elif isinstance(layout, StandIn):
            name = type(layout).__qualname__.rpartition(".")[2]
            what = f"its {name} has fields {sorted(layout.state)[:6]}" if layout.state else f"its {name} has {len(layout.args)} arguments"
        else:
            what = f"a DeviceMesh of fields {sorted(mesh.state)[:8]}, with neither a mesh tensor nor a layout and rank map"
        raise UnknownMeshLayout(what)
    if math.prod(rank_map.size) > 1 << 20:
        raise ValueError(f"device mesh rank map of {math.prod(rank_map.size)} ranks")
    ranks = _elements(rank_map)
    sizes = [math.prod(s) for s, _ in axes]
    shape = [n for s, _ in axes for n in s]
    stride = [t for _, ts in axes for t in ts]
    if math.prod(sizes) != len(ranks) or not all(n > 0 for n in shape) or any(t < 0 for t in stride):
        raise ValueError(f"device mesh layout {sizes} does not cover its rank map of {len(ranks)} ranks (a sub-mesh)")
    offsets = [0]
    for n, t in zip(shape, stride):
        offsets = [o + i * t for o in offsets for i in range(n)]
    if max(offsets) >= len(ranks):
        raise ValueError("device mesh layout points past its rank map")
    if len(set(offsets)) != len(offsets):
        raise ValueError("device mesh layout names a rank twice")
    return rank_map.storage, tuple(sizes), [ranks[o] for o in offsets]


def _mesh_tensor(mesh: Any, mapped: _Mapped) -> torch.Tensor:
    """The device mesh's rank tensor (one axis per mesh dimension), from :func:`mesh_ranks`."""
    import torch

    storage, shape, positions = mesh_ranks(mesh)
    whole = mapped.tensor(_TensorRecord(storage, 0, (storage.numel,), (1,)))
    return whole[torch.tensor(positions, dtype=torch.long)].reshape(shape).clone()


def _cached_mesh(mesh: Any, mapped: _Mapped) -> torch.Tensor:
    """The pickle memoizes one DeviceMesh for every DTensor of a file: compute its ranks once."""
    hit = mapped.meshes.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        hit = mapped.meshes[id(mesh)] = (mesh, _mesh_tensor(mesh, mapped))
    return hit[1]


def _flat(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flat(v)]
    raise TypeError(f"device mesh layout holds {str(value)[:40]}")


def _inconsistent(key: Any, where: str, e: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{str(key)[:80]} in {where}: inconsistent tensor metadata ({str(e)[:150]}); the file is damaged, re-copy it"
    )


def unknown_layout_error(key: Any, where: str, e: UnknownMeshLayout) -> UnsupportedCheckpointError:
    """The one error for a device mesh this reader does not know: not damage, another torch."""
    return UnsupportedCheckpointError(
        f"{str(key)[:80]} in {where}: its device mesh is pickled in a form this hf-merge does not know ({e}); "
        "nothing is wrong with the file: a torch release other than those read here (2.4 to 2.15) wrote it, and a "
        "torch.save file does not record which. Report it with the training run's torch version "
        "(python -c 'import torch; print(torch.__version__)'), or re-save the state dict with torch 2.4 to 2.15"
    )


def _placement(p: Any) -> Placement:
    kind = _PLACEMENT_KINDS.get(type(p))
    if kind is None:
        raise TypeError(f"a placement is a {type(p).__name__}")
    return Placement(kind, tuple(sorted(p.__dict__["state"].items())))


def _spec_parts(spec: Any) -> tuple[Any, tuple[Placement, ...], tuple[str, ...] | None, tuple[int, ...] | None]:
    """A DTensor spec's ``(device mesh, placements, mesh dim names, tensor meta shape)``, checked;
    TypeError / ValueError where it is not one."""
    mesh = spec.get("mesh")
    if not isinstance(mesh, _Mesh):
        raise TypeError("DTensor spec without a device mesh")
    placements = spec.get("placements")
    if not isinstance(placements, (tuple, list)):
        raise TypeError("DTensor spec without placements")
    names = mesh.get("_mesh_dim_names", mesh.get("mesh_dim_names"))
    meta = spec.get("tensor_meta")
    meta_shape = None
    if isinstance(meta, _TensorMeta):
        fields = meta.args or (meta.get("shape"),)
        meta_shape = _ints(fields[0], "DTensor tensor_meta shape")
    elif meta is not None:
        raise TypeError(f"DTensor tensor_meta is a {type(meta).__name__}")
    names = tuple(names) if isinstance(names, (tuple, list)) else None
    return mesh, tuple(_placement(p) for p in placements), names, meta_shape


def _dtensor(rec: _DTensorRecord, mapped: _Mapped) -> LocalDTensor:
    local, spec = rec.attrs.get("_local_tensor"), rec.attrs.get("_spec")
    if not isinstance(local, _TensorRecord) or not isinstance(spec, _Spec):
        raise TypeError("DTensor without a local tensor and a spec")
    mesh, placements, names, meta_shape = _spec_parts(spec)
    return LocalDTensor(
        shape=rec.wrapper.size,
        dtype=rec.wrapper.dtype,
        _local_tensor=mapped.tensor(local),
        placements=placements,
        mesh=_cached_mesh(mesh, mapped),
        mesh_dim_names=names,
        meta_shape=meta_shape,
    )


def _check_byte_order(f: Any, records: dict, prefix: str, where: str) -> None:
    order = records.get(prefix + "byteorder")
    if order is not None:
        f.seek(order.data_start)
        if f.read(min(order.size, 16)).strip() not in (b"little", b""):
            raise UnsupportedCheckpointError(f"{where}: big-endian tensor data is not supported")


def unpickle_records(path: Path, allow: Allowlist, substitutes: dict[Pair, Any], names: Allowlist | None = None) -> tuple[Any, dict, str]:
    """A rank file's ``data.pkl`` interpreted under ``allow`` with ``substitutes``:
    ``(state, zip records, record prefix)``; storages become :class:`_Storage` records."""
    where = path.name
    with open(contained.check(path), "rb") as f:
        records, prefix, data = read_data_pickle(f, where)
        record_crc.add_archive(path, records, where)  # its records' CRC-32, checked when their bytes are used
        _check_byte_order(f, records, prefix, where)

    def persistent_load(pid: Any) -> _Storage:
        stype, key, numel, rec = storage_reference(pid, records, prefix, where, _StorageType)
        if rec.size != numel * stype.dtype.itemsize:
            raise CorruptCheckpointError(
                f"{where}: storage record data/{key[:40]} has {rec.size} bytes, its tensor needs {numel * stype.dtype.itemsize}"
            )
        return _Storage(key, stype.dtype, numel)

    try:
        state = load_pickle(data, allow, where, substitutes=substitutes, persistent_load=persistent_load, names=names)
    except (TypeError, ValueError) as e:  # a stand-in refused what the pickle gave it
        raise CorruptCheckpointError(f"{where}: inconsistent tensor metadata ({str(e)[:150]}); the file is damaged, re-copy it") from None
    return state, records, prefix


def load_rank_records(path: Path) -> dict[str, "torch.Tensor | LocalDTensor"]:
    """One verl FSDP rank file, memory-mapped: plain tensors and :class:`LocalDTensor`\\ s."""
    return load_mapped_rank_records(path)[0]


def load_mapped_rank_records(path: Path) -> tuple[dict[str, "torch.Tensor | LocalDTensor"], "MappedFile | None"]:
    """:func:`load_rank_records`, and the file open by descriptor with where it is mapped (None
    when it holds no storage): the provenance of its tensors' bytes.

    Raises:
        UnsafeCheckpointError: the pickle asks for anything outside :data:`DTENSOR_FILE`.
        CorruptCheckpointError: truncated, records inconsistent, views outside their storage.
        UnsupportedCheckpointError: big-endian data, or a tensor subclass other than DTensor.
    """
    path = Path(path)
    where = path.name
    state, records, prefix = unpickle_records(path, DTENSOR_FILE, _substitutes())
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where} holds a {type(state).__name__}, not a state dict")
    mapped = _Mapped(path, records, prefix, where)
    out: dict[str, Any] = {}
    for key, value in state.items():
        try:
            if isinstance(value, _TensorRecord):
                out[key] = mapped.tensor(value)
            elif isinstance(value, _DTensorRecord):
                out[key] = _dtensor(value, mapped)
            else:
                out[key] = value  # the reader says what it is not
        except UnknownMeshLayout as e:
            raise unknown_layout_error(key, where, e) from None
        except (TypeError, ValueError, RuntimeError, IndexError) as e:
            raise _inconsistent(key, where, e) from None
    whole = mapped.whole
    return out, (MappedFile(path, whole.data_ptr(), whole.nbytes()) if whole is not None else None)


# --------------------------------------------------------------------------------------------
# The same pickle read without torch: what each tensor is and where its bytes are
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IndexedTensor:
    """One tensor of a rank file as its pickle says, read without torch: ``dtype``, global
    ``shape``, ``placements`` (None: a plain tensor), the local tensor's ``local_shape`` and
    ``span``, the file offset and byte count of its bytes when they are one dense run (else None)."""

    dtype: DTypeName
    shape: tuple[int, ...]
    placements: "tuple[Placement, ...] | None"
    local_shape: tuple[int, ...]
    span: "tuple[int, int] | None"
    mesh_shape: "tuple[int, ...] | None" = None  # a DTensor's device mesh: its shape and
    mesh: "tuple[int, ...] | None" = None  # global ranks, row-major (as LocalDTensor.mesh)


def record_span(rec: Any, records: dict, prefix: str) -> tuple[int, int] | None:
    """``(file offset, bytes)`` of a tensor record read by :func:`unpickle_records` when its
    elements are one dense run inside its storage, else None (``records``/``prefix``: its file's)."""
    n = math.prod(rec.size)
    if not c_contiguous(rec.size, rec.stride) or rec.offset < 0 or rec.offset + n > rec.storage.numel:
        return None
    item = rec.storage.dtype.itemsize
    return records[f"{prefix}data/{rec.storage.key}"].data_start + rec.offset * item, n * item


def record_meta(value: Any) -> "tuple[tuple[int, ...], DTypeName] | None":
    """``(shape, dtype)`` of a tensor record read by :func:`unpickle_records`; None for any other value."""
    return (value.size, value.storage.dtype) if isinstance(value, _TensorRecord) else None


def tensor_record_builder() -> Any:
    """What ``_rebuild_tensor_v2`` is bound to under :func:`named_policy` (a caller that binds
    ``_rebuild_from_type_v2`` itself checks it was given this)."""
    return _rebuild_tensor


@functools.cache
def named_policy() -> tuple[Allowlist, Allowlist, dict[Pair, Any]]:
    """``(allow, names, substitutes)`` that read a rank file with no torch module looked up: every
    pair of :data:`DTENSOR_FILE` kept here is substituted or from the standard library."""
    names, subs = named_torch(_StorageType)
    subs.update(_recorders(_rebuild_wrapper_named))

    def kept(pairs: frozenset) -> list:
        return [p for p in pairs if p in subs or p[0] in ("builtins", "collections")]

    allow = Allowlist.of(calls=kept(DTENSOR_FILE.calls), classes=kept(DTENSOR_FILE.classes))
    return allow, names, subs


_INT_CODES = {"int64": "q", "int32": "i"}  # init_device_mesh: int32 ranks; DeviceMesh(torch.arange(n)): int64


def _read_ints(path: Path, offset: int, numel: int, code: str) -> list[int]:
    """``numel`` little-endian integers (struct ``code``) at ``offset`` of ``path``."""
    size = numel * struct.calcsize(code)
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise ValueError("device mesh ranks run past the end of the file")
    return list(struct.unpack(f"<{numel}{code}", data))


def _named_state(path: Path) -> tuple[dict, dict, str]:
    """Rank file ``path``'s pickle read without torch (:func:`named_policy`): ``(state, zip
    records, record prefix)``."""
    allow, names, subs = named_policy()
    state, records, prefix = unpickle_records(path, allow, subs, names)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{path.name} holds a {type(state).__name__}, not a state dict")
    return state, records, prefix


def _indexed(path: Path, state: dict, records: dict, prefix: str):
    """``(key, local tensor record, IndexedTensor)`` per entry of a state read by
    :func:`_named_state`, each DTensor's spec checked (placements, device mesh, tensor meta)."""
    where = path.name

    def span(rec: _TensorRecord) -> tuple[int, int] | None:
        return record_span(rec, records, prefix)

    meshes: dict[int, tuple[Any, tuple[int, ...], tuple[int, ...]]] = {}  # id(mesh) -> (it, shape, ranks)

    def mesh(key: Any, spec: _Spec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        m = spec.get("mesh")
        hit = meshes.get(id(m))
        if hit is None or hit[0] is not m:
            try:
                storage, shape, positions = mesh_ranks(m)
                code = _INT_CODES.get(storage.dtype.name)
                if code is None or storage.numel > 1 << 20:
                    raise TypeError(f"device mesh ranks are {storage.numel} {storage.dtype.name} values")
                values = _read_ints(path, records[f"{prefix}data/{storage.key}"].data_start, storage.numel, code)
            except UnknownMeshLayout as e:
                raise unknown_layout_error(key, where, e) from None
            except (TypeError, ValueError) as e:
                raise _inconsistent(key, where, e) from None
            hit = meshes[id(m)] = (m, shape, tuple(values[p] for p in positions))
        return hit[1], hit[2]

    for key, value in state.items():
        if isinstance(value, _TensorRecord):
            yield key, value, IndexedTensor(value.storage.dtype, value.size, None, value.size, span(value))
        elif isinstance(value, _DTensorRecord):
            local, spec = value.attrs.get("_local_tensor"), value.attrs.get("_spec")
            if not isinstance(local, _TensorRecord) or not isinstance(spec, _Spec) or local.storage.dtype != value.wrapper.dtype:
                raise CorruptCheckpointError(f"{str(key)[:80]} in {where}: a DTensor without its local tensor and spec")
            try:
                placements = _spec_parts(spec)[1]
            except (TypeError, ValueError) as e:
                raise _inconsistent(key, where, e) from None
            yield key, local, IndexedTensor(value.wrapper.dtype, value.wrapper.size, placements, local.size, span(local), *mesh(key, spec))
        else:
            raise UnsupportedCheckpointError(f"{str(key)[:80]} in {where} is a {type(value).__name__}, not a tensor")


def index_rank_file(path: Path) -> dict[str, IndexedTensor]:
    """What :func:`load_rank_records` reads, as specs and file spans, without importing torch.

    Stricter than :func:`load_rank_records` (fewer names allowed); the device mesh is read by the
    same :func:`mesh_ranks`. A caller that must be sure of the bytes checks them against the torch
    reader's (see :mod:`hf_merge.write.head_start`). Raises what :func:`load_rank_records` raises.
    """
    path = Path(path)
    return {key: indexed for key, _local, indexed in _indexed(path, *_named_state(path))}


#: one local tensor as another process hands it over: ``(key, storage key, dtype name, storage
#: numel, storage offset, size, stride)``, the fields of the tensor record the pickle builds
LocalRecord = tuple[Any, str, str, int, int, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class RankRead:
    """What another process read of a rank file (:func:`local_records`): the file's version
    (:func:`~hf_merge.readers.record_crc.file_version`, the same before and after it read), its
    checked zip directory, the archive prefix, and each local tensor's record."""

    version: tuple[int, ...]
    records: dict[str, Record]
    prefix: str
    entries: list[LocalRecord]


def local_records(path: Path) -> RankRead:
    """Rank file ``path``'s local tensors as records, read without torch (checked as
    :func:`index_rank_file` checks them), for another process to map with
    :func:`load_local_records`. Raises ``OSError`` when the file changed while it was read."""
    path = Path(path)
    before = record_crc.file_version(os.stat(path))
    state, records, prefix = _named_state(path)
    out = [
        (key, local.storage.key, local.storage.dtype.name, local.storage.numel, local.offset, local.size, local.stride)
        for key, local, _indexed_tensor in _indexed(path, state, records, prefix)
    ]
    if record_crc.file_version(os.stat(path)) != before:
        raise OSError(f"{path.name} changed while it was read")
    return RankRead(before, records, prefix, out)


class LazyLocals(Mapping):
    """A rank's local tensors from the records another process read: each tensor a view of the
    file's mapping made when it is asked for and not kept, so a rank of many tensors holds small
    records, not tensors (1.3 KB of tensor objects per record before). ``meta(key)`` answers what
    the reader checks without making one."""

    def __init__(self, mapped: _Mapped, records: dict[Any, _TensorRecord]):
        self._mapped, self._records = mapped, records

    def __getitem__(self, key: Any) -> "torch.Tensor":
        return self._mapped.tensor(self._records[key], keep=False)

    def __iter__(self):
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def meta(self, key: Any) -> tuple["torch.dtype", tuple[int, ...], bool, int]:
        """``(dtype, shape, contiguous, storage offset)`` of local tensor ``key``."""
        rec = self._records[key]
        return rec.storage.dtype, rec.size, c_contiguous(rec.size, rec.stride), rec.offset


def load_local_records(path: Path, read: RankRead) -> "tuple[LazyLocals, MappedFile | None] | None":
    """Rank file ``path``'s local tensors, memory-mapped as :func:`load_mapped_rank_records` maps
    them (:class:`LazyLocals`: each made when asked for), from what another process read with
    :func:`local_records`: its records' CRC-32 noted here, each view checked inside its storage.
    None when the file is no longer the version read there (the caller reads it itself)."""
    import torch

    path = Path(contained.check(path))
    where = path.name
    if record_crc.file_version(os.stat(path)) != read.version:
        return None
    record_crc.add_archive(path, read.records, where)
    mapped = _Mapped(path, read.records, read.prefix, where)
    out: dict[Any, _TensorRecord] = {}
    for key, storage_key, dtype_name, numel, offset, size, stride in read.entries:
        dtype = getattr(torch, dtype_name) if dtype_name in NAMED_DTYPES else None
        rec = read.records.get(f"{read.prefix}data/{storage_key}")
        if dtype is None or rec is None or rec.size != numel * dtype.itemsize:
            return None  # not what a read of this file gives
        out[key] = tensor = _TensorRecord(_Storage(storage_key, dtype, numel), offset, size, stride)
        try:
            _check_view(tensor)
        except ValueError as e:
            raise _inconsistent(key, where, e) from None
    whole = mapped.map_whole() if out else None
    return LazyLocals(mapped, out), (MappedFile(path, whole.data_ptr(), whole.nbytes()) if whole is not None else None)
