"""The one pickle policy of hf_merge: every file it unpickles goes through this module.

A pickle is a small program; the only instructions that can run code are the ones that look up a
global (``GLOBAL``/``STACK_GLOBAL``) and the ones that call or fill what was looked up
(``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``, ``BUILD``, ``INST``, ``OBJ``, ``EXT*``). The policy:

- a global is looked up only if its exact ``(module, name)`` pair is on an :class:`Allowlist`;
  a dotted name (``"Path.__init__.__globals__"``, which protocol 4 would walk attribute by
  attribute) is refused, and the object is taken from the module's own namespace, never by
  ``getattr`` walking;
- ``REDUCE`` calls only pairs listed as ``calls``; ``NEWOBJ`` creates only pairs listed as
  ``classes``, and ``BUILD`` fills only an *instance* of such a class (never a class, function or
  module); ``INST``, ``OBJ`` and the ``EXT*`` registry are refused;
- anything else raises :class:`~hf_merge.errors.UnsafeCheckpointError` before it runs.

Speed: the policy's machine is pure Python (``pickle._Unpickler``), ~50x slower than C pickle. A
plain pickle (a DCP ``.metadata``) first takes a fast path that checks the *same* policy with C
pickle (:func:`_fast_load`): the walk both paths start with (:mod:`.pickle_walk`: limits,
argument schemas of :mod:`.pickle_schemas`) refuses ``INST``/``OBJ``/``EXT*`` and persistent ids,
a C scan runs the pickle over inert stand-ins that check every call, creation and fill, and only
then C pickle loads it with the exact pairs. Anything the fast path does not accept goes to the
pure machine, which decides and gives the error.

API (what readers call; allowlists are data, combined with ``|``):

- :func:`load_pickle(file, allow, where)` unpickles a plain pickle (DCP ``.metadata``, a
  DeepSpeed / ColossalAI / accelerate ``.pkl``) into real objects under ``allow``;
  ``substitutes`` maps a pair to a stand-in (e.g. a recorder instead of a tensor rebuild).
- :func:`scan_pickle(data, allow, where)` runs the pickle machine with stand-ins only — nothing
  is constructed or called — and raises if the policy would refuse anything.
- :func:`torch_load(path, allow, where)` is ``torch.load(weights_only=True, mmap=True)`` of a
  ``torch.save`` zip whose records were first checked (:mod:`hf_merge.readers.torch_zip`) and
  whose ``data.pkl`` passed :func:`scan_pickle` under ``allow``; torch's own restricted
  unpickler then loads it with the same pairs registered.
- :func:`load_rank_file` is ``torch_load`` with :data:`DTENSOR_FILE` (torch's own DTensors; the FSDP
  reader interprets rank files with stand-ins instead: :mod:`hf_merge.readers.rank_records`).
- :class:`StandIn` / :func:`stand_in`: inert substitutes for allowlisted classes (they record
  NEWOBJ arguments and BUILD state; nothing of the real class runs).

Allowlists: :data:`TORCH_NAMES` (dtypes, layouts, memory formats, legacy storage classes: names
only), :data:`TENSOR_FILE` (plain tensors and state dicts), :data:`DTENSOR_FILE` (DTensor state
dicts), :data:`DCP_METADATA` (``torch.distributed.checkpoint`` metadata, as torch and
Megatron-Core write it).
"""

from __future__ import annotations

import functools
import importlib
import io
import logging
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Mapping

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from . import pickle_schemas
from .pickle_walk import refuse as _refuse, walk_pickle

Pair = tuple[str, str]

__all__ = [
    "Allowlist", "TORCH_NAMES", "TENSOR_FILE", "DTENSOR_FILE", "DCP_METADATA",
    "load_pickle", "scan_pickle", "torch_load", "load_rank_file",
]


