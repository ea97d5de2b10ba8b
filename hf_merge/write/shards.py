"""Streaming safetensors writer: fills planned files tensor by tensor, front to back.

Each file goes through the engine's sink (:mod:`hf_merge.write.engine`): runs of rows from
:meth:`LazyCheckpoint.read_rows` (rank-file bytes by ``preadv`` from their files, converted runs
from memory), small tensors read whole, and larger tensors without row runs read into a mapping of
their place in the output file (``read_into``). Memory in use is the sink's buffers and the tensor
in flight, never a shard or the model.

Files are independent, so ``workers > 1`` forks processes that each write a share of the files
(the plan is deterministic and partitions by file), each reporting on a pipe of its own
(:class:`hf_merge.forks.Forked`): a writer killed is :class:`~hf_merge.errors.WriterDiedError`, never
a hang; the shares of writers that could not be forked are written by this process. Across
machines the same partition is used by :mod:`hf_merge.write.distributed`: each rank calls
:func:`write_shards` with its share of the files (``files=``) and no index, reporting bytes
through ``progress=``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from .. import forks
from ..errors import WriterDiedError
from ..readers import file_runs, record_crc
from . import engine
from .plan import INDEX_NAME, FilePlan, ShardPlan

if TYPE_CHECKING:  # torch only where bytes are not a file's (the head start's child writes without it)
    from ..checkpoint import LazyCheckpoint

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]


# A tensor without row runs is read whole into memory up to this size; larger ones are read into a
# mapped view of the output file instead (Sink.add_region), so memory stays bounded either way.
WHOLE_TENSOR_LIMIT = 256 << 20


def write_file(
    ckpt: LazyCheckpoint, plan: FilePlan, folder: Path, progress: ProgressFn | None = None, *, checksum: str | None = None,
    cores: int = 1, crc: "record_crc.Placed | None" = None,
) -> str | None:
    """Write one planned safetensors file into ``folder``; return its digest of kind ``checksum``
    (:mod:`~hf_merge.write.digest`) when asked. ``cores``: the CPUs this writer may use (a second
    one hashes a sha256: :func:`hf_merge.write.engine.hash_apart`).
    ``crc``: the merge's account of source records (see :func:`fill_file`)."""
    path = Path(folder) / plan.name
    fd = engine.open_output(path)
    try:
        return fill_file(ckpt, plan, fd, path, progress, checksum=checksum, cores=cores, crc=crc)
    finally:
        os.close(fd)  # after the writer threads stopped (finish or cancel)


def fill_file(ckpt: "LazyCheckpoint", plan: FilePlan, fd: int, path: Path, progress: ProgressFn | None = None, *,
              checksum: str | None = None, cores: int = 1, nice: int = 0,
              crc: "record_crc.Placed | None" = None) -> str | None:
    """Write ``plan``'s file into the open descriptor ``fd`` (of ``path``), front to back; the
    filling thread ``nice`` levels below the sink's threads (which inherit the level they start at).

    The source records whose bytes pass the sink whole are checked as they pass; the others when
    the file's bytes are all appended, or, with ``crc`` (the merge's :class:`record_crc.Placed`),
    when the caller finishes it after its last file: a ZeRO partition cut into several files is
    then combined from the pieces of all of them, not read again for each."""
    sink = engine.Sink(fd, path, checksum, progress, unreported=plan.data_start, hash_thread=engine.hash_apart(cores, checksum))

    def fill() -> None:
        if nice:
            engine.lower_this_thread(nice)
        with record_crc.deferred(into=crc):  # records the sink saw whole are checked as they passed
            _fill(sink, ckpt, plan)
            sink.sources_done()

    return engine.fill_and_finish(sink, fill)


