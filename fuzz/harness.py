"""Seeded mutation fuzzing of every input hf_merge reads, through ``inspect`` and ``merge`` in-process.

Each case copies one pristine checkpoint, mutates one of its files and runs ``hf-merge inspect``
and ``hf-merge merge`` on it (``hf_merge.cli.app.main``, stderr captured). Mutations:

- ``flip``: 1-8 random bytes XOR-ed (a quarter of them within the first 4 KiB);
- ``truncate``: the file cut at a random length;
- ``zip-field``: a random field of a random zip local header or central directory entry
  (rank files, ``.distcp``) set to a random value;
- ``pickle-arg``: the argument bytes of a random opcode of a pickle (``.metadata``, the
  ``data.pkl`` records) replaced;
- ``json-value``: a random JSON value replaced by another type, a huge or non-finite number, a
  deep nesting, or removed (config.json, fsdp_config.json, ckpt_contents.json, index files,
  safetensors headers);
- ``text``: a text side file replaced by non-UTF-8 bytes, letters, or a huge number;
- ``pickle-reduce-arg``, ``pickle-nesting``, ``pickle-memo``, ``pickle-view`` (``.metadata`` and
  rank files' ``data.pkl``, opcode level): an argument replaced by a callable or an extreme value,
  deep nesting or a hash-bomb key, memo indices, tensor offsets/sizes/strides
  (:mod:`pickle_mutations`).

Outcome classes (a case's class is the worst of its runs):

- ``typed-error`` (good): non-zero exit, exactly one ``error:`` line, no "unexpected";
- ``accepted`` (good): exit 0 and the same tensors as the pristine merge, or a side-file mutation
  (config values may legitimately change the output), or tensor bytes were mutated;
- ``unexpected`` / ``traceback`` / ``crash`` / ``hang`` (bad): an "unexpected ... please report"
  line, a traceback, an exception out of ``main`` or no answer within the time limit;
- ``silent-change`` (worst): exit 0 with tensors different from the pristine merge although the
  mutation touched no tensor bytes;
- ``leftover`` (bad): anything named after the target left beside it, or a target after a failure.

For a safetensors folder whose pristine merge is its own tensors (the HF target), "different"
means different from what ``safe_open`` reads from the *mutated* file (cast to the output's
dtype): a header change can make another valid file (a renamed tensor, F16 for BF16), and merging
what it says is right.

Every bad case is kept under ``WORK/bad/NNNNN-CLASS/``: ``case.json`` (target, pristine source,
file, the mutation -- offsets with old and new bytes, the cut length, the zip field with its old
and new value, the pickle argument, or the JSON path with its old and new value -- the outcome
and the error lines) and ``mutated/FILE``; the table's details print the description and the
folder. ``--replay WORK/bad/NNNNN-CLASS`` copies the pristine source, puts the mutated file in
place and runs that one case again.

Sources (each with its side files -- config.json, generation_config.json, tokenizer files --
mutated too): verl FSDP2, megatron-core (v1, v2, legacy ``mp_rank_*``; more with ``--megatron``),
the committed DeepSpeed fixtures (ZeRO-1/3, a HF Trainer folder), accelerate FSDP2, torchtitan and
plain DCP folders when the DCP test fixture is built (``tests/test_dcp_formats.py``, under
``HF_MERGE_FIXTURE_CACHE``), an HF safetensors folder, and any ``--source NAME=DIR``.

Run: ``python fuzz/harness.py --seconds 600`` (``make fuzz``; ``FUZZ_SECONDS``), or from tests
with :func:`run_campaign` on already-built checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import pickletools
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import zipfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pickle_mutations  # noqa: E402

BAD = ("unexpected", "traceback", "crash", "hang", "silent-change", "leftover")
GOOD = ("typed-error", "accepted")
CLASSES = GOOD + BAD
_RANK = {c: i for i, c in enumerate(CLASSES)}
CASE_SECONDS = 120  # generous: a loaded 2-core machine; a real hang never ends


@dataclass
class Target:
    """A pristine checkpoint folder and the files in it to mutate (relative paths)."""

    name: str
    source: Path
    files: list[str]
    self_describing: bool = False  # a safetensors folder whose pristine merge is its own tensors


@dataclass
class Result:
    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    cases: int = 0
    kept: Path | None = None  # where bad cases were saved

    def add(self, kind: str, outcome: str, what: str) -> None:
        self.counts[kind][outcome] += 1
        self.cases += 1
        if outcome in BAD and len(self.examples[outcome]) < 5:
            self.examples[outcome].append(what)

    def bad(self) -> int:
        return sum(c[o] for c in self.counts.values() for o in BAD)

    def table(self) -> str:
        kinds = sorted(self.counts)
        rows = [["file kind"] + list(CLASSES)]
        for k in kinds:
            rows.append([k] + [str(self.counts[k][c]) for c in CLASSES])
        rows.append(["total"] + [str(sum(self.counts[k][c] for k in kinds)) for c in CLASSES])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths)) + " |" for r in rows]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for outcome, ex in self.examples.items():
            lines += [f"{outcome}: {e}" for e in ex]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# mutations
# --------------------------------------------------------------------------------------------


_PICKLE_KINDS = ("rank file (.pt)", "dcp .metadata")


def _kind(rel: str) -> str:
    name = Path(rel).name
    if name.endswith(".pt"):
        return "rank file (.pt)"
    if name.endswith(".distcp"):
        return "dcp .distcp"
    if name == ".metadata":
        return "dcp .metadata"
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(".json"):
        return "json side file"
    return "text side file"


def _zip_fields(raw: bytes) -> list[tuple[int, int]]:
    """``(offset, width)`` of the fields of every local header and central directory entry."""
    out = []
    for sig, widths in ((b"PK\x03\x04", (2, 2, 2, 2, 2, 4, 4, 4, 2, 2)), (b"PK\x01\x02", (2, 2, 2, 2, 2, 2, 4, 4, 4, 2, 2, 2, 2, 2, 4, 4))):
        pos = 0
        while (pos := raw.find(sig, pos)) >= 0:
            off = pos + 4
            for w in widths:
                out.append((off, w))
                off += w
            pos += 4
    return out


def _pickle_args(raw: bytes) -> list[tuple[int, int]]:
    """``(offset, length)`` of the argument bytes of the opcodes of the pickle at the start of ``raw``."""
    out = []
    try:
        ops = list(pickletools.genops(raw))
    except Exception:
        return out
    for i, (op, _arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(raw)
        if end - pos > 1:
            out.append((pos + 1, end - pos - 1))
    return out


def _embedded_pickles(raw: bytes) -> list[tuple[int, int]]:
    """Argument spans of every ``data.pkl`` record in a torch.save zip or a ``.distcp``."""
    spans = []
    pos = 0
    while (pos := raw.find(b"PK\x03\x04", pos)) >= 0:
        nlen, elen = struct.unpack_from("<HH", raw, pos + 26)
        name = raw[pos + 30 : pos + 30 + nlen]
        if name.endswith(b"data.pkl"):
            start = pos + 30 + nlen + elen
            spans += [(start + o, n) for o, n in _pickle_args(raw[start:])]
        pos += 4
    return spans


_JSON_SUBSTITUTES = [None, [], {}, "", "x" * 50, -1, 0, 2**63, 10**400, float("nan"), float("inf"), True, [[[[[]]]]], {"a": {"b": {}}}]


def _json_path(path: list) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _short(value, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _json_mutate(rng: random.Random, text: bytes) -> tuple[bytes, dict]:
    """Replace (or delete) one value of a JSON document; return the new bytes and what changed."""
    data = json.loads(text)
    paths = []

    def walk(node, path):
        paths.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + [i])

    walk(data, [])
    path = rng.choice(paths)
    sub = rng.choice(_JSON_SUBSTITUTES + ["delete"])
    if not path:
        old, data = data, (sub if sub != "delete" else None)
    else:
        parent = data
        for p in path[:-1]:
            parent = parent[p]
        old = parent[path[-1]]
        if sub == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = sub
    record = {"path": _json_path(path), "old": _short(old), "new": "<deleted>" if sub == "delete" else _short(sub)}
    try:
        return json.dumps(data).encode(), record
    except (ValueError, OverflowError):
        return b"{}", {**record, "new": "{} (the value could not be written as JSON)"}


def _safetensors_header_mutate(rng: random.Random, raw: bytes) -> tuple[bytes, dict]:
    n = struct.unpack_from("<Q", raw)[0]
    try:
        new, record = _json_mutate(rng, raw[8 : 8 + n])
    except ValueError:
        return raw, {"path": None, "note": "header is not JSON; unchanged"}
    pad = b" " * ((-len(new)) % 8)
    return struct.pack("<Q", len(new + pad)) + new + pad + raw[8 + n :], {**record, "in": "safetensors header"}


def mutate(rng: random.Random, path: Path, tensor_spans: list[tuple[int, int]], *, pickle_only: bool = False) -> tuple[dict, bool]:
    """Mutate ``path`` in place; return ``(what was changed, touched tensor bytes)``: the record
    names the operation and, per operation, the offsets with old and new bytes, the cut length,
    the zip field, or the JSON path with its old and new value."""
    raw = bytearray(path.read_bytes())
    kind = _kind(str(path))
    ops = ["flip", "truncate"]
    if kind in ("rank file (.pt)", "dcp .distcp"):
        ops += ["zip-field", "zip-field", "pickle-arg"]
    if kind == "dcp .metadata":
        ops += ["pickle-arg", "pickle-arg"]
    if kind in ("rank file (.pt)", "dcp .metadata"):
        ops += list(pickle_mutations.OPS)
    if kind in ("json side file", "safetensors"):
        ops += ["json-value", "json-value"]
    if kind == "text side file":
        ops += ["text"]
    if pickle_only:
        ops = list(pickle_mutations.OPS)
    op = rng.choice(ops)
    rec: dict = {"op": op, "size": len(raw)}
    if op in pickle_mutations.OPS:  # opcode level; the pickle's length may change
        rec.update(pickle_mutations.mutate_file(rng, path, op))
        return rec, False
    touched: list[int] = []
    if op == "flip" and raw:
        changes = []
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(min(len(raw), 4096)) if rng.random() < 0.25 else rng.randrange(len(raw))
            old = raw[i]
            raw[i] ^= rng.randint(1, 255)
            changes.append([i, f"{old:02x}", f"{raw[i]:02x}"])
            touched.append(i)
        rec["bytes"] = changes  # [offset, old hex, new hex], in the order applied
    elif op == "truncate":
        cut = rng.randrange(len(raw) + 1)
        touched.append(cut)
        rec["length"] = cut
        del raw[cut:]
    elif op == "zip-field":
        fields = _zip_fields(bytes(raw))
        if fields:
            off, w = rng.choice(fields)
            old = int.from_bytes(raw[off : off + w], "little")
            value = rng.choice([0, 1, 0xFFFFFFFF, rng.getrandbits(8 * w), old + rng.choice([-64, -1, 1, 64])])
            raw[off : off + w] = (value % (1 << (8 * w))).to_bytes(w, "little")
            touched.append(off)
            header = max((raw.rfind(sig, 0, off + 1), name) for sig, name in ((b"PK\x03\x04", "local header"), (b"PK\x01\x02", "central directory entry")))
            rec.update(offset=off, width=w, old=old, new=value % (1 << (8 * w)), record=f"{header[1]} at {header[0]}, field +{off - header[0]}")
    elif op == "pickle-arg":
        spans = _pickle_args(bytes(raw)) if kind == "dcp .metadata" else _embedded_pickles(bytes(raw))
        if spans:
            off, n = rng.choice(spans)
            old = bytes(raw[off : off + n])
            raw[off : off + n] = bytes(rng.getrandbits(8) for _ in range(n))
            touched.append(off)
            rec.update(offset=off, old=old.hex()[:64], new=bytes(raw[off : off + n]).hex()[:64], length=n)
    elif op == "json-value":
        if kind == "safetensors":
            new, change = _safetensors_header_mutate(rng, bytes(raw))
            raw = bytearray(new)
            touched.append(0)
        else:
            try:
                new, change = _json_mutate(rng, bytes(raw))
                raw = bytearray(new)
            except ValueError:
                n = rng.randint(1, 4)
                change = {"note": f"not JSON; first {n} bytes replaced by ff"}
                raw[:n] = b"\xff"
        rec.update(change)
    elif op == "text":
        rec["old"] = _short(bytes(raw[:40]))
        raw = bytearray(rng.choice([b"\xff\xfe\x00", b"abc", b"9" * 40, b"-1", b"\xc2\xb2", b""]))
        rec["new"] = _short(bytes(raw))
    path.write_bytes(bytes(raw))
    hit = kind in ("rank file (.pt)", "dcp .distcp", "safetensors") and (
        op in ("flip", "zip-field") and any(a <= t < b for t in touched for a, b in tensor_spans)
    )
    return rec, hit


def describe(file: str, rec: dict) -> str:
    """One line saying what a mutation changed."""
    op = rec["op"]
    if op == "flip":
        what = ", ".join(f"@{o} {a}->{b}" for o, a, b in rec.get("bytes", []))
    elif op == "truncate":
        what = f"to {rec['length']} of {rec['size']} bytes"
    elif op == "zip-field" and "offset" in rec:
        what = f"{rec['record']} ({rec['width']} bytes @{rec['offset']}): {rec['old']} -> {rec['new']}"
    elif op == "pickle-arg" and "offset" in rec:
        what = f"{rec['length']} bytes @{rec['offset']}: {rec['old']} -> {rec['new']}"
    elif op == "json-value" and rec.get("path") is not None:
        what = f"{rec.get('in', '')} {rec['path']}: {rec['old']} -> {rec['new']}".strip()
    elif op == "text":
        what = f"{rec['old']} -> {rec['new']}"
    elif op in pickle_mutations.OPS and "new" in rec:
        what = f"{rec.get('opcode', '')} @{rec['offset']}: {rec.get('old', '')} -> {rec['new']}"
    else:
        what = rec.get("note", "nothing changed")
    return f"{op} {file}: {what}"


def tensor_spans(path: Path) -> list[tuple[int, int]]:
    """Byte ranges holding tensor data: ``data/N`` zip records, the safetensors data section."""
    raw = path.read_bytes()
    spans = []
    if path.suffix == ".safetensors":
        n = struct.unpack_from("<Q", raw)[0]
        return [(8 + n, len(raw))]
    pos = 0
    while (pos := raw.find(b"PK\x03\x04", pos)) >= 0:
        nlen, elen = struct.unpack_from("<HH", raw, pos + 26)
        name = raw[pos + 30 : pos + 30 + nlen]
        if b"/data/" in name:
            start = pos + 30 + nlen + elen
            nxt = raw.find(b"PK\x07\x08", start)
            spans.append((start, nxt if nxt > 0 else len(raw)))
        pos += 4
    return spans


# --------------------------------------------------------------------------------------------
# running one case
# --------------------------------------------------------------------------------------------


class _Timeout(BaseException):
    pass


def _on_alarm(signum, frame):  # noqa: ARG001
    raise _Timeout()


def _run_cli(args: list[str], timeout: int = CASE_SECONDS) -> tuple[int | None, str, str]:
    """``(exit code or None on an exception, stderr, class if it ended abnormally)``."""
    from hf_merge.cli.app import main

    err = io.StringIO()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout)
    status = ""
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["--quiet", *args])
    except _Timeout:
        rc, status = None, "hang"
    except BaseException as e:  # noqa: BLE001
        rc, status = None, f"crash ({type(e).__name__})"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    text = err.getvalue()
    if "_Timeout" in text:
        status = "hang"
    return rc, text, status


def _tensors_digest(folder: Path) -> dict[str, str]:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                out[k] = hashlib.sha256(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest() + str(t.dtype)
    return out


def classify(rc: int | None, stderr: str, status: str) -> str:
    if status:
        return "hang" if status == "hang" else "crash"
    if "Traceback" in stderr:
        return "traceback"
    if rc == 0:
        return "accepted"
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    if len(lines) != 1 or lines[0].startswith("error: unexpected "):
        return "unexpected"
    return "typed-error"


@dataclass
class Case:
    """One mutated copy of a target: what was changed, and whether tensor bytes were hit."""

    target: Target
    file: str
    mutation: dict
    hit: bool

    def line(self) -> str:
        return f"[{self.target.name}] {describe(self.file, self.mutation)}"


def prepare_case(target: Target, rng: random.Random, work: Path, *, pickle_only: bool = False) -> Case:
    """Copy ``target`` to ``work/src`` and mutate one of its files (every file kind equally often;
    ``pickle_only``: only the pickles, with the opcode-level classes of :mod:`pickle_mutations`)."""
    src = work / "src"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(target.source, src, symlinks=True)
    by_kind: dict[str, list[str]] = defaultdict(list)
    for f in target.files:
        if not pickle_only or _kind(f) in _PICKLE_KINDS:
            by_kind[_kind(f)].append(f)
    rel = rng.choice(by_kind[rng.choice(sorted(by_kind))])
    spans = tensor_spans(target.source / rel) if _kind(rel) in ("rank file (.pt)", "dcp .distcp", "safetensors") else []
    mutation, hit = mutate(rng, src / rel, spans, pickle_only=pickle_only)
    return Case(target, rel, mutation, hit)


def _reads_as_source(out: Path, src: Path) -> bool | None:
    """For a source that is a safetensors folder: does ``out`` hold exactly what ``safe_open``
    reads from ``src`` (each tensor cast to the output's dtype)? None if safetensors refuses it."""
    import torch
    from safetensors import safe_open

    try:
        want: dict[str, "torch.Tensor"] = {}
        for f in sorted(src.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    want[k] = h.get_tensor(k)
    except Exception:  # noqa: BLE001 - safetensors' own error: the file is not valid
        return None
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            got.update({k: h.get_tensor(k) for k in h.keys()})
    if set(got) != set(want):
        return False
    for k, t in got.items():
        w = want[k].to(t.dtype).contiguous()
        if w.shape != t.shape or not torch.equal(w.view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8)):
            return False
    return True


def judge(case: Case, work: Path, pristine: dict[str, str] | None) -> tuple[str, list[str]]:
    """Run ``inspect`` and ``merge`` on ``work/src``; return the worst class and a line per bad run.

    ``silent-change``: exit 0 and tensors other than the pristine merge's although no tensor
    bytes were touched -- or, for a target that is itself a safetensors folder, other than what
    ``safe_open`` reads from the mutated file (a header change can make another valid file).
    """
    src, out = work / "src", work / "out"
    kind = _kind(case.file)
    worst, notes = "accepted", []
    for args in (["inspect", str(src)], ["merge", str(src), str(out)]):
        rc, stderr, status = _run_cli(args)
        outcome = classify(rc, stderr, status)
        if args[0] == "merge":
            if [p for p in work.iterdir() if p.name.startswith(".out.")] or (rc != 0 and out.exists()):
                outcome = "leftover" if _RANK[outcome] < _RANK["leftover"] else outcome
            elif rc == 0 and outcome == "accepted" and kind not in ("json side file", "text side file") and not case.hit \
                    and pristine is not None:
                same = _tensors_digest(out) == pristine
                if not same and case.target.self_describing and kind == "safetensors":
                    same = bool(_reads_as_source(out, src))
                if not same:
                    outcome = "silent-change"
        if _RANK[outcome] > _RANK[worst] or (worst == "accepted" and outcome == "typed-error"):
            worst = outcome
        if outcome in BAD:
            notes.append(f"{args[0]}: {outcome}: {(stderr.strip().splitlines() or [''])[-1][:200]}")
    return worst, notes


def save_case(case: Case, work: Path, folder: Path, outcome: str, notes: list[str]) -> Path:
    """Keep a bad case: ``case.json`` (target, source, file, mutation, outcome) and the mutated file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mutated").mkdir(exist_ok=True)
    shutil.copyfile(work / "src" / case.file, folder / "mutated" / Path(case.file).name)
    record = {
        "target": case.target.name, "source": str(case.target.source), "file": case.file,
        "mutation": case.mutation, "hit_tensor_bytes": case.hit, "outcome": outcome, "details": notes,
        "description": describe(case.file, case.mutation),
    }
    (folder / "case.json").write_text(json.dumps(record, indent=1) + "\n")
    return folder


def run_case(target: Target, rng: random.Random, work: Path, pristine: dict[str, str], result: Result,
             keep: Path | None = None, pickle_only: bool = False) -> str:
    """One case; a bad one is saved under ``keep`` (see :func:`replay`)."""
    case = prepare_case(target, rng, work, pickle_only=pickle_only)
    worst, notes = judge(case, work, pristine)
    what = " -> ".join([case.line(), *notes])
    if worst in BAD and keep is not None:
        saved = save_case(case, work, keep / f"{result.cases:05d}-{worst}", worst, notes)
        what += f" (replay: --replay {saved})"
    op = case.mutation.get("op")
    result.add(_kind(case.file) + (f" / {op}" if op in pickle_mutations.OPS else ""), worst, what)
    return worst


def _pristine(target: Target, tmp: Path) -> dict[str, str]:
    """The digest of the pristine merge (also warms the imports); marks self-describing targets."""
    out = tmp / f"pristine-{target.name}"
    shutil.rmtree(out, ignore_errors=True)
    rc, stderr, _ = _run_cli(["merge", str(target.source), str(out)], timeout=1800)
    if rc != 0:
        raise RuntimeError(f"pristine merge of {target.source} failed: {stderr[-500:]}")
    digest = _tensors_digest(out)
    target.self_describing = bool(digest) and _tensors_digest(target.source) == digest
    return digest


def run_campaign(targets: list[Target], *, seconds: float, seed: int, work: Path | None = None, max_cases: int | None = None,
                 pickle_only: bool = False) -> Result:
    """Fuzz ``targets`` round robin for ``seconds`` (or ``max_cases``); return the outcome table.
    Bad cases are kept under ``WORK/bad/`` (replayable with ``--replay``)."""
    import logging

    logging.getLogger("hf_merge").setLevel(logging.CRITICAL)
    rng = random.Random(seed)
    result = Result()
    tmp = Path(work or tempfile.mkdtemp(prefix="hf-merge-fuzz-"))
    pristine = {t.name: _pristine(t, tmp) for t in targets}
    deadline = time.monotonic() + seconds
    i = 0
    if pickle_only:
        targets = [t for t in targets if any(_kind(f) in _PICKLE_KINDS for f in t.files)]
    while time.monotonic() < deadline and (max_cases is None or i < max_cases):
        t = targets[i % len(targets)]
        run_case(t, random.Random(rng.getrandbits(64)), tmp / "case", pristine[t.name], result, keep=tmp / "bad", pickle_only=pickle_only)
        i += 1
    shutil.rmtree(tmp / "case", ignore_errors=True)
    result.kept = tmp / "bad" if (tmp / "bad").is_dir() else None
    return result


def replay(folder: Path, *, source: Path | None = None, work: Path | None = None) -> tuple[str, list[str], str]:
    """Re-run one saved case: the pristine source (``case.json``'s, or ``source``) with the saved
    mutated file in place; return ``(class, bad lines, description)``."""
    import logging

    logging.getLogger("hf_merge").setLevel(logging.CRITICAL)
    record = json.loads((folder / "case.json").read_text())
    target = Target(record["target"], Path(source or record["source"]), [record["file"]])
    tmp = Path(work or tempfile.mkdtemp(prefix="hf-merge-replay-"))
    try:
        pristine = _pristine(target, tmp)
    except RuntimeError as e:  # no pristine tensors to compare with: every class but silent-change
        print(f"note: {e}", file=sys.stderr)
        pristine = None
    case_dir = tmp / "case"
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    shutil.copytree(target.source, case_dir / "src", symlinks=True)
    shutil.copyfile(folder / "mutated" / Path(record["file"]).name, case_dir / "src" / record["file"])
    case = Case(target, record["file"], record["mutation"], record["hit_tensor_bytes"])
    worst, notes = judge(case, case_dir, pristine)
    if work is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return worst, notes, case.line()


def default_files(source: Path) -> list[str]:
    """Every file of a checkpoint worth mutating (all but reference outputs and logs)."""
    files = []
    for p in sorted(source.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.suffix not in (".log", ".done", ".py", ".md"):
            files.append(str(p.relative_to(source)))
    return files


SIDE_FILES = Path(__file__).resolve().parents[1] / "tests" / "data" / "gguf_gpt2_tokenizer"


def _with_side_files(folder: Path, config_dir: Path | None, into: Path) -> Path:
    """A fuzz copy of ``folder`` (``into``) with config.json, generation_config.json and
    tokenizer_config.json beside the weights, so that the side files are mutated too."""
    if (into / "fixture.done").is_file():
        return into / "ckpt"
    shutil.rmtree(into, ignore_errors=True)
    ckpt = into / "ckpt"
    shutil.copytree(folder, ckpt, ignore=shutil.ignore_patterns("optimizer*", "reference", "variant.json"))
    if config_dir is not None and not (ckpt / "config.json").is_file():
        shutil.copyfile(config_dir / "config.json", ckpt / "config.json")
    if not (ckpt / "generation_config.json").is_file():
        (ckpt / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 16}) + "\n")
    if not (ckpt / "tokenizer_config.json").is_file():
        shutil.copyfile(SIDE_FILES / "tokenizer_config.json", ckpt / "tokenizer_config.json")
    (into / "fixture.done").write_text("ok\n")
    return ckpt


def _deepspeed_targets(cache: Path) -> list[Target]:
    """The committed DeepSpeed fixtures: ZeRO-1 bf16 tied, ZeRO-3 fp32, and a HF Trainer folder."""
    data = Path(__file__).resolve().parents[1] / "tests" / "data" / "deepspeed"
    out = []
    for name, sub in (("z1_bf16_tied_ws2", ""), ("z3_fp32_ws3", ""), ("z2_bf16_trainer_ws2", "checkpoint-2")):
        if not (data / name).is_dir():
            continue
        src = data / name / sub if sub else data / name
        step = max(int(p.name[len("global_step"):]) for p in (data / name).rglob("global_step*"))
        ckpt = _with_side_files(src, data / name / "reference" / f"step{step}" / "config", cache / f"fuzz-ds-{name}")
        out.append(Target(f"deepspeed-{name}", ckpt, default_files(ckpt)))
    return out


def _dcp_targets(cache: Path) -> list[Target]:
    """accelerate FSDP2 and torchtitan folders from the DCP fixture (``tests/test_dcp_formats.py``
    builds it under HF_MERGE_FIXTURE_CACHE as ``dcp-*``); none if it is not built."""
    roots = sorted(cache.glob("dcp-*/accelerate/ckpt/pytorch_model_fsdp_0"), key=lambda p: p.stat().st_mtime)
    if not roots:
        return []
    root = roots[-1].parents[2]
    out = []
    for name, folder, config in (
        ("accelerate", root / "accelerate" / "ckpt", root / "accelerate" / "config"),
        ("torchtitan", root / "torchtitan" / "dump" / "checkpoint" / "step-1", root / "torchtitan" / "config"),
        ("dcp-plain", root / "dcp_plain" / "ckpt", None),
    ):
        if folder.is_dir():
            ckpt = _with_side_files(folder, config, cache / f"fuzz-{name}")
            out.append(Target(name, ckpt, default_files(ckpt)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("FUZZ_SECONDS", 60)))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("FUZZ_SEED", 0)))
    ap.add_argument("--fsdp", type=Path, help="a verl FSDP actor/ folder (default: built with examples/)")
    ap.add_argument("--megatron", type=Path, nargs="*", default=[], help="verl Megatron role folders")
    ap.add_argument("--hf", type=Path, help="an HF safetensors folder (default: the pristine FSDP merge)")
    ap.add_argument("--source", action="append", default=[], metavar="NAME=DIR",
                    help="any other checkpoint folder to fuzz (config.json inside it or beside it)")
    ap.add_argument("--no-deepspeed", action="store_true", help="leave out the committed DeepSpeed fixtures")
    ap.add_argument("--pickle-only", action="store_true", help="mutate only pickles (.metadata, rank files), opcode level")
    ap.add_argument("--work", type=Path, help="work folder; bad cases are kept in WORK/bad/ (default: a temporary one)")
    ap.add_argument("--replay", type=Path, metavar="CASE_DIR", help="re-run one saved case (WORK/bad/NNNNN-CLASS) and exit")
    ap.add_argument("--replay-source", type=Path, help="with --replay: the pristine source, if it moved")
    args = ap.parse_args(argv)
    if args.replay is not None:
        outcome, notes, line = replay(args.replay, source=args.replay_source, work=args.work)
        print(f"{outcome}: {line}")
        for note in notes:
            print(f"  {note}")
        return 1 if outcome in BAD else 0
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "examples"))
    cache = Path(os.environ.get("HF_MERGE_FIXTURE_CACHE") or tempfile.mkdtemp(prefix="hf-merge-fuzz-ckpt-"))
    fsdp = args.fsdp
    if fsdp is None:
        import make_fsdp_checkpoint as mk

        root = cache / "fuzz-fsdp"
        if not (root / "fixture.json").is_file():
            mk.write_fsdp_checkpoint(root, arch="qwen2", world_size=2)
        fsdp = mk.load_checkpoint_info(root).actor
    targets = [Target("fsdp", fsdp, [f for f in default_files(fsdp)])]
    megatron = list(args.megatron)
    if not megatron and importlib.util.find_spec("megatron") is not None:
        root = cache / "fuzz-megatron"
        if not (root / "fixture.done").is_file():  # real megatron-core checkpoints, 4 gloo ranks
            import subprocess

            subprocess.run([sys.executable, str(repo / "examples" / "make_megatron_checkpoint.py"), str(root)], check=True)
            (root / "fixture.done").write_text("ok\n")
        megatron = [root / "qwen2_v1" / "actor", root / "llama_v2_singleton" / "actor", root / "qwen2_legacy_tied" / "actor"]
    for m in megatron:
        targets.append(Target(f"megatron-{m.parent.name}", m, default_files(m)))
    if not args.no_deepspeed:
        targets += _deepspeed_targets(cache)
    targets += _dcp_targets(cache)
    for spec in args.source:
        name, _, folder = spec.partition("=")
        targets.append(Target(name, Path(folder), default_files(Path(folder))))
    hf = args.hf
    if hf is None:
        hf = cache / "fuzz-hf"
        if not (hf / "config.json").is_file():
            from hf_merge.cli.app import main as cli

            cli(["--quiet", "merge", str(fsdp), str(hf), "--overwrite"])
    targets.append(Target("hf", hf, [f for f in default_files(hf) if f.endswith((".json", ".safetensors"))]))
    t0 = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="hf-merge-fuzz-"))
    result = run_campaign(targets, seconds=args.seconds, seed=args.seed, work=work, pickle_only=args.pickle_only)
    print(f"{result.cases} cases in {time.monotonic() - t0:.0f} s (seed {args.seed}; targets: {', '.join(t.name for t in targets)})")
    print(result.table())
    if result.kept is not None:
        print(f"bad cases kept in {result.kept} (python fuzz/harness.py --replay DIR re-runs one)")
    return 1 if result.bad() else 0


if __name__ == "__main__":
    sys.exit(main())
