"""A head start for the CLI's plain merge: the first output file is written while torch loads.

Importing torch takes ~1 s of a 3 s merge of a 3 GB checkpoint; copying source-file bytes into a
safetensors file needs none. So once the CLI knows the source is verl FSDP rank files, a generic
DCP folder, an accelerate ``save_state`` folder, a torchtitan step folder, a Megatron-Core
``torch_dist`` folder, a DeepSpeed ZeRO folder or a ColossalAI booster folder of ``.bin`` shards
(:data:`FORMATS`) and the merge a plain copy,
it forks (before torch is imported) a child that runs the merge's own parts without torch: the
reader's layout (:class:`~hf_merge.readers.fsdp_files.RankIndex`, the FSDP reader's layout and
rank checks; :class:`~hf_merge.readers.dcp_index.DcpIndex`, the DCP reader's metadata and chunk
parsing, under a name table for torchtitan and Megatron;
:class:`~hf_merge.readers.deepspeed_files.DeepSpeedIndex`, the DeepSpeed reader's ``ZeroLayout``;
:class:`~hf_merge.readers.colossalai_files.BoosterIndex`, the ColossalAI reader's index and shards;
pickles read under a subset of the one policy), the planner
(:func:`~hf_merge.write.plan.plan_shards`), the byte recipe
(:func:`~hf_merge.write.engine.byte_recipe`) and the file writer
(:func:`~hf_merge.write.shards.fill_file`) into an anonymous ``O_TMPFILE`` beside the target. It
sends the parent the first file's name and header digest first, then its progress, then the
file's recipe and checksum (a DCP index parses each chunk's archive as the write reaches it).

The merge (torch, every check of the full reader and transforms) links the child's file
(``linkat``) when its own name and header digest for that file are identical, otherwise it kills
the child and writes the file as always; it keeps the file only when the child's recipe is its
own too. A child that fails, or that copied other bytes, is not trusted: the merge writes the file again. The child changes how fast a merge is,
never what it writes. It declines (the merge writes everything) what is not a plain copy: a cast (also of
the tensors a model keeps in float32, :mod:`~hf_merge.transforms.keep_fp32`),
a tie, LoRA, a model ``save_pretrained`` may rename (the Hub layout) unless the plan cache holds a
merge's finding that it writes this source's own names
(:func:`~hf_merge.transforms.layout_cache.stored_passthrough`), bytes that are not source-file runs; and there is none with ``HF_MERGE_HEAD_START=0`` or without ``O_TMPFILE`` / ``O_DIRECT`` / ``fork``.
A sharded plan is in the order transformers 5 saves in (:func:`~hf_merge.write.save_order.natural_key`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
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


#: the formats whose first file a child can write, and the reader module of each whose ``probe``
#: and ``open_index(source, config)`` (the source as the reader lays it out, and its config folder)
#: import no torch
FORMATS = {"fsdp": "fsdp_files", "dcp": "dcp_generic", "accelerate": "accelerate", "torchtitan": "torchtitan",
           "megatron": "megatron", "deepspeed": "deepspeed_files", "colossalai": "colossalai_files"}


@dataclass(frozen=True)
class Request:
    """The merge the CLI was asked for: ``source``, ``target``, its ``MergeOptions`` and the
    ``format`` the merge will read the source as (one of :data:`FORMATS`)."""

    source: str
    target: str
    options: Any
    format: str = "fsdp"


class _Skip(Exception):
    """The child does not serve this merge (the merge writes every file itself)."""


def begin(request: Request) -> "HeadStart | None":
    """Fork the child for ``request``; None when this platform or environment gives no head start."""
    if not settings.head_start():
        return None
    if not hasattr(os, "fork") or not getattr(os, "O_TMPFILE", 0) or not getattr(os, "O_DIRECT", 0):
        return None
    from ..transforms import conversion_keys, keep_fp32, layout_cache  # noqa: F401 - imported before the fork: the child imports nothing
    from . import atomic, shards  # noqa: F401
    from .. import forks  # noqa: F401
    if request.format == "fsdp":
        from ..readers import fsdp_files, rank_pool, rank_records  # noqa: F401
    elif request.format == "deepspeed":
        from ..readers import deepspeed_files, deepspeed_universal, rank_records  # noqa: F401
    elif request.format == "colossalai":
        from ..readers import colossalai_files, rank_records  # noqa: F401
    else:
        from ..readers import accelerate, dcp_generic, dcp_index, dcp_sources, megatron, torchtitan  # noqa: F401
    if request.format in ("torchtitan", "megatron"):
        from ..transforms import name_table, name_table_view  # noqa: F401
        from ..transforms.name_table import all_tables

        all_tables()  # the name tables' modules, imported

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
        self._outcome: dict[str, Any] | None = None  # {"done": digest, "ranges": recipe}, {"skip": why}, {"error": what}
        self._eof = False
        self._pending = 0  # bytes reported before a progress function was given
        self.reported = 0  # bytes of its file the child reported written
        self._progress: Callable[[int], None] | None = None
        self._adopted: Path | None = None
        self._recipe: list[list[int]] | None = None  # the merge's recipe of the linked file
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
        """Link the child's file into ``folder`` as ``name`` when the child plans this file: the
        same ``name`` and header bytes (:meth:`finish` keeps it only if the child also copied the
        source ranges ``recipe()`` gives: :func:`~hf_merge.write.engine.byte_recipe`). Else stop
        the child; the caller writes it."""
        if self._wait(lambda: self._plan is not None, PLAN_WAIT_S):
            plan = self._plan
            if plan["name"] == name and plan["header"] == hashlib.sha256(header).hexdigest():
                try:
                    root = os.open("/", os.O_RDONLY)
                    try:  # linkat(AT_SYMLINK_FOLLOW) of the anonymous file: it gets its name
                        os.link(f"/proc/self/fd/{self._fd}", Path(folder) / name, src_dir_fd=root, follow_symlinks=True)
                    finally:
                        os.close(root)
                except OSError as e:
                    logger.debug("head start: the child's file could not be linked (%s)", e)
                else:
                    # the merge's own recipe, made while the child writes; compared when it is done
                    self._adopted, self._recipe = Path(folder) / name, recipe()
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
        """Wait for the adopted file: ``(True, digest or None)`` once the child wrote all of it from
        the merge's own source ranges, ``(False, None)`` when the child failed or copied other
        bytes (its file is removed; the caller writes it)."""
        with self._cond:
            self._cond.wait_for(lambda: self._eof or self._outcome is not None)
            outcome = self._outcome or {"error": "no answer"}
        self._reap()
        if "done" in outcome and self._exit == 0:
            if outcome.get("ranges") == self._recipe:
                self._close()
                return True, outcome["done"]
            logger.debug("head start: the child copied other bytes into %s; writing it here", self._adopted.name)
        else:
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


def _child(request: Request, fd: int, write_end: int, parent: int) -> None:
    """Plan, report, write, report; exit without returning into the parent's code."""
    code = 0

    def send(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(write_end, data):]

    try:
        from ..forks import die_with_parent

        die_with_parent(parent)
        with contextlib.suppress(ValueError, OSError):  # Ctrl-C: the parent decides and stops this child
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        from ..readers import record_crc

        with record_crc.skipping(not request.options.source_crc):
            plan = _plan(request)
            send({"plan": {"name": plan.file.name, "header": hashlib.sha256(plan.file.header).hexdigest()}})
            digest, ranges = _write(plan, fd, request.options.checksum(), lambda n: send({"bytes": n}))
            send({"done": digest, "ranges": ranges})
    except _Skip as e:
        with contextlib.suppress(BaseException):
            send({"skip": str(e)})
    except BaseException as e:  # noqa: BLE001 - told to the parent, which decides
        code = 1
        with contextlib.suppress(BaseException):
            send({"error": f"{type(e).__name__}: {e}"[:300]})
    finally:
        os._exit(code)


