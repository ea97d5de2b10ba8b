"""Opcode-level pickle mutations for the fuzz harness (issue 26): the classes the pickle policy's
argument schemas and limits exist for, applied to a ``.metadata`` or a rank file's ``data.pkl``.

- ``pickle-reduce-arg``: one argument opcode (an int, string, None, bool or memo get) replaced by
  an allowlisted callable (``torch.Tensor``, a rebuild function, ``OrderedDict``), ``None``, an
  empty tuple, a huge or a negative int;
- ``pickle-nesting``: a prefix (then ``POP``) that nests tuples or lists 50 to a million deep, or
  a dict key of shared nested tuples (a hash bomb of 2**20 to 2**64 steps);
- ``pickle-memo``: a memo index (``BINPUT``/``BINGET``/``LONG_*``) set to 0, a neighbour, or a
  huge ``LONG_BINPUT`` (2**20 to 2**31);
- ``pickle-view``: the storage offset, a size or a stride of a tensor view (the ints after a
  persistent id) set to 0, 1, a neighbour or a large value (stride 0 broadcasts, overlaps, views
  past their storage).

A rank file is written again by torch's own zip writer (the pickle's length changes); the
mutation record names the opcode, its offset and the old and new bytes.
"""

from __future__ import annotations

import pickletools
import random
import struct
import zipfile
from pathlib import Path

OPS = ("pickle-reduce-arg", "pickle-nesting", "pickle-memo", "pickle-view")

_ARGS = {"BININT1", "BININT2", "BININT", "LONG1", "SHORT_BINUNICODE", "BINUNICODE", "NONE", "NEWTRUE", "NEWFALSE", "BINGET", "LONG_BINGET"}
_CALLABLES = [b"ctorch\nTensor\n", b"ctorch._utils\n_rebuild_tensor_v2\n", b"ctorch._utils\n_rebuild_wrapper_subclass\n",
              b"ccollections\nOrderedDict\n", b"ctorch\nSize\n"]
_VALUES = [b"N", b")", b"J\xff\xff\xff\x7f", b"J\xff\xff\xff\xff", b"\x8a\x08" + (1 << 62).to_bytes(8, "little")]


def _unframed(data: bytes) -> bytes:
    """``data`` without ``FRAME`` opcodes (optional; an edit would break their lengths)."""
    out, last = [], 0
    for op, _arg, pos in pickletools.genops(data):
        if op.name == "FRAME":
            out.append(data[last:pos])
            last = pos + 9
    return b"".join(out) + data[last:]


def _ops(data: bytes) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` of each opcode up to STOP."""
    ops = list(pickletools.genops(data))
    return [(op.name, pos, ops[i + 1][2] if i + 1 < len(ops) else pos + 1) for i, (op, _a, pos) in enumerate(ops)]


def _nesting(rng: random.Random) -> tuple[bytes, str]:
    kind = rng.choice(["tuple", "list", "hash"])
    if kind == "hash":
        n = rng.randint(20, 64)
        return b"})" + b"2\x86" * n + b"Ns0", f"a dict key of nested shared tuples {n} deep"
    n = rng.choice([50, 101, 1000, 100_000, 1_000_000])
    body = b")" + b"\x85" * n if kind == "tuple" else b"(" * n + b"l" * n
    return body + b"0", f"{kind}s nested {n} deep"


def mutate_pickle(rng: random.Random, data: bytes, op: str) -> tuple[bytes, dict]:
    """One mutation of class ``op`` of the pickle ``data``: ``(new bytes, record)``."""
    data = _unframed(data)
    ops = _ops(data)
    rec: dict = {"class": op}
    if op == "pickle-nesting":
        body, what = _nesting(rng)
        start = ops[0][2] if ops and ops[0][0] == "PROTO" else 0
        rec.update(offset=start, new=what)
        return data[:start] + body + data[start:], rec
    if op == "pickle-reduce-arg":
        choices = [o for o in ops if o[0] in _ARGS]
        new = rng.choice(_CALLABLES + _VALUES)
    elif op == "pickle-memo":
        choices = [o for o in ops if o[0] in ("BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "MEMOIZE")]
        new = None
    else:  # pickle-view: ints after a persistent id (offset, sizes, strides)
        choices = []
        for i, o in enumerate(ops):
            if o[0] == "BINPERSID":
                choices += [x for x in ops[i + 1 : i + 12] if x[0] in ("BININT1", "BININT2", "BININT")]
        new = None
    if not choices:
        return data, {**rec, "note": "no opcode of that kind; unchanged"}
    name, start, end = rng.choice(choices)
    if op == "pickle-memo":
        if name == "MEMOIZE" or rng.random() < 0.4:
            new = b"r" + struct.pack("<I", rng.choice([1 << 20, 1 << 26, (1 << 31) - 1, rng.getrandbits(31)]))
        else:
            old = int.from_bytes(data[start + 1 : end], "little")
            value = rng.choice([0, max(0, old - 1), old + 1])
            new = data[start : start + 1] + value.to_bytes(end - start - 1, "little") if value < 1 << 8 * (end - start - 1) else data[start:end]
    elif op == "pickle-view":
        new = b"J" + struct.pack("<i", rng.choice([0, 1, 2, 3, 4096, 1 << 20, (1 << 31) - 1, -1]))
    rec.update(opcode=name, offset=start, old=data[start:end].hex()[:64], new=new.hex()[:64])
    return data[:start] + new + data[end:], rec


def mutate_file(rng: random.Random, path: Path, op: str) -> dict:
    """Apply one ``op`` mutation to a ``.metadata`` file or to a rank file's ``data.pkl`` (then
    written again by torch's zip writer)."""
    if path.name == ".metadata":
        new, rec = mutate_pickle(rng, path.read_bytes(), op)
        path.write_bytes(new)
        return rec
    import torch

    with zipfile.ZipFile(path) as z:
        records = [(n.split("/", 1)[1], z.read(n)) for n in z.namelist()]
    rec: dict = {}
    path.unlink()
    w = torch._C.PyTorchFileWriter(str(path))
    for name, data in records:
        if name in ("version", ".data/version", ".data/serialization_id"):
            continue  # the writer adds them
        if name == "data.pkl":
            data, rec = mutate_pickle(rng, data, op)
        w.write_record(name, data, len(data))
    w.write_end_of_file()
    return rec
