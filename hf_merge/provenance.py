"""The provenance record every merge writes (``hf_merge.json``), as typed data.

:class:`Provenance` is what :func:`hf_merge.merge` records and what the model card
(:mod:`hf_merge.publish.card`), ``verify`` and ``push`` read back; its JSON form (:meth:`Provenance.to_dict`)
is the schema documented in :mod:`hf_merge.publish.card`. Format-specific source details (mesh,
placements, ...) ride in :attr:`SourceRecord.details` and are written beside the common keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .write.atomic import PROVENANCE_FILE


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
    files: dict[str, str] | None = None  # file name -> digest (hf_merge.write.digest), when recorded
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


# -- the record a merge writes ----------------------------------------------------------------
def write_record(folder: Path, provenance: dict[str, Any]) -> None:
    """``hf_merge.json`` from the JSON object (what :func:`merge_record` returns, completed)."""
    (folder / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")


def framework(info: Any) -> str | None:
    """The training framework of the format that read the source (the registry says)."""
    from .readers.formats import find_format

    fmt = find_format(info.reader)
    return fmt.framework if fmt is not None else None


def dtype_option(requested: Any) -> str:
    """How ``--dtype`` was given: ``config``, ``auto`` or the dtype's name."""
    from .spec import dtype_name, parse_dtype

    if requested is None or requested == "config":
        return "config"
    return "auto" if requested == "auto" else dtype_name(parse_dtype(requested))


def reader_options(info: Any, given: dict[str, Any] | None) -> dict[str, Any]:
    """The reader options (``source_options``) that changed what was read: those given that the source's
    format takes (DeepSpeed's ``tag``, ``source_weights``). ``verify --against`` reads the source with them."""
    from .readers.formats import find_format

    fmt = find_format(info.reader)
    taken = fmt.options if fmt is not None else frozenset()
    return {k: v for k, v in sorted((given or {}).items()) if v is not None and k in taken}


def merge_record(
    ckpt: Any, config: dict[str, Any], views: Any, base_model_name: str | None, written: Any, *, requested: Any = None,
    source_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The :class:`Provenance` record of a merge, as the JSON object each output completes."""
    import datetime as _dt

    from .version import __version__
    from .hf_files import written_dtype
    from .spec import dtype_name
    from .transforms.views import ADAPTER_SUBDIR

    info = ckpt.info
    out_dtype = views.out_dtype
    lora = views.lora
    if lora is not None and views.adapter is not None:
        adapter_dtype, _ = written_dtype(views.adapter.specs())
        lora = {**lora, "adapter_dtype": dtype_name(adapter_dtype) if adapter_dtype else None}
        if views.model is not None:
            lora["adapter_subfolder"] = ADAPTER_SUBDIR
    if views.model is not None:
        shown = dtype_name(written) if written is not None else (dtype_name(out_dtype) if out_dtype else "auto")
    else:  # an adapter folder alone
        shown = lora["adapter_dtype"] if lora and lora.get("adapter_dtype") else "auto"
    source = SourceRecord(
        format=info.format,
        framework=framework(info),
        path="/".join(Path(info.path).parts[-3:]),  # no local home paths in uploaded files
        world_size=info.world_size,
        step=info.step,
        details={k: v for k, v in info.details.items() if k in ("mesh", "mesh_dim_names", "fsdp_version", "placements")},
    )
    options = reader_options(info, source_options)
    if options:
        source.details["options"] = options
    return Provenance(
        hf_merge_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        source=source,
        dtype=shown,
        dtype_option=dtype_option(requested),
        architecture=(config.get("architectures") or [None])[0],
        base_model=base_model_name or config.get("_name_or_path") or None,
        lora=lora,
    ).to_dict()
