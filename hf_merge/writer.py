"""Streaming safetensors writer: fills planned files tensor by tensor, in place.

Each output file is created at its final size with its header already written, and every tensor
is written at its planned offset: runs of rows straight from the rank files (``copy_file_range``
from the rank file when no cast is needed, see :mod:`hf_merge.filemap`, else ``pwrite`` of the
memory-mapped view; converted chunks of ~32 MB when a cast is needed),
small tensors whole, and large tensors with no row runs through a memory-mapped view of the output
(``read_into``). Memory in use is the tensors in flight, never a shard or the model.

Files are independent, so ``workers > 1`` forks processes that each write a share of the files
(the plan is deterministic and partitions by file). Each file's sha256 is computed on a second
thread that follows the writer through the file (tensors are written in offset order), so hashing
overlaps with writing instead of re-reading the output afterwards. Across machines the same
partition is used by :mod:`hf_merge.distributed`: each rank calls :func:`write_shards` with its
share of the files (``files=``) and no index, reporting bytes through ``progress=``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing as mp
import os
import threading
from pathlib import Path
from typing import Callable

import torch

from . import filemap
from .copypool import HASHING_NICE, PIECE_BYTES, CompletedRanges, PiecePool, default_threads, usable_cpus
from .checkpoint import LazyCheckpoint
from .plan import INDEX_NAME, FilePlan, ShardPlan

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]


# A tensor without a row fast path is read whole into memory up to this size; larger ones are read
# into a memory-mapped view of the output file instead, so memory stays bounded either way.
WHOLE_TENSOR_LIMIT = 256 << 20


def _pwrite_all(fd: int, tensor: torch.Tensor, offset: int) -> None:
    if filemap.copy_to_file(tensor, fd, offset):  # bytes of a rank file: copied file to file
        return
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


# Small reads keep the buffer in the CPU cache for hashlib: 256 KiB took 1.05-1.23 CPU s/GB against
# 1.27-1.53 for 8 MiB (a page-cached rank file, interleaved runs, load 4.5).
HASH_CHUNK = 256 << 10


class FollowingSha256:
    """sha256 of a file written front to back, computed on a thread that trails the writer.

    The writer calls :meth:`advance` with the offset below which the file is final; the thread
    reads that part back (from the page cache) and hashes it. pread and hashlib release the GIL,
    so this runs on another core while the writer writes on. :meth:`finish` returns the digest.
    """

    def __init__(self, path: Path):
        self._fd = os.open(path, os.O_RDONLY)
        self._hash = hashlib.sha256()
        self._done = 0
        self._limit = 0
        self._closing = False
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"sha256 {path.name}", daemon=True)
        self._thread.start()

    def advance(self, final_up_to: int) -> None:
        with self._cv:
            self._limit = max(self._limit, final_up_to)
            self._cv.notify()

    def finish(self) -> str:
        self._stop()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()

    def cancel(self) -> None:
        self._stop()

    def _stop(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _run(self) -> None:
        buf = memoryview(bytearray(HASH_CHUNK))
        try:
            while True:
                with self._cv:
                    while self._done >= self._limit and not self._closing:
                        self._cv.wait()
                    limit, closing = self._limit, self._closing
                while self._done < limit:
                    n = os.preadv(self._fd, [buf[: min(HASH_CHUNK, limit - self._done)]], self._done)
                    if n <= 0:
                        raise OSError(f"unexpected end of file at byte {self._done} while hashing")
                    self._hash.update(buf[:n])
                    self._done += n
                if closing:
                    return
        except BaseException as e:  # noqa: BLE001 - handed to finish()
            self._error = e


def _size_file(fd: int, size: int) -> None:
    """Give the new file its final size before the pieces land at their offsets."""
    os.ftruncate(fd, size)


def _write_piece(piece: torch.Tensor, fd: int, offset: int, done: CompletedRanges) -> None:
    _pwrite_all(fd, piece, offset)
    done.add(offset, offset + piece.numel())


def _submit_copy(
    pool: PiecePool, rows: torch.Tensor, fd: int, offset: int, done: CompletedRanges, poll: Callable[[], None]
) -> bool:
    """Hand the file-to-file copy of ``rows`` to ``pool`` in pieces; False when ``rows`` are not
    bytes of a registered rank file (then only the caller knows how long they stay valid)."""
    if filemap.locate(rows) is None:
        return False
    flat = rows.reshape(-1).view(torch.uint8)
    for a in range(0, flat.numel(), PIECE_BYTES):
        pool.submit(_write_piece, flat[a : a + PIECE_BYTES], fd, offset + a, done, poll=poll)
    return True


def write_file(
    ckpt: LazyCheckpoint,
    plan: FilePlan,
    folder: Path,
    progress: ProgressFn | None = None,
    *,
    sha256: bool = False,
    copy_threads: int | None = None,
) -> str | None:
    """Write one planned safetensors file into ``folder``; return its sha256 when asked.

    Tensors stream into place: runs of rows from :meth:`LazyCheckpoint.read_rows` that are bytes
    of a rank file are copied file to file by ``copy_threads`` threads (default: the usable CPUs,
    at most 8; see :mod:`hf_merge.copypool`), in pieces of at most 64 MB; converted runs, small
    tensors (read whole) and large tensors without runs (read into a view of the memory-mapped
    output file) are written by this thread meanwhile. The sha256 thread follows the contiguous
    prefix of finished bytes.
    """
    path = Path(folder) / plan.name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    mapped = None
    hasher = None
    threads = default_threads() if copy_threads is None else copy_threads
    pool = PiecePool(threads, name=f"copy {plan.name}", nice=HASHING_NICE if sha256 else 0)
    try:
        os.pwrite(fd, plan.header, 0)
        _size_file(fd, plan.file_size)
        hasher = FollowingSha256(path) if sha256 else None
        done = CompletedRanges(plan.data_start, hasher.advance if hasher is not None else None)
        reported = 0

        def report() -> None:  # the bytes finished since the last call, on this thread
            nonlocal reported
            if progress:
                now = done.total
                if now > reported:
                    progress(now - reported)
                    reported = now

        final = plan.data_start  # the planned end of the tensors issued so far
        for spec in plan.specs:
            start = plan.data_start + plan.offsets[spec.name]
            if start != final:  # the plan lays tensors out back to back, in this order
                raise RuntimeError(f"{plan.name}: {spec.name} planned at byte {start}, expected {final}")
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
        if hasher is not None:
            hasher.advance(plan.file_size)
            digest, hasher = hasher.finish(), None
            return digest
        return None
    finally:
        pool.close()  # the pieces in flight end before the file is closed
        if hasher is not None:
            hasher.cancel()
        del mapped
        os.close(fd)


def _worker(ckpt: LazyCheckpoint, files: list[FilePlan], folder: Path, queue, sha256: bool, copy_threads: int) -> None:
    torch.set_num_threads(1)  # forked children: no OpenMP pool, one core each
    try:
        for plan in files:
            digest = write_file(
                ckpt, plan, folder, progress=lambda n: queue.put(("bytes", n)), sha256=sha256, copy_threads=copy_threads
            )
            queue.put(("sha256", (plan.name, digest)))
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


def default_workers(n_files: int) -> int:
    """One writer per file, two cores each (the writer and its sha256 thread), at most 8.

    Each forked writer also carries an interpreter's worth of memory (~200 MB), so on a small
    machine one writer is both the fastest and the leanest choice.
    """
    return max(1, min(n_files, usable_cpus() // 2, 8))


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
        n = workers or default_workers(len(share))
        n = max(1, min(n, len(share)))
        threads = copy_threads or default_threads(n * max(1, processes_here))
        with contextlib.ExitStack() as stack:
            if progress is None:
                from .progress import progress_bar

                bar = stack.enter_context(progress_bar(total=sum(f.data_size for f in share), unit="B", desc=desc))
                progress = bar.update
            if n == 1:
                for fp in share:
                    digests[fp.name] = write_file(
                        ckpt, fp, folder, progress=progress, sha256=sha256, copy_threads=threads
                    )
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
    procs = [ctx.Process(target=_worker, args=(ckpt, share, folder, queue, sha256, threads), daemon=True) for share in shares]
    for p in procs:
        p.start()
    done = 0
    digests: dict[str, str | None] = {}
    try:
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
