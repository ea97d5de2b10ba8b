"""``merge``: open -> transforms -> writer, into an atomic output folder."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .checkpoint import LazyCheckpoint, open_checkpoint
from .formats import registry, weights_label
from .hf_files import (
    checkpoint_config, copy_side_files, holds_side_files_only, missing_side_files, resolve_dtype, tied_pairs,
    write_config, written_dtype,
)
from .hub import push, write_card
from .output import PROVENANCE_FILE as PROVENANCE_NAME, atomic_folder, check_free_space, check_target
from .errors import HfMergeError, HubError
from .plan import parse_size, plan_shards
from .preload import preload
from .readers import record_crc
from .spec import dtype_name, parse_dtype
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
    quantization: str | None = None  # nf4 / fp4 / int8 when the weights are bitsandbytes-quantized
    adapter: dict[str, Any] | None = None  # LoRA "both": the adapter folder's path, tensors, bytes, dtype
    rank: int = 0  # a distributed merge's rank (rank 0 finishes the folder and reports)


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
    hub: bool = True,
) -> Views:
    """The transform stack from a source's tensors to what the output folder(s) hold.

    Plain checkpoints: tied alias dropped, the Hub layout (``hub``: what ``save_pretrained``
    writes, see :mod:`hf_merge.transforms.hub_layout`), floating tensors cast. PEFT checkpoints: the base
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
    from .skeleton import experts_transposed

    # the adapter's target_modules are settled on the model's meta skeleton (PEFT imports transformers anyway);
    # a fused merge of a dense model imports neither
    layout = find_lora(ckpt.specs(), experts_transposed=lambda module: experts_transposed(config, module),
                       config=config if lora in ("adapter", "both") else None)
    model: LazyCheckpoint | None = ckpt
    views = Views(model=None, out_dtype=out_dtype, notes=notes)
    if layout is not None:
        settings = resolve_settings(
            layout, ckpt.info.path, config, lora_alpha=lora_alpha, use_rslora=use_rslora, base_model_name=base_model_name
        )
        views.lora = {
            "mode": lora, "r": settings.r, "lora_alpha": settings.lora_alpha, "alpha_source": settings.alpha_source,
            "target_modules": layout.target_modules, "use_rslora": settings.use_rslora,
            "target_parameters": layout.target_parameters,
            "modules_to_save": layout.modules_to_save, "rank_pattern": settings.rank_pattern,
            "modules": len(layout.modules), "lora_only": layout.lora_only,
        }
        notes.append(
            f"LoRA: r={settings.r}, lora_alpha={settings.lora_alpha} (from {settings.alpha_source}), "
            f"{'rsLoRA, ' if settings.use_rslora else ''}targets {', '.join(layout.target_modules + layout.target_parameters)}"
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
        model, dropped = drop_tied(model, tied_pairs(config, model.specs()))
        if dropped:
            notes.append(f"tied weights: wrote {', '.join(dropped)} once, under its source name (tie_word_embeddings)")
        if hub:
            from .transforms.hub_layout import hub_layout

            model, hub_notes = hub_layout(model, config)
            notes.extend(hub_notes)
        views.model = Cast(model, out_dtype)
    return views


def model_view(
    ckpt: LazyCheckpoint, config: dict[str, Any], *, dtype: "str | torch.dtype | None" = None, **lora_options: Any
) -> tuple[LazyCheckpoint, torch.dtype | None, list[str]]:
    """The HF model in transformers' in-memory layout (LoRA fused), for loading into a model:
    ``(view, output dtype or None, notes)``."""
    views = build_views(ckpt, config, dtype=dtype, lora="fuse", hub=False, **lora_options)
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
    source_options: dict[str, Any] | None = None,
    gguf: str | None = None,
    gguf_pre_tokenizer: str | None = None,
    distributed: bool | None = None,
    dist_writers: str = "node",
    head_start: Any = None,
    source_crc: bool = True,
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
            bitsandbytes weights, as transformers saves them (needs ``pip install bitsandbytes``).
        push_to_hub / private: upload the finished folder to this Hub repo (see :func:`hf_merge.push`).
        is_value_model: the checkpoint is a critic: write its value head as ``score.weight`` of a
            ``*ForTokenClassification`` model (Megatron; detected from the head shape when None).
        source_options: format-specific reader options, e.g. ``{"tag": "global_step100",
            "source_weights": "module"}`` for DeepSpeed (each format takes the ones it declares).
        gguf / gguf_pre_tokenizer: write one GGUF file (``"f32"``, ``"bf16"``, ``"q8_0"``, ...) for
            llama.cpp instead of safetensors, LoRA fused (see :mod:`hf_merge.gguf`). In a distributed
            job rank 0 writes it alone; the other ranks wait and return its result.
        distributed: this process is one rank of a merge shared by every rank of a torch.distributed
            job (see :mod:`hf_merge.distributed`). None: yes when launched by torchrun (``RANK``,
            ``WORLD_SIZE`` > 1, ``MASTER_ADDR``/``PORT`` set) and no process group exists yet; a
            program that already runs torch.distributed passes True on every rank (False, or None,
            when only one rank merges).
        dist_writers: in a distributed merge, which ranks write the files: ``"node"`` (default: the
            first rank of each node, with forked writers on all its CPUs) or ``"rank"`` (every rank
            writes a share; for file systems where more writing processes help).
        head_start: internal, from the CLI: a :class:`~hf_merge.head_start.HeadStart` whose first
            file is taken when it is byte for byte the one planned here (else it is stopped).
        source_crc: check the CRC-32 of every zip record of the source that is read (rank files,
            ``.distcp``, DeepSpeed and legacy Megatron ``.pt``); a damaged record raises
            :class:`~hf_merge.readers.record_crc.SourceCrcError`. ``False`` skips the check
            (``--no-source-crc``). See docs/integrity.md.
    """
    if not source_crc:
        with record_crc.skipping():
            return merge(**{**locals(), "source_crc": True})
    arguments = dict(locals())  # for the single-process merge rank 0 runs when every rank is on one node
    if gguf is not None:  # gguf: a llama.cpp file instead of safetensors
        from .gguf.convert import merge_gguf

        if quantize is not None or verify:
            raise HfMergeError("--gguf writes its own quantized types; it does not combine with --quantize or --verify")

        def write_gguf() -> MergeResult:
            return merge_gguf(
                source, target, gguf, backend=backend, dtype=dtype, config=config, overwrite=overwrite, lora=lora,
                lora_alpha=lora_alpha, use_rslora=use_rslora, base_model=base_model, base_model_name=base_model_name,
                pre_tokenizer=gguf_pre_tokenizer, push_to_hub=push_to_hub, private=private, is_value_model=is_value_model,
                source_options=source_options,
            )

        from .distributed import join_job

        job = join_job(distributed)  # under torchrun: one GGUF stream, written by rank 0 while the others wait
        if job is None:
            return write_gguf()
        with job:
            return job.one_writer(write_gguf)
    target = Path(target)
    try:
        max_shard_size = parse_size(max_shard_size)
    except ValueError as e:
        raise HfMergeError(f"--max-shard-size: {e}") from None
    # verl scripts merge into actor/huggingface, which holds config and tokenizer only: fill it in place.
    into_side_files = not overwrite and holds_side_files_only(target)
    replace = overwrite or into_side_files
    check_target(target, overwrite=replace)

    def prepare() -> Prepared:
        return _prepare(
            source, target, backend=backend, dtype=dtype, max_shard_size=max_shard_size, config=config, lora=lora,
            lora_alpha=lora_alpha, use_rslora=use_rslora, base_model=base_model, base_model_name=base_model_name,
            quantize=quantize, is_value_model=is_value_model, source_options=source_options,
            into_side_files=into_side_files,
        )

    def finish(prepared: Prepared, tmp: Path, digests: "dict[str, str | None] | None") -> None:
        _finish(
            prepared, tmp, digests, verify=verify, backend=backend, config=config, lora_alpha=lora_alpha,
            use_rslora=use_rslora, base_model=base_model, push_to_hub=push_to_hub, source_options=source_options,
        )

    from .distributed import join_job

    job = join_job(distributed)  # under torchrun: this process is one rank of a distributed merge
    if job is not None:
        with job:
            if dist_writers == "node" and job.on_one_node():  # start-up paid once: the others read nothing
                return job.alone(lambda: merge(**{**arguments, "distributed": False}))
            return job.merge(
                prepare, target, overwrite=replace, workers=workers, checksums=checksums,
                finish=finish, writers=dist_writers,
                result=lambda prepared, main: _result(prepared, target, push_to_hub if main else None, private),
            )
    # The target is locked (and its temporary folder made) before the source is read, so a second
    # run on the same target is refused at once rather than after this one's reading.
    with atomic_folder(target, overwrite=replace) as tmp:
        prepared = prepare()
        card_imports = preload()  # the card's imports, while the weights are written
        try:
            digests = None
            if prepared.model_plan is not None:
                digests = _write_model(prepared, tmp, head_start, workers=workers, sha256=checksums)
            card_imports.join()
            finish(prepared, tmp, digests)
        finally:
            prepared.ckpt.close()
    return _result(prepared, target, push_to_hub, private)


def _write_model(p: "Prepared", tmp: Path, head: Any, *, workers, sha256: bool) -> dict[str, str | None]:
    """The model's weight files (and index) in ``tmp``; the first one from the CLI's head start
    when that child wrote exactly this file (:mod:`hf_merge.head_start`)."""
    plan, view = p.model_plan, p.views.model
    if head is not None:
        from .sequential import byte_recipe

        first = plan.files[0]

        def recipe():
            # the child checks the CRC-32 of every record it copies (a child that fails is not
            # trusted: the file is then written here, and checked here)
            with record_crc.deferred(check_at_end=False):
                return byte_recipe(view, first)

        if head.adopt(first.name, first.header, recipe, tmp):
            from .progress import progress_bar
            from .writer import write_index

            lock = threading.Lock()
            with progress_bar(total=plan.total_size, unit="B", desc="Merging") as bar:
                def update(n: int) -> None:
                    with lock:
                        bar.update(n)

                head.report_to(update)
                rest = plan.files[1:]
                digests = {}
                if rest:  # the child is one of the writers: the others share the rest of the CPUs
                    from .writer import default_workers

                    n = workers or max(1, default_workers(len(plan.files)) - 1)
                    digests = write_shards(view, plan, tmp, workers=n, sha256=sha256, files=rest, progress=update,
                                           processes_here=2)  # the child writes too
                taken, digest = head.finish()
                if not taken:  # the child failed: its file is gone, written here instead
                    shown = head.reported  # already on the bar: counted once

                    def catch_up(n: int) -> None:
                        nonlocal shown
                        skip = min(shown, n)
                        shown -= skip
                        if n > skip:
                            update(n - skip)

                    digests.update(write_shards(view, plan, tmp, workers=1, sha256=sha256, files=[first], progress=catch_up))
                else:
                    digests[first.name] = digest
            write_index(plan, tmp)
            return {f.name: digests[f.name] for f in plan.files}
    return write_shards(view, plan, tmp, workers=workers, desc="Merging", sha256=sha256)


@dataclass
class Prepared:
    """Everything a merge decides before writing a byte: the same on every rank of a distributed merge."""

    ckpt: LazyCheckpoint
    config_dir: Path | None
    config: dict[str, Any]
    views: Views
    provenance: dict[str, Any]
    model_plan: Any  # ShardPlan | None
    adapter_plan: Any  # ShardPlan | None
    written: "torch.dtype | None"  # the dtype config.json names (that of the written floating weights)
    warnings: list[str]
    quantization: str | None  # nf4 / fp4 / int8
    into_side_files: bool  # the target held config/tokenizer files only: they are kept
    target: Path


def _prepare(source, target: Path, *, backend, dtype, max_shard_size, config, lora, lora_alpha, use_rslora, base_model,
             base_model_name, quantize, is_value_model, source_options, into_side_files) -> Prepared:
    """Open the source, build the views and plan every output file (specs only, nothing read)."""
    if quantize is not None:  # quantize: options and bitsandbytes are checked before anything is read
        from .transforms.quantize import QuantizeOptions, Quantized, require_bitsandbytes

        quantize = QuantizeOptions.coerce(quantize)
        require_bitsandbytes()
    ckpt = open_checkpoint(source, backend=backend, config=config, is_value_model=is_value_model, **(source_options or {}))
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
        warnings = list(ckpt.info.warnings)  # logged now; the output's own warnings once it is written
        if into_side_files:
            views.notes.append(f"{target} holds config/tokenizer files only: merging into it, its files kept")
        if is_value_model and "is_value_model" not in getattr(registry().get(ckpt.info.format), "options", ()):
            views.notes.append("--is-value-model changes nothing here: FSDP critics are saved under their HF names already")
        written = None
        if views.model is not None:
            written, counts = written_dtype(views.model.specs(), skip=qview.group if qview is not None else None)
            views.notes += _dtype_notes(ckpt, written, counts, requested=dtype)
        provenance = _provenance(ckpt, cfg, views, base_model_name, written, requested=dtype)
        if provenance["base_model"] is None:
            views.notes.append(
                "base model unknown (config.json has no _name_or_path): pass --base-model-name ORG/NAME to set "
                "base_model in the model card" + (" and adapter_config.json" if views.adapter is not None else "")
            )
        for note in ckpt.info.notes + views.notes:
            logger.info(note)
        for warning in warnings:
            logger.warning(warning)
        if qview is not None:  # quantize
            provenance["quantization"] = qview.provenance()
            cfg = qview.output_config(cfg)
        metadata = {"hf_merge_version": __version__, "source_format": weights_label(ckpt.info.format)}
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
        check_free_space(target, sum(f.file_size for plan in (model_plan, adapter_plan) if plan for f in plan.files))
    except BaseException:
        ckpt.close()
        raise
    return Prepared(
        ckpt, config_dir, cfg, views, provenance, model_plan, adapter_plan, written, warnings,
        quantize.mode if qview is not None else None, into_side_files, target,
    )


def _finish(p: Prepared, tmp: Path, digests: "dict[str, str | None] | None", *, verify, backend, config, lora_alpha,
            use_rslora, base_model, push_to_hub, source_options) -> None:
    """Everything but the model's weight files: index, config, side files, provenance, card, adapter."""
    views, provenance = p.views, p.provenance
    if p.into_side_files:
        copy_side_files(p.target, tmp)  # the target's own files, refreshed below from the config folder
    if p.model_plan is not None:
        write_config(p.config, tmp, dtype=p.written)
        copy_side_files(p.config_dir, tmp)
        missing = missing_side_files(p.config, sorted(f.name for f in tmp.iterdir()))
        if missing:
            provenance["missing_files"] = missing
            p.warnings.append(_missing_message(missing, p.config_dir))
            logger.warning(p.warnings[-1])
        if digests is not None and any(v is not None for v in digests.values()):
            provenance["files"] = digests
    adapter_dir = None
    if p.adapter_plan is not None:
        adapter_dir = tmp if p.model_plan is None else tmp / ADAPTER_SUBDIR
        write_shards(views.adapter, p.adapter_plan, adapter_dir, workers=1, desc="Adapter")
        (adapter_dir / "adapter_config.json").write_text(json.dumps(views.adapter_config, indent=2, sort_keys=True) + "\n")
        if p.model_plan is None:
            copy_side_files(p.config_dir, adapter_dir, skip=("generation_config.json",))
    if verify:  # the model and/or the adapter, before the folder is moved into place
        _write_provenance(tmp, provenance)
        report = verify_or_raise(
            tmp, p.ckpt.info.path, backend=backend, config=config, lora_alpha=lora_alpha,
            use_rslora=use_rslora, base_model=base_model, source_options=source_options, distributed=False,
        )
        provenance["verification"] = {"passed": True, "summary": report.summary(), "against": "source"}
    _write_provenance(tmp, provenance)
    if p.model_plan is not None:
        write_card(tmp, provenance, kind="model", repo_id=push_to_hub)
    if adapter_dir is not None:
        write_card(adapter_dir, provenance, kind="adapter", repo_id=push_to_hub if p.model_plan is None else None)


def _result(p: Prepared, target: Path, push_to_hub: str | None, private: bool | None) -> MergeResult:
    main_plan = p.model_plan or p.adapter_plan
    adapter = None
    if p.adapter_plan is not None and p.model_plan is not None:
        adapter = {
            "path": target / ADAPTER_SUBDIR, "tensors": sum(len(f.specs) for f in p.adapter_plan.files),
            "bytes": p.adapter_plan.total_size, "dtype": p.provenance["lora"]["adapter_dtype"],
        }
    result = MergeResult(
        target=target,
        files=[f.name for f in main_plan.files],
        dtype=p.provenance["dtype"],
        num_tensors=sum(len(f.specs) for f in main_plan.files),
        total_bytes=main_plan.total_size,
        notes=p.ckpt.info.notes + p.views.notes + p.warnings,
        provenance=p.provenance,
        quantization=p.quantization,
        adapter=adapter,
    )
    if push_to_hub:
        try:
            result.url = push(target, push_to_hub, private=private)
        except HfMergeError as e:
            raise HubError(
                f"{e} -- the merged folder {target} was written; retry the upload with: hf-merge push {target} {push_to_hub}"
            ) from e
    return result


def _write_provenance(folder: Path, provenance: dict[str, Any]) -> None:
    (folder / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=2) + "\n")


