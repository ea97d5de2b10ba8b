"""Overlap for the GGUF writer: encode the next row chunk while the current one is written.

- :func:`prefetched` runs an iterator on a thread, at most ``depth`` items ahead of its consumer
  (torch and numpy release the GIL in their kernels, so reading + quantizing runs on one core
  while ``write`` runs on the other).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

_DONE = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def prefetched(items: Iterator[T], depth: int = 1, *, one_thread: bool = False) -> Iterator[T]:
    """Yield what ``items`` yields, produced on a thread up to ``depth`` items ahead (which runs
    torch with one intra-op thread with ``one_thread``: see :func:`.quant.one_torch_thread`).

    An exception in ``items`` is raised here, at the point it would have been; closing this
    generator early (or an exception in the consumer) stops the thread after its current item. An
    interrupt (SIGTERM, Ctrl-C) while waiting for an item leaves at once: the thread, which only
    computes, stops after its current item.
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
            if one_thread:
                from .quant import one_torch_thread

                one_torch_thread()
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
    except BaseException as e:
        stop.set()
        if not isinstance(e, GeneratorExit):  # SIGTERM / Ctrl-C while waiting here: not after the chunk in hand
            raise
        thread.join()
        raise
    else:
        stop.set()
        thread.join()


def interruptible(work: Callable[[], T]) -> T:
    """``work()`` on a thread of its own, waited for here: a long C call (llama.cpp's quantizer)
    then does not hold back SIGTERM / Ctrl-C, which the main thread only sees between Python
    steps. Its exception is raised here; on an interrupt the thread is left to end with the process."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, work()))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box.append((False, e))

    thread = threading.Thread(target=run, name="hf-merge-work", daemon=True)
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value
