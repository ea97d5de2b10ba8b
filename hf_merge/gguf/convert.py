"""``merge(..., gguf=TYPE)``: the GGUF output (:class:`GgufFile`) of the merge pipeline.

The same stack as the safetensors merge (open -> views -> an executor of :mod:`hf_merge.pipeline`):
the model view keeps each tensor's stored dtype (the GGUF type decides what is written), the tied
alias is dropped (no ``output.weight``), and the folder gets the ``.gguf`` (and the GGUF LoRA file),
the model card and ``hf_merge.json`` with each file's checksum. Each GGUF file is one stream: one
writer, on one rank of a torchrun job.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Sequence

from ..errors import HfMergeError, LoraError, QuantizationError
from ..readers.formats import is_hf_folder
from ..options import MergeOptions
from ..pipeline import MergeResult, Unit, Writing

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


class GgufFile:
    """Output: ``TARGET/<name>-<type>.gguf`` (+ README.md, hf_merge.json); see :func:`hf_merge.merge`.

    PEFT checkpoints: ``lora="fuse"`` writes the fused model, ``"adapter"`` a GGUF LoRA file
    (``<name>-lora-<type>.gguf``, for llama.cpp's ``--lora``), ``"both"`` (default) both files.
    """

    @staticmethod
    def check(target: Path, options: MergeOptions) -> bool:
        """Refuse what can be refused before reading; the ``overwrite`` the target is staged with."""
        from ..write.atomic import check_target
        from . import quant

        if options.quantize is not None or options.verify:
            raise HfMergeError("--gguf writes its own quantized types; it does not combine with --quantize or --verify")
        check_target(target, overwrite=options.overwrite)
        ftype = quant.file_type(options.gguf)
        require_gguf()
        if options.dtype not in (None, "auto"):
            raise HfMergeError(f"--dtype {options.dtype} does not apply to GGUF output; the --gguf type ({ftype.name}) decides what is written")
        return options.overwrite

    @classmethod
    def prepare(cls, source: "str | Path", target: Path, options: MergeOptions, *, overwrite: bool) -> "GgufFile":
        from ..checkpoint import open_checkpoint

        ckpt = open_checkpoint(source, **options.open_kwargs())
        try:
            return cls(ckpt, target, options)
        except BaseException:
            ckpt.close()
            raise

    def __init__(self, ckpt: Any, target: Path, options: MergeOptions):
        """Views, vocabulary, provenance and every planned GGUF tensor (specs only, nothing read)."""
        from ..hf_files import checkpoint_config
        from ..side_files import side_files_bytes
        from ..write.atomic import check_free_space
        from ..provenance import merge_record
        from ..transforms.views import build_views
        from . import quant
        from .arch import arch_for
        from .tokenizer import load_vocab
        from .writer import plan_tensors, total_bytes

        self.ckpt, self.options = ckpt, options
        self.ftype = ftype = quant.file_type(options.gguf)
        lora, lora_kwargs = options.lora, options.lora_kwargs()
        self.config_dir, cfg = checkpoint_config(ckpt.info)
        self.config = cfg
        self.arch = arch_for(cfg)  # unsupported architectures are refused before anything is read
        self.views = views = build_views(ckpt, cfg, dtype="auto", lora=lora, **lora_kwargs)
        self.layout, self.settings = views.layout, views.settings  # lora: what the adapter view was built from
        if views.adapter is not None:
            try:
                from .lora import lora_alpha as gguf_alpha

                gguf_alpha(self.layout, self.settings)  # refused before anything is written
            except LoraError as e:
                if lora == "adapter":
                    raise
                logger.warning("no GGUF LoRA file: %s", e)  # --lora both: the fused model alone
                views.adapter = None
        self.vocab = load_vocab(self.config_dir, cfg["vocab_size"], pre_tokenizer=options.gguf_pre_tokenizer) if views.model is not None else None
        for note in ckpt.info.notes + views.notes:
            logger.info(note)
        for warning in ckpt.info.warnings:
            logger.warning(warning)
        self.name = model_name(cfg, options.base_model_name, ckpt.info.path if is_hf_folder(ckpt.info.format) else None, target)
        self.provenance = merge_record(ckpt, cfg, views, options.base_model_name, views.out_dtype, requested=options.dtype,
                                       source_options=options.source_options)
        self.planned: dict[str, list] = {}  # file name -> its GGUF tensors, in file order
        self.model_file = self.lora_file = None
        if views.model is not None:
            self.model_file = file_name(self.name, ftype.name)
            self.planned[self.model_file] = plan_tensors(views.model, cfg, self.arch, ftype)
        if views.adapter is not None:
            from .lora import plan_lora

            self.lora_file = file_name(self.name, ftype.name, lora=True)
            self.planned[self.lora_file] = plan_lora(views.adapter, self.layout, cfg, self.arch, ftype)
        if self.model_file is not None:  # k-quants: the BF16 file and the quantized one exist together for a while
            check_free_space(target, total_bytes(self.planned[self.model_file]) * (2 if ftype.k_quant else 1),
                             side_files_bytes([self.config_dir], scale=2))  # the tokenizer again in the GGUF file

    @property
    def notes(self) -> list[str]:
        return self.views.notes

    # -- the Output protocol --------------------------------------------------------------------
    def plan(self) -> list[Unit]:
        from .writer import total_bytes

        units = []
        for name, planned in self.planned.items():
            tensors = "".join(f"{t.gguf_name}:{t.type_name}:{t.shape}\n" for t in planned)
            units.append(Unit(name, total_bytes(planned), tensors.encode()))
        return units

    def write(self, folder: Path, units: Sequence[Unit], how: Writing) -> dict[str, str | None]:
        """Each GGUF file in ``units`` (one stream each, written here), hashed as it is written when asked."""
        digests: dict[str, str | None] = {}
        for unit in units:
            path = folder / unit.name
            if unit.name == self.model_file:
                digests[unit.name] = self._write_model(path, how.checksum)
            else:
                from .lora import write_lora_gguf

                digests[unit.name] = write_lora_gguf(self.views.adapter, self.layout, self.settings, self.config, path,
                                                     self.ftype, name=f"{self.name}-lora", checksum=how.checksum)
            if how.progress is not None:
                how.progress(unit.data_size)
        return digests

    def _write_model(self, path: Path, checksum: str | None) -> str | None:
        from .writer import write_gguf

        view, cfg, ftype = self.views.model, self.config, self.ftype
        if not ftype.k_quant:
            return write_gguf(view, cfg, path, ftype, vocab=self.vocab, name=self.name, checksum=checksum)
        # k-quants: BF16 first, then llama.cpp's C quantizer (kquant.py) writes the file; hashed after
        from ..write import digest
        from .kquant import quantize_file
        from .pipeline import interruptible

        bf16 = path.with_name(f".{path.name}.bf16")
        write_gguf(view, cfg, bf16, ftype, vocab=self.vocab, name=self.name)
        interruptible(lambda: quantize_file(bf16, path, ftype.name))  # minutes of C
        bf16.unlink()
        return digest.of_file(path, checksum) if checksum else None

    def finish(self, tmp: Path, digests: dict[str, str | None]) -> None:
        """``hf_merge.json`` (the GGUF record, each file's checksum) and the model card."""
        from ..publish.card import write_card
        from ..provenance import write_record

        provenance, ftype = self.provenance, self.ftype
        record: dict[str, Any] = {"type": ftype.name, "architecture": self.arch.name}
        # read back from the files: a k-quant's types are llama.cpp's quantizer's choice, and F32 stays F32
        counts = {name: written_types(tmp / name) for name in self.planned}
        if self.model_file is not None:
            record.update(file=self.model_file, tensor_types=sorted(counts[self.model_file]),
                          tokenizer={"model": self.vocab.model, "pre": self.vocab.pre})
        if self.lora_file is not None:
            record["lora_file"] = self.lora_file
            record.setdefault("file", self.lora_file)
        record["tensor_counts"] = counts
        provenance["dtype"] = ftype.name
        provenance["quantization"] = {"method": "gguf", "mode": ftype.name}  # the card's tags and row
        provenance["gguf"] = record
        if any(v is not None for v in digests.values()):
            provenance["files"] = digests
        write_record(tmp, provenance)
        write_card(tmp, provenance, kind="model", repo_id=self.options.push_to_hub)

    # -- after the executor -------------------------------------------------------------------
    def close(self) -> None:
        self.ckpt.close()

    def result(self, target: Path) -> MergeResult:
        files = list(self.planned)
        first = self.planned[self.model_file or self.lora_file]
        return MergeResult(  # quantization: the --gguf type, as hf_merge.json's {"method": "gguf", "mode": ...}
            target=target, files=files, dtype=self.ftype.name, num_tensors=len(first), quantization=self.ftype.name,
            total_bytes=sum((target / f).stat().st_size for f in files),
            notes=self.ckpt.info.notes + self.views.notes + self.ckpt.info.warnings, provenance=self.provenance,
        )


def written_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type the GGUF file ``path`` holds (``{"Q8_0": 16, "F32": 11}``)."""
    from collections import Counter

    import gguf

    reader = gguf.GGUFReader(path)
    return dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items(), key=lambda kv: (-kv[1], kv[0])))
