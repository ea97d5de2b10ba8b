"""Which step of a save root (a folder of step folders) to read, for every format: the step the
framework's pointer file names (``latest``, ``latest_checkpointed_iteration.txt``), else the
highest. That step missing, empty or incomplete is an error naming the complete step to pass:
an older step is never merged in its place.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..errors import IncompleteStepError

K = TypeVar("K", bound=Hashable)


def newest_step(steps: Mapping[K, Path], complete: Callable[[Path], bool], *,
                pointer: tuple[K, str] | None = None, order: Callable[[K], Any] | None = None) -> K | None:
    """The key of ``steps`` (step folders of one root, by step) to read: the one ``pointer``
    ``(step, what to say when it is not here)`` names (from the framework's pointer file), else
    the highest by ``order``.
    None when no step is ``complete`` (nothing to name instead: the caller says what is missing).

    Raises:
        IncompleteStepError: the step chosen is not here, or not ``complete``, and another step is.
    """
    if not steps:
        return None
    newest = max(steps, key=order)
    if pointer is not None and pointer[0] in steps:
        newest, pointer = pointer[0], None
    newest_complete = complete(steps[newest])
    if pointer is None and newest_complete:
        return newest
    done = newest if newest_complete else max((k for k in steps if k != newest and complete(steps[k])), key=order, default=None)
    if done is None:
        return None
    problems = [] if pointer is None else [pointer[1]]
    if not newest_complete:
        problems.append(f"{steps[newest]} is empty or incomplete (a run stopped while saving it?)")
    raise IncompleteStepError(
        f"{'; '.join(problems)}; the newest complete step is {steps[done].name}: pass {steps[done]} to merge it"
    )
