"""``merge``: open -> transforms -> writer, into an atomic output folder."""

from __future__ import annotations

import datetime as _dt
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .checkpoint import LazyCheckpoint, open_checkpoint
from .hf_files import copy_side_files, find_config_dir, load_config, resolve_dtype, tied_pairs, write_config
from .output import atomic_folder, check_target
from .plan import plan_shards
from .spec import dtype_name
from .transforms import Cast, drop_tied
from .writer import write_shards

logger = logging.getLogger(__name__)

PROVENANCE_NAME = "hf_merge.json"


@dataclass
class MergeResult:
    target: Path
    files: list[str]
    dtype: str | None
    num_tensors: int
    total_bytes: int
    notes: list[str] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)


def model_view(
    ckpt: LazyCheckpoint, config: dict[str, Any], *, dtype: "str | torch.dtype | None" = None
) -> tuple[LazyCheckpoint, torch.dtype | None, list[str]]:
    """The transform stack from a source's names to what the HF folder holds.

    Returns ``(view, output dtype or None for 'keep', notes)``.
    """
    notes: list[str] = []
    out_dtype = resolve_dtype(dtype, config)
    view, dropped = drop_tied(ckpt, tied_pairs(config))
    if dropped:
        notes.append(f"tied weights: wrote {', '.join(dropped)} once, under its source name (tie_word_embeddings)")
    return Cast(view, out_dtype), out_dtype, notes


def merge(
    source: "str | Path",
    target: "str | Path",
    *,
    backend: str = "auto",
    dtype: "str | torch.dtype | None" = None,
    max_shard_size: "int | str" = "5GB",
    workers: int | None = None,
    config: "str | Path | None" = None,
    overwrite: bool = False,
) -> MergeResult:
    """Merge a sharded training checkpoint into a Hugging Face model folder.

    Args:
        source: checkpoint folder (see :func:`hf_merge.open_checkpoint`).
        target: output folder; written atomically (temporary folder beside it, renamed at the end).
        dtype: ``None`` (the config's dtype), ``"auto"`` (keep the shards' dtype) or a dtype.
        max_shard_size: largest output file, e.g. ``"5GB"``.
        workers: processes writing output files in parallel (default: one per file, up to the CPUs).
        config: folder with config.json / tokenizer, when the checkpoint has no ``huggingface/``.
        overwrite: replace a non-empty ``target``.
    """
    target = Path(target)
    check_target(target, overwrite=overwrite)
    ckpt = open_checkpoint(source, backend=backend, config=config)
    try:
        config_dir = find_config_dir(ckpt.info.hf_dir, ckpt.info.path)
        cfg = load_config(config_dir)
        view, out_dtype, notes = model_view(ckpt, cfg, dtype=dtype)
        notes = list(ckpt.info.notes) + notes + list(ckpt.info.warnings)
        provenance = _provenance(ckpt, cfg, out_dtype)
        metadata = {"hf_merge_version": __version__, "source_format": ckpt.info.format}
        plan = plan_shards(view.specs(), max_shard_size=max_shard_size, metadata=metadata)
        for note in notes[: len(notes) - len(ckpt.info.warnings)]:
            logger.info(note)
        for warning in ckpt.info.warnings:
            logger.warning(warning)
        with atomic_folder(target, overwrite=overwrite) as tmp:
            write_shards(view, plan, tmp, workers=workers, desc="Merging")
            write_config(cfg, tmp, dtype=out_dtype)
            copy_side_files(config_dir, tmp)
            (tmp / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=2) + "\n")
        specs = view.specs()
        return MergeResult(
            target=target,
            files=[f.name for f in plan.files],
            dtype=dtype_name(out_dtype) if out_dtype else None,
            num_tensors=len(specs),
            total_bytes=plan.total_size,
            notes=notes,
            provenance=provenance,
        )
    finally:
        ckpt.close()


def _provenance(ckpt: LazyCheckpoint, config: dict[str, Any], out_dtype: torch.dtype | None) -> dict[str, Any]:
    info = ckpt.info
    return {
        "hf_merge_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": {
            "format": info.format,
            "framework": "verl" if info.format.startswith(("verl", "megatron")) else None,
            "path": str(info.path),
            "world_size": info.world_size,
            "step": info.step,
            **{k: v for k, v in info.details.items() if k in ("mesh", "mesh_dim_names", "fsdp_version", "placements")},
        },
        "dtype": dtype_name(out_dtype) if out_dtype else "auto",
        "architecture": (config.get("architectures") or [None])[0],
        "base_model": config.get("_name_or_path") or None,
        "lora": None,
        "quantization": None,
        "verification": None,
    }