def _fill(sink: engine.Sink, ckpt: LazyCheckpoint, plan: FilePlan) -> None:
    sink.add_memory(memoryview(plan.header))
    for spec, start in plan.placed():
        if spec.nbytes == 0:
            continue
        rows = ckpt.read_rows(spec.name, spec.dtype) if spec.shape else None
        if rows is not None:
            row_bytes = spec.nbytes // spec.shape[0]
            at = start
            for first, run in rows:
                if start + first * row_bytes != at:
                    raise RuntimeError(f"{plan.name}: {spec.name}: row runs out of order at row {first}")
                at += _add_tensor(sink, run)
            if at != start + spec.nbytes:
                raise RuntimeError(f"{plan.name}: {spec.name}: row runs cover {at - start} of {spec.nbytes} bytes")
        elif spec.nbytes <= WHOLE_TENSOR_LIMIT or start % spec.dtype.itemsize:
            _add_tensor(sink, ckpt.read(spec.name, dtype=spec.dtype))
        else:
            def read_into(view: memoryview, spec=spec) -> None:
                import torch

                ckpt.read_into(spec.name, torch.frombuffer(view, dtype=torch.uint8).view(spec.dtype).view(spec.shape))

            sink.add_region(spec.nbytes, read_into)
        sink.report()


