"""The pickle walked once over abstract values, before any machine runs it: limits and argument schemas.

Both ways :mod:`~hf_merge.readers.safe_pickle` runs a pickle (the pure-Python policy machine and the
C fast path) first pass the bytes through :func:`walk_pickle`, so they decide the same by
construction. The walk simulates the pickle machine's stack and memo with small abstract values
(what kind of object, how deep, how costly to hash, whether a callable is inside) -- nothing is
imported, built or called -- and refuses:

- a global outside the allowlist, a call, creation or fill the policy does not allow (the same
  messages as the machine);
- an allowed call whose arguments are outside its schema (:mod:`~hf_merge.readers.pickle_schemas`):
  wrong types or ranges, a callable where the schema names none, a tensor view that reads outside
  its storage or reads an element twice (stride 0, overlaps);
- ``BUILD`` state that would give an object attributes its class does not define (containers none,
  stand-ins no dunder names), filling (``APPEND``/``SETITEM``/``ADDITEMS``) anything but a list, dict
  or set, or an object that was already placed inside another one (so depths stay exact);
- work not bounded by the input (:class:`~hf_merge.errors.PickleLimitError`): containers nested
  deeper than :data:`MAX_DEPTH`, a memo index past the file's length (C pickle allocates the memo
  up to the largest index), and hashing (dict keys, set items) costing more than
  :func:`hash_budget` steps in all (a tuple's hash visits every element, shared ones again).
"""

from __future__ import annotations

import codecs
import gc
import struct
from typing import Any, Callable

from ..errors import CorruptCheckpointError, PickleLimitError, PickleRefusedError, UnsafeCheckpointError

Pair = tuple[str, str]

#: Containers may nest this deep (real checkpoints: under 15).
MAX_DEPTH = 100


def hash_budget(nbytes: int) -> int:
    """Hashing steps a pickle of ``nbytes`` may cost in all (each key hashes its elements once)."""
    return 4 * nbytes + 4096


# kinds of abstract values
INT, BOOL, NONE, FLOAT, STR, BYTES = "int", "bool", "none", "float", "str", "bytes"
TUPLE, LIST, DICT, SET, FROZENSET = "tuple", "list", "dict", "set", "frozenset"
REF, MADE, PID = "ref", "made", "pid"


class V:
    """An abstract pickle value: ``kind``; ``value`` (int, bool or str value; a global's or maker's
    pair); ``items`` (tuple/list items, dict ``(key, value)`` pairs, a made object's argument tuple,
    a persistent id); ``depth`` of nesting; hash ``cost``; ``calls``: a callable global is inside;
    ``placed``: it was put inside another object."""

    __slots__ = ("kind", "value", "items", "depth", "cost", "calls", "placed", "state")

    def __init__(self, kind: str, value: Any = None, items: Any = None, depth: int = 0, cost: int = 1, calls: bool = False):
        self.kind, self.value, self.items, self.depth, self.cost, self.calls = kind, value, items, depth, cost, calls
        self.placed = False
        self.state: V | None = None


#: made objects that are containers: what SETITEM(S) / ADDITEMS may fill besides plain dicts and sets
_FILLED_MADE: dict[str, Pair] = {DICT: ("collections", "OrderedDict"), SET: ("builtins", "set")}
_NONE, _TRUE, _FALSE, _FLOAT, _BYTES = V(NONE), V(BOOL, True), V(BOOL, False), V(FLOAT), V(BYTES)


class Refusal(Exception):
    """A schema's refusal: the reason, in words."""


def refuse(where: str, what: str) -> PickleRefusedError:
    return PickleRefusedError(where, what)


def _limit(where: str, what: str) -> PickleLimitError:
    return PickleLimitError(
        f"{where}: the pickle {what}; refused as crafted or damaged before anything was built. "
        "Re-copy the file from the training run"
    )


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def describe(v: V) -> str:
    if v.kind in (REF, MADE) and isinstance(v.value, tuple):
        return ".".join(v.value)
    return v.kind


def _text_arg(data: bytes, pos: int) -> tuple[bytes, int]:
    nl = data.find(b"\n", pos)
    if nl < 0:
        raise EOFError("a text argument without its newline")
    return data[pos:nl], nl + 1


