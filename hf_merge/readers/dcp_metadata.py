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

from .safe_pickle import DCP_METADATA, Pair, StandIn, stand_in

__all__ = ["metadata_substitutes"]

_TENSOR_PROPERTIES = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


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
    """``TensorProperties`` pickles its fields as a tuple (``__getstate__``), not a dict."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == len(_TENSOR_PROPERTIES):
            state = dict(zip(_TENSOR_PROPERTIES, state))
        super().__setstate__(state)


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
            cls.defaults = _DEFAULTS.get(name, {})
            subs[(module, name)] = cls
    for module, name in DCP_METADATA.calls:
        if module.startswith("torch.distributed.checkpoint"):
            subs[(module, name)] = functools.partial(EnumValue, f"{module}.{name}")
    return subs
