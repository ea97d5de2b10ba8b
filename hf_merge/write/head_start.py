"""A head start for the CLI's plain FSDP merge: the first output file is written while torch loads.

``hf-merge merge`` needs torch to open a checkpoint (the full reader, the transforms, the plan),
and importing torch takes ~0.8 s of a 3 s merge of a 3 GB checkpoint, on one core, before the
first byte is written. Copying rank-file bytes into a safetensors file and hashing them needs no
torch. So, for a verl FSDP source that is merged as a plain copy, the CLI forks (before torch is
imported) a child that:

- reads the rank files' pickles without torch
  (:func:`~hf_merge.readers.rank_records.index_rank_file`, under a subset of the one pickle
  policy; nothing from the file is run), and plans the output as a plain merge would: every
  tensor under its training name and dtype, ``Shard(0)`` pieces or whole plain tensors
  (:func:`~hf_merge.write.plan.plan_shards`, the same planner);
- sends the parent its first file's name, header digest and the rank-file byte ranges it copies;
- writes that file into an anonymous file (``O_TMPFILE``) beside the target, with
  :mod:`hf_merge.write.engine`'s ``O_DIRECT`` sink and its sha256, reporting progress.

The merge itself (with torch and every check of the full reader and transforms) then plans the
output and compares: the first file's name, the digest of its header bytes and the exact ranges
:func:`~hf_merge.write.engine.byte_recipe` says the writer would copy, in order. Only when all are
identical is the child's file linked into the merge's temporary folder and its digest used;
otherwise the child is killed and the merge writes the file as always. The child can change how
fast a merge is, never what it writes. A child that fails after its file was taken (killed,
out of memory) is not trusted: the file is written again by the merge.

Anything the child does not expect (another format, a cast, a tie, LoRA, a model whose tensors
``save_pretrained`` renames or splits (the Hub layout: MoE, VLMs), a placement other than
``Shard(0)``, ``HF_MERGE_HEAD_START=0``, no ``O_TMPFILE`` / ``O_DIRECT`` / ``fork``) means no head
start: the merge runs as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import settings

logger = logging.getLogger(__name__)

ENV = settings.HEAD_START_VAR
#: how long the merge waits for the child's plan once it has its own (the child sends it after
#: reading the pickles, long before torch is imported; this bounds a stuck child)
PLAN_WAIT_S = 120.0


@dataclass(frozen=True)
class Request:
    """What the child needs to plan the merge the CLI was asked for."""

    source: str
    target: str
    config: str | None
    dtype: str | None  # None / "config": config.json's; "auto": the shards'; else a dtype name
    max_shard_size: int
    checksums: bool
    source_crc: bool = True  # check the CRC-32 of the rank-file records it copies (docs/integrity.md)


class _Skip(Exception):
    """The child does not serve this merge (the merge writes every file itself)."""


def begin(request: Request) -> "HeadStart | None":
    """Fork the child for ``request``; None when this platform or environment gives no head start."""
    if not settings.head_start():
        return None
    if not hasattr(os, "fork") or not getattr(os, "O_TMPFILE", 0) or not getattr(os, "O_DIRECT", 0):
        return None
    _load_child_modules()  # imported before the fork: the child imports nothing
    folder = Path(request.target).absolute().parent
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:  # no such folder (the merge says so), or a file system without O_TMPFILE / O_DIRECT
        return None
    read_end, write_end = os.pipe()
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        for f in (fd, read_end, write_end):
            os.close(f)
        return None
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _child(request, fd, write_end, parent)
    os.close(write_end)
    return HeadStart(pid, fd, read_end)


class HeadStart:
    """The parent's handle on the child: :meth:`adopt` its file or not, :meth:`finish` it, and
    :meth:`cancel` it (also on leaving a ``with`` block) when the merge goes another way."""

    def __init__(self, pid: int, fd: int, read_end: int):
        self._pid, self._fd = pid, fd
        self._cond = threading.Condition()
        self._plan: dict[str, Any] | None = None
        self._outcome: dict[str, Any] | None = None  # {"done": digest}, {"skip": why}, {"error": what}
        self._eof = False
        self._pending = 0  # bytes reported before a progress function was given
        self.reported = 0  # bytes of its file the child reported written
        self._progress: Callable[[int], None] | None = None
        self._adopted: Path | None = None
        self._exit: int | None = None
        self._reader = threading.Thread(target=self._read, args=(read_end,), name="head start", daemon=True)
        self._reader.start()

    # -- messages from the child ----------------------------------------------------------------
    def _read(self, read_end: int) -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                try:
                    message = json.loads(line)
                except ValueError:
                    break
                with self._cond:
                    if "bytes" in message:
                        self.reported += int(message["bytes"])
                        if self._progress is not None:
                            self._progress(int(message["bytes"]))
                        else:
                            self._pending += int(message["bytes"])
                    elif "plan" in message:
                        self._plan = message["plan"]
                    else:
                        self._outcome = message
                    self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: ready() or self._eof or self._outcome is not None, timeout) and ready()

    # -- the merge's side ---------------------------------------------------------------------
    def adopt(self, name: str, header: bytes, recipe: "Callable[[], list[list[int]] | None]", folder: Path) -> bool:
        """Link the child's file into ``folder`` as ``name`` when the child plans exactly this
        file: the same ``name``, header bytes and rank-file ranges (``recipe()``, asked only once
        the child has a plan: :func:`~hf_merge.write.engine.byte_recipe`). Else stop the child; the
        caller writes it."""
        if self._wait(lambda: self._plan is not None, PLAN_WAIT_S):
            plan = self._plan
            same = (
                plan["name"] == name and plan["header"] == hashlib.sha256(header).hexdigest()
                and plan["ranges"] == recipe()
            )
            if same:
                try:
                    root = os.open("/", os.O_RDONLY)
                    try:  # linkat(AT_SYMLINK_FOLLOW) of the anonymous file: it gets its name
                        os.link(f"/proc/self/fd/{self._fd}", Path(folder) / name, src_dir_fd=root, follow_symlinks=True)
                    finally:
                        os.close(root)
                except OSError as e:
                    logger.debug("head start: the child's file could not be linked (%s)", e)
                else:
                    self._adopted = Path(folder) / name
                    logger.debug("head start: %s taken from the child", name)
                    return True
            else:
                logger.debug("head start: the child planned another %s; writing it here", name)
        else:
            logger.debug("head start: not used (%s)", self._outcome or "no plan")
        self.cancel()
        return False

    def report_to(self, progress: Callable[[int], None]) -> None:
        """From now on hand the bytes the child writes to ``progress`` (those written so far first)."""
        with self._cond:
            self._progress = progress
            if self._pending:
                progress(self._pending)
                self._pending = 0

    def finish(self) -> "tuple[bool, str | None]":
        """Wait for the adopted file: ``(True, sha256 or None)`` once the child wrote all of it,
        ``(False, None)`` when the child failed (its file is removed; the caller writes it)."""
        with self._cond:
            self._cond.wait_for(lambda: self._eof or self._outcome is not None)
            outcome = self._outcome or {"error": "no answer"}
        self._reap()
        if "done" in outcome and self._exit == 0:
            self._close()
            return True, outcome["done"]
        logger.warning("the head-start writer failed (%s); writing %s again", outcome.get("error", outcome), self._adopted.name)
        with contextlib.suppress(FileNotFoundError):
            self._adopted.unlink()
        self._close()
        return False, None

    def cancel(self) -> None:
        """Stop the child if it still runs; forget its file (unless the merge linked it)."""
        if self._exit is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
            self._reap()
        self._close()

    def _reap(self) -> None:
        if self._exit is None:
            _, status = os.waitpid(self._pid, 0)
            self._exit = os.waitstatus_to_exitcode(status)
        self._reader.join()

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "HeadStart":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()


# --------------------------------------------------------------------------------------------
# The child (no torch: it runs while the parent imports it)
# --------------------------------------------------------------------------------------------


def _load_child_modules() -> None:
    from ..transforms import conversion_keys
    from . import atomic, plan, engine  # noqa: F401
    from ..readers import fsdp_files, rank_records  # noqa: F401


def _child(request: Request, fd: int, write_end: int, parent: int) -> None:
    """Plan, report, write, report; exit without returning into the parent's code."""
    code = 0

    def send(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(write_end, data):]

    try:
        die_with_parent(parent)
        with contextlib.suppress(ValueError, OSError):  # Ctrl-C: the parent decides and stops this child
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        from ..readers import record_crc

        with record_crc.skipping(not request.source_crc):
            plan, sources = _plan(request)
            send({"plan": {"name": plan.file.name, "header": hashlib.sha256(plan.file.header).hexdigest(), "ranges": plan.ranges}})
            send({"done": _write(plan, sources, fd, request.checksums, lambda n: send({"bytes": n}))})
    except _Skip as e:
        with contextlib.suppress(BaseException):
            send({"skip": str(e)})
    except BaseException as e:  # noqa: BLE001 - told to the parent, which decides
        code = 1
        with contextlib.suppress(BaseException):
            send({"error": f"{type(e).__name__}: {e}"[:300]})
    finally:
        os._exit(code)


