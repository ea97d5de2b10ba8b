"""hf_merge: distributed training checkpoints to standard Hugging Face models, streaming and exact."""

__version__ = "0.1.0"

from .checkpoint import CheckpointInfo, LazyCheckpoint, open_checkpoint  # noqa: E402
from .errors import HfMergeError  # noqa: E402
from .merge import MergeResult, merge  # noqa: E402
from .spec import TensorSpec  # noqa: E402

__all__ = [
    "CheckpointInfo",
    "HfMergeError",
    "LazyCheckpoint",
    "MergeResult",
    "TensorSpec",
    "merge",
    "open_checkpoint",
]
