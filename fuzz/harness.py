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
- ``text``: a text side file replaced by non-UTF-8 bytes, letters, or a huge number.

Outcome classes (a case's class is the worst of its runs):

- ``typed-error`` (good): non-zero exit, exactly one ``error:`` line, no "unexpected";
- ``accepted`` (good): exit 0 and the same tensors as the pristine merge, or a side-file mutation
  (config values may legitimately change the output), or tensor bytes were mutated;
- ``unexpected`` / ``traceback`` / ``crash`` / ``hang`` (bad): an "unexpected ... please report"
  line, a traceback, an exception out of ``main`` or no answer within the time limit;
- ``silent-change`` (worst): exit 0 with tensors different from the pristine merge although the
  mutation touched no tensor bytes;
- ``leftover`` (bad): anything named after the target left beside it, or a target after a failure.

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


@dataclass
class Result:
    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    cases: int = 0

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


def _json_mutate(rng: random.Random, text: bytes) -> bytes:
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
        data = sub if sub != "delete" else None
    else:
        parent = data
        for p in path[:-1]:
            parent = parent[p]
        if sub == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = sub
    try:
        return json.dumps(data).encode()
    except (ValueError, OverflowError):
        return b"{}"


def _safetensors_header_mutate(rng: random.Random, raw: bytes) -> tuple[bytes, bool]:
    n = struct.unpack_from("<Q", raw)[0]
    try:
        new = _json_mutate(rng, raw[8 : 8 + n])
    except ValueError:
        return raw, False
    pad = b" " * ((-len(new)) % 8)
    return struct.pack("<Q", len(new + pad)) + new + pad + raw[8 + n :], False


def mutate(rng: random.Random, path: Path, tensor_spans: list[tuple[int, int]]) -> tuple[str, bool]:
    """Mutate ``path`` in place; return ``(description, touched tensor bytes)``."""
    raw = bytearray(path.read_bytes())
    kind = _kind(str(path))
    ops = ["flip", "truncate"]
    if kind in ("rank file (.pt)", "dcp .distcp"):
        ops += ["zip-field", "zip-field", "pickle-arg"]
    if kind == "dcp .metadata":
        ops += ["pickle-arg", "pickle-arg"]
    if kind in ("json side file", "safetensors"):
        ops += ["json-value", "json-value"]
    if kind == "text side file":
        ops += ["text"]
    op = rng.choice(ops)
    touched: list[int] = []
    if op == "flip" and raw:
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(min(len(raw), 4096)) if rng.random() < 0.25 else rng.randrange(len(raw))
            raw[i] ^= rng.randint(1, 255)
            touched.append(i)
    elif op == "truncate":
        cut = rng.randrange(len(raw) + 1)
        touched.append(cut)
        del raw[cut:]
    elif op == "zip-field":
        fields = _zip_fields(bytes(raw))
        if fields:
            off, w = rng.choice(fields)
            value = rng.choice([0, 1, 0xFFFFFFFF, rng.getrandbits(8 * w), int.from_bytes(raw[off : off + w], "little") + rng.choice([-64, -1, 1, 64])])
            raw[off : off + w] = (value % (1 << (8 * w))).to_bytes(w, "little")
            touched.append(off)
    elif op == "pickle-arg":
        spans = _pickle_args(bytes(raw)) if kind == "dcp .metadata" else _embedded_pickles(bytes(raw))
        if spans:
            off, n = rng.choice(spans)
            raw[off : off + n] = bytes(rng.getrandbits(8) for _ in range(n))
            touched.append(off)
    elif op == "json-value":
        if kind == "safetensors":
            new, _ = _safetensors_header_mutate(rng, bytes(raw))
            raw = bytearray(new)
            touched.append(0)
        else:
            try:
                raw = bytearray(_json_mutate(rng, bytes(raw)))
            except ValueError:
                raw[: rng.randint(1, 4)] = b"\xff"
    elif op == "text":
        raw = bytearray(rng.choice([b"\xff\xfe\x00", b"abc", b"9" * 40, b"-1", b"\xc2\xb2", b""]))
    path.write_bytes(bytes(raw))
    hit = kind in ("rank file (.pt)", "dcp .distcp", "safetensors") and (
        op in ("flip", "zip-field") and any(a <= t < b for t in touched for a, b in tensor_spans)
    )
    return f"{op} {path.name} at {touched[:3]}", hit


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


def run_case(target: Target, rng: random.Random, work: Path, pristine: dict[str, str], result: Result) -> str:
    src = work / "src"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(target.source, src, symlinks=True)
    by_kind: dict[str, list[str]] = defaultdict(list)
    for f in target.files:
        by_kind[_kind(f)].append(f)
    rel = rng.choice(by_kind[rng.choice(sorted(by_kind))])  # every file kind equally often
    victim = src / rel
    what, hit = mutate(rng, victim, tensor_spans(target.source / rel) if _kind(rel) in ("rank file (.pt)", "dcp .distcp", "safetensors") else [])
    worst = "accepted"
    for args in (["inspect", str(src)], ["merge", str(src), str(work / "out")]):
        rc, stderr, status = _run_cli(args)
        outcome = classify(rc, stderr, status)
        if args[0] == "merge":
            out = work / "out"
            if [p for p in work.iterdir() if p.name.startswith(".out.")] or (rc != 0 and out.exists()):
                outcome = "leftover" if _RANK[outcome] < _RANK["leftover"] else outcome
            elif rc == 0 and outcome == "accepted" and _kind(rel) not in ("json side file", "text side file"):
                if not hit and _tensors_digest(out) != pristine:
                    outcome = "silent-change"
        if _RANK[outcome] > _RANK[worst] or (worst == "accepted" and outcome == "typed-error"):
            worst = outcome
        if outcome in BAD:
            what += f" -> {args[0]}: {outcome}: {(stderr.strip().splitlines() or [''])[-1][:200]}"
    result.add(_kind(rel), worst, f"[{target.name}] {what}")
    return worst


def run_campaign(targets: list[Target], *, seconds: float, seed: int, work: Path | None = None, max_cases: int | None = None) -> Result:
    """Fuzz ``targets`` round robin for ``seconds`` (or ``max_cases``); return the outcome table."""
    import logging

    logging.getLogger("hf_merge").setLevel(logging.CRITICAL)
    rng = random.Random(seed)
    result = Result()
    tmp = Path(work or tempfile.mkdtemp(prefix="hf-merge-fuzz-"))
    pristine = {}
    for t in targets:
        out = tmp / f"pristine-{t.name}"
        shutil.rmtree(out, ignore_errors=True)
        rc, stderr, _ = _run_cli(["merge", str(t.source), str(out)], timeout=1800)  # also warms the imports
        if rc != 0:
            raise RuntimeError(f"pristine merge of {t.source} failed: {stderr[-500:]}")
        pristine[t.name] = _tensors_digest(out)
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline and (max_cases is None or i < max_cases):
        t = targets[i % len(targets)]
        run_case(t, random.Random(rng.getrandbits(64)), tmp / "case", pristine[t.name], result)
        i += 1
    shutil.rmtree(tmp, ignore_errors=True) if work is None else None
    return result


def default_files(source: Path) -> list[str]:
    """Every file of a checkpoint worth mutating (all but reference outputs and logs)."""
    files = []
    for p in sorted(source.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.suffix not in (".log", ".done", ".py", ".md"):
            files.append(str(p.relative_to(source)))
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("FUZZ_SECONDS", 60)))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("FUZZ_SEED", 0)))
    ap.add_argument("--fsdp", type=Path, help="a verl FSDP actor/ folder (default: built with examples/)")
    ap.add_argument("--megatron", type=Path, nargs="*", default=[], help="verl Megatron role folders")
    ap.add_argument("--hf", type=Path, help="an HF safetensors folder (default: the pristine FSDP merge)")
    args = ap.parse_args(argv)
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
        megatron = [root / "qwen2_v1" / "actor", root / "llama_v2_singleton" / "actor"]
    for m in megatron:
        targets.append(Target(f"megatron-{m.parent.name}", m, default_files(m)))
    hf = args.hf
    if hf is None:
        hf = cache / "fuzz-hf"
        if not (hf / "config.json").is_file():
            from hf_merge.cli.app import main as cli

            cli(["--quiet", "merge", str(fsdp), str(hf), "--overwrite"])
    targets.append(Target("hf", hf, [f for f in default_files(hf) if f.endswith((".json", ".safetensors"))]))
    t0 = time.monotonic()
    result = run_campaign(targets, seconds=args.seconds, seed=args.seed)
    print(f"{result.cases} cases in {time.monotonic() - t0:.0f} s (seed {args.seed}; targets: {', '.join(t.name for t in targets)})")
    print(result.table())
    return 1 if result.bad() else 0


if __name__ == "__main__":
    sys.exit(main())
