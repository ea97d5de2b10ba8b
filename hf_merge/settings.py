"""The environment variables hf-merge reads, parsed in this one place.

Everything else is an option (:class:`hf_merge.options.MergeOptions`, the CLI's flags). What is
left here is what a user sets for every run, or what a program that launches the CLI sets:

- ``HF_MERGE_CACHE``: the plan cache's folder; ``off`` (or ``0``, ``false``, ``no``, empty) turns
  it off; default ``$XDG_CACHE_HOME/hf_merge`` (``~/.cache/hf_merge``).
- ``HF_MERGE_DEBUG``: any value but ``0`` / empty: the CLI prints the traceback of an error too.
- ``HF_MERGE_DIST_TIMEOUT``: seconds a distributed merge waits for the other ranks (default 1800).
- ``HF_MERGE_DISTRIBUTED``: ``1`` / ``0`` stand for ``distributed=True`` / ``False`` when the
  option is not given (for the CLI run inside a program that already runs torch.distributed).
- ``HF_MERGE_HEAD_START``: ``0`` (or ``off``, ``false``, ``no``): the CLI forks no head start for
  the merges it serves (verl FSDP, DCP, accelerate, torchtitan, Megatron-Core, DeepSpeed, ColossalAI
  booster folders: :mod:`hf_merge.write.head_start`, docs/head-start.md).

Each is read when asked for (not at import), so a test or a program may set it at any time.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import HfMergeError

CACHE_VAR = "HF_MERGE_CACHE"
DEBUG_VAR = "HF_MERGE_DEBUG"
DIST_TIMEOUT_VAR = "HF_MERGE_DIST_TIMEOUT"
DISTRIBUTED_VAR = "HF_MERGE_DISTRIBUTED"
HEAD_START_VAR = "HF_MERGE_HEAD_START"
DEFAULT_DIST_TIMEOUT_S = 1800.0

_OFF = ("off", "0", "false", "no", "")


def cache_dir() -> Path | None:
    """The plan cache's folder, or None when ``HF_MERGE_CACHE`` turns it off."""
    value = os.environ.get(CACHE_VAR)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_merge"


def debug() -> bool:
    """``HF_MERGE_DEBUG`` set (to anything but ``0``): errors come with their traceback."""
    return os.environ.get(DEBUG_VAR, "") not in ("", "0")


def dist_timeout_s() -> float:
    """``HF_MERGE_DIST_TIMEOUT`` in seconds (default 1800); a bad value is an error naming the fix."""
    raw = os.environ.get(DIST_TIMEOUT_VAR, "")
    try:
        value = float(raw) if raw else DEFAULT_DIST_TIMEOUT_S
    except ValueError:
        raise HfMergeError(f"{DIST_TIMEOUT_VAR}={raw!r} is not a number of seconds; unset it or set e.g. 1800") from None
    if value <= 0:
        raise HfMergeError(f"{DIST_TIMEOUT_VAR}={raw!r} must be positive")
    return value


def distributed() -> bool | None:
    """``HF_MERGE_DISTRIBUTED``: ``1`` -> True, ``0`` -> False, anything else -> None (not set)."""
    value = os.environ.get(DISTRIBUTED_VAR, "")
    return {"1": True, "0": False}.get(value)


def head_start() -> bool:
    """False when ``HF_MERGE_HEAD_START`` turns the CLI's head start off (read before torch is imported)."""
    return os.environ.get(HEAD_START_VAR, "").strip().lower() not in ("0", "off", "false", "no")
