"""A PEFT LoRA adapter as a llama.cpp GGUF LoRA file (``llama-cli -m base.gguf --lora this.gguf``).

The format llama.cpp's ``convert_lora_to_gguf.py`` writes: ``general.type = adapter``,
``adapter.type = lora``, ``adapter.lora.alpha``, and per adapted linear ``<gguf weight>.lora_a``
(PEFT's A, ``[r, in]``) and ``<gguf weight>.lora_b`` (B, ``[out, r]``). llama.cpp scales by
``alpha / r`` with r from the tensors; rsLoRA's ``alpha / sqrt(r)`` is written as the alpha that
gives the same scale. Where llama.cpp permutes a weight's rows (Llama q / k), B's rows are permuted
the same way: ``P(B @ A) = (P B) @ A``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..checkpoint import LazyCheckpoint
from ..errors import LoraError
from ..transforms.lora_layout import PEFT_PREFIX, LoraLayout, LoraSettings
from . import quant
from .arch import GgufArch, Piece, arch_for, map_names
from .hparams import head_counts
from .writer import PlannedTensor, write_file


def lora_alpha(layout: LoraLayout, settings: LoraSettings) -> float:
    """The single ``adapter.lora.alpha`` that gives every module PEFT's scale, or a LoraError."""
    if settings.rank_pattern or settings.alpha_pattern:
        raise LoraError(
            "this adapter has per-module ranks or alphas (rank_pattern / alpha_pattern); a GGUF LoRA file holds one "
            "alpha: write the fused model instead (--lora fuse)"
        )
    if layout.saved:
        raise LoraError(
            f"this adapter also trains whole modules ({', '.join(layout.modules_to_save)}: modules_to_save), which a GGUF "
            "LoRA file cannot hold: write the fused model instead (--lora fuse)"
        )
    if settings.use_rslora:  # alpha / sqrt(r) == alpha' / r
        return settings.lora_alpha * math.sqrt(settings.r)
    return float(settings.lora_alpha)


def plan_lora(adapter: LazyCheckpoint, layout: LoraLayout, config: dict[str, Any], arch: GgufArch, ftype: quant.FileType) -> list[PlannedTensor]:
    specs = adapter.specs()
    heads = head_counts(config)
    planned: list[PlannedTensor] = []
    for module in layout.modules.values():
        (mapped,) = map_names(arch, [f"{module.name}.weight"])
        if mapped.stacked or mapped.pieces[0].part is not None:
            raise LoraError(f"LoRA on {module.name} (MoE experts) cannot be written as a GGUF LoRA file yet; use --lora fuse")
        for suffix, key in ((".lora_a", "A"), (".lora_b", "B")):
            name = f"{PEFT_PREFIX}{module.name}.lora_{key}.weight"
            shape = tuple(specs[name].shape)
            type_name = quant.tensor_type(mapped.gguf_name + suffix, shape, ftype)
            permute = heads[mapped.permute_heads] if mapped.permute_heads and key == "B" else None
            planned.append(PlannedTensor(
                mapped.gguf_name + suffix, (Piece(name),), shape, type_name, quant.nbytes(shape, type_name), permute
            ))
    return planned


def write_lora_gguf(
    adapter: LazyCheckpoint, layout: LoraLayout, settings: LoraSettings, config: dict[str, Any], path: Path,
    ftype: quant.FileType, *, name: str, checksum: str | None = None,
) -> str | None:
    """Write the PEFT adapter view ``adapter`` (``base_model.model.<m>.lora_{A,B}.weight``) to ``path``."""
    import gguf

    arch = arch_for(config)
    alpha = lora_alpha(layout, settings)
    planned = plan_lora(adapter, layout, config, arch, ftype)

    def add_keys(writer) -> None:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name(name)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)

    return write_file(adapter, path, arch.name, planned, add_keys, checksum=checksum)
