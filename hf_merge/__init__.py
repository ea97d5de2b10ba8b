"""hf_merge: distributed training checkpoints to standard Hugging Face models, streaming and exact.

The public API is re-exported lazily so that ``import hf_merge`` (and every ``hf-merge`` command)
does not pay for torch / transformers until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

# public name -> module that defines it
_EXPORTS = {
    "CheckpointInfo": "checkpoint",
    "LazyCheckpoint": "checkpoint",
    "open_checkpoint": "checkpoint",
    "HfMergeError": "errors",
    "MergeOptions": "options",
    "MergeResult": "pipeline",
    "merge": "merging",
    "TensorSpec": "spec",
    "verify": "verification",
    "VerifyReport": "verification",
    "push": "publish.hub",
    "from_sharded_pretrained": "load.model",
    "load_tokenizer": "load.model",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint import CheckpointInfo, LazyCheckpoint, open_checkpoint
    from .errors import HfMergeError
    from .publish.hub import push
    from .merging import merge
    from .options import MergeOptions
    from .pipeline import MergeResult
    from .load.model import from_sharded_pretrained, load_tokenizer
    from .spec import TensorSpec
    from .verification import VerifyReport, verify


# Every transformers Auto model class gets ``from_sharded_pretrained`` (now, or when transformers'
# Auto module is first imported: a one-shot import hook keeps ``import hf_merge`` light).
from .load import auto as _auto  # noqa: E402

_auto.install()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_merge' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
