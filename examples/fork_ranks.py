"""How the fixture generators start their gloo ranks: forked from a parent that imported the
training libraries once, so that no rank pays their import (about 1.5 CPU-s for torch and 3 for
megatron-core, per rank, under ``spawn``).

The generators' parents run nothing but these imports before they fork: no thread, no process
group, no tensor work. Where ``fork`` is missing (macOS, Windows) the ranks are spawned.
"""

from __future__ import annotations

import importlib
import multiprocessing


def rank_start_method(preload: tuple[str, ...]) -> str:
    """Import ``preload`` here and return ``"fork"``; ``"spawn"`` where there is no fork."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return "spawn"
    for name in preload:
        importlib.import_module(name)
    return "fork"