def _add_tensor(sink: engine.Sink, piece: "file_runs.Piece") -> int:
    """Append a piece's bytes: from its file when the reader says it is a file's bytes
    (a :class:`~hf_merge.readers.file_runs.FileRun`), else from memory."""
    if isinstance(piece, file_runs.RowGather):
        sink.add_gather(piece)
        return piece.run.nbytes
    if isinstance(piece, file_runs.ColumnGather):
        sink.add_columns(piece)
        return piece.nbytes
    run = engine.file_bytes(piece)
    if run is not None:
        sink.add_file(run.fd, run.offset, run.nbytes)
        return run.nbytes
    import torch

    tensor = file_runs.values(piece)
    sink.add_memory(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return tensor.numel() * tensor.element_size()


def _write_files(
    ckpt: LazyCheckpoint, files: list[FilePlan], folder: Path, progress: ProgressFn | None, checksum: str | None, cores: int,
    crc: "record_crc.Placed",
) -> Iterator[tuple[str, str | None]]:
    """Write ``files`` one after the other; yield ``(name, checksum)`` as each is done. The source
    records not checked as they streamed are left in ``crc`` for the caller to finish."""
    for plan in files:
        yield plan.name, write_file(ckpt, plan, folder, progress=progress, checksum=checksum, cores=cores, crc=crc)


def _worker(files: list[FilePlan], conn, ckpt: LazyCheckpoint, folder: Path, checksum: str | None, cores: int) -> None:
    """In a forked writer (:class:`~hf_merge.forks.Forked`): write ``files``, sending progress,
    digests, the records other writers hold pieces of, and any error, on ``conn``."""
    try:
        import torch

        torch.set_num_threads(1)  # forked children: no OpenMP pool, one core each
        inherited = _open_descriptors()  # the parent's too: it keeps its readers open until the merge ends
        crc = record_crc.Placed()
        for name, digest in _write_files(ckpt, files, folder, lambda n: conn.send(("bytes", n)), checksum, cores, crc):
            conn.send(("digest", (name, digest)))
        conn.send(("crc", crc.hand_over(inherited)))  # records other writers hold pieces of: the parent combines
        crc.finish()  # the rest: read here, in parallel with the other writers
    except BaseException as e:  # hand the typed error to the parent, which re-raises it
        with contextlib.suppress(OSError):  # the parent gone
            conn.send(("error", forks.sendable(e)))
        return
    conn.send(("done", None))


def _open_descriptors() -> set[int]:
    """This process's open file descriptors (none known where ``/proc`` or ``/dev/fd`` lacks)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return {int(n) for n in os.listdir(folder)}
    return set()


def default_workers(n_files: int, processes_here: int = 1) -> int:
    """One writer per file and per CPU, at most 8 (a writer left a second core hashes on it).

    ``processes_here``: the writing processes on this machine (distributed ranks) share its CPUs.
    Each forked writer also carries an interpreter's worth of memory (~200 MB).
    """
    return max(1, min(n_files, forks.usable_cpus() // max(1, processes_here), 8))


def write_shards(
    ckpt: LazyCheckpoint,
    plan: ShardPlan,
    folder: Path,
    *,
    workers: int | None = None,
    desc: str = "Writing",
    checksum: str | None = None,
    files: list[FilePlan] | None = None,
    progress: ProgressFn | None = None,
    processes_here: int = 1,
) -> dict[str, str | None]:
    """Write the files of ``plan`` (and the index when sharded) into ``folder``.

    ``files`` (a distributed rank's share) writes only those files and no index; ``progress``
    receives the bytes written instead of a progress bar being shown. ``processes_here``: the
    writing processes on this machine, which share its CPUs with the ``workers``. Returns
    ``{file name: digest}`` for the files written (``None`` values without ``checksum``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    share = plan.files if files is None else files
    digests: dict[str, str | None] = {}
    if share:
        n = workers or default_workers(len(share), processes_here)
        n = max(1, min(n, len(share)))
        cores = forks.usable_cpus() // (n * max(1, processes_here))  # each writer's share
        with contextlib.ExitStack() as stack:
            if progress is None:
                from ..progress import progress_bar

                bar = stack.enter_context(progress_bar(total=sum(f.data_size for f in share), unit="B", desc=desc))
                progress = bar.update
            crc = record_crc.Placed()  # the records whose pieces the files' writers copied: one account
            if n == 1:
                digests.update(_write_files(ckpt, share, folder, progress, checksum, cores, crc))
            else:
                digests.update(_write_parallel(ckpt, share, folder, n, progress, checksum, cores, crc))
            crc.finish()  # before the caller fsyncs and renames; only what no file's piece covered is read
    if files is None:
        write_index(plan, folder)
    return {fp.name: digests[fp.name] for fp in share}


def write_index(plan: ShardPlan, folder: Path) -> None:
    """``model.safetensors.index.json`` for a sharded plan (nothing for a single file), dumped as
    ``save_pretrained`` dumps it (indent 2, keys sorted, a final newline)."""
    if plan.index is not None:
        (Path(folder) / INDEX_NAME).write_text(json.dumps(plan.index, indent=2, sort_keys=True) + "\n")


def _write_parallel(
    ckpt: LazyCheckpoint, files: list[FilePlan], folder: Path, n: int, update: ProgressFn, checksum: str | None, cores: int,
    crc: "record_crc.Placed",
) -> dict[str, str | None]:
    # Largest files first, round robin: shares of similar size.
    order = sorted(files, key=lambda f: -f.file_size)
    shares = [order[i::n] for i in range(n)]
    digests: dict[str, str | None] = {}
    with contextlib.closing(forks.Forked(_worker, shares, ckpt, folder, checksum, cores)) as writers:
        running = {conn: i for i, conn in enumerate(writers.conns)}
        while running:
            for conn in mp_connection.wait(list(running)):
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):  # it died, perhaps halfway through a message
                    raise _died(writers.procs[running[conn]]) from None
                if kind == "error":
                    raise value
                if kind == "bytes":
                    update(value)
                elif kind == "digest":
                    digests[value[0]] = value[1]
                elif kind == "crc":
                    crc.take(value)
                else:
                    del running[conn]
    for share in shares[len(writers.procs):]:  # no fork for these (ENOMEM, EAGAIN): written here
        digests.update(_write_files(ckpt, share, folder, update, checksum, cores, crc))
    return digests


def _died(proc) -> BaseException:
    """The error for a writer that ended without a word (SIGKILL: the OOM killer, most often)."""
    proc.join()
    code = proc.exitcode
    if code in (-signal.SIGINT, -signal.SIGTERM):  # Ctrl-C to the process group, a batch system's SIGTERM
        return KeyboardInterrupt()
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return WriterDiedError(f"a writer process {how} before its files were done (SIGKILL: most often the kernel's "
                           "OOM killer); nothing was written to the target. Free memory or lower --workers "
                           "(each writer holds an interpreter, ~200 MB), and merge again")
