"""Streaming safetensors writer: fills planned files tensor by tensor, in place.

Where it applies, :func:`write_file` hands the file to :mod:`hf_merge.sequential`, which writes it
front to back with ``O_DIRECT`` and hashes it on the way. What follows is the page-cache path, used
for the other files, file systems that refuse ``O_DIRECT`` and ``HF_MERGE_DIRECT_IO=0``.

Each output file is created at its final size with its header already written, and every tensor
is written at its planned offset: runs of rows straight from the rank files (``copy_file_range``
from the rank file when no cast is needed, see :mod:`hf_merge.filemap`, else ``pwrite`` of the
memory-mapped view; converted chunks of ~32 MB when a cast is needed),
small tensors whole, and large tensors with no row runs through a memory-mapped view of the output
(``read_into``). Memory in use is the tensors in flight, never a shard or the model.

Files are independent, so ``workers > 1`` forks processes that each write a share of the files
(the plan is deterministic and partitions by file). Each file's sha256 is computed on a second
thread that follows the writer through the file (tensors are written in offset order), so hashing
overlaps with writing instead of re-reading the output afterwards, and the next file is written
while a file's hash catches up (:class:`TrailingDigests`); another thread starts the disk write of
the finished part as it grows (see :mod:`hf_merge.following`). Across machines the same
partition is used by :mod:`hf_merge.distributed`: each rank calls :func:`write_shards` with its
share of the files (``files=``) and no index, reporting bytes through ``progress=``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import filemap, sequential
from .following import FollowingSha256, FollowingWriteback
from .copypool import HASHING_NICE, PIECE_BYTES, CompletedRanges, PiecePool, default_threads, usable_cpus
from .checkpoint import LazyCheckpoint
from .plan import INDEX_NAME, FilePlan, ShardPlan

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]


# A tensor without a row fast path is read whole into memory up to this size; larger ones are read
# into a memory-mapped view of the output file instead, so memory stays bounded either way.
WHOLE_TENSOR_LIMIT = 256 << 20


def _pwrite_all(fd: int, piece: filemap.Piece, offset: int) -> None:
    if filemap.copy_to_file(piece, fd, offset):  # bytes of a rank file: copied file to file
        return
    filemap.pwrite_exact(fd, memoryview(filemap.values(piece).reshape(-1).view(torch.uint8).numpy()), offset)


def _write_piece(piece: filemap.FileRun, fd: int, offset: int, done: CompletedRanges) -> None:
    _pwrite_all(fd, piece, offset)
    done.add(offset, offset + piece.nbytes)


def _submit_copy(
    pool: PiecePool, rows: filemap.Piece, fd: int, offset: int, done: CompletedRanges, poll: Callable[[], None]
) -> bool:
    """Hand the file-to-file copy of ``rows`` to ``pool`` in pieces; False when ``rows`` are not
    bytes of a rank file (then only the caller knows how long they stay valid)."""
    run = filemap.run_of(rows)
    if run is None:
        return False
    flat = run.tensor.reshape(-1).view(torch.uint8)
    for a in range(0, flat.numel(), PIECE_BYTES):
        pool.submit(_write_piece, run.piece(flat[a : a + PIECE_BYTES]), fd, offset + a, done, poll=poll)
    return True


def write_file(
    ckpt: LazyCheckpoint,
    plan: FilePlan,
    folder: Path,
    progress: ProgressFn | None = None,
    *,
    sha256: bool = False,
    copy_threads: int | None = None,
    defer_digest: bool = False,
):
    """Write one planned safetensors file into ``folder``; return its sha256 when asked.

    ``defer_digest``: return as soon as every byte is written, with a :class:`FollowingSha256`
    (or None without ``sha256``) whose :meth:`~FollowingSha256.finish` gives the digest once its
    thread has read the rest of the file; the caller must finish or cancel it. The next file can
    then be written while this one's hash catches up.

    Tensors stream into place: runs of rows from :meth:`LazyCheckpoint.read_rows` that are bytes
    of a rank file are copied file to file by ``copy_threads`` threads (default: the usable CPUs,
    at most 8; see :mod:`hf_merge.copypool`), in pieces of at most 64 MB; converted runs, small
    tensors (read whole) and large tensors without runs (read into a view of the memory-mapped
    output file) are written by this thread meanwhile. The sha256 thread follows the contiguous
    prefix of finished bytes.
    """
    path = Path(folder) / plan.name
    threads = default_threads() if copy_threads is None else copy_threads
    if sequential.enabled():
        runs = sequential.plan_runs(ckpt, plan, WHOLE_TENSOR_LIMIT)
        direct = sequential.open_direct(path) if runs is not None else None
        if direct is not None:
            digest = sequential.write_file(ckpt, plan, path, direct, runs, sha256=sha256, progress=progress, cores=threads)
            return _Finished(digest) if defer_digest and sha256 else digest
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    mapped = None
    hasher = None
    writeback = None
    nice = HASHING_NICE if sha256 else 0  # copies and writeback below a sha256 that must not wait
    pool = PiecePool(threads, name=f"copy {plan.name}", nice=nice)
    try:
        os.pwrite(fd, plan.header, 0)
        os.ftruncate(fd, plan.file_size)  # final size first: pieces land at their offsets
        hasher = FollowingSha256(path) if sha256 else None
        writeback = FollowingWriteback(path, nice=nice) if FollowingWriteback.available() else None
        followers = [f.advance for f in (hasher, writeback) if f is not None]

        def finished_up_to(offset: int) -> None:
            for advance in followers:
                advance(offset)

        done = CompletedRanges(plan.data_start, finished_up_to)
        reported = 0

        def report() -> None:  # the bytes finished since the last call, on this thread
            nonlocal reported
            if progress:
                now = done.total
                if now > reported:
                    progress(now - reported)
                    reported = now

        for spec, start in plan.placed():
            final = start + spec.nbytes
            if spec.nbytes == 0:
                continue
            runs = ckpt.read_rows(spec.name, spec.dtype) if spec.shape else None
            if runs is not None:
                row_bytes = spec.nbytes // spec.shape[0]
                for first, rows in runs:
                    at = start + first * row_bytes
                    if not _submit_copy(pool, rows, fd, at, done, report):
                        _pwrite_all(fd, rows, at)  # a converted run lives in a reused buffer: now
                        done.add(at, at + rows.numel() * rows.element_size())
            elif spec.nbytes <= WHOLE_TENSOR_LIMIT or start % spec.dtype.itemsize:
                _pwrite_all(fd, ckpt.read(spec.name, dtype=spec.dtype), start)
                done.add(start, final)
            else:
                if mapped is None:
                    mapped = torch.from_file(str(path), shared=True, size=plan.file_size, dtype=torch.uint8)
                ckpt.read_into(spec.name, mapped[start : start + spec.nbytes].view(spec.dtype).view(spec.shape))
                done.add(start, final)
            report()
        pool.wait(poll=report)
        report()
        if writeback is not None:
            writeback.advance(plan.file_size)
            finishing, writeback = writeback, None
            finishing.finish()
        if hasher is None:
            return None
        hasher.advance(plan.file_size)
        if defer_digest:
            owned, hasher = hasher, None  # the caller finishes or cancels it now
            return owned
        digest, hasher = hasher.finish(), None
        return digest
    finally:
        pool.close()  # the pieces in flight end before the file is closed
        for follower in (hasher, writeback):
            if follower is not None:
                follower.cancel()
        del mapped
        os.close(fd)


class _Finished:
    """A digest already computed, handed out where a trailing one (:class:`FollowingSha256`) may be."""

    def __init__(self, digest: str | None):
        self._digest = digest

    def finish(self) -> str | None:
        return self._digest

    def cancel(self) -> None:
        pass


class TrailingDigests:
    """The sha256 threads of files already written, finished lazily so that the next file is
    written while they catch up (one file's hash runs at ~1.6 GB/s, slower than the copy: on a
    6.4 GB merge into 4.9 + 1.5 GB files, the first file's hash still had 2 GB to read when its
    copies ended). At most ``keep`` of them run behind the file being written; leaving the
    ``with`` block cancels any not finished (on an error)."""

    def __init__(self, keep: int = 1):
        self._keep = keep
        self._pending: list[tuple[str, FollowingSha256 | None]] = []

    def add(self, name: str, pending: "FollowingSha256 | None") -> None:
        self._pending.append((name, pending))

    def finished(self) -> list[tuple[str, str | None]]:
        """Digests of all but the newest ``keep`` files (waiting for their threads)."""
        done = []
        while len(self._pending) > self._keep:
            done.append(self._finish_first())
        return done

    def finish_all(self) -> list[tuple[str, str | None]]:
        return [self._finish_first() for _ in range(len(self._pending))]

    def _finish_first(self) -> tuple[str, str | None]:
        name, pending = self._pending[0]
        digest = pending.finish() if pending is not None else None
        self._pending.pop(0)
        return name, digest

    def __enter__(self) -> "TrailingDigests":
        return self

    def __exit__(self, *exc: object) -> None:
        for _, pending in self._pending:
            if pending is not None:
                pending.cancel()
        self._pending.clear()


def _write_files(
    ckpt: LazyCheckpoint, files: list[FilePlan], folder: Path, progress: ProgressFn | None, sha256: bool, copy_threads: int
) -> Iterator[tuple[str, str | None]]:
    """Write ``files`` one after the other; yield ``(name, sha256)`` as each digest is finished
    (a file's hash may still run while the next file is written; see :class:`TrailingDigests`)."""
    with TrailingDigests() as trailing:
        for plan in files:
            trailing.add(plan.name, write_file(
                ckpt, plan, folder, progress=progress, sha256=sha256, copy_threads=copy_threads, defer_digest=True,
            ))
            yield from trailing.finished()
        yield from trailing.finish_all()


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_handlers_before_fork: dict[int, object] = {}  # the handlers _signals_deferred replaced (for the children)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends (then their handlers run as usual): a
    KeyboardInterrupt raised inside ``fork`` is swallowed by the interpreter's at-fork code, and
    the merge would go on. Nothing changes off the main thread (handlers live there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    _handlers_before_fork.clear()
    for s in _STOP_SIGNALS:
        if signal.getsignal(s) not in (signal.SIG_IGN, None):
            _handlers_before_fork[s] = signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s, handler in _handlers_before_fork.items():
            signal.signal(s, handler)
        if got:
            signal.raise_signal(got[0])


def _worker(
    ckpt: LazyCheckpoint, files: list[FilePlan], folder: Path, queue, sha256: bool, copy_threads: int, parent: int
) -> None:
    from .head_start import die_with_parent

    for s, handler in _handlers_before_fork.items():  # forked while the parent deferred them
        signal.signal(s, handler)
    die_with_parent(parent)  # a SIGKILLed merge leaves no writer behind
    torch.set_num_threads(1)  # forked children: no OpenMP pool, one core each
    try:
        for name, digest in _write_files(ckpt, files, folder, lambda n: queue.put(("bytes", n)), sha256, copy_threads):
            queue.put(("sha256", (name, digest)))
    except BaseException as e:  # hand the typed error to the parent, which re-raises it
        try:
            queue.put(("error", e))
        except Exception:  # an exception that does not pickle: its text then
            queue.put(("error", RuntimeError(f"{type(e).__name__}: {e}")))
        queue.close()
        queue.join_thread()  # flushed before _exit, so the parent gets the typed error (e.g. disk full)
        os._exit(1)
    queue.put(("done", None))


def _raise_reported_error(queue) -> None:
    """Re-raise the error a dead writer reported, if it is still in the queue."""
    while True:
        try:
            kind, value = queue.get(timeout=0.5)
        except Exception:  # queue.Empty
            return
        if kind == "error":
            raise value


def default_workers(n_files: int, processes_here: int = 1) -> int:
    """One writer per file, at most 8: one core each where files are written front to back with
    ``O_DIRECT`` (:mod:`hf_merge.sequential`: a writer left a second core hashes on it), else
    two cores each (the writer and its sha256 thread; copies on the page-cache path cost a core).

    ``processes_here``: the writing processes on this machine (distributed ranks) share its CPUs.
    Each forked writer also carries an interpreter's worth of memory (~200 MB).
    """
    per_writer = 1 if sequential.enabled() else 2
    return max(1, min(n_files, usable_cpus() // (per_writer * max(1, processes_here)), 8))


def write_shards(
    ckpt: LazyCheckpoint,
    plan: ShardPlan,
    folder: Path,
    *,
    workers: int | None = None,
    desc: str = "Writing",
    sha256: bool = False,
    files: list[FilePlan] | None = None,
    progress: ProgressFn | None = None,
    copy_threads: int | None = None,
    processes_here: int = 1,
) -> dict[str, str | None]:
    """Write the files of ``plan`` (and the index when sharded) into ``folder``.

    ``files`` (a distributed rank's share) writes only those files and no index; ``progress``
    receives the bytes written instead of a progress bar being shown. ``copy_threads``: threads
    copying rank-file bytes in each writer process (default: the usable CPUs shared by the
    ``workers`` processes and the ``processes_here`` other writers on this machine, 1..8). Returns
    ``{file name: sha256 hex digest}`` for the files written (``None`` values unless ``sha256``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    share = plan.files if files is None else files
    digests: dict[str, str | None] = {}
    if share:
        n = workers or default_workers(len(share), processes_here)
        n = max(1, min(n, len(share)))
        threads = copy_threads or default_threads(n * max(1, processes_here))
        with contextlib.ExitStack() as stack:
            if progress is None:
                from .progress import progress_bar

                bar = stack.enter_context(progress_bar(total=sum(f.data_size for f in share), unit="B", desc=desc))
                progress = bar.update
            if n == 1:
                digests.update(_write_files(ckpt, share, folder, progress, sha256, threads))
            else:
                digests.update(_write_parallel(ckpt, share, folder, n, progress, sha256, threads))
    if files is None:
        write_index(plan, folder)
    return {fp.name: digests[fp.name] for fp in share}


def write_index(plan: ShardPlan, folder: Path) -> None:
    """``model.safetensors.index.json`` for a sharded plan (nothing for a single file)."""
    if plan.index is not None:
        (Path(folder) / INDEX_NAME).write_text(json.dumps(plan.index, indent=2, sort_keys=False) + "\n")


def _write_parallel(
    ckpt: LazyCheckpoint, files: list[FilePlan], folder: Path, n: int, update: ProgressFn, sha256: bool, threads: int
) -> dict[str, str | None]:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    # Largest files first, round robin: shares of similar size.
    order = sorted(files, key=lambda f: -f.file_size)
    shares = [order[i::n] for i in range(n)]
    procs = [ctx.Process(target=_worker, args=(ckpt, share, folder, queue, sha256, threads, os.getpid()),
                         daemon=True) for share in shares]
    done = 0
    digests: dict[str, str | None] = {}
    try:
        with _signals_deferred():  # an interrupt lands after the forks, not in one
            for p in procs:
                p.start()
        while done < len(procs):
            try:
                kind, value = queue.get(timeout=1.0)
            except Exception:  # queue.Empty: check nobody died
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    _raise_reported_error(queue)
                    raise RuntimeError(f"a writer process exited with code {dead[0].exitcode}") from None
                continue
            if kind == "error":
                raise value
            if kind == "bytes":
                update(value)
            elif kind == "sha256":
                digests[value[0]] = value[1]
            else:
                done += 1
        for p in procs:
            p.join()
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"a writer process exited with code {failed[0]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return digests
