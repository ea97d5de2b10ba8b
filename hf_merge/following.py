"""Threads that follow a file while it is written: its sha256, and the start of its disk write.

The writer reports the offset below which the file is final (:meth:`PrefixFollower.advance`, fed
by :class:`hf_merge.copypool.CompletedRanges`); each follower works on that prefix on a thread of
its own, so neither holds up the copies:

- :class:`FollowingSha256` reads the prefix back (from the page cache) and hashes it; pread and
  hashlib release the GIL, so the hash runs on another core while the writer writes on.
- :class:`FollowingWriteback` asks the kernel to start writing the prefix to disk
  (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: it starts the write and returns; it does not wait
  for it). Left alone, Linux starts writing dirty pages only once 10% of memory is dirty
  (``vm.dirty_background_ratio``) or after 30 s, and throttles every writer to the disk's speed
  at 20% (``vm.dirty_ratio``): a merge then fills the page cache while the disk idles, and the
  disk works on after the merge returns. Started early, the write overlaps the merge. On a 6.4 GB
  merge (L9 benchmark checkpoint, output fsynced inside the timed run, 4 interleaved runs each)
  the wall went from a median of 7.51 s to 6.14 s.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

from .copypool import lower_this_thread

logger = logging.getLogger(__name__)

# Small reads keep the buffer in the CPU cache for hashlib: 256 KiB took 1.05-1.23 CPU s/GB against
# 1.27-1.53 for 8 MiB (a page-cached rank file, interleaved runs, load 4.5).
HASH_CHUNK = 256 << 10
#: the disk write of a file is started in stretches of at least this many finished bytes
WRITEBACK_STEP = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>


class PrefixFollower:
    """A thread that calls :meth:`_follow` with each new stretch ``[done, limit)`` of final bytes
    (of at least ``min_stretch`` bytes, except the last one before :meth:`close`).

    :meth:`close` lets the thread reach the last limit given, stops it and raises the error the
    thread met, if any; :meth:`cancel` stops it where it is and drops any error."""

    def __init__(self, path: Path, name: str, min_stretch: int = 1, nice: int = 0):
        self._min_stretch = max(1, min_stretch)
        self._nice = nice
        self._fd = os.open(path, os.O_RDONLY)
        self._done = 0
        self._limit = 0
        self._closing = False
        self._cancelled = False
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"{name} {Path(path).name}", daemon=True)
        self._thread.start()

    def advance(self, final_up_to: int) -> None:
        with self._cv:
            self._limit = max(self._limit, final_up_to)
            self._cv.notify()

    def close(self) -> None:
        self._stop(cancel=False)
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        self._stop(cancel=True)

    def _stop(self, cancel: bool) -> None:
        with self._cv:
            self._closing = True
            self._cancelled = self._cancelled or cancel
            self._cv.notify()
        self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _follow(self, start: int, end: int) -> None:
        """Work on the final bytes ``[start, end)``."""
        raise NotImplementedError

    def _run(self) -> None:
        lower_this_thread(self._nice)
        try:
            while True:
                with self._cv:
                    while self._limit - self._done < self._min_stretch and not self._closing:
                        self._cv.wait()
                    limit, closing = self._limit, self._closing
                    if self._cancelled:
                        return
                if self._done < limit:
                    self._follow(self._done, limit)
                    self._done = limit
                if closing:
                    return
        except BaseException as e:  # noqa: BLE001 - handed to close()
            self._error = e


class FollowingSha256(PrefixFollower):
    """sha256 of a file written front to back, computed on a thread that trails the writer.
    :meth:`finish` returns the digest once the thread has read up to the last :meth:`advance`."""

    def __init__(self, path: Path):
        self._hash = hashlib.sha256()
        self._buf = memoryview(bytearray(HASH_CHUNK))
        super().__init__(path, "sha256")

    def finish(self) -> str:
        self.close()
        return self._hash.hexdigest()

    def _follow(self, start: int, end: int) -> None:
        buf = self._buf
        while start < end and not self._cancelled:
            n = os.preadv(self._fd, [buf[: min(HASH_CHUNK, end - start)]], start)
            if n <= 0:
                raise OSError(f"unexpected end of file at byte {start} while hashing")
            self._hash.update(buf[:n])
            start += n


def _sync_file_range():
    """libc's ``sync_file_range``, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        # the process's own symbols (libc is loaded); ctypes.util.find_library would run ldconfig
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # a CDLL call releases the GIL
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()


class FollowingWriteback(PrefixFollower):
    """Starts the disk write of each finished stretch of at least :data:`WRITEBACK_STEP` bytes
    (and of the rest at :meth:`finish`). Best effort: where the call is missing or the file
    system refuses it, the kernel writes the file back on its own, as it would have anyway."""

    def __init__(self, path: Path, nice: int = 0):
        self._refused = False
        super().__init__(path, "writeback", min_stretch=WRITEBACK_STEP, nice=nice)

    @staticmethod
    def available() -> bool:
        return _SYNC_FILE_RANGE is not None

    def finish(self) -> None:
        """Start the write of the rest of the file, and stop the thread."""
        self.close()

    def _follow(self, start: int, end: int) -> None:
        if self._refused:
            return
        if _SYNC_FILE_RANGE(self._fd, start, end - start, _SYNC_FILE_RANGE_WRITE) != 0:
            self._refused = True  # e.g. a file system without it: the kernel's own writeback then
            logger.debug("sync_file_range: %s", os.strerror(ctypes.get_errno()))
