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
from .hf_files import checkpoint_config, copy_side_files, resolve_dtype, tied_pairs, write_config
from .hub import push, write_card
from .output import PROVENANCE_FILE as PROVENANCE_NAME, atomic_folder, check_target
from .plan import plan_shards
from .spec import dtype_name
from .transforms import Cast, drop_tied
from .verification import verify_or_raise
from .writer import write_shards

logger = logging.getLogger(__name__)

ADAPTER_SUBDIR = "lora_adapter"
ADAPTER_PATTERN = "adapter_model{suffix}.safetensors"


@dataclass
class MergeResult:
    target: Path
    files: list[str]
    dtype: str | None
    num_tensors: int
    total_bytes: int
    notes: list[str] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)
    url: str | None = None  # the Hub URL when pushed


@dataclass
class Views:
    """What a merge writes: the HF model view and/or the PEFT adapter view."""

    model: LazyCheckpoint | None
    out_dtype: torch.dtype | None
    notes: list[str]
    adapter: LazyCheckpoint | None = None
    adapter_config: dict[str, Any] | None = None
    lora: dict[str, Any] | None = None
    base: LazyCheckpoint | None = None  # the unfused base model the adapter goes onto (adapter/both)


LORA_MODES = ("fuse", "adapter", "both")


def build_views(
    ckpt: LazyCheckpoint,
    config: dict[str, Any],
    *,
    dtype: "str | torch.dtype | None" = None,
    lora: str = "both",
    lora_alpha: float | None = None,
    use_rslora: bool | None = None,
    base_model: "str | Path | None" = None,
    base_model_name: str | None = None,
) -> Views:
    """The transform stack from a source's tensors to what the output folder(s) hold.

    Plain checkpoints: tied alias dropped, floating tensors cast. PEFT checkpoints: the base
    names unwrapped, LoRA folded in (``lora`` fuse/both) and/or the adapter on its own
    (adapter/both; it keeps the training dtype unless ``dtype`` names one).
    """
    from .errors import LoraError
    from .lora import adapter_config, find_lora, resolve_settings
    from .transforms import Renamed
    from .transforms.lora import FusedLora, LoraAdapter

    if lora not in LORA_MODES:
        raise LoraError(f"unknown --lora mode {lora!r}; use fuse, adapter or both")
    notes: list[str] = []
    out_dtype = resolve_dtype(dtype, config)
    layout = find_lora(ckpt.specs())
    model: LazyCheckpoint | None = ckpt
    views = Views(model=None, out_dtype=out_dtype, notes=notes)
    if layout is not None:
        settings = resolve_settings(
            layout, ckpt.info.path, config, lora_alpha=lora_alpha, use_rslora=use_rslora, base_model_name=base_model_name
        )
        views.lora = {
            "mode": lora, "r": settings.r, "lora_alpha": settings.lora_alpha, "alpha_source": settings.alpha_source,
            "target_modules": layout.target_modules, "use_rslora": settings.use_rslora,
            "modules_to_save": layout.modules_to_save, "rank_pattern": settings.rank_pattern,
            "modules": len(layout.modules), "lora_only": layout.lora_only,
        }
        notes.append(
            f"LoRA: r={settings.r}, lora_alpha={settings.lora_alpha} (from {settings.alpha_source}), "
            f"{'rsLoRA, ' if settings.use_rslora else ''}targets {', '.join(layout.target_modules)}"
        )
        if layout.lora_only:
            if base_model is None:
                if lora != "adapter":
                    raise LoraError(
                        "this checkpoint holds only LoRA weights (save_lora_only); pass --base-model DIR with the "
                        "base model's Hugging Face folder to fuse them, or --lora adapter to write the adapter alone"
                    )
                base = None
            else:
                from .readers.hf_dir import open_hf_dir

                base = open_hf_dir(Path(base_model))
                notes.append(f"base weights from {base_model}")
        else:
            base = Renamed(ckpt, layout.base)
        if lora in ("adapter", "both"):
            adapter_dtype = None if dtype in (None, "config") else out_dtype
            views.adapter = Cast(LoraAdapter(ckpt, layout), adapter_dtype)
            views.adapter_config = adapter_config(layout, settings)
            views.base = base if layout.lora_only else Renamed(ckpt, layout.unfused_base)
        if lora in ("fuse", "both"):
            model = FusedLora(base, ckpt, layout, settings)
        else:
            model = None
    elif lora == "adapter":
        raise LoraError("--lora adapter was asked for, but the checkpoint has no LoRA weights (no lora_A/lora_B tensors)")
    if model is not None:
        model, dropped = drop_tied(model, tied_pairs(config))
        if dropped:
            notes.append(f"tied weights: wrote {', '.join(dropped)} once, under its source name (tie_word_embeddings)")
        views.model = Cast(model, out_dtype)
    return views


