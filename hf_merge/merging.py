"""``merge``: open -> views -> an output (:mod:`hf_merge.pipeline`) -> an executor, into an atomic folder.

This module holds the API entry (:func:`merge`, :func:`run`) and the safetensors outputs: the
Hugging Face model folder (:class:`HfFolder`) and the PEFT adapter folder (:class:`PeftAdapter`).
The GGUF output is :class:`hf_merge.gguf.convert.GgufFile`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .checkpoint import LazyCheckpoint, open_checkpoint
from .config_fit import check_config_fits
from .hf_files import (
    GENERATION_CONFIG, checkpoint_config, config_text, copy_side_files, derive_generation_config,
    generation_config_warm_up, missing_side_files, without_stale_quantization, write_config, written_dtype,
)
from .side_files import side_files_bytes
from .publish.card import write_card
from .errors import for_python
from .options import MergeOptions
from .write import digest
from .write.atomic import PROVENANCE_FILE, check_apart, check_free_space, check_target, holds_side_files_only
from .pipeline import MergeResult, Writing, pushed, run_in_process, run_staged
from .write.plan import ShardPlan, plan_shards
from .write.save_order import plan_like_save_pretrained
from .provenance import merge_record, write_record
from .readers import record_crc
from .spec import dtype_name
from .transformers_compat import rope_unread
from .transforms.views import ADAPTER_SUBDIR, build_views
from .write.shards import write_index, write_shards

__all__ = ["ADAPTER_SUBDIR", "HfFolder", "MergeOptions", "MergeResult", "PeftAdapter", "merge", "run"]

logger = logging.getLogger(__name__)

ADAPTER_PATTERN = "adapter_model{suffix}.safetensors"


@for_python
def merge(source: "str | Path", target: "str | Path", *, head_start: Any = None, **options: Any) -> MergeResult:
    """Merge a sharded training checkpoint into a Hugging Face model folder.

    The keyword arguments are the fields of :class:`~hf_merge.options.MergeOptions` (an unknown one
    is a ``TypeError``).

    Args:
        source: checkpoint folder (see :func:`hf_merge.open_checkpoint`).
        target: output folder; written atomically (temporary folder beside it, renamed at the end).
        dtype: ``None`` (the config's dtype), ``"auto"`` (keep the shards' dtype) or a dtype.
        max_shard_size: largest output file, e.g. ``"5GB"``; default (None): the installed
            transformers' ``save_pretrained`` default (``"50GB"`` in 5.x, ``"5GB"`` in 4.57), so the
            files are cut, and the tensors ordered into them, as ``save_pretrained`` of the trained
            model would (see docs/sharding.md).
        workers: processes writing output files in parallel (default: one per file, up to the CPUs).
        config: folder with config.json / tokenizer, when the checkpoint has no ``huggingface/``.
        overwrite: replace a non-empty ``target``.
        lora: for PEFT checkpoints, ``fuse`` (the model with LoRA folded in), ``adapter`` (a PEFT
            adapter folder at ``target``) or ``both`` (fused model, adapter in ``target/lora_adapter``).
        lora_alpha / use_rslora: LoRA settings when the checkpoint does not record them.
        base_model: HF folder with the base weights, for ``save_lora_only`` checkpoints (and the config
            when the checkpoint has none).
        base_model_name: ``base_model_name_or_path`` for adapter_config.json / the model card.
        verify: re-read the written model and compare it with the source, tensor by tensor, before
            the output is moved into place (a mismatch raises VerificationError; no target is left).
        checksums: record a checksum of each output file in hf_merge.json (``hf-merge verify`` checks
            them): True (a CRC-32; a sha256 with ``push_to_hub``), ``"crc32"``, ``"sha256"`` or False.
        quantize: ``"nf4"``, ``"fp4"``, ``"int8"`` or a :class:`~hf_merge.transforms.quantize.QuantizeOptions`:
            bitsandbytes weights, as transformers saves them (needs ``pip install bitsandbytes``).
        push_to_hub / private: upload the finished folder to this Hub repo (see :func:`hf_merge.push`).
        is_value_model: the checkpoint is a critic: write its value head as ``score.weight`` of a
            ``*ForTokenClassification`` model (Megatron; detected from the head shape when None).
        source_options: format-specific reader options, e.g. ``{"tag": "global_step100",
            "source_weights": "module"}`` for DeepSpeed (each format takes the ones it declares).
        gguf / gguf_pre_tokenizer: write one GGUF file (``"f32"``, ``"bf16"``, ``"q8_0"``, ...) for
            llama.cpp instead of safetensors, LoRA fused (see :mod:`hf_merge.gguf`); its checksum is
            recorded like a safetensors file's. In a distributed job one writing rank writes it.
        distributed: this process is one rank of a merge shared by every rank of a torch.distributed
            job (see :mod:`hf_merge.write.distributed`). None: yes when launched by torchrun (``RANK``,
            ``WORLD_SIZE`` > 1, ``MASTER_ADDR``/``PORT`` set) and no process group exists yet; a
            program that already runs torch.distributed passes True on every rank (False, or None,
            when only one rank merges).
        dist_writers: in a distributed merge, which ranks write the files: ``"node"`` (default: the
            first rank of each node, with forked writers on all its CPUs) or ``"rank"`` (every rank
            writes a share; for file systems where more writing processes help).
        head_start: internal, from the CLI: a :class:`~hf_merge.write.head_start.HeadStart` whose first
            file is taken when it is byte for byte the one planned here (else it is stopped).
        source_crc: check the CRC-32 of every zip record of the source that is read (rank files,
            ``.distcp``, DeepSpeed and legacy Megatron ``.pt``); a damaged record raises
            :class:`~hf_merge.readers.record_crc.SourceCrcError`. ``False`` skips the check
            (``--no-source-crc``). See docs/integrity.md.
    """
    return run(source, target, MergeOptions(**options), head=head_start)


def run(source: "str | Path", target: "str | Path", options: MergeOptions, *, head: Any = None) -> MergeResult:
    """The merge ``options`` ask for, by the executor this process is in: the ranks of a torchrun job
    (:meth:`hf_merge.write.distributed.Job.merge`) or this process (:func:`hf_merge.pipeline.run_staged`)."""
    if not options.source_crc:
        with record_crc.skipping():
            return run(source, target, dataclasses.replace(options, source_crc=True), head=head)
    target = Path(target)
    if options.gguf is not None:  # gguf: a llama.cpp file instead of safetensors
        from .gguf.convert import GgufFile as kind
    else:
        kind = HfFolder
    check_apart(source, target)
    overwrite = kind.check(target, options)  # before anything is read

    def prepare():
        return kind.prepare(source, target, options, overwrite=overwrite)

    def result(output, main: bool) -> MergeResult:
        return pushed(output.result(target), options.push_to_hub if main else None, options.private)

    from .write.distributed import join_job

    job = join_job(options.distributed)  # under torchrun: this process is one rank of a distributed merge
    if job is not None:
        with job:
            if options.dist_writers == "node" and job.on_one_node():  # start-up paid once: the others read nothing
                return job.alone(lambda: run(source, target, dataclasses.replace(options, distributed=False), head=head))
            return job.merge(prepare, target, options, overwrite=overwrite, result=result)
    return result(run_staged(prepare, target, options, overwrite=overwrite, head=head), True)


def _write_model(p: "HfFolder", tmp: Path, head: Any, *, workers, checksum: str | None) -> dict[str, str | None]:
    """The model's weight files (and index) in ``tmp``; the first one from the CLI's head start
    when that child wrote exactly this file (:mod:`hf_merge.write.head_start`)."""
    plan, view = p.model_plan, p.views.model
    if head is not None:
        from .write.engine import byte_recipe

        first = plan.files[0]

        def recipe():
            # the child checks the CRC-32 of every record it copies (a child that fails is not
            # trusted: the file is then written here, and checked here)
            with record_crc.deferred(check_at_end=False):
                return byte_recipe(view, first)

        if head.adopt(first.name, first.header, recipe, tmp):
            from .progress import progress_bar
            from .write.shards import write_index

            lock = threading.Lock()
            with progress_bar(total=plan.total_size, unit="B", desc="Merging") as bar:
                def update(n: int) -> None:
                    with lock:
                        bar.update(n)

                head.report_to(update)
                rest = plan.files[1:]
                digests = {}
                if rest:  # the child is one of the writers: the others share the rest of the CPUs
                    from .write.shards import default_workers

                    n = workers or max(1, default_workers(len(plan.files)) - 1)
                    digests = write_shards(view, plan, tmp, workers=n, checksum=checksum, files=rest, progress=update,
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

                    digests.update(write_shards(view, plan, tmp, workers=1, checksum=checksum, files=[first], progress=catch_up))
                else:
                    digests[first.name] = digest
            write_index(plan, tmp)
            return {f.name: digests[f.name] for f in plan.files}
    return write_shards(view, plan, tmp, workers=workers, desc="Merging", checksum=checksum)


class PeftAdapter:
    """Output: a PEFT adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``), one
    file never sharded (PEFT loads one). Alone (``--lora adapter``) it gets the tokenizer files too;
    nested in a model folder (``--lora both``) it is written in that folder's finish."""

    def __init__(self, view: LazyCheckpoint, adapter_config: dict[str, Any]):
        self.view, self.adapter_config = view, adapter_config
        # PEFT loads one adapter file: never shard it.
        self.file_plan: ShardPlan = plan_shards(view.specs(), max_shard_size=2**62,
                                                filename_pattern=ADAPTER_PATTERN)
        self.side_files: Path | None = None  # the config folder whose tokenizer files it gets (alone)

    def plan(self) -> list:
        return self.file_plan.files

    def write(self, folder: Path, units: Sequence[Any], how: Writing) -> dict[str, str | None]:
        return write_shards(self.view, self.file_plan, folder, workers=1, desc="Adapter", checksum=how.checksum,
                            files=list(units), progress=how.progress)

    def finish(self, folder: Path, digests: dict[str, str | None]) -> None:
        (folder / "adapter_config.json").write_text(json.dumps(self.adapter_config, indent=2, sort_keys=True) + "\n")
        if self.side_files is not None:
            copy_side_files(self.side_files, folder, skip=("generation_config.json",))


