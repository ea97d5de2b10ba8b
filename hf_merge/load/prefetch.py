"""A load's big CPU tensors, built while transformers' model code is still being imported.

``from_sharded_pretrained`` knows the view (the checkpoint under its Hugging Face names, after the
transform stack) and the load dtype before it picks the model class. Picking it runs the first
``import transformers.modeling_utils`` and the model's modeling module: about 1.3 s of Python on
the benchmark machine, in which the disk and the other cores sat idle. Building a mapped tensor
(:meth:`hf_merge.load.page_mapper.Mapper.tensor`: ``mmap`` of the rank files' pages, ``preadv`` of
the rest into fresh pages, the CRC-32 of each piece as the model holds it) is a few large calls per
tensor that run outside the GIL, so it can run beside the import without slowing it much.

:class:`Prefetch` starts those builds on its own threads as soon as the view is known: every tensor
of at least :data:`MIN_BYTES` the view holds in the load dtype, largest first: mapped where its
runs are all file bytes (listed on the calling thread first: the threads make only big
GIL-releasing calls), else, unless it is a cast, read by the view's ``read_into`` (a Megatron
row-parallel weight: its TP chunks cut every row, a region read per chunk; meg-L8, 5.9 GB,
``bench_load.py --repeat 5``: load 3.26 -> 3.00 s median). ``_fill`` then :meth:`Prefetch.take` s the tensor for a key whose
checkpoint name, shape and dtype match what it would build, and builds as before otherwise (a
cast, a ``keep_in_fp32`` module, a stacked expert slot). The threads note their records in the
load's :class:`~hf_merge.readers.record_crc.Placed` and place their pieces there, so a damaged
record raises at ``Placed.finish``, before the model is returned, as for a tensor the fill built.
:meth:`Prefetch.close` (always called, also when the import fails) cancels what has not started,
joins the threads and drops the tensors nobody took (their finalizers unmap them).

Only where the fill would map the same tensors: CPU loads (no ``device_map`` or ``"cpu"``),
without quantization, with mapping allowed; a second load in the same process gets no overlap
(its imports are done already), and loses nothing either.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from ..readers import record_crc
from . import page_mapper
from .page_mapper import Mapper
from ..readers.file_runs import run_of
from .stacked import first_piece

if TYPE_CHECKING:
    from ..checkpoint import LazyCheckpoint

logger = logging.getLogger(__name__)

THREAD_PREFIX = "hf_merge-prefetch"
#: smaller tensors are left to the fill: each costs Python calls (GIL) for few bytes
MIN_BYTES = 4 << 20


def _casts(view: "LazyCheckpoint", name: str) -> bool:
    """Whether the load casts tensor ``name`` (the model view's top ``Cast`` over another dtype):
    left to the fill. Casting it on the prefetch's thread during the import measured slower (L2 as
    float32: 6.06 against 5.31 s, system time 9.0 against 5.7 s, 3 runs)."""
    from ..transforms.cast import Cast

    return isinstance(view, Cast) and view.base.specs()[name].dtype != view.specs()[name].dtype


class Prefetch:
    """Mapped CPU tensors of ``view`` in ``dtype``, built on ``threads`` threads from now on."""

    def __init__(self, view: "LazyCheckpoint", dtype: torch.dtype, *, threads: int, mapper: Mapper | None = None,
                 placed: "record_crc.Placed | None" = None, skip: "set[str] | None" = None):
        self.view, self.dtype = view, dtype
        self.mapper = mapper if mapper is not None else Mapper()
        self.placed = placed if placed is not None else record_crc.Placed()
        self.taken = 0
        self.read = 0  # tensors built by read_into (not file bytes throughout)
        self._closed = threading.Event()
        self._futures: dict[str, Future] = {}
        specs = view.specs()
        names = [
            n for n, s in specs.items()
            if s.dtype == dtype and s.shape and s.nbytes >= MIN_BYTES and n not in (skip or ())
        ]
        self._pool = None
        if not names or not self.mapper.available:
            return
        # The runs are listed here, on the calling thread (the readers' Python: zip headers, chunk
        # indexes); the threads then only make big calls that release the GIL. A thread that
        # walked the runs itself would take the GIL back from the import after each of its
        # thousands of small reads, and the import would wait for it every time.
        todo = []
        with record_crc.deferred(check_at_end=False, pending=self.placed.pending):
            for name in sorted(names, key=lambda n: -specs[n].nbytes):
                try:
                    runs = self._file_runs(name)
                except Exception as e:  # the fill reads it again and raises the reader's error in its turn
                    logger.debug("not prefetched: %s (%s)", name, e)
                    continue
                if runs is not None or not _casts(view, name):
                    todo.append((name, tuple(specs[name].shape), runs))
        if not todo:
            return
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=THREAD_PREFIX)
        for name, shape, runs in todo:
            self._futures[name] = self._pool.submit(self._build, shape, runs, name)

    def _file_runs(self, name: str) -> list | None:
        """Tensor ``name``'s runs when every one is file bytes the mapper takes (a computed run is
        only valid until the next is listed), else None: the thread then reads it with ``read_into``."""
        first = first_piece(self.view, name, self.dtype)
        if first is None or not self.mapper.maps(first):
            return None
        runs = []
        for row, piece in self.view.read_rows(name, self.dtype):
            if run_of(piece) is None:
                return None
            runs.append((row, piece))
        return runs

    def _build(self, shape: tuple[int, ...], runs: list | None, name: str) -> torch.Tensor | None:
        if self._closed.is_set():
            return None
        if runs is None:  # not file bytes throughout (a Megatron row-parallel weight): read, as the fill would
            out = page_mapper.empty(shape, self.dtype)
            with record_crc.deferred(check_at_end=False, pending=self.placed.pending):
                self.view.read_into(name, out)
            self.read += 1
            return out
        return self.mapper.tensor(shape, self.dtype, runs, self.placed.place)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor built for checkpoint tensor ``name`` when it has ``shape`` and ``dtype``
        (waits for it to be built); None when there is none or its build has not started (then the
        caller builds it: once the import is done, the fill's threads share what is left)."""
        future = self._futures.pop(name, None)
        if future is None or dtype != self.dtype or future.cancel():  # not started: the fill's threads build it
            return None
        try:
            tensor = future.result()
        except Exception as e:  # the fill reads it again, and raises the reader's error itself
            logger.debug("prefetch of %s failed (%s); read by the fill", name, e)
            return None
        if tensor is None or tuple(tensor.shape) != tuple(shape):
            return None
        self.taken += 1
        return tensor

    def close(self) -> None:
        """Cancel the builds not started, wait for the running ones, drop what was not taken."""
        self._closed.set()
        if self._pool is not None:
            for future in self._futures.values():
                future.cancel()
            self._pool.shutdown(wait=True)
        self._futures.clear()