def model_view(
    ckpt: LazyCheckpoint, config: dict[str, Any], *, dtype: "str | torch.dtype | None" = None, **lora_options: Any
) -> tuple[LazyCheckpoint, torch.dtype | None, list[str]]:
    """The HF model as a lazy checkpoint (LoRA fused): ``(view, output dtype or None, notes)``."""
    views = build_views(ckpt, config, dtype=dtype, lora="fuse", **lora_options)
    return views.model, views.out_dtype, views.notes


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
    lora: str = "both",
    lora_alpha: float | None = None,
    use_rslora: bool | None = None,
    base_model: "str | Path | None" = None,
    base_model_name: str | None = None,
    verify: bool = False,
    checksums: bool = True,
    quantize: "str | dict[str, Any] | Any | None" = None,
    push_to_hub: str | None = None,
    private: bool | None = None,
    is_value_model: bool | None = None,
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
        lora: for PEFT checkpoints, ``fuse`` (the model with LoRA folded in), ``adapter`` (a PEFT
            adapter folder at ``target``) or ``both`` (fused model, adapter in ``target/lora_adapter``).
        lora_alpha / use_rslora: LoRA settings when the checkpoint does not record them.
        base_model: HF folder with the base weights, for ``save_lora_only`` checkpoints.
        base_model_name: ``base_model_name_or_path`` for adapter_config.json / the model card.
        verify: re-read the written model and compare it with the source, tensor by tensor, before
            the output is moved into place (a mismatch raises VerificationError; no target is left).
        checksums: record each output file's sha256 in hf_merge.json (``hf-merge verify`` checks them).
        quantize: ``"nf4"``, ``"fp4"``, ``"int8"`` or a :class:`~hf_merge.transforms.quantize.QuantizeOptions`:
            bitsandbytes weights, as transformers saves them (``pip install 'hf-merge[quantize]'``).
        push_to_hub / private: upload the finished folder to this Hub repo (see :func:`hf_merge.push`).
        is_value_model: the checkpoint is a critic: write its value head as ``score.weight`` of a
            ``*ForTokenClassification`` model (Megatron; detected from the head shape when None).
    """
    target = Path(target)
    check_target(target, overwrite=overwrite)
    if quantize is not None:  # quantize: options and bitsandbytes are checked before anything is read
        from .transforms.quantize import QuantizeOptions, Quantized, require_bitsandbytes

        quantize = QuantizeOptions.coerce(quantize)
        require_bitsandbytes()
    ckpt = open_checkpoint(source, backend=backend, config=config, is_value_model=is_value_model)
    try:
        config_dir, cfg = checkpoint_config(ckpt.info)
        views = build_views(
            ckpt, cfg, dtype=dtype, lora=lora, lora_alpha=lora_alpha, use_rslora=use_rslora,
            base_model=base_model, base_model_name=base_model_name,
        )
        qview = None
        if quantize is not None and views.model is not None:  # quantize: wraps the (LoRA-fused) model view
            views.model = qview = Quantized(views.model, cfg, quantize)
            views.notes.extend(qview.notes)
        for note in ckpt.info.notes + views.notes:
            logger.info(note)
        for warning in ckpt.info.warnings:
            logger.warning(warning)
        provenance = _provenance(ckpt, cfg, views, base_model_name)
        if qview is not None:  # quantize
            provenance["quantization"] = qview.provenance()
            cfg = qview.output_config(cfg)
        metadata = {"hf_merge_version": __version__, "source_format": ckpt.info.format}
        model_plan = adapter_plan = None
        if views.model is not None:
            model_plan = plan_shards(
                views.model.specs(), max_shard_size=max_shard_size, metadata=metadata,
                group=qview.group if qview is not None else None,  # quantize: a module's parts stay together
            )
        if views.adapter is not None:
            adapter_plan = plan_shards(
                # PEFT loads one adapter file: never shard it.
                views.adapter.specs(), max_shard_size=2**62, metadata=metadata, filename_pattern=ADAPTER_PATTERN
            )
        with atomic_folder(target, overwrite=overwrite) as tmp:
            if model_plan is not None:
                digests = write_shards(views.model, model_plan, tmp, workers=workers, desc="Merging", sha256=checksums)
                write_config(cfg, tmp, dtype=views.out_dtype)
                copy_side_files(config_dir, tmp)
                if checksums:
                    provenance["files"] = digests
                if verify:
                    _write_provenance(tmp, provenance)
                    report = verify_or_raise(
                        tmp, ckpt.info.path, backend=backend, config=config, lora_alpha=lora_alpha,
                        use_rslora=use_rslora, base_model=base_model,
                    )
                    provenance["verification"] = {"passed": True, "summary": report.summary(), "against": "source"}
                _write_provenance(tmp, provenance)
                write_card(tmp, provenance, kind="model", repo_id=push_to_hub)
            if adapter_plan is not None:
                adapter_dir = tmp if model_plan is None else tmp / ADAPTER_SUBDIR
                write_shards(views.adapter, adapter_plan, adapter_dir, workers=1, desc="Adapter")
                (adapter_dir / "adapter_config.json").write_text(json.dumps(views.adapter_config, indent=2, sort_keys=True) + "\n")
                if model_plan is None:
                    copy_side_files(config_dir, adapter_dir, skip=("generation_config.json",))
                    _write_provenance(adapter_dir, provenance)
                write_card(adapter_dir, provenance, kind="adapter", repo_id=push_to_hub if model_plan is None else None)
        main_plan = model_plan or adapter_plan
        return MergeResult(
            target=target,
            files=[f.name for f in main_plan.files],
            dtype=dtype_name(views.out_dtype) if views.out_dtype else None,
            num_tensors=sum(len(f.specs) for f in main_plan.files),
            total_bytes=main_plan.total_size,
            notes=ckpt.info.notes + views.notes + ckpt.info.warnings,
            provenance=provenance,
            url=push(target, push_to_hub, private=private) if push_to_hub else None,
        )
    finally:
        ckpt.close()


def _write_provenance(folder: Path, provenance: dict[str, Any]) -> None:
    (folder / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=2) + "\n")


def _framework(info: Any) -> str | None:
    """The training framework of the format that read the source (the registry says)."""
    from .formats import registry

    fmt = registry().get(info.reader or "")
    return fmt.framework if fmt is not None else None


def _provenance(ckpt: LazyCheckpoint, config: dict[str, Any], views: Views, base_model_name: str | None) -> dict[str, Any]:
    """The :class:`~hf_merge.provenance.Provenance` record, as the JSON object merge() completes."""
    from .provenance import Provenance, SourceRecord

    info = ckpt.info
    out_dtype = views.out_dtype
    source = SourceRecord(
        format=info.format,
        framework=_framework(info),
        path="/".join(Path(info.path).parts[-3:]),  # no local home paths in uploaded files
        world_size=info.world_size,
        step=info.step,
        details={k: v for k, v in info.details.items() if k in ("mesh", "mesh_dim_names", "fsdp_version", "placements")},
    )
    return Provenance(
        hf_merge_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        source=source,
        dtype=dtype_name(out_dtype) if out_dtype else "auto",
        architecture=(config.get("architectures") or [None])[0],
        base_model=base_model_name or config.get("_name_or_path") or None,
        lora=views.lora,
    ).to_dict()
