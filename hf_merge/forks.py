"""Forked helper processes (the writers, the rank-file readers, the head start): an interrupt lands
after a fork, not inside it, and no child outlives its parent."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_handlers_before_fork: dict[int, object] = {}  # the handlers signals_deferred replaced (for the children)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
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


def child_started(parent: int) -> None:
    """In a child forked inside :func:`signals_deferred`: the parent's signal handlers back, and
    the child dies with ``parent``."""
    for s, handler in _handlers_before_fork.items():
        signal.signal(s, handler)
    die_with_parent(parent)


def die_with_parent(parent: int) -> None:
    """SIGKILL this forked child when the parent (its pid, taken before the fork) dies
    (PR_SET_PDEATHSIG), so no helper outlives a killed merge."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before that took effect
        os._exit(1)


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_processes_here = 1  # processes on this machine that each fork their own helpers (torchrun ranks that all read)


def share_cpus(processes: int) -> None:
    """From now on ``processes`` on this machine (this one included) fork helpers of their own:
    :func:`helper_cpus` gives each its share of the CPUs."""
    global _processes_here
    _processes_here = max(1, processes)


def helper_cpus() -> int:
    """How many helper processes this process may fork to read in parallel (rank files, chunk
    archives): its share of the CPUs (:func:`share_cpus`)."""
    return max(1, usable_cpus() // _processes_here)
