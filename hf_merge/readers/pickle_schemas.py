"""Argument schemas of the pickle policy: what each allowed call, creation and fill may be given.

:func:`~hf_merge.readers.pickle_walk.walk_pickle` checks every ``REDUCE`` against :data:`CALLS`,
every ``NEWOBJ`` against :data:`NEW` and every ``BUILD`` against :data:`STATE` (a pair without an
entry gets the default: plain data only). "Data" is anything with no callable global inside (a
pair the allowlist lets be called or created); a callable is accepted only where a schema names
it, e.g. ``_rebuild_from_type_v2``'s first argument, which it calls, must be one of torch's tensor
rebuild functions (whose own arguments are then checked by their schema), never ``torch.Tensor``.

Tensor views (``_rebuild_tensor_v2``) must lie inside their storage (``numel`` of the persistent
id) and read no element twice: no stride 0 or overlapping strides over a dimension of more than
one element. No format hf_merge reads saves such views; they would let a few stored bytes become
gigabytes of output.
"""

from __future__ import annotations

from typing import Any, Callable

from .pickle_walk import BOOL, BYTES, DICT, INT, LIST, MADE, NONE, PID, REF, STR, TUPLE, Pair, Refusal, V, describe

_U = "torch._utils"
_REBUILD_TENSOR = (_U, "_rebuild_tensor_v2")
_REBUILD_WRAPPER = (_U, "_rebuild_wrapper_subclass")
_FROM_TYPE = ("torch._tensor", "_rebuild_from_type_v2")
_SIZE = ("torch", "Size")
_DTENSOR = ("torch.distributed.tensor", "DTensor")
_DTENSOR_2_4 = ("torch.distributed._tensor.api", "DTensor")  # torch 2.4 pickles DTensor under its old module
_TENSOR_TYPES = {("torch", "Tensor"), ("torch.nn.parameter", "Parameter")}
_TENSORS = {_REBUILD_TENSOR, _FROM_TYPE, (_U, "_rebuild_parameter"), (_U, "_rebuild_parameter_with_state")}
_MAX_DIMS = 64
#: pathlib's classes a DCP ``StorageMeta.checkpoint_id`` may be pickled as
PATH_CLASSES = ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
_MAX_INT = 1 << 62


def _what(v: V) -> str:
    if v.kind in (INT, STR, BOOL):
        return f"{v.kind} {str(v.value)[:30]}"
    return describe(v)


def data(v: V, what: str) -> None:
    if v.calls:
        raise Refusal(f"passes a callable inside {what}")