class _Walk:
    def __init__(self, data: bytes, where: str, allow: Any, *, persistent: bool, schemas: Any):
        self.data, self.where, self.allow, self.persistent, self.schemas = data, where, allow, persistent, schemas
        self.pairs = allow.pairs()
        self.callable = allow.calls | allow.classes
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.floor = 0  # the stack's length at the last mark: nothing below it may be popped
        self.memo: dict[int, V] = {}
        self.max_memo = len(data)
        self.budget = hash_budget(len(data))

    # -- building values -----------------------------------------------------------------------

    def _deep(self, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _limit(self.where, f"nests containers more than {MAX_DEPTH} deep")

    def _place(self, items: Any) -> tuple[int, int, bool]:
        depth, cost, calls = 0, 1, False
        for v in items:
            v.placed = True
            depth = max(depth, v.depth)
            cost += v.cost
            calls = calls or v.calls
        return depth, cost, calls

    def _no_callable_data(self, items: list, calls: bool) -> None:
        """A dict, list or set holds data: an allowed function or class is an argument of a call (inside
        the tuple a ``REDUCE`` takes), never a value a reader would find where it expects data."""
        if calls:
            what = next((describe(v) for v in items if isinstance(v, V) and v.calls), "a callable")
            raise refuse(self.where, f"puts {what} into a container as data")

    def container(self, kind: str, items: list) -> V:
        depth, cost, calls = self._place(items)
        if kind != TUPLE:
            self._no_callable_data(items, calls)
        self._deep(depth + 1)
        if kind == DICT:
            pairs = list(zip(items[::2], items[1::2]))
            for key, _ in pairs:
                self.hashed(key)
            return V(DICT, None, pairs, depth + 1, 1, calls)
        if kind in (SET, FROZENSET):
            for item in items:
                self.hashed(item)
            return V(kind, None, list(items), depth + 1, 1 + len(items), calls)
        return V(kind, None, list(items), depth + 1, min(cost, self.budget + 1) if kind == TUPLE else 1, calls)

    def hashed(self, key: V) -> None:
        self.budget -= key.cost
        if self.budget < 0:
            raise _limit(self.where, "hashes keys that cost more steps than its size allows (a nested-tuple hash bomb)")

    def fill(self, target: Any, items: list, kind: str) -> None:
        if not isinstance(target, V):
            raise CorruptCheckpointError(f"{self.where}: not a readable pickle (a fill without a container); re-copy the file from the training run")
        pair = target.value if target.kind == MADE else None
        if target.kind != kind and (pair is None or pair != _FILLED_MADE.get(kind)):
            raise refuse(self.where, f"fills a {describe(target)}, which is not a container of that kind")
        if target.placed:
            raise refuse(self.where, f"fills a {describe(target)} after placing it inside another object")
        depth, cost, calls = self._place(items)
        self._no_callable_data(items, calls)
        hashed = items[::2] if kind == DICT else items if kind == SET else ()
        for key in hashed:
            self.budget -= key.cost
        if self.budget < 0:
            self.hashed(_NONE)  # refuses it
        target.depth = max(target.depth, depth + 1)
        target.calls = target.calls or calls
        if target.kind != MADE:
            target.items.extend(zip(items[::2], items[1::2]) if kind == DICT else items)
        self._deep(target.depth)

    # -- the opcodes ---------------------------------------------------------------------------

    def pop_mark(self) -> list:
        if not self.marks:
            raise IndexError("no mark")
        k = self.marks.pop()
        self.floor = self.marks[-1] if self.marks else 0
        items = self.stack[k:]
        del self.stack[k:]
        return items

    def pop(self) -> Any:
        if len(self.stack) <= self.floor:
            raise IndexError("stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        if len(self.stack) <= self.floor:
            raise IndexError("stack underflow")
        return self.stack[-1]

    def memo_get(self, index: int) -> None:
        """Push memo entry ``index`` (GET, BINGET, LONG_BINGET)."""
        v = self.memo.get(index)
        if v is None:
            raise KeyError(f"memo value {index} not found")
        self.stack.append(v)

    def memo_put(self, index: int) -> None:
        if index < 0:
            raise ValueError("negative memo index")
        if index > self.max_memo:
            raise _limit(self.where, f"stores memo entry {index} in a pickle of {len(self.data)} bytes")
        self.memo[index] = self.top()

    def glob(self, module: Any, name: Any) -> V:
        if not isinstance(module, str) or not isinstance(name, str):
            raise refuse(self.where, "names a global by a non-string")
        pair = (module, name)
        if "." in name or pair not in self.pairs:
            what = "walks a dotted name" if "." in name else "asks for"
            raise refuse(self.where, f"{what} {_short(module + '.' + name)}")
        return V(REF, pair, calls=pair in self.callable)

    def reduce(self) -> None:
        args = self.pop()
        func = self.top()
        if not isinstance(func, V) or func.kind != REF or func.value not in self.allow.calls:
            raise refuse(self.where, f"calls {describe(func) if isinstance(func, V) else 'a mark'}")
        if not isinstance(args, V) or args.kind != TUPLE:
            raise CorruptCheckpointError(f"{self.where}: not a readable pickle (a call without an argument tuple); re-copy the file from the training run")
        self.schemas.check_call(self, func.value, args)
        self.stack[-1] = self.made(func.value, args)

    def made(self, pair: Pair, args: V, kwargs: V | None = None) -> V:
        args.placed = True
        depth, cost = args.depth, args.cost
        if kwargs is not None:
            kwargs.placed = True
            depth, cost = max(depth, kwargs.depth), cost + kwargs.cost
        self._deep(depth + 1)
        return V(MADE, pair, args, depth + 1, cost)

    def newobj(self, cls: Any, args: Any, kwargs: Any = None) -> None:
        if not isinstance(cls, V) or cls.kind != REF or cls.value not in self.allow.classes:
            raise refuse(self.where, f"creates a {describe(cls) if isinstance(cls, V) else 'mark'}")
        if not isinstance(args, V) or args.kind != TUPLE or (kwargs is not None and (not isinstance(kwargs, V) or kwargs.kind != DICT)):
            raise CorruptCheckpointError(f"{self.where}: not a readable pickle (an object created without its argument tuple); re-copy the file from the training run")
        self.schemas.check_new(self, cls.value, args, kwargs)
        self.stack.append(self.made(cls.value, args, kwargs))

    def build(self) -> None:
        state = self.pop()
        inst = self.top()
        if not isinstance(inst, V) or inst.kind != MADE or inst.value not in self.allow.classes:
            raise refuse(self.where, f"fills a {describe(inst) if isinstance(inst, V) else 'mark'}")
        if not isinstance(state, V):
            raise CorruptCheckpointError(f"{self.where}: not a readable pickle (BUILD without state); re-copy the file from the training run")
        if inst.placed:
            raise refuse(self.where, f"fills a {describe(inst)} after placing it inside another object")
        self.schemas.check_state(self, inst.value, state)
        state.placed = True
        inst.depth = max(inst.depth, state.depth + 1)
        inst.cost = min(inst.cost + state.cost, self.budget + 1)
        inst.state = state
        self._deep(inst.depth)

    def run(self) -> None:
        data, pos, end = self.data, 0, len(self.data)
        while True:
            if pos >= end:
                raise EOFError("no STOP opcode")
            code = data[pos]
            pos += 1
            op = _OPS.get(code)
            if op is None:
                raise ValueError(f"unknown opcode {code:#x}")
            pos = op(self, data, pos)
            if pos < 0:
                return


def _fixed(fmt: str) -> Callable[[bytes, int], tuple[Any, int]]:
    s = struct.Struct(fmt)

    def read(data: bytes, pos: int) -> tuple[Any, int]:
        if pos + s.size > len(data):
            raise EOFError("a cut argument")
        return s.unpack_from(data, pos)[0], pos + s.size

    return read


_U1, _U2, _U4, _I4, _U8 = _fixed("<B"), _fixed("<H"), _fixed("<I"), _fixed("<i"), _fixed("<Q")


def _counted(width: Callable[[bytes, int], tuple[int, int]]) -> Callable[[bytes, int], tuple[bytes, int]]:
    def read(data: bytes, pos: int) -> tuple[bytes, int]:
        n, pos = width(data, pos)
        if n < 0 or pos + n > len(data):
            raise EOFError("a cut argument")
        return data[pos : pos + n], pos + n

    return read


_C1, _C4, _C4S, _C8 = _counted(_U1), _counted(_U4), _counted(_I4), _counted(_U8)


def _push(w: _Walk, v: V) -> None:
    w.stack.append(v)


def _op_push_int(reader: Callable) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        n, pos = reader(data, pos)
        _push(w, V(INT, n))
        return pos

    return op


def _op_long(reader: Callable) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        raw, pos = reader(data, pos)
        _push(w, V(INT, int.from_bytes(raw, "little", signed=True)))
        return pos

    return op


def _op_leaf(v: V, reader: Callable | None = None) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        if reader is not None:
            _, pos = reader(data, pos)
        w.stack.append(v)
        return pos

    return op


def _op_str(reader: Callable, decode: Callable[[bytes], str]) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        raw, pos = reader(data, pos)
        _push(w, V(STR, decode(raw)))
        return pos

    return op


def _utf8(raw: bytes) -> str:
    return str(raw, "utf-8", "surrogatepass")


def _ascii_string(raw: bytes) -> str:
    return raw.decode("ascii")


def _op_int_text(w: _Walk, data: bytes, pos: int) -> int:
    text, pos = _text_arg(data, pos)
    if text in (b"00", b"01"):
        _push(w, _TRUE if text == b"01" else _FALSE)
    else:
        _push(w, V(INT, int(text, 0)))
    return pos


def _op_long_text(w: _Walk, data: bytes, pos: int) -> int:
    text, pos = _text_arg(data, pos)
    _push(w, V(INT, int(text[:-1] if text.endswith(b"L") else text, 0)))
    return pos


def _op_string_text(w: _Walk, data: bytes, pos: int) -> int:
    text, pos = _text_arg(data, pos)
    if len(text) < 2 or text[0] != text[-1] or text[:1] not in (b"'", b'"'):
        raise ValueError("the STRING opcode argument must be quoted")
    _push(w, V(STR, codecs.escape_decode(text[1:-1])[0].decode("ascii")))
    return pos


def _op_unicode_text(w: _Walk, data: bytes, pos: int) -> int:
    text, pos = _text_arg(data, pos)
    _push(w, V(STR, str(text, "raw-unicode-escape")))
    return pos


def _op_float_text(w: _Walk, data: bytes, pos: int) -> int:
    text, pos = _text_arg(data, pos)
    float(text)
    _push(w, _FLOAT)
    return pos


def _op_mark(w: _Walk, data: bytes, pos: int) -> int:
    w.marks.append(len(w.stack))
    w.floor = len(w.stack)
    return pos


def _op_stop(w: _Walk, data: bytes, pos: int) -> int:
    w.pop()
    return -1


def _op_pop(w: _Walk, data: bytes, pos: int) -> int:
    if len(w.stack) > w.floor:
        w.stack.pop()
    else:
        w.pop_mark()
    return pos


def _op_pop_mark(w: _Walk, data: bytes, pos: int) -> int:
    w.pop_mark()
    return pos


def _op_dup(w: _Walk, data: bytes, pos: int) -> int:
    w.stack.append(w.top())
    return pos


def _op_empty(kind: str) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        _push(w, V(kind, None, [], 1, 1))
        return pos

    return op


def _op_from_mark(kind: str) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        items = w.pop_mark()
        if kind == DICT and len(items) % 2:
            raise ValueError("odd number of items for DICT")
        _push(w, w.container(kind, items))
        return pos

    return op


def _op_tuple_n(n: int) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        items = [w.pop() for _ in range(n)][::-1]
        _push(w, w.container(TUPLE, items))
        return pos

    return op


def _op_append(w: _Walk, data: bytes, pos: int) -> int:
    value = w.pop()
    w.fill(w.top(), [value], LIST)
    return pos


def _op_fill_from_mark(kind: str) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        items = w.pop_mark()
        if kind == DICT and len(items) % 2:
            raise ValueError("odd number of items for SETITEMS")
        w.fill(w.top(), items, kind)
        return pos

    return op


def _op_setitem(w: _Walk, data: bytes, pos: int) -> int:
    value = w.pop()
    key = w.pop()
    w.fill(w.top(), [key, value], DICT)
    return pos


def _memo_index(reader: Callable | None, data: bytes, pos: int) -> tuple[int, int]:
    if reader is None:
        text, pos = _text_arg(data, pos)
        return int(text), pos
    return reader(data, pos)


def _op_get(reader: Callable | None) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        index, pos = _memo_index(reader, data, pos)
        w.memo_get(index)
        return pos

    return op


def _op_put(reader: Callable | None) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        index, pos = _memo_index(reader, data, pos)
        w.memo_put(index)
        return pos

    return op


def _op_memoize(w: _Walk, data: bytes, pos: int) -> int:
    w.memo_put(len(w.memo))
    return pos


def _op_binint1(w: _Walk, data: bytes, pos: int) -> int:  # the commonest opcodes, without a reader call
    if pos >= len(data):
        raise EOFError("a cut argument")
    w.stack.append(V(INT, data[pos]))
    return pos + 1


def _op_short_binunicode(w: _Walk, data: bytes, pos: int) -> int:
    if pos >= len(data):
        raise EOFError("a cut argument")
    end = pos + 1 + data[pos]
    if end > len(data):
        raise EOFError("a cut argument")
    w.stack.append(V(STR, str(data[pos + 1 : end], "utf-8", "surrogatepass")))
    return end


def _op_long_binget(w: _Walk, data: bytes, pos: int) -> int:
    if pos + 4 > len(data):
        raise EOFError("a cut argument")
    w.memo_get(int.from_bytes(data[pos : pos + 4], "little"))
    return pos + 4


def _op_binget(w: _Walk, data: bytes, pos: int) -> int:
    if pos >= len(data):
        raise EOFError("a cut argument")
    w.memo_get(data[pos])
    return pos + 1


def _op_binput(w: _Walk, data: bytes, pos: int) -> int:
    if pos >= len(data):
        raise EOFError("a cut argument")
    if len(w.stack) <= w.floor:
        raise IndexError("stack underflow")
    if data[pos] > w.max_memo:
        w.memo_put(data[pos])  # refuses it
    w.memo[data[pos]] = w.stack[-1]
    return pos + 1


def _op_global(w: _Walk, data: bytes, pos: int) -> int:
    module, pos = _text_arg(data, pos)
    name, pos = _text_arg(data, pos)
    _push(w, w.glob(module.decode("utf-8"), name.decode("utf-8")))
    return pos


def _op_stack_global(w: _Walk, data: bytes, pos: int) -> int:
    name = w.pop()
    module = w.pop()
    if not (isinstance(name, V) and isinstance(module, V) and name.kind == STR and module.kind == STR):
        raise refuse(w.where, "names a global by a non-string")
    _push(w, w.glob(module.value, name.value))
    return pos


def _op_reduce(w: _Walk, data: bytes, pos: int) -> int:
    w.reduce()
    return pos


def _op_newobj(w: _Walk, data: bytes, pos: int) -> int:
    args = w.pop()
    w.newobj(w.pop(), args)
    return pos


def _op_newobj_ex(w: _Walk, data: bytes, pos: int) -> int:
    kwargs = w.pop()
    args = w.pop()
    w.newobj(w.pop(), args, kwargs)
    return pos


def _op_build(w: _Walk, data: bytes, pos: int) -> int:
    w.build()
    return pos


def _op_persid(binary: bool) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        if not w.persistent:
            raise refuse(w.where, "holds a persistent id")
        if binary:
            pid = w.pop()
            if not isinstance(pid, V):
                raise IndexError("no persistent id")
            pid.placed = True
        else:
            text, pos = _text_arg(data, pos)
            pid = V(STR, text.decode("ascii"))
        _push(w, V(PID, None, pid, 1, 1))
        return pos

    return op


def _op_never(w: _Walk, data: bytes, pos: int) -> int:
    raise refuse(w.where, "uses an instance-creating opcode (INST/OBJ/EXT)")


def _op_buffer(w: _Walk, data: bytes, pos: int) -> int:
    raise ValueError("pickle stream refers to out-of-band data")


def _op_skip(reader: Callable) -> Callable:
    def op(w: _Walk, data: bytes, pos: int) -> int:
        _, pos = reader(data, pos)
        return pos

    return op


def _op_frame(w: _Walk, data: bytes, pos: int) -> int:
    n, pos = _U8(data, pos)
    if pos + n > len(data):  # C pickle refuses it (truncated); Python's reads the short frame and goes on
        raise EOFError("a frame longer than the rest of the pickle")
    return pos


_OPS: dict[int, Callable[[_Walk, bytes, int], int]] = {
    ord("("): _op_mark, ord("."): _op_stop, ord("0"): _op_pop, ord("1"): _op_pop_mark, ord("2"): _op_dup,
    ord("F"): _op_float_text, ord("G"): _op_leaf(_FLOAT, _fixed(">d")),
    ord("I"): _op_int_text, ord("J"): _op_push_int(_I4), ord("M"): _op_push_int(_U2),
    ord("L"): _op_long_text, 0x8A: _op_long(_C1), 0x8B: _op_long(_C4S),
    ord("N"): _op_leaf(_NONE), 0x88: _op_leaf(_TRUE), 0x89: _op_leaf(_FALSE),
    ord("S"): _op_string_text, ord("T"): _op_str(_C4S, _ascii_string), ord("U"): _op_str(_C1, _ascii_string),
    ord("V"): _op_unicode_text, ord("X"): _op_str(_C4, _utf8), 0x8C: _op_short_binunicode, 0x8D: _op_str(_C8, _utf8),
    ord("B"): _op_leaf(_BYTES, _C4S), ord("C"): _op_leaf(_BYTES, _C1), 0x8E: _op_leaf(_BYTES, _C8), 0x96: _op_leaf(_BYTES, _C8),
    ord("]"): _op_empty(LIST), ord("}"): _op_empty(DICT), 0x8F: _op_empty(SET),
    ord(")"): lambda w, data, pos: (_push(w, V(TUPLE, None, [], 1, 1)), pos)[1],
    ord("t"): _op_from_mark(TUPLE), ord("l"): _op_from_mark(LIST), ord("d"): _op_from_mark(DICT),
    0x91: _op_from_mark(FROZENSET),
    0x85: _op_tuple_n(1), 0x86: _op_tuple_n(2), 0x87: _op_tuple_n(3),
    ord("a"): _op_append, ord("e"): _op_fill_from_mark(LIST), ord("s"): _op_setitem, ord("u"): _op_fill_from_mark(DICT),
    0x90: _op_fill_from_mark(SET),
    ord("g"): _op_get(None), ord("h"): _op_binget, ord("j"): _op_long_binget,
    ord("p"): _op_put(None), ord("q"): _op_binput, ord("r"): _op_put(_U4), 0x94: _op_memoize,
    ord("K"): _op_binint1,
    ord("c"): _op_global, 0x93: _op_stack_global,
    ord("R"): _op_reduce, 0x81: _op_newobj, 0x92: _op_newobj_ex, ord("b"): _op_build,
    ord("P"): _op_persid(False), ord("Q"): _op_persid(True),
    ord("i"): _op_never, ord("o"): _op_never, 0x82: _op_never, 0x83: _op_never, 0x84: _op_never,
    0x97: _op_buffer, 0x98: _op_buffer,
    0x80: _op_skip(_U1), 0x95: _op_frame,
}


def walk_pickle(data: bytes, allow: Any, where: str, *, persistent: bool, schemas: Any) -> None:
    """Walk ``data`` over abstract values under ``allow`` (an :class:`~hf_merge.readers.safe_pickle.Allowlist`)
    and ``schemas`` (:mod:`~hf_merge.readers.pickle_schemas`); ``persistent``: persistent ids are
    allowed (a ``torch.save`` ``data.pkl``).

    Raises:
        UnsafeCheckpointError: what the policy refuses (:class:`~hf_merge.errors.PickleLimitError`
            for the limits).
        CorruptCheckpointError: the pickle is cut or malformed.
    """
    w = _Walk(data, where, allow, persistent=persistent, schemas=schemas)
    collecting = gc.isenabled()
    gc.disable()  # the walk makes many small acyclic objects; collecting them as it goes costs 10x
    try:
        w.run()
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Refusal as e:
        raise refuse(where, str(e)) from None
    except (EOFError, ValueError, IndexError, KeyError, UnicodeError, struct.error, TypeError, OverflowError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CorruptCheckpointError(
            f"{where}: not a readable pickle ({type(e).__name__}{': ' + _short(detail, 100) if detail else ''}); "
            "re-copy the file from the training run"
        ) from None
    finally:
        if collecting:
            gc.enable()
