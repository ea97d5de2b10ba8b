"""The provenance record every merge writes (``hf_merge.json``), as typed data.

:class:`Provenance` is what :func:`hf_merge.merge` records and what the model card
(:mod:`hf_merge.card`), ``verify`` and ``push`` read back; its JSON form (:meth:`Provenance.to_dict`)
is the schema documented in :mod:`hf_merge.card`. Format-specific source details (mesh,
placements, ...) ride in :attr:`SourceRecord.details` and are written beside the common keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .output import PROVENANCE_FILE


@dataclass
class SourceRecord:
    """Where the weights came from. ``path`` keeps the last three components only (no home paths
    in uploaded files)."""

    format: str
    framework: str | None = None
    path: str | None = None
    world_size: int | None = None
    step: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        common = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "details"}
        return {**common, **{k: v for k, v in self.details.items() if k not in common}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SourceRecord":
        if not isinstance(data, dict) or not isinstance(data.get("format"), str):
            raise ValueError(f"{PROVENANCE_FILE}: 'source' must be an object with a 'format' string")
        known = {f.name for f in fields(cls)} - {"details"}
        return cls(**{k: data.get(k) for k in known}, details={k: v for k, v in data.items() if k not in known})


@dataclass
class Provenance:
    """The content of ``hf_merge.json``."""

    hf_merge_version: str
    source: SourceRecord
    dtype: str  # the written (floating, unquantized) weights' dtype, as config.json says
    created: str | None = None
    # what was asked for ("config", "auto" or a dtype): verify rebuilds the expected tensors with it
    dtype_option: str | None = None
    architecture: str | None = None
    base_model: str | None = None
    lora: dict[str, Any] | None = None
    quantization: dict[str, Any] | None = None
    verification: dict[str, Any] | None = None
    files: dict[str, str] | None = None  # file name -> sha256, when checksums were recorded
    # keys other writers add (missing_files, distributed, gguf, ...): kept as they are
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out["source"] = self.source.to_dict()
        if self.files is None:
            del out["files"]
        return {**out, **{k: v for k, v in self.extra.items() if k not in out}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Provenance":
        if not isinstance(data, dict):
            raise ValueError(f"{PROVENANCE_FILE} must hold a JSON object")
        missing = [k for k in ("hf_merge_version", "source", "dtype") if k not in data]
        if missing:
            raise ValueError(f"{PROVENANCE_FILE} lacks {', '.join(missing)}")
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: data[k] for k in known if k in data}
        values["source"] = SourceRecord.from_dict(data["source"])
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})

    def write(self, folder: Path) -> Path:
        path = Path(folder) / PROVENANCE_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, folder: Path) -> "Provenance":
        return cls.from_dict(json.loads((Path(folder) / PROVENANCE_FILE).read_text()))
