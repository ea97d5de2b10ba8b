"""A checkpoint's description for ``hf-merge inspect``, built from specs and metadata alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import config_fields
from .checkpoint import open_checkpoint
from .hf_files import load_config, tied_pairs


def describe(
    source: "str | Path",
    *,
    backend: str = "auto",
    config: "str | Path | None" = None,
    tensors: bool = False,
    source_names: bool = False,
    source_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``source_options``: format-specific reader options, as :func:`hf_merge.merge` takes them
    (DeepSpeed: ``{"tag": "global_step100", "source_weights": "module"}``). ``source_names``: list
    every tensor (as ``tensors``) with the source tensor it comes from, where a name table renamed
    it (Megatron, torchtitan): ``decoder.layers.self_attention.linear_qkv.weight[1] (qkv: q)``."""
    ckpt = open_checkpoint(source, backend=backend, config=config, **(source_options or {}))
    try:
        info = ckpt.info
        specs = ckpt.specs()
        dtypes: dict[str, int] = {}
        for s in specs.values():
            key = str(s.dtype).removeprefix("torch.")
            dtypes[key] = dtypes.get(key, 0) + s.numel
        report: dict[str, Any] = {
            "format": info.format,
            "path": str(info.path),
            "step": info.step,
            "world_size": info.world_size,
        }
        report.update({k: v for k, v in info.details.items() if v is not None})
        if info.config_overrides:
            report["config_overrides"] = info.config_overrides.as_dict()
        report["tensors_count"] = len(specs)
        report["parameters"] = sum(s.numel for s in specs.values())
        report["size_bytes"] = sum(s.nbytes for s in specs.values())
        report["dtypes"] = dtypes
        hf_dir = Path(config) if config else info.hf_dir
        if hf_dir is not None and (Path(hf_dir) / "config.json").is_file():
            cfg = load_config(Path(hf_dir))
            info.config_overrides.apply(cfg)
            report["hf_config"] = str(hf_dir)
            report["architecture"] = (cfg.get("architectures") or [None])[0]
            report["config_dtype"] = config_fields.get(cfg, "dtype")
            report["tied_embeddings"] = bool(tied_pairs(cfg))
            # a tied weight the checkpoint stores twice is one parameter, written once (model.num_parameters())
            copies = sorted(a for a, src in tied_pairs(cfg, specs).items() if a in specs and src in specs)
            if copies:
                report["tied_copies"] = copies
                report["tensors_count"] -= len(copies)
                report["parameters"] -= sum(specs[a].numel for a in copies)
                report["size_bytes"] -= sum(specs[a].nbytes for a in copies)
            report["model_kind"] = model_family(cfg, specs)  # dense / MoE / VLM (a reader may set "family" itself)
            report["output_layout"] = _output_layout(ckpt, cfg)
        else:
            report["hf_config"] = None
        report["lora"] = _lora_summary(ckpt)
        if info.notes:
            report["notes"] = info.notes
        if info.warnings:
            report["warnings"] = info.warnings
        if tensors or source_names:
            placements = getattr(ckpt, "placements", lambda: {})()
            report["tensors"] = [
                {"name": n, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."), "placement": placements.get(n, "")}
                for n, s in specs.items()
            ]
            source_of = getattr(ckpt, "describe_source", None)
            if source_names:
                for t in report["tensors"]:
                    t["source"] = source_of(t["name"]) if source_of is not None else t["name"]
        return report
    finally:
        ckpt.close()


def model_family(config: dict[str, Any], specs: dict) -> str:
    """``dense``, ``MoE with E experts``, ``VLM`` or ``VLM, MoE with E experts`` (from config.json)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    counts = (config_fields.get(c, "num_experts") for c in (config, text))
    experts = next((n for n in counts if isinstance(n, int) and not isinstance(n, bool) and n > 1), None)
    parts = []
    if isinstance(config.get("vision_config"), dict):
        parts.append("VLM")
    if experts:
        parts.append(f"MoE with {experts} experts")
    return ", ".join(parts) or "dense"


def _output_layout(ckpt, config: dict[str, Any]) -> str:
    """What a merge writes: the names as stored, or transformers' saved layout (from specs only)."""
    from .errors import HfMergeError
    from .transforms.lora_layout import find_lora
    from .transforms import Renamed, drop_tied
    from .transforms.hub_layout import HubLayout, hub_layout

    lora = find_lora(ckpt.specs())
    if lora is not None and lora.lora_only:
        return "the base model's (--base-model), in its Hub layout"
    base = ckpt if lora is None else Renamed(ckpt, lora.base)
    base, _ = drop_tied(base, tied_pairs(config, base.specs()))
    try:
        view, _ = hub_layout(base, config)
    except HfMergeError as e:
        return f"cannot be written in the Hub layout: {e}"
    if not isinstance(view, HubLayout):
        return "as stored (transformers saves this architecture with its in-memory names)"
    changed = [n for n in view.specs() if view.source_names(n) != [n]]
    example = changed[0]
    return (
        f"{view.architecture}.save_pretrained layout: {len(view.specs())} tensors from {len(base.specs())}, "
        f"{len(changed)} renamed or split (e.g. {', '.join(view.source_names(example))} -> {example})"
    )


def _lora_summary(ckpt) -> Any:
    try:
        from .transforms.lora_layout import describe_lora
    except ImportError:
        return any(".lora_A." in n for n in ckpt.specs())
    return describe_lora(ckpt)