def integer(v: V, what: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if v.kind != INT or not lo <= v.value <= hi:
        raise Refusal(f"gives {what} as {_what(v)} (an integer in [{lo}, {hi}] is expected)")
    return v.value


def boolean(v: V, what: str) -> None:
    if v.kind != BOOL:
        raise Refusal(f"gives {what} as {_what(v)}, not a bool")


def string(v: V, what: str) -> str:
    if v.kind != STR:
        raise Refusal(f"gives {what} as {_what(v)}, not a string")
    return v.value


def ints(v: V, what: str) -> tuple[int, ...]:
    if v.kind == MADE and v.value == _SIZE:
        v = v.items.items[0]
    if v.kind not in (TUPLE, LIST) or len(v.items) > _MAX_DIMS:
        raise Refusal(f"gives {what} as {_what(v)}, not a tuple of at most {_MAX_DIMS} integers")
    return tuple(integer(x, what) for x in v.items)


def ref(v: V, allowed: set[Pair], what: str) -> Pair:
    if v.kind != REF or v.value not in allowed:
        raise Refusal(f"gives {what} as {_what(v)}")
    return v.value


def made(v: V, allowed: set[Pair], what: str) -> None:
    if v.kind != MADE or v.value not in allowed:
        raise Refusal(f"gives {what} as {_what(v)}")


def arity(args: V, lo: int, hi: int, what: str) -> list[V]:
    if not lo <= len(args.items) <= hi:
        raise Refusal(f"calls {what} with {len(args.items)} arguments")
    return args.items


def view(size: tuple[int, ...], stride: tuple[int, ...], offset: int, numel: int | None) -> None:
    """A strided view reads each element of its storage at most once, and only inside it."""
    if len(size) != len(stride):
        raise Refusal(f"gives a tensor view of {len(size)} sizes and {len(stride)} strides")
    if 0 in size:
        return
    reach = 0
    for n, s in sorted(((n, s) for n, s in zip(size, stride) if n > 1), key=lambda ns: ns[1]):
        if s <= reach:
            raise Refusal(f"gives a tensor view (size {list(size)[:8]}, stride {list(stride)[:8]}) that reads elements more than once")
        reach += s * (n - 1)
    if numel is not None and offset + reach + 1 > numel:
        raise Refusal(f"gives a tensor view up to element {offset + reach + 1} of a storage of {numel} elements")


def _storage_numel(v: V) -> int | None:
    if v.kind != PID:
        raise Refusal(f"gives a tensor storage as {_what(v)}, not a persistent id")
    pid = v.items
    if pid.kind == TUPLE and len(pid.items) == 5 and pid.items[4].kind == INT:
        return pid.items[4].value
    return None


def rebuild_tensor(w: Any, args: V) -> None:
    a = arity(args, 6, 7, "_rebuild_tensor_v2")
    numel = _storage_numel(a[0])
    offset = integer(a[1], "a storage offset")
    view(ints(a[2], "a tensor size"), ints(a[3], "a tensor stride"), offset, numel)
    boolean(a[4], "requires_grad")
    for x in a[5:]:
        data(x, "tensor hooks or metadata")


def rebuild_wrapper(w: Any, args: V) -> None:
    a = arity(args, 8, 8, "_rebuild_wrapper_subclass")
    ref(a[0], {_DTENSOR, _DTENSOR_2_4} & w.allow.pairs(), "the wrapper class")
    if a[1].kind != REF or a[1].calls:
        raise Refusal(f"gives a DTensor dtype as {_what(a[1])}")
    ints(a[2], "a DTensor size")
    ints(a[3], "a DTensor stride")
    integer(a[4], "a DTensor storage offset")
    if not (a[5].kind == MADE and a[5].value == ("torch.serialization", "_get_layout")) and not (a[5].kind == REF and not a[5].calls):
        raise Refusal(f"gives a DTensor layout as {_what(a[5])}")
    if not (a[6].kind == MADE and a[6].value == ("torch", "device")) and a[6].kind != STR:
        raise Refusal(f"gives a DTensor device as {_what(a[6])}")
    boolean(a[7], "requires_grad")


#: what ``_rebuild_from_type_v2(func, new_type, args, state)`` may call, and the types it may give
_FROM_TYPE_FUNCS: dict[Pair, tuple[set[Pair], Callable[[Any, V], None]]] = {
    _REBUILD_TENSOR: (_TENSOR_TYPES, rebuild_tensor),
    _REBUILD_WRAPPER: ({_DTENSOR, _DTENSOR_2_4}, rebuild_wrapper),
}


def rebuild_from_type(w: Any, args: V) -> None:
    a = arity(args, 4, 4, "_rebuild_from_type_v2")
    func = ref(a[0], set(_FROM_TYPE_FUNCS) & w.allow.calls, "the function _rebuild_from_type_v2 calls")
    types, check = _FROM_TYPE_FUNCS[func]
    ref(a[1], types & w.allow.pairs(), f"the tensor type of a {func[1]} result")
    if a[2].kind != TUPLE:
        raise Refusal("gives _rebuild_from_type_v2 arguments that are not a tuple")
    check(w, a[2])
    tensor_state(a[3])


def tensor_state(v: V) -> None:
    """Attributes ``_set_obj_state`` sets on a tensor: ``None``, or a dict (or a pair of dicts) of
    plain names to data."""
    if v.kind == NONE:
        return
    attributes(v, "tensor state")


def attributes(v: V, what: str, names: set[str] | None = None) -> None:
    """A ``BUILD`` / ``__setstate__`` state: a dict of attribute names (not dunder names; only
    ``names`` when given) to data, or ``(dict | None, dict | None)`` (instance and slots state)."""
    parts = v.items if v.kind == TUPLE and len(v.items) == 2 else [v]
    for part in parts:
        if part.kind == NONE and part is not v:
            continue
        if part.kind != DICT:
            raise Refusal(f"gives {what} as {_what(part)}, not a dict of attributes")
        for key, value in part.items:
            name = string(key, f"an attribute name of {what}")
            if name.startswith("__") or (names is not None and name not in names):
                raise Refusal(f"sets attribute {name[:40]!r} through {what}")
            data(value, what)


def rebuild_parameter(w: Any, args: V) -> None:
    a = arity(args, 3, 4, "_rebuild_parameter")
    made(a[0], _TENSORS, "a parameter's data")
    boolean(a[1], "requires_grad")
    data(a[2], "parameter hooks")
    if len(a) == 4:
        tensor_state(a[3])


def one_of(*kinds: str, lo: int = 0, hi: int = 1) -> Callable[[Any, V], None]:
    def check(w: Any, args: V) -> None:
        for x in arity(args, lo, hi, "it"):
            if x.kind not in kinds:
                raise Refusal(f"gives {_what(x)} where {' or '.join(kinds)} is expected")
            data(x, "its arguments")

    return check


def small_int(w: Any, args: V) -> None:
    (x,) = arity(args, 1, 1, "an enum")
    integer(x, "an enum value", 0, 1 << 16)


def iterable_of_data(pairs: bool) -> Callable[[Any, V], None]:
    """``set([...])``, ``frozenset([...])``, ``OrderedDict([(key, value), ...])`` (``pairs``):
    nothing, or one list or tuple of data, whose items (keys) are hashed."""

    def check(w: Any, args: V) -> None:
        for x in arity(args, 0, 1, "a container"):
            if x.kind not in (LIST, TUPLE):
                raise Refusal(f"builds a container from {_what(x)}")
            data(x, "a container's items")
            for item in x.items:
                w.hashed(item.items[0] if pairs and item.kind in (TUPLE, LIST) and item.items else item)

    return check


def device(w: Any, args: V) -> None:
    a = arity(args, 1, 2, "torch.device")
    string(a[0], "a device type")
    if len(a) == 2:
        integer(a[1], "a device index", 0, 1 << 16)


_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"

#: REDUCE schemas by pair (a pair without one: its arguments are plain data)
CALLS: dict[Pair, Callable[[Any, V], None]] = {
    _REBUILD_TENSOR: rebuild_tensor,
    _REBUILD_WRAPPER: rebuild_wrapper,
    _FROM_TYPE: rebuild_from_type,
    (_U, "_rebuild_parameter"): rebuild_parameter,
    (_U, "_rebuild_parameter_with_state"): rebuild_parameter,
    ("torch.serialization", "_get_layout"): one_of(STR, lo=1),
    _SIZE: lambda w, args: ints(arity(args, 1, 1, "torch.Size")[0], "a torch.Size"),
    ("torch", "device"): device,
    ("collections", "OrderedDict"): iterable_of_data(pairs=True),
    ("builtins", "set"): iterable_of_data(pairs=False),
    ("builtins", "frozenset"): iterable_of_data(pairs=False),
    ("builtins", "slice"): one_of(INT, NONE, lo=1, hi=3),
    (_DCP_MD, "_MEM_FORMAT_ENCODING"): small_int,
    (_DCP_PLANNER, "WriteItemType"): small_int,
    (_DCP_PLANNER, "LoadItemType"): small_int,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): small_int,
    ("_io", "BytesIO"): one_of(BYTES),
    **{(module, name): one_of(STR, lo=0, hi=64) for module in ("pathlib", "pathlib._local") for name in PATH_CLASSES},
}