@dataclass(frozen=True)
class Allowlist:
    """Exact ``(module, name)`` pairs a pickle may use, by what it may do with them.

    Attributes:
        calls: may be called by ``REDUCE`` (functions, and classes whose call only builds a value).
        classes: may be created by ``NEWOBJ`` without ``__init__``; their instances may be filled
            by ``BUILD`` (plain data classes).
        names: may only be referenced (dtypes, storage types, enum members).
    """

    calls: frozenset[Pair] = field(default_factory=frozenset)
    classes: frozenset[Pair] = field(default_factory=frozenset)
    names: frozenset[Pair] = field(default_factory=frozenset)

    @staticmethod
    def of(*, calls: Iterable[Pair] = (), classes: Iterable[Pair] = (), names: Iterable[Pair] = ()) -> "Allowlist":
        return Allowlist(frozenset(calls), frozenset(classes), frozenset(names))

    def __or__(self, other: "Allowlist") -> "Allowlist":
        return Allowlist(self.calls | other.calls, self.classes | other.classes, self.names | other.names)

    def pairs(self) -> frozenset[Pair]:
        return self.calls | self.classes | self.names


def _torch_names() -> frozenset[Pair]:
    """dtypes, layouts, memory formats and legacy ``<X>Storage`` names of the installed torch."""
    import torch

    out = set()
    for n, v in vars(torch).items():
        if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            out.add(("torch", n))
        elif n.endswith("Storage") and isinstance(v, type):
            out.add(("torch", n))
    return frozenset(out)


@functools.cache
def _names() -> Allowlist:
    return Allowlist.of(names=_torch_names())


_STD_CALLS = [("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")]
_STD_CLASSES = [("collections", "OrderedDict")]  # a state dict's ``_metadata`` attribute is BUILD state

#: What ``torch.save`` of plain tensors (and their containers) needs, besides :data:`TORCH_NAMES`.
TENSOR_FILE = Allowlist.of(
    calls=[
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._utils", "_rebuild_parameter_with_state"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("torch", "device"),
        *_STD_CALLS,
    ],
    classes=_STD_CLASSES,
)

#: DTensor state dicts (verl FSDP1/FSDP2 rank files), torch 2.4 - 2.15. ``_rebuild_from_type_v2``
#: and ``_rebuild_wrapper_subclass`` are torch's own rebuild functions; the DTensor classes are
#: filled by ``BUILD`` / ``__setstate__`` only, never called.
DTENSOR_FILE = TENSOR_FILE | Allowlist.of(
    calls=[
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch._utils", "_rebuild_wrapper_subclass"),
    ],
    classes=[
        ("torch.distributed.tensor", "DTensor"),
        ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
        ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
        ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
        ("torch.distributed.tensor.placement_types", "Shard"),
        ("torch.distributed.tensor.placement_types", "Replicate"),
        ("torch.distributed.tensor.placement_types", "Partial"),
        ("torch.distributed.tensor.placement_types", "_StridedShard"),
        ("torch.distributed.device_mesh", "DeviceMesh"),
        ("torch.distributed._mesh_layout", "_MeshLayout"),
        ("torch.distributed._mesh_layout", "_FlatLayout"),
        # torch 2.4 pickles DTensor and its spec under their modules of then
        ("torch.distributed._tensor.api", "DTensor"),
        ("torch.distributed._tensor.placement_types", "DTensorSpec"),
        ("torch.distributed._tensor.placement_types", "TensorMeta"),
        ("torch.distributed._tensor.placement_types", "Shard"),
    ],
)

_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
#: ``torch.distributed.checkpoint`` ``.metadata`` (torch, and Megatron-Core's planner data).
DCP_METADATA = Allowlist.of(
    calls=[
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        (_DCP_MD, "_MEM_FORMAT_ENCODING"),  # enum lookup by value
        (_DCP_PLANNER, "WriteItemType"),
        (_DCP_PLANNER, "LoadItemType"),
        *_STD_CALLS,
        # StorageMeta.checkpoint_id: a path (Python 3.13 names pathlib's classes pathlib._local.*)
        *((module, name) for module in ("pathlib", "pathlib._local") for name in pickle_schemas.PATH_CLASSES),
    ],
    classes=[
        *_STD_CLASSES,
        (_DCP_MD, "Metadata"), (_DCP_MD, "TensorStorageMetadata"), (_DCP_MD, "BytesStorageMetadata"),
        (_DCP_MD, "ChunkStorageMetadata"), (_DCP_MD, "TensorProperties"), (_DCP_MD, "MetadataIndex"),
        (_DCP_MD, "StorageMeta"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint._extension", "StreamTransformExtension"),
        (_DCP_PLANNER, "SavePlan"), (_DCP_PLANNER, "WriteItem"), (_DCP_PLANNER, "TensorWriteData"),
        (_DCP_PLANNER, "ReadItem"), (_DCP_PLANNER, "LoadPlan"), (_DCP_PLANNER, "BytesIOWriteData"),
    ],
)


#: a private module a pickle may name for a public module's class: Python 3.13 defines pathlib's
#: classes in ``pathlib._local`` and pickles them so; 3.10-3.12 and 3.14 have them in ``pathlib``
_SAME_AS = {"pathlib._local": "pathlib"}


def _global(module: str, name: str) -> Any:
    """The object an allowlisted pair names, from its module's own namespace (never getattr walking)."""
    return vars(importlib.import_module(_SAME_AS.get(module, module)))[name]


#: dtypes and legacy storage types a reader that must not import torch knows, by torch's names (a
#: subset of TORCH_NAMES; a test checks them against the installed torch)
NAMED_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
NAMED_STORAGES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}