@dataclass
class HfFolder:
    """Output: a Hugging Face model folder (weights, index, config, side files, provenance, card) and/or
    the PEFT adapter (:class:`PeftAdapter`: the folder itself for ``--lora adapter``, ``lora_adapter/``
    for ``both``). Everything is decided before a byte is written, the same on every rank."""

    ckpt: LazyCheckpoint
    config_dir: Path | None
    config: dict[str, Any]
    views: Any  # hf_merge.transforms.views.Views
    provenance: dict[str, Any]
    model_plan: ShardPlan | None
    adapter: PeftAdapter | None
    written: "torch.dtype | None"  # the dtype config.json names (that of the written floating weights)
    warnings: list[str]
    quantization: str | None  # nf4 / fp4 / int8
    into_side_files: bool  # the target held config/tokenizer files only: they are kept
    target: Path
    options: MergeOptions

    @property
    def notes(self) -> list[str]:
        return self.views.notes

    @staticmethod
    def check(target: Path, options: MergeOptions) -> bool:
        """Refuse what can be refused before reading; the ``overwrite`` the target is staged with
        (verl scripts merge into actor/huggingface, which holds config and tokenizer only: filled in place)."""
        options.shard_bytes()
        if options.quantize is not None and options.lora == "adapter":
            from .errors import QuantizationError

            raise QuantizationError("--quantize does not apply to --lora adapter: a PEFT adapter is written unquantized; "
                                    "drop --quantize, or use --lora both to write a quantized fused model beside it")
        replace = options.overwrite or holds_side_files_only(target)
        check_target(target, overwrite=replace)
        return replace

    @classmethod
    def prepare(cls, source: "str | Path", target: Path, options: MergeOptions, *, overwrite: bool) -> "HfFolder":
        return _prepare(source, target, options, into_side_files=overwrite and not options.overwrite)

    def warm_up(self) -> "Callable[[], None] | None":
        """What :meth:`finish` will import, to run while the weights are written
        (:func:`hf_merge.publish.preload.preload`): transformers' config code when a
        ``generation_config.json`` must be derived and the plan cache does not hold it."""
        if self.model_plan is None:
            return None
        names = [p.name for p in self.config_dir.iterdir()] + ([p.name for p in self.target.iterdir()]
                                                               if self.into_side_files else [])
        if GENERATION_CONFIG not in missing_side_files(self.config, names):
            return None
        return generation_config_warm_up(self.config, config_text(self.config, self.written))

    # -- the Output protocol --------------------------------------------------------------------
    def plan(self) -> list:
        return self.model_plan.files if self.model_plan is not None else self.adapter.plan()

    def write(self, folder: Path, units: Sequence[Any], how: Writing) -> dict[str, str | None]:
        if self.model_plan is None:  # an adapter folder alone
            return self.adapter.write(folder, units, how)
        if how.progress is None and len(units) == len(self.model_plan.files):  # all of them, in this process
            return _write_model(self, folder, how.head, workers=how.workers, checksum=how.checksum)
        return write_shards(self.views.model, self.model_plan, folder, workers=how.workers, checksum=how.checksum,
                            files=list(units), progress=how.progress, processes_here=how.processes_here)

    def finish(self, tmp: Path, digests: dict[str, str | None]) -> None:
        """Everything but the weight files: index, config, side files, adapter, provenance, card."""
        options, provenance = self.options, self.provenance
        if self.into_side_files:
            copy_side_files(self.target, tmp)  # the target's own files, refreshed below from the config folder
        adapter_dir = None
        if self.model_plan is not None:
            write_index(self.model_plan, tmp)
            write_config(self.config, tmp, dtype=self.written)
            copy_side_files(self.config_dir, tmp)
            missing = missing_side_files(self.config, sorted(f.name for f in tmp.iterdir()))
            if GENERATION_CONFIG in missing and derive_generation_config(self.config, tmp):
                missing.remove(GENERATION_CONFIG)
                provenance["derived_files"] = [GENERATION_CONFIG]
                self.warnings.append(_derived_message(self.config_dir))
                logger.warning(self.warnings[-1])
            if missing:
                provenance["missing_files"] = missing
                self.warnings.append(_missing_message(missing, self.config_dir))
                logger.warning(self.warnings[-1])
            if self.adapter is not None:
                adapter_dir = tmp / ADAPTER_SUBDIR
                run_in_process(self.adapter, adapter_dir)
        else:
            adapter_dir = tmp
            self.adapter.finish(tmp, digests)
        if any(v is not None for v in digests.values()):
            provenance["files"] = {**digests, **_other_digests(tmp, digests)}
        if options.verify:  # the model and/or the adapter, before the folder is moved into place
            from .verification import verify_or_raise

            write_record(tmp, provenance)
            report = verify_or_raise(
                tmp, self.ckpt.info.path, backend=options.backend, config=options.config, lora_alpha=options.lora_alpha,
                use_rslora=options.use_rslora, base_model=options.base_model, source_options=options.source_options,
                distributed=False, shown_as=self.target, next_step=_verify_step(self.target, self.ckpt.info.path, options),
            )
            provenance["verification"] = {"passed": True, "summary": report.summary(), "against": "source"}
        write_record(tmp, provenance)
        if self.model_plan is not None:
            write_card(tmp, provenance, kind="model", repo_id=options.push_to_hub)
        if adapter_dir is not None:
            write_card(adapter_dir, provenance, kind="adapter", repo_id=options.push_to_hub if self.model_plan is None else None)

    # -- after the executor -------------------------------------------------------------------
    def close(self) -> None:
        self.ckpt.close()

    def result(self, target: Path) -> MergeResult:
        main_plan = self.model_plan or self.adapter.file_plan
        adapter = None
        if self.adapter is not None and self.model_plan is not None:
            plan = self.adapter.file_plan
            adapter = {
                "path": target / ADAPTER_SUBDIR, "tensors": sum(len(f.specs) for f in plan.files),
                "bytes": plan.total_size, "dtype": self.provenance["lora"]["adapter_dtype"],
            }
        return MergeResult(
            target=target,
            files=[f.name for f in main_plan.files],
            dtype=self.provenance["dtype"],
            num_tensors=sum(len(f.specs) for f in main_plan.files),
            total_bytes=main_plan.total_size,
            notes=self.ckpt.info.notes + self.views.notes + self.warnings,
            provenance=self.provenance,
            quantization=self.quantization,
            adapter=adapter,
        )


