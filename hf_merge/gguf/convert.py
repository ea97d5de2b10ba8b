"""``merge(..., gguf=TYPE)``: any source -> (LoRA fused) -> one GGUF file in an atomic folder.

The same stack as the safetensors merge (open -> transforms -> writer): the model view keeps each
tensor's stored dtype (the GGUF type decides what is written), the tied alias is dropped (no
``output.weight``), and the folder gets the ``.gguf``, the model card and ``hf_merge.json``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from ..errors import HfMergeError, LoraError, QuantizationError
from ..formats import is_hf_folder

logger = logging.getLogger(__name__)


def require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise QuantizationError("GGUF output needs the gguf package: pip install 'hf-merge[gguf]'") from None


def file_name(model_name: str, type_name: str, *, lora: bool = False) -> str:
    """``Qwen2-7B`` + ``q8_0`` -> ``Qwen2-7B-q8_0.gguf`` (``Qwen2-7B-lora-q8_0.gguf`` for an adapter;
    characters unsafe in a file name become ``-``)."""
    safe = re.sub(r"[^A-Za-z0-9._+-]+", "-", model_name).strip("-.") or "model"
    return f"{safe}{'-lora' if lora else ''}-{type_name}.gguf"


def model_name(config: dict[str, Any], base_model_name: str | None, source_dir: Path | None, target: Path) -> str:
    """The model's name for ``general.name`` and the file: ``--base-model-name``, config.json's
    ``_name_or_path``, a Hugging Face source folder's name, else the target folder's."""
    for value in (base_model_name, config.get("_name_or_path"), source_dir and source_dir.name):
        if value:
            return str(value).rstrip("/").split("/")[-1]
    return Path(target).name


def merge_gguf(
    source: "str | Path",
    target: "str | Path",
    gguf_type: str,
    *,
    backend: str = "auto",
    dtype: Any = None,
    config: "str | Path | None" = None,
    overwrite: bool = False,
    lora: str = "both",
    lora_alpha: float | None = None,
    use_rslora: bool | None = None,
    base_model: "str | Path | None" = None,
    source_options: "dict[str, Any] | None" = None,
    base_model_name: str | None = None,
    pre_tokenizer: str | None = None,
    push_to_hub: str | None = None,
    private: bool | None = None,
    is_value_model: bool | None = None,
):
    """Write ``TARGET/<name>-<type>.gguf`` (+ README.md, hf_merge.json); see :func:`hf_merge.merge`.

    PEFT checkpoints: ``lora="fuse"`` writes the fused model, ``"adapter"`` a GGUF LoRA file
    (``<name>-lora-<type>.gguf``, for llama.cpp's ``--lora``), ``"both"`` (default) both files.
    """
    from .. import merging
    from ..checkpoint import open_checkpoint
    from ..hf_files import checkpoint_config
    from ..hub import push, write_card
    from ..output import check_free_space, check_target, committed, stage
    from . import quant
    from .arch import arch_for
    from .tokenizer import load_vocab
    from .writer import plan_tensors, total_bytes, write_gguf

    target = Path(target)
    check_target(target, overwrite=overwrite)
    ftype = quant.file_type(gguf_type)
    require_gguf()
    if dtype not in (None, "auto"):
        raise HfMergeError(f"--dtype {dtype} does not apply to GGUF output; the --gguf type ({ftype.name}) decides what is written")
    staged = stage(target, overwrite=overwrite)  # locked before the source is read
    try:
        ckpt = open_checkpoint(source, backend=backend, config=config, is_value_model=is_value_model, **(source_options or {}))
    except BaseException:
        staged.discard()
        raise
    try:
        config_dir, cfg = checkpoint_config(ckpt.info)
        arch_for(cfg)  # unsupported architectures are refused before anything is read
        views = merging.build_views(
            ckpt, cfg, dtype="auto", lora=lora, lora_alpha=lora_alpha, use_rslora=use_rslora,
            base_model=base_model, base_model_name=base_model_name,
        )
        if views.adapter is not None:  # lora: the layout and settings the adapter view was built from
            from ..lora import find_lora, resolve_settings

            layout = find_lora(ckpt.specs())
            settings = resolve_settings(
                layout, ckpt.info.path, cfg, lora_alpha=lora_alpha, use_rslora=use_rslora, base_model_name=base_model_name
            )
            try:
                from .lora import lora_alpha as gguf_alpha

                gguf_alpha(layout, settings)  # refused before anything is written
            except LoraError as e:
                if lora == "adapter":
                    raise
                logger.warning("no GGUF LoRA file: %s", e)  # --lora both: the fused model alone
                views.adapter = None
        vocab = load_vocab(config_dir, cfg["vocab_size"], pre_tokenizer=pre_tokenizer) if views.model is not None else None
        for note in ckpt.info.notes + views.notes:
            logger.info(note)
        for warning in ckpt.info.warnings:
            logger.warning(warning)
        name = model_name(cfg, base_model_name, ckpt.info.path if is_hf_folder(ckpt.info.format) else None, target)
        provenance = merging._provenance(ckpt, cfg, views, base_model_name, views.out_dtype, requested=dtype)
        if views.model is not None:  # k-quants: the BF16 file and the quantized one exist together for a while
            planned_bytes = total_bytes(plan_tensors(views.model, cfg, arch_for(cfg), ftype))
            check_free_space(target, planned_bytes * (2 if ftype.k_quant else 1))
        record: dict[str, Any] = {"type": ftype.name, "architecture": arch_for(cfg).name}
        files: list[str] = []
        planned = []
        with committed(staged) as tmp:
            if views.model is not None:
                fname = file_name(name, ftype.name)
                if ftype.k_quant:  # BF16 first, then llama.cpp's C quantizer (kquant.py)
                    from .kquant import quantize_file
                    from .pipeline import interruptible

                    bf16 = tmp / f".{fname}.bf16"
                    planned = write_gguf(views.model, cfg, bf16, ftype, vocab=vocab, name=name)
                    interruptible(lambda: quantize_file(bf16, tmp / fname, ftype.name))  # minutes of C
                    bf16.unlink()
                else:
                    planned = write_gguf(views.model, cfg, tmp / fname, ftype, vocab=vocab, name=name)
                files.append(fname)
                record.update(file=fname, tensor_types=sorted({t.type_name for t in planned}),
                              tokenizer={"model": vocab.model, "pre": vocab.pre})
            if views.adapter is not None:
                from .lora import write_lora_gguf

                lname = file_name(name, ftype.name, lora=True)
                lplanned = write_lora_gguf(views.adapter, layout, settings, cfg, tmp / lname, ftype, name=f"{name}-lora")
                files.append(lname)
                record["lora_file"] = lname
                record.setdefault("file", lname)
                planned = planned or lplanned
            provenance["dtype"] = ftype.name
            provenance["quantization"] = {"method": "gguf", "mode": ftype.name}  # the card's tags and row
            provenance["gguf"] = record
            merging._write_provenance(tmp, provenance)
            write_card(tmp, provenance, kind="model", repo_id=push_to_hub)
        return merging.MergeResult(
            target=target, files=files, dtype=ftype.name, num_tensors=len(planned),
            total_bytes=sum((target / f).stat().st_size for f in files), notes=ckpt.info.notes + views.notes + ckpt.info.warnings,
            provenance=provenance, url=push(target, push_to_hub, private=private) if push_to_hub else None,
        )
    finally:
        staged.discard()  # nothing once committed
        ckpt.close()
