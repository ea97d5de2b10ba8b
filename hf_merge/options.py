"""``MergeOptions``: everything a merge is asked to do, in one frozen value.

:func:`hf_merge.merge` builds it from its keyword arguments (an unknown one is a ``TypeError``),
the CLI builds it once from its flags, and every executor (in-process, forked writers, torchrun
ranks) and every output (safetensors folder, PEFT adapter, GGUF file) reads it. See
:func:`hf_merge.merge` for what each option means.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import HfMergeError


@dataclass(frozen=True)
class MergeOptions:
    backend: str = "auto"
    dtype: Any = None  # None (the config's), "auto" (the shards'), or a dtype / its name
    max_shard_size: "int | str | None" = None  # None: the installed transformers' save_pretrained default
    workers: int | None = None
    config: "str | Path | None" = None
    overwrite: bool = False
    lora: str = "both"
    lora_alpha: float | None = None
    use_rslora: bool | None = None
    base_model: "str | Path | None" = None
    base_model_name: str | None = None
    verify: bool = False
    checksums: "bool | str" = True  # True: crc32, or sha256 with push_to_hub; False: none; or a kind
    quantize: Any = None  # "nf4" / "fp4" / "int8" / a QuantizeOptions (or its dict)
    push_to_hub: str | None = None
    private: bool | None = None
    is_value_model: bool | None = None
    source_options: "dict[str, Any] | None" = None
    gguf: str | None = None
    gguf_pre_tokenizer: str | None = None
    distributed: bool | None = None
    dist_writers: str = "node"
    source_crc: bool = True

    def shard_bytes(self) -> int:
        """``max_shard_size`` in bytes (``--max-shard-size`` named in the error); when None, the
        default of the installed transformers' ``save_pretrained`` (:mod:`hf_merge.write.shard_size`)."""
        from .sizes import parse_size
        from .write.shard_size import default_max_shard_size

        try:
            return parse_size(default_max_shard_size() if self.max_shard_size is None else self.max_shard_size)
        except ValueError as e:
            raise HfMergeError(f"--max-shard-size: {e}") from None

    def checksum(self) -> str | None:
        """The kind of digest recorded for each output file (:mod:`hf_merge.write.digest`), or None.
        ``checksums=True`` is a CRC-32, or a sha256 when the folder goes to the Hub (whose upload
        needs each file's sha256: the merge computes it while writing, ``push`` reuses it)."""
        from .write.digest import KINDS

        if self.checksums is True:
            return "sha256" if self.push_to_hub else "crc32"
        if self.checksums is False or self.checksums in (None, "none"):
            return None
        if self.checksums not in KINDS:
            raise HfMergeError(f"--checksum: unknown kind {self.checksums!r} (choose from {', '.join(KINDS)}, none)")
        return self.checksums

    def open_kwargs(self) -> dict[str, Any]:
        """What :func:`~hf_merge.checkpoint.open_checkpoint` takes from the options."""
        return dict(backend=self.backend, config=self.config, is_value_model=self.is_value_model,
                    base_model=self.base_model, **(self.source_options or {}))

    def lora_kwargs(self) -> dict[str, Any]:
        """What :func:`~hf_merge.transforms.views.build_views` takes besides ``dtype`` and ``lora``."""
        return dict(lora_alpha=self.lora_alpha, use_rslora=self.use_rslora, base_model=self.base_model,
                    base_model_name=self.base_model_name)
