"""Overlap for the GGUF writer: encode the next row chunk while the current one is written, and
send the written bytes to disk while later ones are still being computed.

- :func:`prefetched` runs an iterator on a thread, at most ``depth`` items ahead of its consumer
  (torch and numpy release the GIL in their kernels, so reading + quantizing runs on one core
  while ``write`` runs on the other).
- :class:`Writeback` calls ``fdatasync`` on a thread each time another ``every`` bytes have been
  written, so the disk writes overlap the computation instead of all waiting for the final fsync;
  :meth:`Writeback.finish` makes the whole file durable (before the atomic rename of its folder).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Iterator, TypeVar

T = TypeVar("T")

_DONE = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def prefetched(items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """Yield what ``items`` yields, produced on a thread up to ``depth`` items ahead.

    An exception in ``items`` is raised here, at the point it would have been; closing this
    generator early (or an exception in the consumer) stops the thread after its current item.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            put(_Failed(e))

    thread = threading.Thread(target=run, name="gguf-encode", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()


class Writeback:
    """Start the disk writes of a file being written front to back, ``every`` bytes at a time."""

    def __init__(self, fd: int, every: int = 256 << 20):
        self._fd = fd
        self._every = every
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def wrote(self, nbytes: int) -> None:
        self._pending += nbytes
        if self._pending >= self._every and (self._thread is None or not self._thread.is_alive()):
            self._pending = 0
            self._thread = threading.Thread(target=self._sync, name="gguf-writeback", daemon=True)
            self._thread.start()

    def _sync(self) -> None:
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            self._error = e

    def finish(self) -> None:
        """Wait for the running sync, then sync the rest; an error of either is raised."""
        if self._thread is not None:
            self._thread.join()
        self._sync()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Close the descriptor (after :meth:`finish`, or on an error without syncing)."""
        if self._thread is not None:
            self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def sync_file(path) -> None:
    """``fdatasync`` a file written by someone else (llama.cpp's quantizer) before its folder is renamed."""
    writeback = Writeback(os.open(path, os.O_RDONLY))
    try:
        writeback.finish()
    finally:
        writeback.close()