def die_with_parent(parent: int) -> None:
    """SIGKILL this child when the parent (its pid, taken before the fork) dies (PR_SET_PDEATHSIG),
    so no writer outlives a killed merge."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before that took effect
        os._exit(1)


@dataclass
class _Planned:
    file: Any  # FilePlan
    ranges: list[list[int]]  # join_range items: [st_dev, st_ino, offset, n]
    files: int  # files in the whole plan: this child and the merge's writers share the CPUs


def _output_dtype(requested: str | None, config: dict[str, Any]) -> str | None:
    """The dtype floating tensors are written in, by name (None: each keeps its own), as
    :func:`hf_merge.hf_files.resolve_dtype` decides it."""
    from ..spec import config_dtype_name, dtype_alias

    if requested == "auto":
        return None
    if requested in (None, "config"):
        return config_dtype_name(config)
    return dtype_alias(requested) or str(requested)


def _plan(request: Request) -> tuple[_Planned, dict[tuple[int, int], int]]:
    from .. import __version__
    from ..transforms.conversion_keys import may_convert
    from .durable import free_bytes
    from .atomic import SIDE_FILES_ROOM
    from .plan import plan_shards
    from ..readers.fsdp_files import (
        check_rank_files_present, chunk_range, detect_world_size, rank_file_name, resolve_fsdp_dir,
    )
    from ..readers.rank_records import index_rank_file
    from .engine import join_range
    from ..spec import TensorSpec

    folder, _step, _notes = resolve_fsdp_dir(Path(request.source))
    world, _ = detect_world_size(folder)
    check_rank_files_present(folder, world)
    config_dir = Path(request.config) if request.config else folder / "huggingface"
    config = json.loads((config_dir / "config.json").read_bytes())
    if not isinstance(config, dict):
        raise _Skip("config.json is not an object")
    text = config.get("text_config") or {}
    if config.get("tie_word_embeddings", text.get("tie_word_embeddings")) is not False:
        raise _Skip("tied weights (or config.json leaves it to the config class's default)")
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if architectures and may_convert(config, architectures[0], ask_transformers=False) is not False:
        raise _Skip("save_pretrained may rename or split this model's tensors (the Hub layout)")
    out_dtype = _output_dtype(request.dtype, config)
    paths = [folder / rank_file_name(world, r) for r in range(world)]
    indexes = [index_rank_file(p) for p in paths]
    names = list(indexes[0])
    if any(list(ix) != names for ix in indexes[1:]):
        raise _Skip("rank files hold different tensors")
    specs, pieces = [], {}
    for name in names:
        if "lora_" in name:
            raise _Skip("LoRA")
        first = indexes[0][name]
        if out_dtype is not None and first.dtype.is_floating_point and first.dtype.name != out_dtype:
            raise _Skip("a cast")
        item = first.dtype.itemsize
        if first.placements is None:  # a plain tensor: rank 0's copy
            if first.local_shape != first.shape or first.span is None:
                raise _Skip(f"{name}: a strided plain tensor")
            pieces[name] = [(0, first.span)]
        else:
            if len(first.placements) != 1 or first.placements[0].kind != "Shard" or first.placements[0].dim != 0:
                raise _Skip(f"{name}: placements {first.placements}")
            if first.mesh != tuple(range(world)):  # rank r holds chunk r only on the identity mesh
                raise _Skip(f"{name}: device mesh {first.mesh_shape} of ranks {first.mesh}")
            rows, row_bytes = first.shape[0], item * math.prod(first.shape[1:])
            pieces[name] = []
            for r, ix in enumerate(indexes):
                t = ix[name]
                lo, hi = chunk_range(0, rows, world, r)  # as the reader places a Shard(0) piece
                if (t.dtype, t.shape, t.placements, t.mesh) != (first.dtype, first.shape, first.placements, first.mesh) or \
                        t.local_shape != (hi - lo, *first.shape[1:]):
                    raise _Skip(f"{name}: rank {r} disagrees")
                if hi > lo:
                    if t.span is None or t.span[1] != (hi - lo) * row_bytes:
                        raise _Skip(f"{name}: rank {r} is not one run")
                    pieces[name].append((r, t.span))
        specs.append(TensorSpec(name, first.shape, first.dtype))
    plan = plan_shards(specs, max_shard_size=request.max_shard_size,
                       metadata={"hf_merge_version": __version__, "source_format": "verl-fsdp"})
    planned = sum(f.file_size for f in plan.files) + SIDE_FILES_ROOM
    if free_bytes(Path(request.target).absolute().parent) < planned:
        raise _Skip("not enough free space (the merge says so before writing)")
    file = plan.files[0]
    sources: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) -> descriptor, for the sink's preadv
    ids = []
    for path in paths:
        f = os.open(path, os.O_RDONLY)
        st = os.fstat(f)
        ids.append((st.st_dev, st.st_ino))
        sources[ids[-1]] = f
    ranges: list[list[int]] = []
    for spec, _start in file.placed():
        if spec.nbytes:
            for r, (offset, n) in pieces[spec.name]:
                join_range(ranges, ids[r], offset, n)
    return _Planned(file, ranges, len(plan.files)), sources


def _write(planned: _Planned, sources: dict[tuple[int, int], int], fd: int, sha256: bool,
           progress: Callable[[int], None]) -> str | None:
    from . import engine

    file = planned.file
    writers = max(1, min(planned.files, engine.usable_cpus(), 8))  # as writer.default_workers counts them
    apart = sha256 and engine.hash_apart(engine.usable_cpus() // writers)
    sink = engine.Sink(fd, Path(f"/proc/self/fd/{fd}"), sha256, progress, unreported=file.data_start,
                            hash_thread=apart)
    if apart:  # the sha256 thread is the one that must not wait: it, and torch's import, go first
        engine.lower_this_thread(engine.HASHING_NICE)

    def fill() -> None:
        from ..readers import record_crc

        sink.add_memory(memoryview(file.header))
        for dev, ino, offset, n in planned.ranges:
            sink.add_file(sources[(dev, ino)], offset, n)
            sink.report()
        # every record copied was checked as it streamed through the sink; any it did not see whole, here.
        # A mismatch fails this child: the merge then writes the file itself, and its reader refuses the record.
        record_crc.check_ranges([(sources[(dev, ino)], offset, n) for dev, ino, offset, n in planned.ranges])

    return engine.fill_and_finish(sink, fill)
