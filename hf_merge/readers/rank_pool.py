"""Rank files read by forked processes while this one goes on: verl FSDP rank pickles, DCP chunk archives.

Every rank file's pickle is walked under the one policy before anything is built from it, in pure
Python: about 0.3 ms of CPU per tensor per rank, so a checkpoint of many tensors saved by many
ranks spends minutes there (18,900 tensors x 64 ranks: ~6 min on one core) before a byte moves.
The ranks are independent, so where their pickles are large (:data:`PARALLEL_PICKLE_BYTES` in all)
:class:`RankPool` hands ranks 1.. to forked processes, one per CPU, that read them without torch
(:func:`~hf_merge.readers.rank_records.local_records`, nothing built) and send back the zip
directory they checked and each local tensor's record; this process maps the tensors as they are
asked for (:func:`~hf_merge.readers.rank_records.load_local_records`).

A DCP checkpoint saved by many ranks holds a ``torch.save`` archive per tensor per rank in its
``.distcp`` files, each checked (zip directory, local headers, its pickle) before its bytes are
used: ~0.15 ms each. Where there are many (:data:`~hf_merge.readers.dcp.PARALLEL_CHUNKS`), the
first tensor read hands the files to forked processes the same way.

What a process could not read (any error, a dead process, a file changed since, a fork refused)
comes back as None and the reader reads it itself, so every error is the one the reader raises and
nothing is taken from a file that changed: the file's version (device, inode, size, modification
and change times) must be the one the other process read, unchanged while it read.
"""

from __future__ import annotations

import queue as queue_module
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from .. import forks
from . import contained
from .torch_zip import read_records

#: rank pickles larger than this in all (about 1.5 s of walking on one core) are read in parallel
PARALLEL_PICKLE_BYTES = 2 << 20


def pickle_bytes(path: Path) -> int:
    """The size of a ``torch.save`` file's ``data.pkl`` (its zip directory read, nothing else)."""
    with open(contained.check(path), "rb") as f:
        records = read_records(f, Path(path).name)
    return sum(r.size for name, r in records.items() if name.endswith("data.pkl"))


def worth(rank_files: list[Path]) -> bool:
    """Whether ``rank_files`` (rank 0 first, all alike) hold pickles large enough in all to read
    them in parallel; judged from rank 0's pickle."""
    return len(rank_files) > 1 and pickle_bytes(rank_files[0]) * len(rank_files) >= PARALLEL_PICKLE_BYTES


def _read(jobs: list[tuple[Any, Any]], conn: Connection, read: Callable[[Any], Any]) -> None:
    """In a forked process: ``(key, read(item))`` of each job sent on ``conn``, by a thread (the
    next item is read while the parent is busy); None for an item ``read`` failed on."""
    out: queue_module.SimpleQueue = queue_module.SimpleQueue()
    sender = threading.Thread(target=_send, args=(out, conn), daemon=True)
    sender.start()
    try:
        for key, item in jobs:
            try:
                value = read(item)
            except Exception:  # the reader reads this itself and raises its error (an interrupt ends the process)
                value = None
            out.put((key, value))
    finally:
        out.put(_DONE)
        sender.join()


_DONE = object()


def _send(out: queue_module.SimpleQueue, conn: Connection) -> None:
    while (got := out.get()) is not _DONE:
        conn.send(got)
    conn.close()


class RankPool:
    """``read(item)`` of each of ``items`` (``{key: item}``, e.g. rank: file) in up to ``processes``
    forked processes (:class:`~hf_merge.forks.Forked`: a pipe of its own each); :meth:`take` hands
    each result over. The keys of a process that died, even halfway through a result (the OOM
    killer's SIGKILL), or that could not be forked come back as None."""

    def __init__(self, items: dict[Any, Any], processes: int, read: Callable[[Any], Any]):
        keys = list(items)
        n = max(1, min(processes, len(keys)))
        shares = [[(k, items[k]) for k in keys[i::n]] for i in range(n)]
        self._owner = {k: i for i, share in enumerate(shares) for k, _ in share}
        self._got: list[dict[Any, Any]] = [{} for _ in shares]
        self._forked = forks.Forked(_read, shares, read)
        self._procs = self._forked.procs
        self._conns = self._forked.conns  # [i]: share i's process (those started)

    def take(self, key: Any) -> Any:
        """What ``read`` gave for ``key``; None when its process did not read it (or died first)."""
        owner = self._owner.get(key)
        if owner is None:
            return None
        got = self._got[owner]
        while key not in got:
            conn = self._conns[owner] if owner < len(self._conns) else None
            if conn is None:
                return None
            try:
                got_key, value = conn.recv()  # its results come in the order of its share
            except (EOFError, OSError):  # the process ended, perhaps halfway through a result
                conn.close()
                self._conns[owner] = None
                return None
            got[got_key] = value
        return got.pop(key)

    def close(self) -> None:
        self._forked.close()