@dataclass
class _Planned:
    file: Any  # the FilePlan of the first file
    index: Any  # the RankIndex the bytes are read from
    cores: int  # this child's share of the CPUs: it is one of the merge's writers


def _open(request: Request) -> tuple[Any, Path]:
    """The source laid out as the merge's reader lays it out, read without torch, and the folder
    of its config.json: the format's ``open_index`` (:data:`FORMATS`)."""
    import importlib

    config = Path(request.options.config) if request.options.config else None
    opened = importlib.import_module(f"hf_merge.readers.{FORMATS[request.format]}").open_index(Path(request.source), config)
    if opened is None:
        raise _Skip("not served: a layout the child does not read, or pickles the merge reads with a process per CPU")
    return opened


def _plan(request: Request) -> _Planned:
    """The merge's first file as a plain copy would write it: the reader's layout (:func:`_open`),
    the merge's planner and byte recipe."""
    from ..spec import output_dtype_name
    from ..transforms.conversion_keys import may_convert
    from ..transforms.keep_fp32 import may_declare
    from ..transforms.layout_cache import stored_passthrough
    from ..side_files import side_files_bytes
    from .atomic import check_free_space
    from ..forks import usable_cpus
    from .plan import plan_shards
    from .save_order import natural_key
    from ..transformers_compat import has_weight_conversions
    from .shards import default_workers

    index, config_dir = _open(request)
    options = request.options
    config = json.loads((config_dir / "config.json").read_bytes())
    if not isinstance(config, dict):
        raise _Skip("config.json is not an object")
    if config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings")) is not False:
        raise _Skip("tied weights (or config.json leaves it to the config class's default)")
    specs = index.specs()
    if not specs:
        raise _Skip("no model tensors")
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if (architectures and may_convert(config, architectures[0], ask_transformers=False) is not False
            and not stored_passthrough(config, specs)):  # a merge of this model found it writes the source's names
        raise _Skip("save_pretrained may rename or split this model's tensors (the Hub layout)")
    out_dtype = output_dtype_name(options.dtype, config)
    if any("lora_" in name for name in specs):
        raise _Skip("LoRA")
    if any(s.dtype.is_floating_point and out_dtype not in (None, s.dtype.name) for s in specs.values()):
        raise _Skip("a cast")
    if may_declare(config, out_dtype):  # the merge may write some of them in float32
        raise _Skip("the model may keep some tensors in float32 in this dtype (_keep_in_fp32_modules)")
    plan = plan_shards(specs, max_shard_size=options.shard_bytes())
    if plan.index is not None and has_weight_conversions():  # sharded: in the order transformers 5 saves in
        plan = plan_shards(sorted(specs.values(), key=lambda s: natural_key(s.name)),
                           max_shard_size=options.shard_bytes())
    side = side_files_bytes([config_dir], plan.index["weight_map"] if plan.index else None)
    check_free_space(Path(request.target), sum(f.file_size for f in plan.files), side)  # the merge says so first
    # every tensor must be runs of source files (the runs themselves, parsed as the write reaches
    # them, make the recipe the merge compares: engine.byte_recipe after the write)
    if any(s.nbytes and (not s.shape or index.read_rows(s.name, s.dtype) is None) for s, _ in plan.files[0].placed()):
        raise _Skip("some bytes of the first file are not one run of a source file (a placement other than Shard(0))")
    return _Planned(plan.files[0], index, usable_cpus() // default_workers(len(plan.files)))


def _write(planned: _Planned, fd: int, checksum: str | None, progress: Callable[[int], None]) -> "tuple[str | None, list[list[int]]]":
    """Write the first file; ``(its checksum, the source ranges copied: engine.byte_recipe)``."""
    from . import engine
    from ..readers import record_crc
    from .shards import fill_file

    # a sha256 thread must not wait: it, and torch's import, go first
    apart = engine.hash_apart(planned.cores, checksum)
    digest = fill_file(planned.index, planned.file, fd, Path(f"/proc/self/fd/{fd}"), progress, checksum=checksum,
                       cores=planned.cores, nice=engine.HASHING_NICE if apart else 0)
    # records the sink did not see whole; a mismatch fails this child, and the merge then writes the file itself
    ranges = engine.byte_recipe(planned.index, planned.file)
    by_id = {(st.st_dev, st.st_ino): f for f in planned.index.fds.values() for st in [os.fstat(f)]}
    record_crc.check_ranges([(by_id[(dev, ino)], offset, n) for dev, ino, offset, n, *_order in ranges])
    return digest, ranges