def _prepare(source, target: Path, options: MergeOptions, *, into_side_files: bool) -> HfFolder:
    """Open the source, build the views and plan every output file (specs only, nothing read)."""
    quantize, dtype = options.quantize, options.dtype
    if quantize is not None:  # quantize: options and bitsandbytes are checked before anything is read
        from .transforms.quantize import QuantizeOptions, Quantized, require_bitsandbytes

        quantize = QuantizeOptions.coerce(quantize)
        require_bitsandbytes()
    ckpt = open_checkpoint(source, **options.open_kwargs())
    try:
        config_dir, cfg = checkpoint_config(ckpt.info)
        views = build_views(ckpt, cfg, dtype=dtype, lora=options.lora, **options.lora_kwargs())
        if views.model is not None:  # a --config of another model: refused before anything is written
            check_config_fits({n: s.shape for n, s in views.model.specs().items()}, cfg, config_dir)
            cfg, dropped = without_stale_quantization(cfg, views.model.specs())
            views.notes += [dropped] if dropped else []
        qview = None
        if quantize is not None and views.model is not None:  # quantize: wraps the (LoRA-fused) model view
            views.model = qview = Quantized(views.model, cfg, quantize)
            views.notes.extend(qview.notes)
        warnings = list(ckpt.info.warnings)  # logged now; the output's own warnings once it is written
        rope = rope_unread(cfg)  # transformers 4.x reading a transformers 5 config.json
        if rope is not None:
            warnings.append(f"{rope}; the output is what transformers 5's save_pretrained writes: load it with "
                            "transformers>=5")
        if into_side_files:
            views.notes.append(f"{target} holds config/tokenizer files only: merging into it, its files kept")
        written = None
        if views.model is not None:
            written, counts = written_dtype(views.model.specs(), skip=qview.group if qview is not None else None)
            views.notes += _dtype_notes(ckpt, written, counts, requested=dtype)
        provenance = merge_record(ckpt, cfg, views, options.base_model_name, written, requested=dtype,
                                  source_options=options.source_options)
        if provenance["base_model"] is None:
            views.notes.append(
                "base model unknown (config.json has no _name_or_path): pass --base-model-name ORG/NAME to set "
                "base_model in the model card" + (" and adapter_config.json" if views.adapter is not None else "")
            )
        for note in ckpt.info.notes + views.notes:
            logger.info(note)
        for warning in warnings:
            logger.warning(warning)
        model_cfg = cfg  # the model's own config (the skeleton the shard order and counts come from)
        if qview is not None:  # quantize
            provenance["quantization"] = qview.provenance()
            cfg = qview.output_config(cfg)
        model_plan = adapter = None
        if views.model is not None:  # quantize: a module's parts stay together
            model_plan = plan_like_save_pretrained(views.model, model_cfg, max_shard_size=options.shard_bytes(),
                                                   quantized=qview)
        if views.adapter is not None:
            adapter = PeftAdapter(views.adapter, views.adapter_config)
            if model_plan is None:
                adapter.side_files = config_dir
        planned = [f for f in (model_plan.files if model_plan else []) + (adapter.plan() if adapter else [])]
        side = [config_dir] + ([target] if into_side_files else [])  # the target's own side files are kept
        weight_map = model_plan.index["weight_map"] if model_plan is not None and model_plan.index else None
        check_free_space(target, sum(f.file_size for f in planned), side_files_bytes(side, weight_map))
    except BaseException:
        ckpt.close()
        raise
    return HfFolder(
        ckpt, config_dir, cfg, views, provenance, model_plan, adapter, written, warnings,
        quantize.mode if qview is not None else None, into_side_files, target, options,
    )


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