def named_torch(storage: Callable[[Any], Any]) -> tuple[Allowlist, dict[Pair, Any]]:
    """``(names, substitutes)`` for :func:`load_pickle` of a ``torch.save`` pickle without torch: each
    of :data:`NAMED_DTYPES` is its :class:`~hf_merge.spec.DTypeName`, each of :data:`NAMED_STORAGES`
    ``storage(DTypeName)``, ``torch.strided`` its name; ``torch.Size`` builds a tuple, ``torch.device``
    and ``_get_layout`` a string. A pickle naming any other torch dtype is refused: the caller, which
    serves only a fast path, then leaves the file to the torch reader."""
    from ..spec import DTypeName

    subs: dict[Pair, Any] = {
        ("torch", "Size"): tuple,
        ("torch", "device"): lambda *args: ":".join(str(a) for a in args),
        ("torch", "strided"): "strided",
        ("torch.serialization", "_get_layout"): str,  # "torch.strided", kept as its name
    }
    for name in NAMED_DTYPES:
        subs[("torch", name)] = DTypeName(name)
    for name, dtype in NAMED_STORAGES.items():
        subs[("torch", name)] = storage(DTypeName(dtype))
    names = [("torch", "strided"), *(("torch", n) for n in NAMED_DTYPES), *(("torch", n) for n in NAMED_STORAGES)]
    return Allowlist.of(names=names), subs


def torch_names() -> Allowlist:
    """:data:`TORCH_NAMES`: the names-only pairs of torch's dtypes, layouts, memory formats, storages."""
    return _names()


def __getattr__(name: str) -> Any:  # TORCH_NAMES, lazily (module attribute)
    if name == "TORCH_NAMES":
        return _names()
    raise AttributeError(name)


# --------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------


def _short(s: Any, n: int = 80) -> str:
    text = s if isinstance(s, str) else repr(s)
    return text if len(text) <= n else text[: n - 3] + "..."


@dataclass(eq=False)
class _Ref:
    """Scan mode: a looked-up global, not resolved."""

    pair: Pair


@dataclass(eq=False)
class _Made:
    """Scan mode: what a call or ``NEWOBJ`` would have produced."""

    pair: Pair
    fillable: bool

    # containers are filled by SETITEM(S) / APPEND(S) / ADDITEMS; in scan mode they accept anything
    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def add(self, value: Any) -> None:
        pass


_D = pickle._Unpickler.dispatch  # the pure-Python machine: its dispatch table can be overridden


