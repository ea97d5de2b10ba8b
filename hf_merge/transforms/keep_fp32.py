"""The tensors ``from_pretrained(dtype=D)`` keeps in float32, so ``save_pretrained`` writes them so.

A model class may name modules that stay float32 whatever 16-bit dtype it is loaded in:
``_keep_in_fp32_modules_strict`` for float16 and bfloat16, ``_keep_in_fp32_modules`` for float16
only (transformers 4.51 to 5.x alike; DeepSeek-V3's router ``gate.weight`` and
``e_score_correction_bias`` under transformers 5). ``merge --dtype D`` writes those tensors in
float32 too, upcast from the source (one exact conversion, as transformers makes it).

Which names match is transformers' own rule for the installed release, asked of the model
(:func:`hf_merge.transformers_compat.keep_in_fp32_matcher`: 5.x's glob search on the in-memory
name, 4.x's whole-segment match). Asking needs the model's class; a model whose transformers source
declares neither attribute (:func:`may_declare`, read as text, nothing imported) is not asked,
and an answer is kept in the plan cache (:mod:`hf_merge.transforms.layout_cache`). Models from
custom code (``auto_map``) are not looked at: their code is never run.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch

__all__ = ["kept_in_fp32", "may_declare"]

#: ``_keep_in_fp32_modules[_strict] = <something>`` (not None, not empty), by attribute
_DECLARED = re.compile(r"\b_keep_in_fp32_modules(_strict)?\b[ \t]*(?::[^=\n]*)?=(?!=)[ \t]*(?!None\b|\[\]|\(\)|set\(\))\S")
_IMPORTED = re.compile(r"^from \.\.(\w+)\.modeling_\w+ import", re.MULTILINE)


def _model_types(config: dict[str, Any]) -> list[str]:
    """The ``model_type`` of the config and of every nested config (sub-models)."""
    out = [config["model_type"]] if isinstance(config.get("model_type"), str) else []
    for value in config.values():
        if isinstance(value, dict):
            out += _model_types(value)
    return out


def _models_dir() -> Path | None:
    spec = importlib.util.find_spec("transformers")  # where it is installed; nothing imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


@functools.lru_cache(maxsize=64)
def _declared_in(models: Path, folder: str, seen: frozenset[str] = frozenset()) -> frozenset[str]:
    """``{"plain", "strict"}``: which attributes the modeling files of ``models/folder`` (and the
    modeling files they import classes from) assign."""
    found: set[str] = set()
    for path in sorted((models / folder).glob("modeling_*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, ValueError):
            found |= {"plain", "strict"}  # unreadable: unknown, so asked of transformers
            continue
        found |= {"strict" if m.group(1) else "plain" for m in _DECLARED.finditer(text)}
        for other in set(_IMPORTED.findall(text)) - seen - {folder}:
            found |= _declared_in(models, other, seen | {folder})
    return frozenset(found)


#: trailing parts of a sub-model's type that its model's folder leaves out (``siglip_vision_model``)
_SUB_PARTS = frozenset({"text", "vision", "audio", "speech", "model", "encoder", "decoder"})


def _folder(models: Path, model_type: str) -> str | None:
    """The ``models/`` folder of a model type: its own name (``-`` as ``_``), or that name less
    sub-model parts (``siglip_vision_model`` -> ``siglip``); None when neither is a folder."""
    parts = model_type.replace("-", "_").split("_")
    while parts:
        if (models / "_".join(parts)).is_dir():
            return "_".join(parts)
        if parts[-1] not in _SUB_PARTS:
            return None
        parts = parts[:-1]
    return None


def may_declare(config: dict[str, Any], dtype_name: str | None) -> bool:
    """Whether the model may keep some tensors in float32 when loaded in ``dtype_name``: its
    transformers source (the model types in config.json) assigns the attribute that applies to
    that dtype. Reads source files as text (no torch, no transformers import); True when a model
    type's folder is not found (then transformers is asked)."""
    if dtype_name not in ("float16", "bfloat16"):
        return False
    wanted = {"plain", "strict"} if dtype_name == "float16" else {"strict"}
    models = _models_dir()
    if models is None:
        return False  # no transformers: nothing loads the output with its rule here
    for model_type in _model_types(config):
        folder = _folder(models, model_type)
        if folder is None or _declared_in(models, folder) & wanted:
            return True
    return False


def kept_in_fp32(config: dict[str, Any], names: Iterable[str], dtype: "torch.dtype | None") -> frozenset[str]:
    """Of ``names`` (transformers' in-memory names), those ``from_pretrained(dtype=dtype)`` loads
    in float32; empty for a float32 or unchanged (None) output and for a model that keeps none."""
    from ..spec import dtype_name

    name = dtype_name(dtype) if dtype is not None else None
    if not may_declare(config, name):
        return frozenset()
    from . import layout_cache

    names = sorted(names)
    key = None
    if layout_cache.cache_dir() is not None:
        key = layout_cache.digest({"plan": "keep_fp32", "format": 1, "versions": layout_cache.runtime(),
                                   "config": config, "dtype": name, "names": names})
        stored = layout_cache.get("keep_fp32", key)
        if isinstance(stored, list) and set(stored) <= set(names):
            return frozenset(stored)
    kept = _ask_transformers(config, names, dtype)
    if key is not None:
        layout_cache.put("keep_fp32", key, sorted(kept))
    return kept


def _ask_transformers(config: dict[str, Any], names: list[str], dtype: "torch.dtype") -> frozenset[str]:
    from ..errors import MappingError
    from ..transformers_compat import keep_in_fp32_matcher
    from .skeleton import model_class_for, skeleton

    cls = model_class_for(config)
    if cls is None:  # custom code, or no architectures: nothing of transformers' to ask
        return frozenset()
    try:
        model = skeleton(cls, config)  # the instance: transformers 5 adds its sub-models' modules
    except MappingError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' own error, re-raised typed with the architecture
        raise MappingError(
            f"{cls.__name__}: transformers cannot build the model from config.json to find the tensors it keeps in "
            f"float32 ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); fix config.json"
        ) from e
    match = keep_in_fp32_matcher(model, dtype)
    return frozenset(n for n in names if match is not None and match(n))
