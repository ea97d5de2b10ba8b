"""Transforms: lazy checkpoints built on lazy checkpoints. Nothing is read until a consumer asks.

The names below are imported on first use, so that the torch-free modules of this package
(``conversion_keys``, ``layout_cache``, ``lora_targets``) can be imported without torch (the head
start's child, :mod:`hf_merge.write.head_start`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Cast": "cast", "cast_policy": "cast", "HubLayout": "hub_layout",
    "Renamed": "rename", "drop_tied": "rename",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from .cast import Cast, cast_policy
    from .hub_layout import HubLayout
    from .rename import Renamed, drop_tied


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
