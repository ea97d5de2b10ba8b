"""A few threads that write pieces of one output file, and the completed prefix they leave behind.

The kernel's file-to-file copy (``copy_file_range``) costs CPU time in the calling thread (system
time: the page cache copies the bytes), so one thread copying rank files into an output file keeps
one core busy and leaves the other idle. :class:`PiecePool` runs such copies on a few threads, in
pieces of at most :data:`PIECE_BYTES` so that one large tensor is also spread over them.

Pieces finish out of order; :class:`CompletedRanges` collects the finished byte ranges of a file
and reports the contiguous prefix from the start, which is what the file's trailing sha256 thread
may read (:class:`hf_merge.following.FollowingSha256`).

An error on a pool thread is kept and raised, unchanged (same exception object, so the same typed
error and the same CLI line), by the next :meth:`PiecePool.submit` or :meth:`PiecePool.wait`;
the pieces still queued are dropped. :meth:`PiecePool.close` always waits for the pieces in flight,
so no thread writes into a file descriptor after the caller closed it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from typing import Any, Callable

#: largest piece one thread copies: a tensor of 1 GB is some 16 pieces, shared by the threads
PIECE_BYTES = 64 << 20
#: most threads one writer process uses, however many CPUs it may use
MAX_THREADS = 8
#: how much lower the copy threads run than the sha256 thread that follows them: on 2 cores and
#: a loaded machine (load average 5.6-6.8) a 3.1 GB merge's hash ended 1.0-1.2 s after the copies
#: instead of 2.1-2.8 s
HASHING_NICE = 5
POLL_SECONDS = 0.2


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def lower_this_thread(nice: int) -> None:
    """Run the calling thread ``nice`` levels lower (Linux: a thread has its own nice value);
    nothing where that is not possible."""
    if nice:
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)


def default_threads(processes: int = 1) -> int:
    """Copy threads for one of ``processes`` writers on this machine: its share of the CPUs, 1..8."""
    return max(1, min(MAX_THREADS, usable_cpus() // max(1, processes)))


class CompletedRanges:
    """Finished byte ranges ``[start, end)`` of one file, from ``start`` on; calls ``on_prefix(end)``
    each time the contiguous finished prefix grows to ``end``. Safe to call from any thread."""

    def __init__(self, start: int, on_prefix: Callable[[int], None] | None = None):
        self._prefix = start
        self._total = 0  # bytes finished, prefix or not
        self._pending: dict[int, int] = {}  # start -> end of finished ranges beyond the prefix
        self._lock = threading.Lock()
        self._on_prefix = on_prefix

    @property
    def prefix(self) -> int:
        with self._lock:
            return self._prefix

    @property
    def total(self) -> int:
        """Bytes finished so far (for a progress bar)."""
        with self._lock:
            return self._total

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        with self._lock:
            self._total += end - start
            self._pending[start] = max(end, self._pending.get(start, end))
            moved = False
            while self._prefix in self._pending:
                self._prefix = max(self._prefix, self._pending.pop(self._prefix))
                moved = True
            prefix = self._prefix
        if moved and self._on_prefix is not None:
            self._on_prefix(prefix)  # outside the lock; the hasher keeps the largest value it is given


class PiecePool:
    """``threads`` threads running submitted calls in submission order (started on first use).

    ``threads <= 1`` runs each call at once on the caller's thread (no thread at all). ``nice``
    lowers the threads' scheduling priority by that much (Linux), so that a thread that must not
    wait for them (the file's sha256, which only one thread can compute) gets a core first."""

    def __init__(self, threads: int, name: str = "copy", *, nice: int = 0, max_queued: int = 0):
        self._n = max(1, threads)
        self._nice = nice
        # calls waiting for a thread: beyond this, submit() waits (a progress bar then follows the
        # copies instead of the hand-overs)
        self._max_queued = max_queued or 2 * self._n
        self._name = name
        self._jobs: collections.deque[tuple[Callable[..., Any], tuple]] = collections.deque()
        self._cv = threading.Condition()
        self._busy = 0
        self._closing = False
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []

    @property
    def threads(self) -> int:
        return self._n

    def submit(self, fn: Callable[..., Any], *args: Any, poll: Callable[[], None] | None = None) -> None:
        """Queue ``fn(*args)``; while the queue is full, wait, calling ``poll`` about every 0.2 s."""
        if self._n == 1:
            fn(*args)
            return
        while True:
            with self._cv:
                self._raise_error()
                if len(self._jobs) < self._max_queued:
                    break
                self._cv.wait(POLL_SECONDS)
            if poll is not None:
                poll()
        with self._cv:
            self._raise_error()
            if not self._threads:
                self._threads = [
                    threading.Thread(target=self._run, name=f"{self._name} {i}", daemon=True) for i in range(self._n)
                ]
                for t in self._threads:
                    t.start()
            self._jobs.append((fn, args))
            self._cv.notify()

    def wait(self, poll: Callable[[], None] | None = None) -> None:
        """Until every submitted call has run, calling ``poll`` about every 0.2 s; raises the
        first error one of them raised."""
        while True:
            with self._cv:
                if not (self._jobs or self._busy) or self._error is not None:
                    break
                self._cv.wait(POLL_SECONDS)
            if poll is not None:
                poll()
        with self._cv:
            while self._busy:  # an error: the others' pieces in flight end first
                self._cv.wait()
            self._raise_error()

    def close(self) -> None:
        """Drop the calls not started, wait for those running, stop the threads."""
        with self._cv:
            self._jobs.clear()
            self._closing = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []

    def __enter__(self) -> "PiecePool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_error(self) -> None:
        if self._error is not None:  # kept: a failed pool raises it again, and takes no more work
            self._jobs.clear()
            raise self._error
        if self._closing:
            raise RuntimeError(f"{self._name} pool used after close()")

    def _run(self) -> None:
        lower_this_thread(self._nice)
        while True:
            with self._cv:
                while not self._jobs and not self._closing:
                    self._cv.wait()
                if not self._jobs:
                    return
                fn, args = self._jobs.popleft()
                self._busy += 1
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                with self._cv:
                    if self._error is None and not self._closing:
                        self._error = e
                    self._jobs.clear()
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()
