"""A checkpoint's description for ``hf-merge inspect``, built from specs and metadata alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checkpoint import open_checkpoint
from .hf_files import load_config, tied_pairs


def describe(source: "str | Path", *, backend: str = "auto", config: "str | Path | None" = None, tensors: bool = False) -> dict[str, Any]:
    ckpt = open_checkpoint(source, backend=backend, config=config)
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
        report["tensors_count"] = len(specs)
        report["parameters"] = sum(s.numel for s in specs.values())
        report["size_bytes"] = sum(s.nbytes for s in specs.values())
        report["dtypes"] = dtypes
        hf_dir = Path(config) if config else info.hf_dir
        if hf_dir is not None and (Path(hf_dir) / "config.json").is_file():
            cfg = load_config(Path(hf_dir))
            cfg.update(info.details.get("config_overrides") or {})
            report["hf_config"] = str(hf_dir)
            report["architecture"] = (cfg.get("architectures") or [None])[0]
            report["config_dtype"] = cfg.get("dtype") or cfg.get("torch_dtype")
            report["tied_embeddings"] = bool(tied_pairs(cfg))
        else:
            report["hf_config"] = None
        report["lora"] = _lora_summary(ckpt)
        if info.notes:
            report["notes"] = info.notes
        if info.warnings:
            report["warnings"] = info.warnings
        if tensors:
            placements = getattr(ckpt, "placements", lambda: {})()
            report["tensors"] = [
                {"name": n, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."), "placement": placements.get(n, "")}
                for n, s in specs.items()
            ]
        return report
    finally:
        ckpt.close()


def _lora_summary(ckpt) -> Any:
    try:
        from .lora import describe_lora
    except ImportError:
        return any(".lora_A." in n for n in ckpt.specs())
    return describe_lora(ckpt)
