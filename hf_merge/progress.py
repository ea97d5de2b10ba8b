"""Progress of long steps: a tqdm bar on a terminal, plain periodic lines anywhere else.

A bar redraws itself with ``\\r``, which a log file or a CI log keeps as one ever-growing line.
When stderr is not a terminal, progress is a ``note: Merging: 45% (1.2 GB of 2.6 GB)`` log line
at most every ``interval`` seconds instead (nothing for short steps). Both follow huggingface_hub's
switch (``HF_HUB_DISABLE_PROGRESS_BARS=1``, ``-q``): disabled, nothing is shown.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable, Iterable

logger = logging.getLogger("hf_merge.progress")

PLAIN_INTERVAL = 30.0


def progress_bar(
    iterable: Iterable | None = None, *, total: int | None = None, desc: str, unit: str = "B",
    interval: float | None = None, stream: Any = None, clock: Callable[[], float] = time.monotonic,
):
    """A context manager / iterable with ``update(n)``: tqdm on a terminal, :class:`PlainProgress` otherwise."""
    from huggingface_hub.utils import are_progress_bars_disabled, tqdm

    stream = stream if stream is not None else sys.stderr
    if getattr(stream, "isatty", lambda: False)() or are_progress_bars_disabled():
        return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit == "B", disable=are_progress_bars_disabled() or None)
    interval = PLAIN_INTERVAL if interval is None else interval
    return PlainProgress(iterable, total=total, desc=desc, unit=unit, interval=interval, clock=clock)


class PlainProgress:
    """Counts like a tqdm bar; logs one line when ``interval`` seconds passed since the last one."""

    def __init__(self, iterable=None, *, total=None, desc: str, unit: str = "B", interval: float = PLAIN_INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        self.iterable, self.desc, self.unit, self.interval, self.clock = iterable, desc, unit, interval, clock
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n = 0
        self._last = clock()

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def close(self) -> None:
        return None

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self._last >= self.interval:
            self._last = now
            logger.info(self.line())

    def line(self) -> str:
        done = self._amount(self.n)
        if not self.total:
            return f"{self.desc}: {done}"
        return f"{self.desc}: {100 * self.n / self.total:.0f}% ({done} of {self._amount(self.total)})"

    def _amount(self, n: int) -> str:
        if self.unit == "B":
            return human_bytes(n)
        return count(n, self.unit)


def count(n: int, noun: str) -> str:
    """``1 file``, ``3 files``: ``n`` and ``noun``, plural unless ``n`` is 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def human_bytes(n: int) -> str:
    """Decimal units, as the progress bars and huggingface_hub: ``1.23 GB``, ``45.6 MB``, ``812 B``."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if n < 100 * size else f"{n / size:.0f} {unit}"
    return f"{n} B"