class _PolicyUnpickler(pickle._Unpickler):
    def __init__(
        self,
        file: IO[bytes],
        allow: Allowlist,
        where: str,
        *,
        resolve: bool,
        substitutes: Mapping[Pair, Any] | None = None,
        persistent_load: Callable[[Any], Any] | None = None,
    ):
        super().__init__(file)
        self._allow, self._where, self._resolve = allow, where, resolve
        self._subs = dict(substitutes or {})
        self._pid = persistent_load
        self._calls: dict[int, Any] = {}  # id -> object (kept alive so ids stay unique)
        self._classes: dict[int, Any] = {}

    # -- lookups ------------------------------------------------------------------------------

    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise _refuse(self._where, "names a global by a non-string")
        pair = (module, name)
        if "." in name or pair not in self._allow.pairs():
            what = "walks a dotted name" if "." in name else "asks for"
            raise _refuse(self._where, f"{what} {_short(module + '.' + name)}")
        if not self._resolve:
            return _Ref(pair)
        if pair in self._subs:
            obj = self._subs[pair]
        else:
            try:
                obj = _global(module, name)
            except (ImportError, KeyError):
                raise _refuse(self._where, f"asks for {_short(module + '.' + name)} (absent from this torch)") from None
        if pair in self._allow.calls:
            self._calls[id(obj)] = obj
        if pair in self._allow.classes:
            if not isinstance(obj, type):
                raise _refuse(self._where, f"uses {module}.{name} as a class")
            self._classes[id(obj)] = obj
        return obj

    def persistent_load(self, pid: Any) -> Any:
        if self._pid is None:
            raise _refuse(self._where, "holds a persistent id")
        return self._pid(pid)

    def _pair_of(self, obj: Any) -> str:
        if isinstance(obj, (_Ref, _Made)):
            return ".".join(obj.pair)
        return _short(getattr(obj, "__qualname__", type(obj).__name__))

    # -- the opcodes that call or fill ------------------------------------------------------

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if self._resolve:
            if id(func) not in self._calls or self._calls[id(func)] is not func:
                raise _refuse(self._where, f"calls {self._pair_of(func)}")
            self.stack[-1] = func(*args)
        else:
            if not isinstance(func, _Ref) or func.pair not in self._allow.calls:
                raise _refuse(self._where, f"calls {self._pair_of(func)}")
            self.stack[-1] = _Made(func.pair, func.pair in self._allow.classes)

    def _new(self, cls: Any, args: tuple, kwargs: dict) -> Any:
        if self._resolve:
            if id(cls) not in self._classes or self._classes[id(cls)] is not cls:
                raise _refuse(self._where, f"creates a {self._pair_of(cls)}")
            return cls.__new__(cls, *args, **kwargs)
        if not isinstance(cls, _Ref) or cls.pair not in self._allow.classes:
            raise _refuse(self._where, f"creates a {self._pair_of(cls)}")
        return _Made(cls.pair, True)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._new(cls, args, {}))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._new(cls, args, kwargs))

    def load_build(self) -> None:
        inst = self.stack[-2]
        if self._resolve:
            ok = not isinstance(inst, type) and id(type(inst)) in self._classes
        else:
            ok = isinstance(inst, _Made) and inst.fillable
        if not ok:
            raise _refuse(self._where, f"fills a {self._pair_of(inst if not self._resolve else type(inst))}")
        if self._resolve:
            super().load_build()
        else:
            self.stack.pop()

    def _refused(self) -> None:
        raise _refuse(self._where, "uses an instance-creating opcode (INST/OBJ/EXT)")

    dispatch = dict(_D)
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    for _op in (pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _refused


def _run(unpickler: _PolicyUnpickler, where: str) -> Any:
    try:
        return unpickler.load()
    except UnsafeCheckpointError:
        raise
    except CorruptCheckpointError:
        raise
    except Exception as e:  # truncated or garbage pickle: the machine stopped, nothing was called
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CorruptCheckpointError(
            f"{where}: not a readable pickle ({type(e).__name__}{': ' + _short(detail, 100) if detail else ''}); "
            "re-copy the file from the training run"
        ) from None


# --------------------------------------------------------------------------------------------
# The fast path: the same policy, checked by C pickle running on stand-ins, then C pickle for real
# --------------------------------------------------------------------------------------------


class _Refused(Exception):
    """The fast path met something the policy may refuse: the pure-Python machine decides."""


def _refused(*_args: Any, **_kwargs: Any) -> Any:
    raise _Refused()


class _StandInType(type):
    """The type of a looked-up global's stand-in in the C scan. Calling it is ``REDUCE`` (checked
    against ``calls``); every way to fill or walk the class itself is refused."""

    _pair: Pair
    _allow: Allowlist

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls._pair not in cls._allow.calls:
            raise _Refused()
        return _Filled(cls._pair, cls._pair in cls._allow.classes)

    __setitem__ = _refused  # SETITEM(S) on the class
    __setstate__ = property(_refused)  # BUILD on the class (data descriptors win over the class dict)
    __getinitargs__ = property(_refused)  # INST / OBJ without arguments (also refused by opcode)
    append = extend = add = property(_refused)  # APPEND(S) / ADDITEMS on the class


class _Filled(_Made):
    """A stand-in result in the C scan: ``BUILD`` only on instances of allowed data classes."""

    def __setstate__(self, state: Any) -> None:
        if not self.fillable:
            raise _Refused()


def _stand_in(pair: Pair, allow: Allowlist) -> type:
    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # NEWOBJ / NEWOBJ_EX
        if pair not in allow.classes:
            raise _Refused()
        return _Filled(pair, True)

    return _StandInType("_StandIn", (), {"__new__": __new__, "_pair": pair, "pair": pair, "_allow": allow})


class _CScan(pickle.Unpickler):
    """C pickle over stand-ins: nothing is imported, constructed or called (``persistent_load``:
    the checker of persistent ids, which are refused without one)."""

    def __init__(self, file: IO[bytes], allow: Allowlist, persistent_load: Callable[[Any], Any] | None = None):
        if persistent_load is not None:
            self.persistent_load = persistent_load  # before __init__: C pickle looks it up there
        super().__init__(file)
        self._allow, self._types = allow, {}

    def find_class(self, module: str, name: str) -> Any:
        pair = (module, name)
        if not isinstance(module, str) or not isinstance(name, str) or "." in name or pair not in self._allow.pairs():
            raise _Refused()
        if pair not in self._types:
            self._types[pair] = _stand_in(pair, self._allow)
        return self._types[pair]

    persistent_load = _refused


def _fast_scan(data: bytes, allow: Allowlist, persistent_load: Callable[[Any], Any] | None, *, walked: bool = False) -> None:
    """:func:`scan_pickle`'s work done by C pickle over stand-ins (after the same walk; ``walked``:
    the caller did it); raises :class:`_Refused` (or anything) where the policy may refuse, and the
    pure machine decides."""
    if not walked:
        _walk(data, allow, "pickle", persistent=persistent_load is not None)
    _CScan(io.BytesIO(data), allow, persistent_load).load()


class _CLoad(pickle.Unpickler):
    """C pickle for real, after :class:`_CScan` passed the same bytes: exact pairs only."""

    def __init__(self, file: IO[bytes], allow: Allowlist, substitutes: Mapping[Pair, Any] | None = None):
        super().__init__(file)
        self._allow, self._substitutes = allow, substitutes or {}

    def find_class(self, module: str, name: str) -> Any:
        pair = (module, name)
        if not isinstance(module, str) or not isinstance(name, str) or "." in name or pair not in self._allow.pairs():
            raise _Refused()
        obj = self._substitutes[pair] if pair in self._substitutes else _global(module, name)
        if pair in self._allow.classes and not isinstance(obj, type):
            raise _Refused()
        return obj

    persistent_load = _refused


def _fast_load(data: bytes, allow: Allowlist, substitutes: Mapping[Pair, Any] | None = None, *, walked: bool = False) -> Any:
    """Unpickle ``data`` with C pickle if the policy allows all of it; raise :class:`_Refused` (or
    anything) otherwise, and the caller runs the pure-Python machine, which decides and says why.

    ``data`` first passes :func:`_walk` (limits and argument schemas; ``walked``: the caller did
    that already), as it does before the pure machine, so both decide the same.

    Sound because the three passes read the same bytes: (1) the walk refuses every opcode outside
    the policy's set (``INST``/``OBJ``/``EXT*``, persistent ids) and bounds the memo C pickle
    allocates; (2) C pickle with every global an inert stand-in
    that checks each ``REDUCE`` against ``calls``, ``NEWOBJ`` against ``classes`` and ``BUILD``
    against instances of ``classes``, and refuses filling a class: the stack of (3) holds, slot for
    slot, the real objects of these stand-ins, so (3) calls and fills only what (2) checked
    (or the caller's inert ``substitutes`` for them).
    """
    if not walked:
        _walk(data, allow, "pickle", persistent=False)
    _CScan(io.BytesIO(data), allow).load()
    return _CLoad(io.BytesIO(data), allow, substitutes).load()


def load_pickle(
    file: "IO[bytes] | bytes",
    allow: Allowlist,
    where: str,
    *,
    substitutes: Mapping[Pair, Any] | None = None,
    persistent_load: Callable[[Any], Any] | None = None,
    names: Allowlist | None = None,
) -> Any:
    """Unpickle ``file`` into real objects under ``allow`` (plus :data:`TORCH_NAMES`).

    Args:
        file: a binary file object or the pickle's bytes.
        allow: what the pickle may use; see :class:`Allowlist`.
        where: the file's name, for error messages.
        substitutes: pair -> object used instead of the module's (must still be on ``allow``).
        persistent_load: handler of persistent ids (refused when None).
        names: the names-only pairs instead of :data:`TORCH_NAMES` (a subset of them, given by a
            caller that must not import torch: every pair it allows is then substituted).

    Raises:
        UnsafeCheckpointError: the pickle asks for anything the policy refuses (nothing ran).
        CorruptCheckpointError: the pickle is truncated or malformed.
    """
    data = bytes(file) if isinstance(file, (bytes, bytearray, memoryview)) else file.read()
    allow = allow | (_names() if names is None else names)
    _walk(data, allow, where, persistent=persistent_load is not None)
    if persistent_load is None:  # plain pickles (.metadata): the fast path first
        try:
            return _fast_load(data, allow, substitutes, walked=True)
        except Exception:  # noqa: BLE001 - refused, malformed or failing: the pure machine decides
            pass
    u = _PolicyUnpickler(io.BytesIO(data), allow, where, resolve=True, substitutes=substitutes, persistent_load=persistent_load)
    return _run(u, where)


def scan_pickle(data: bytes, allow: Allowlist, where: str, *, persistent_load: Callable[[Any], Any] | None = None) -> None:
    """Check that ``data`` uses only what ``allow`` permits, constructing and calling nothing.

    ``persistent_load`` receives persistent ids with looked-up globals as stand-ins (``_Ref`` in
    the pure machine, a :class:`_StandInType` class in the C scan; both have ``pair``).
    """
    allow = allow | _names()
    _walk(data, allow, where, persistent=persistent_load is not None)
    try:  # C pickle over the same stand-ins first (after the same walk); the pure machine decides otherwise
        _fast_scan(data, allow, persistent_load, walked=True)
        return
    except Exception:  # noqa: BLE001 - refused, malformed or failing: the pure machine decides and says why
        pass
    u = _PolicyUnpickler(io.BytesIO(data), allow, where, resolve=False, persistent_load=persistent_load)
    _run(u, where)


def _walk(data: bytes, allow: Allowlist, where: str, *, persistent: bool) -> None:
    """The abstract walk both machines start with (:mod:`.pickle_walk`): limits and argument schemas."""
    walk_pickle(data, allow, where, persistent=persistent, schemas=pickle_schemas)


# --------------------------------------------------------------------------------------------
# torch.save files
# --------------------------------------------------------------------------------------------


def _register(allow: Allowlist) -> None:
    """Add the pairs of ``allow`` to torch's weights_only allowlist, once per pair and process.

    Registered globally rather than with the ``safe_globals`` context manager: on exit, that
    context removes the classes from the process-wide list, including the ones torch itself
    registered when ``torch.distributed.tensor`` was imported.
    """
    todo = [p for p in sorted(allow.calls | allow.classes) if p not in _REGISTERED]
    if not todo:
        return
    import torch

    found = []
    for module, name in todo:
        _REGISTERED.add((module, name))
        try:
            found.append(_global(module, name))
        except (ImportError, KeyError):
            continue
    torch.serialization.add_safe_globals(found)


_REGISTERED: set[Pair] = set()


class _DropMeshPickleWarning(logging.Filter):
    """Unpickling a DeviceMesh without process groups logs a warning meant for torch.compile users;
    reading files never needs process groups. Only that one message is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pickling/unpickling of the DeviceMesh" not in record.getMessage()


@functools.cache
def _quiet_device_mesh() -> None:
    logging.getLogger("torch.distributed.device_mesh").addFilter(_DropMeshPickleWarning())


def storage_reference(pid: Any, records: Mapping[str, Any], prefix: str, where: str, storage_type: "type | tuple[type, ...]") -> tuple[Any, str, int, Any]:
    """A ``torch.save`` persistent id, ``('storage', <XStorage>, key, location, numel)``, checked:
    the storage type (an instance of ``storage_type``), the key, ``numel`` and that the zip holds
    the ``data/<key>`` record. Returns ``(storage type, key, numel, record)``."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise CorruptCheckpointError(f"{where}: unexpected persistent id {_short(pid, 60)}; not a torch.save file")
    _, stype, key, _location, numel = pid
    if not isinstance(stype, storage_type) or not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
        raise CorruptCheckpointError(f"{where}: malformed storage reference {_short(pid, 60)}")
    record = records.get(f"{prefix}data/{key}")
    if record is None:
        raise CorruptCheckpointError(f"{where}: storage record data/{_short(key, 40)} is missing")
    return stype, key, numel, record


def _storage_pid(records: Mapping[str, Any], prefix: str, where: str) -> Callable[[Any], Any]:
    """Persistent ids of torch.save, for the scan: each must name a record of the zip."""

    def check(pid: Any) -> Any:
        stype, _key, _numel, _record = storage_reference(pid, records, prefix, where, (_Ref, _StandInType))
        return _Filled(stype.pair, False)

    return check


def torch_load(path: Path, allow: Allowlist, where: str | None = None) -> Any:
    """``torch.load`` a ``torch.save`` zip, memory-mapped, after checking its records and its pickle.

    Raises:
        UnsafeCheckpointError: the pickle uses anything the policy refuses; nothing from it ran.
        CorruptCheckpointError: truncated, not a torch.save zip, records inconsistent.
    """
    import torch

    from .torch_zip import read_data_pickle

    path = Path(path)
    where = where or path.name
    with open(path, "rb") as f:
        records, prefix, data = read_data_pickle(f, where)
    scan_pickle(data, allow, where, persistent_load=_storage_pid(records, prefix, where))
    _register(allow)
    _quiet_device_mesh()
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _refuse(where, f"was refused by torch's restricted unpickler ({_short(first, 120)})") from None
    except (RuntimeError, EOFError, ValueError, OSError, TypeError, AttributeError, KeyError, IndexError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptCheckpointError(
            f"{where} is truncated or not a torch.save file ({_short(first, 150)}); "
            "re-copy it from the training run or re-save that rank"
        ) from None


def load_rank_file(path: Path) -> dict[str, Any]:
    """Load one verl FSDP rank's state dict (:data:`DTENSOR_FILE`), memory-mapped.

    Raises:
        UnsafeCheckpointError: the pickle references something outside the allowlist.
        CorruptCheckpointError: the file is truncated, not a torch.save zip, or not a dict.
    """
    path = Path(path)
    state = torch_load(path, DTENSOR_FILE)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{path.name} holds a {type(state).__name__}, not a state dict")
    return state


# --------------------------------------------------------------------------------------------
# Inert stand-ins: substitutes for allowlisted classes that record what the pickle gave them
# --------------------------------------------------------------------------------------------


class StandIn:
    """An object of an allowlisted class, as data: ``args`` from ``NEWOBJ``, ``state`` from
    ``BUILD`` (a dict, or ``(dict state, slots state)``). Fields read as attributes or by
    :meth:`get`; nothing of the class it stands for runs."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "StandIn":
        obj = object.__new__(cls)
        obj.__dict__.update(args=args, kwargs=kwargs, state={})
        return obj

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:
            merged: dict = {}
            for part in state:
                if part is not None and not isinstance(part, dict):
                    raise TypeError(f"{type(self).__qualname__} state holds a {type(part).__name__}")
                merged.update(part or {})
            state = merged
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise TypeError(f"{type(self).__qualname__} state is a {type(state).__name__}, not a dict of fields")
        self.__dict__["state"] = {**self.__dict__["state"], **state}

    def get(self, key: str, default: Any = None) -> Any:
        return self.__dict__["state"].get(key, default)

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__.get("state", {})
        if name in state:
            return state[name]
        raise AttributeError(name)


def stand_in(module: str, name: str, base: type = StandIn) -> type:
    """A :class:`StandIn` subclass named ``module.name`` (so a refusal names the real class)."""
    return type(name, (base,), {"__qualname__": f"{module}.{name}", "__module__": __name__})
