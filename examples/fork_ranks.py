"""How the fixture generators start their gloo ranks: forked from a parent that imported the
training libraries once, so that no rank pays their import (about 1.5 CPU-s for torch and 3 for
megatron-core, per rank, under ``spawn``).

The generators' parents run nothing but these imports before they fork: no thread of their own,
no process group, no tensor work (a fork after ``import torch``, as DataLoader workers are
made). Off Linux (macOS, where forking a process that loaded these libraries is
unsafe, and Windows, which has no fork) the ranks are spawned.
"""

from __future__ import annotations

import importlib
import sys


def rank_start_method(preload: tuple[str, ...]) -> str:
    """Import ``preload`` here and return ``"fork"``; ``"spawn"`` off Linux."""
    if sys.platform != "linux":
        return "spawn"
    for name in preload:
        importlib.import_module(name)
    return "fork"
