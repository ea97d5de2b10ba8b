"""What a merge writes, as views of the source: the HF model view and/or the PEFT adapter view.

:func:`build_views` stacks the transforms from a source's tensors to what an output holds (tied
alias dropped, Hub layout, LoRA fused and/or the adapter alone, dtype cast); every output (safetensors,
PEFT adapter, GGUF) and the in-memory loader (:func:`model_view`) start from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import LazyCheckpoint
from ..hf_files import resolve_dtype, tied_pairs
from ..spec import dtype_name
from .cast import Cast
from .rename import Renamed, drop_tied

#: where ``--lora both`` puts the PEFT adapter inside the model folder
ADAPTER_SUBDIR = "lora_adapter"


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
    layout: Any = None  # hf_merge.transforms.lora_layout.LoraLayout of a PEFT checkpoint (what the GGUF LoRA file is planned from)
    settings: Any = None  # its hf_merge.transforms.lora_layout.LoraSettings (r, alpha, rsLoRA)


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
    from ..errors import LoraError
    from .lora_layout import adapter_config, find_lora, resolve_settings

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
    if layout is not None:  # a PEFT checkpoint: only these merges import the LoRA transforms
        from .lora import FusedLora, LoraAdapter

        settings = resolve_settings(
            layout, ckpt.info.path, config, lora_alpha=lora_alpha, use_rslora=use_rslora, base_model_name=base_model_name
        )
        views.layout, views.settings = layout, settings
        views.lora = {
            "mode": lora, "r": settings.r, "lora_alpha": settings.lora_alpha, "alpha_source": settings.alpha_source,
            "target_modules": layout.target_modules, "use_rslora": settings.use_rslora,
            "target_parameters": layout.target_parameters,
            "modules_to_save": layout.modules_to_save, "rank_pattern": settings.rank_pattern,
            "modules": len(layout.modules), "lora_only": layout.lora_only,
        }
        alpha_from = settings.alpha_source
        if settings.overridden_alpha is not None:
            alpha_from += f", overriding the recorded {settings.overridden_alpha[0]} in {settings.overridden_alpha[1]}"
        rslora = "rsLoRA, " if settings.use_rslora else ""
        if not settings.rslora_recorded:  # verl does not record it: a wrong guess misscales every update
            rslora = "rsLoRA not recorded, assumed off (pass --use-rslora if training used it), "
        notes.append(
            f"LoRA: r={settings.r}, lora_alpha={settings.lora_alpha} (from {alpha_from}), "
            f"{rslora}targets {', '.join(layout.target_modules + layout.target_parameters)}"
        )
        if settings.fused_alphas:
            ranks = sorted({settings.rank_pattern[k] for k in settings.fused_alphas})
            notes.append(
                f"LoRA: {len(settings.fused_alphas)} fused expert parameter(s) at rank {'/'.join(map(str, ranks))} take "
                f"lora_alpha {'/'.join(str(v) for v in sorted(set(settings.fused_alphas.values())))} (alpha / r kept, as "
                "PEFT sets it when it fuses per-projection targets under transformers 5)"
            )
        if layout.lora_only:
            if base_model is None:
                if lora != "adapter":
                    raise LoraError(  # hub=False: a load, which needs the base weights whatever the mode
                        "this checkpoint holds only LoRA weights (save_lora_only); pass --base-model DIR with the "
                        "base model's Hugging Face folder to fuse them, or --lora adapter to write the adapter alone"
                        if hub else "this checkpoint holds only LoRA weights (save_lora_only); pass --base-model DIR "
                        "with the base model's Hugging Face folder: a model cannot be loaded without its base weights"
                    )
                base = None
            else:
                from ..readers.hf_dir import open_hf_dir

                base = open_hf_dir(Path(base_model))
                notes.append(f"base weights from {base_model}")
        else:
            base = Renamed(ckpt, layout.base)
            if base_model is not None and not _config_from(ckpt, base_model):
                notes.append("--base-model changes nothing here: the checkpoint holds the base weights itself "
                             "(only a save_lora_only checkpoint takes them from --base-model)")
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
    else:
        given = [flag for flag, value in (("--lora-alpha", lora_alpha), ("--use-rslora", use_rslora),
                                          ("--base-model", base_model)) if value is not None
                 and not (flag == "--base-model" and _config_from(ckpt, base_model))]
        if given:
            notes.append(f"{' and '.join(given)} change{'s' if len(given) == 1 else ''} nothing here: the checkpoint "
                         "has no LoRA weights (no lora_A/lora_B tensors)")
    if model is not None:
        model, dropped = drop_tied(model, tied_pairs(config, model.specs()))
        if dropped:
            notes.append(f"tied weights: wrote {', '.join(dropped)} once, under its source name (tie_word_embeddings)")
        fp32: frozenset[str] = frozenset()
        if hub:
            from .hub_layout import HubLayout, hub_layout
            from .keep_fp32 import kept_in_fp32

            in_memory = model.specs()
            model, hub_notes = hub_layout(model, config)
            notes.extend(hub_notes)
            kept = kept_in_fp32(config, in_memory, out_dtype)  # matched on the in-memory names, as transformers does
            if kept:
                fp32 = frozenset(n for n in model.specs() if (set(model.source_names(n)) if isinstance(model, HubLayout)
                                                              else {n}) & kept)
                notes.append(f"{len(fp32)} tensor(s) kept in float32, as from_pretrained(dtype={dtype_name(out_dtype)}) "
                             "loads them and save_pretrained writes them (the model's _keep_in_fp32_modules)")
        else:  # the loader fills the in-memory layout, which must be this transformers' own (and keeps fp32 itself)
            from .hub_layout import check_legacy_experts

            check_legacy_experts(model.specs(), config)
        views.model = Cast(model, out_dtype, fp32)
    return views


def _config_from(ckpt: LazyCheckpoint, base_model: "str | Path") -> bool:
    """The checkpoint had no config.json and took the --base-model folder's (open_checkpoint)."""
    return ckpt.info.hf_dir is not None and Path(ckpt.info.hf_dir) == Path(base_model)


def model_view(
    ckpt: LazyCheckpoint, config: dict[str, Any], *, dtype: "str | torch.dtype | None" = None, **lora_options: Any
) -> tuple[LazyCheckpoint, torch.dtype | None, list[str]]:
    """The HF model in transformers' in-memory layout (LoRA fused), for loading into a model:
    ``(view, output dtype or None, notes)``."""
    views = build_views(ckpt, config, dtype=dtype, lora="fuse", hub=False, **lora_options)
    return views.model, views.out_dtype, views.notes
