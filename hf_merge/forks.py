"""Forked helper processes (the writers, the rank-file readers, the head start): an interrupt lands
after a fork, not inside it, and no child outlives its parent. :class:`Forked` starts the writers
and the readers: a pipe of its own per process, so that one killed halfway through a message ends
its pipe and never blocks this process."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, Sequence

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


class Forked:
    """``target(share, conn, *args)`` for each of ``shares`` in a process forked from this one; each
    sends on ``conn``, a pipe whose only writer it is (:attr:`conns` [i]: share i's receiving end).

    A process that dies, even halfway through a message (the OOM killer's SIGKILL while the pipe is
    full), ends its pipe: end-of-file here. A ``multiprocessing.Queue`` shared by all would keep the
    message cut short (this process holds its writing end) and its reader would wait for ever.
    A fork refused (ENOMEM of a large process without overcommit, EAGAIN under a process limit)
    stops the forking: :attr:`procs` holds the processes started, share i's for i < len(procs), and
    the caller does the other shares itself. An interrupt ends a process at once and quietly (no
    traceback of its own): SIGINT / SIGTERM back to their default action there, unless ignored."""

    def __init__(self, target: Callable[..., None], shares: Sequence[Any], *args: Any):
        ctx = mp.get_context("fork")
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection | None] = []
        try:
            with signals_deferred():  # an interrupt lands after the forks, not in one
                for share in shares:
                    receive, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_run, args=(os.getpid(), target, share, send, args), daemon=True)
                    try:
                        proc.start()
                    except OSError:  # no fork: the caller does the rest
                        receive.close()
                        break
                    finally:
                        send.close()  # the child's is its only copy: its pipe ends when it does
                    self.procs.append(proc)
                    self.conns.append(receive)
        except BaseException:  # e.g. the interrupt that waited for the forks: none of them outlives this
            self.close()
            raise

    def close(self) -> None:
        """End the processes still running; close the pipes."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()
        for i, conn in enumerate(self.conns):
            if conn is not None:
                conn.close()
                self.conns[i] = None


def _run(parent: int, target: Callable[..., None], share: Any, conn: Connection, args: tuple) -> None:
    child_started(parent)
    for s in _STOP_SIGNALS:
        if signal.getsignal(s) != signal.SIG_IGN:
            signal.signal(s, signal.SIG_DFL)
    try:
        target(share, conn, *args)
    finally:
        conn.close()


def sendable(error: BaseException) -> BaseException:
    """``error`` where it comes back whole from a pickle (it goes to the parent), else a
    RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