def _framework(info: Any) -> str | None:
    """The training framework of the format that read the source (the registry says)."""
    fmt = registry().get(info.reader or "")
    return fmt.framework if fmt is not None else None


def _dtype_notes(ckpt: LazyCheckpoint, written, counts, *, requested) -> list[str]:
    """Say what config.json's dtype is when the weights are mixed, and when the config's dtype
    rounds the trained weights (a float32 output is pointed out by the summary line and the card)."""
    notes = []
    if written is None:
        return notes
    if len(counts) > 1:
        total = sum(counts.values())
        others = ", ".join(f"{dtype_name(d)} {100 * n / total:.1f}%" for d, n in counts.items() if d != written)
        notes.append(f"the weights have mixed dtypes: config.json says {dtype_name(written)}, the majority (others: {others})")
    trained, _ = written_dtype(ckpt.specs())
    if trained is not None and written.itemsize < trained.itemsize and requested in (None, "config"):
        notes.append(
            f"the checkpoint holds {dtype_name(trained)} weights and its config.json says {dtype_name(written)}: "
            f"writing {dtype_name(written)} (one rounding per weight); --dtype auto keeps them exact"
        )
    return notes


def _dtype_option(requested: "str | torch.dtype | None") -> str:
    if requested is None or requested == "config":
        return "config"
    return "auto" if requested == "auto" else dtype_name(parse_dtype(requested))


def _missing_message(missing: list[str], config_dir: Path) -> str:
    what = " and ".join("no tokenizer" if m == "tokenizer" else f"no {m}" for m in missing)
    return (
        f"{config_dir} has {what}, so the output has none either (AutoTokenizer would not give the model's "
        "tokenizer); pass --config DIR with the base model's config and tokenizer files"
    )


def _provenance(
    ckpt: LazyCheckpoint, config: dict[str, Any], views: Views, base_model_name: str | None, written: torch.dtype | None,
    *, requested: "str | torch.dtype | None" = None,
) -> dict[str, Any]:
    """The :class:`~hf_merge.provenance.Provenance` record, as the JSON object merge() completes."""
    from .provenance import Provenance, SourceRecord

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
        dtype=shown,
        dtype_option=_dtype_option(requested),
        architecture=(config.get("architectures") or [None])[0],
        base_model=base_model_name or config.get("_name_or_path") or None,
        lora=lora,
    ).to_dict()
