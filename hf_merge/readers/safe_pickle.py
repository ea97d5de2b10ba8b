"""Loading torch.save rank files without executing anything from them.

Rank files are pickles. They are loaded with ``weights_only=True`` (PyTorch's restricted
unpickler) plus an explicit allowlist of the distributed-tensor classes that FSDP writes; anything
else in the file is refused with :class:`UnsafeCheckpointError` before any of it runs. Files are
memory-mapped (``mmap=True``): tensor bytes stay in the page cache and are read on first touch.
"""

from __future__ import annotations

import functools
import importlib
import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, UnsafeCheckpointError

# (module, attribute) of every class a DTensor state dict pickles, across torch 2.4 - 2.13.
# Missing ones (older/newer torch) are skipped.
_DTENSOR_GLOBALS = [
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
    ("torch.distributed.tensor.placement_types", "Shard"),
    ("torch.distributed.tensor.placement_types", "Replicate"),
    ("torch.distributed.tensor.placement_types", "Partial"),
    ("torch.distributed.tensor.placement_types", "_StridedShard"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
    ("torch.distributed._mesh_layout", "_MeshLayout"),
    ("torch.distributed._mesh_layout", "_FlatLayout"),
]


def _allowlist() -> list[Any]:
    found = []
    for module, name in _DTENSOR_GLOBALS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


@functools.cache
def _register_allowlist() -> None:
    """Add the DTensor classes to torch's weights_only allowlist, once per process.

    Registered globally rather than with the ``safe_globals`` context manager: on exit, that
    context removes the classes from the process-wide list, including the ones torch itself
    registered when ``torch.distributed.tensor`` was imported, and later plain
    ``torch.load(weights_only=True)`` calls of DTensor files would fail.
    """
    import torch

    torch.serialization.add_safe_globals(_allowlist())


class _DropMeshPickleWarning(logging.Filter):
    """Unpickling a DeviceMesh without process groups logs a warning meant for torch.compile users;
    reading files never needs process groups. Only that one message is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pickling/unpickling of the DeviceMesh" not in record.getMessage()


@functools.cache
def _quiet_device_mesh() -> None:
    logging.getLogger("torch.distributed.device_mesh").addFilter(_DropMeshPickleWarning())


def load_rank_file(path: Path) -> dict[str, Any]:
    """Load one rank's state dict, memory-mapped, with the restricted unpickler.

    Raises:
        UnsafeCheckpointError: the pickle references something outside the allowlist.
        CorruptCheckpointError: the file is truncated, not a torch.save zip, or not a dict.
    """
    import torch

    _register_allowlist()
    _quiet_device_mesh()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "Weights only load failed" in text or "Unsupported" in text:
            detail = _first_line_with(text, ("Unsupported global", "Unsupported operand", "Unsupported class"))
            raise UnsafeCheckpointError(
                f"{path.name} asks the unpickler for code outside the tensor allowlist"
                f"{': ' + detail if detail else ''}; refused, nothing from it was run. "
                "Re-save the checkpoint with plain tensors/DTensors, or only if you fully trust the file "
                "convert it yourself with torch.load(weights_only=False)"
            ) from None
        raise CorruptCheckpointError(f"{path.name} is not a readable torch.save file ({text.splitlines()[0]})") from None
    except (RuntimeError, zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptCheckpointError(
            f"{path.name} is truncated or not a torch.save file ({first[:200]}); "
            "re-copy it from the training run or re-save that rank"
        ) from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{path.name} holds a {type(state).__name__}, not a state dict")
    return state


def _first_line_with(text: str, needles: tuple[str, ...]) -> str:
    for line in text.splitlines():
        if any(n in line for n in needles):
            return line.strip().rstrip(".")[:200]
    return ""
