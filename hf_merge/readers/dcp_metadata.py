"""DCP ``.metadata`` read without importing ``torch.distributed.checkpoint`` (~0.7 s of imports).

The pickle is read by the package's one policy under
:data:`~hf_merge.readers.safe_pickle.DCP_METADATA`, with every ``torch.distributed.checkpoint``
class bound to an inert :class:`~hf_merge.readers.safe_pickle.StandIn` (its pickled fields read
as attributes: ``md.state_dict_metadata[key].chunks[i].offsets``, ``md.storage_data[index]
.relative_path`` ...) and the enum look-ups (``_MEM_FORMAT_ENCODING``, ``WriteItemType``,
``LoadItemType``) bound to a recorder of the value. Nothing of torch's classes runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedCheckpointError
from .safe_pickle import DCP_METADATA, Pair, StandIn, stand_in

__all__ = ["check_tensor_properties", "metadata_substitutes"]

#: ``TensorProperties.__getstate__``'s tuple: 5 fields (torch <= 2.14), ``strides`` sixth (2.15+)
_TENSOR_PROPERTIES = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory", "strides")


#: Dataclass fields whose default is not pickled (``MetadataIndex.__init__`` leaves ``offset``
#: and ``index`` unset when None) or that older torch did not write, as torch declares them.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "MetadataIndex": {"offset": None, "index": None},
    "_StorageInfo": {"transform_descriptors": None},
    "Metadata": {"planner_data": None, "storage_meta": None, "version": None},
}


class _Record(StandIn):
    """A DCP dataclass: its pickled fields, else the class default (:data:`_DEFAULTS`)."""

    defaults: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in type(self).defaults:
                return type(self).defaults[name]
            raise


class _Fields(_Record):
    """``TensorProperties`` pickles its fields as a tuple (``__getstate__``), not a dict: the first
    five of :data:`_TENSOR_PROPERTIES`, or all six. A tuple of another length (a torch this reader
    does not know) is kept whole as ``unread_fields`` (see :func:`check_tensor_properties`)."""

    defaults = {"strides": None}

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):
            if len(state) in (5, 6):
                state = dict(zip(_TENSOR_PROPERTIES, state))
            else:
                state = {"unread_fields": state}
        super().__setstate__(state)


def check_tensor_properties(md: Any, where: str) -> None:
    """Raise the one error for a ``.metadata`` whose ``TensorProperties`` this reader does not know
    (not damage: a torch release newer than those read here)."""
    entries = getattr(md, "state_dict_metadata", None)
    for key, entry in (entries.items() if isinstance(entries, dict) else ()):
        unread = getattr(getattr(entry, "properties", None), "unread_fields", None)
        if unread is not None:
            version = getattr(md, "version", None)
            fmt = f"DCP format version {str(version)[:20]}" if isinstance(version, str) else "no DCP format version"
            raise UnsupportedCheckpointError(
                f"{where}: {str(key)[:80]} has tensor properties of {len(unread)} fields, a layout this hf-merge "
                f"does not know (torch 2.4 to 2.14 write 5 fields, 2.15 writes 6; the file records {fmt}, not "
                "the torch version). Nothing is wrong with the file: report it with the training run's torch "
                "version, or re-save the checkpoint with torch 2.4 to 2.15"
            )


@dataclass(frozen=True)
class EnumValue:
    """What ``SomeEnum(value)`` would have returned: the enum's name and the value."""

    enum: str
    value: Any


@functools.cache
def metadata_substitutes() -> dict[Pair, Any]:
    """Stand-ins for every ``torch.distributed.checkpoint`` pair of :data:`DCP_METADATA`."""
    subs: dict[Pair, Any] = {}
    for module, name in DCP_METADATA.classes:
        if module.startswith("torch.distributed.checkpoint"):
            cls = stand_in(module, name, _Fields if name == "TensorProperties" else _Record)
            cls.defaults = {**cls.defaults, **_DEFAULTS.get(name, {})}
            subs[(module, name)] = cls
    for module, name in DCP_METADATA.calls:
        if module.startswith("torch.distributed.checkpoint"):
            subs[(module, name)] = functools.partial(EnumValue, f"{module}.{name}")
    return subs
