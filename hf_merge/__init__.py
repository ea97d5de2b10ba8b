"""hf_merge: distributed training checkpoints to standard Hugging Face models, streaming and exact.

The public API is re-exported lazily so that ``import hf_merge`` (and every ``hf-merge`` command)
does not pay for torch / transformers until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "CheckpointInfo": "checkpoint",
    "LazyCheckpoint": "checkpoint",
    "open_checkpoint": "checkpoint",
    "HfMergeError": "errors",
    "MergeResult": "merging",
    "merge": "merging",
    "TensorSpec": "spec",
    "verify": "verification",
    "VerifyReport": "verification",
    "push": "hub",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint import CheckpointInfo, LazyCheckpoint, open_checkpoint
    from .errors import HfMergeError
    from .hub import push
    from .merging import MergeResult, merge
    from .spec import TensorSpec
    from .verification import VerifyReport, verify


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_merge' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