#: What a user of the output loses without each missing side file (:func:`missing_side_files`).
_LOST = {
    "tokenizer": ("no tokenizer", "AutoTokenizer would not give the model's tokenizer", "tokenizer files"),
    GENERATION_CONFIG: (f"no {GENERATION_CONFIG}", "generate() would fall back to config.json's defaults, losing the "
                        "base model's eos tokens and sampling settings", GENERATION_CONFIG),
}


#: files a merge writes whose checksum it does not record: the record itself, and the model cards, which
#: are written from it and meant to be edited (``push`` completes them too); see docs/integrity.md
UNRECORDED = (PROVENANCE_FILE, "README.md")


def _other_digests(folder: Path, digests: dict[str, str | None]) -> dict[str, str]:
    """The checksum of every file in ``folder`` (sub-folders too: ``lora_adapter/``) besides the weight
    files in ``digests`` and :data:`UNRECORDED`: config, index, tokenizer and processor files, adapter
    files, of the kind the weights' checksums are."""
    kind = digest.kind_of(next(v for v in digests.values() if v is not None))
    out = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and not path.is_symlink() and name not in digests and path.name not in UNRECORDED:
            out[name] = digest.of_file(path, kind)
    return out


def _verify_step(target: Path, source: Path, options: MergeOptions) -> str:
    """What a failed ``--verify`` tells to do: the temporary folder it checked is gone, the target untouched."""
    flags = [("--backend", options.backend if options.backend != "auto" else None), ("--config", options.config),
             ("--base-model", options.base_model), ("--lora-alpha", options.lora_alpha)]
    flags += [(f"--{k.replace('_', '-')}", v) for k, v in (options.source_options or {}).items()]
    given = "".join(f" {flag} {value}" for flag, value in flags if value is not None)
    return (f"{target} was left as it was: merge without --verify, then run "
            f"`hf-merge verify {target} --against {source}{given}` for the full table")


def _derived_message(config_dir: Path) -> str:
    return (
        f"{config_dir} has no {GENERATION_CONFIG}: wrote the one save_pretrained derives from config.json (its bos/eos "
        f"tokens, no sampling settings); pass --config DIR with the base model's files to keep its own"
    )


def _missing_message(missing: list[str], config_dir: Path) -> str:
    what, lost, files = (" and ".join(_LOST[m][i] for m in missing) for i in range(3))
    return (
        f"{config_dir} has {what}, so the output has none either ({lost}); pass --config DIR with the base "
        f"model's config and {files}"
    )