def _bytes_io_state(v: V) -> None:
    if v.kind != TUPLE or len(v.items) != 3 or v.items[0].kind != BYTES or v.items[2].kind not in (DICT, NONE):
        raise Refusal(f"gives a BytesIO state as {_what(v)}")
    integer(v.items[1], "a BytesIO position")
    if v.items[2].kind == DICT:
        attributes(v.items[2], "a BytesIO's attributes")


def _fields_tuple(lo: int, hi: int) -> Callable[[V], None]:
    """A tuple of ``lo..hi`` plain-data fields (the reader decides which lengths it knows)."""

    def check(v: V) -> None:
        if v.kind == TUPLE and lo <= len(v.items) <= hi:
            for x in v.items:
                data(x, "a field")
        else:
            attributes(v, "object state")

    return check


#: BUILD state schemas by class pair (a class without one: :func:`attributes`)
STATE: dict[Pair, Callable[[V], None]] = {
    ("collections", "OrderedDict"): lambda v: attributes(v, "a state dict's attributes", {"_metadata"}),
    ("_io", "BytesIO"): _bytes_io_state,
    # its __getstate__ is a tuple of its fields: 5 up to torch 2.14, 6 (``strides``) from 2.15; a length
    # the DCP reader does not know is its honest error, not the policy's
    (_DCP_MD, "TensorProperties"): _fields_tuple(1, 16),
}


def check_call(w: Any, pair: Pair, args: V) -> None:
    CALLS.get(pair, _plain_args)(w, args)


def _plain_args(w: Any, args: V) -> None:
    data(args, "the arguments of a call")


def check_new(w: Any, pair: Pair, args: V, kwargs: V | None) -> None:
    data(args, "the arguments of a created object")
    if kwargs is not None:
        for key, value in kwargs.items:
            string(key, "a keyword argument name")
            data(value, "keyword arguments")


def check_state(w: Any, pair: Pair, state: V) -> None:
    STATE.get(pair, lambda v: attributes(v, "object state"))(state)
