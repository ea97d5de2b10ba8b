"""Config fields read as transformers reads them: one name, whichever spelling config.json uses.

A transformers config class reads a field under its own name or under the name its
``attribute_map`` (``{name: stored name}``) sends it to; releases rename fields and keep the old
name readable that way. So one field has several real spellings in config.json files:

- the expert count: Qwen3-MoE's and Mixtral's ``num_experts`` is stored as ``num_local_experts``
  by transformers 5 (``save_pretrained`` writes that), while the Hub's Qwen3-30B-A3B says
  ``num_experts``; DeepSeek-V3's is ``n_routed_experts``;
- ``torch_dtype`` became ``dtype`` (transformers 4.56); ``rope_scaling`` became ``rope_parameters``
  (transformers 5, which also moved ``rope_theta`` into it);
- and the per-family aliases (``n_layer``, ``n_head``, ``d_model``...) every attribute_map lists.

:func:`get` looks a field up by its name, then as the model type's config class maps it (loaded
from the installed transformers, no network; imported only when the plain name is absent), then
under the other spellings in :data:`RENAMES` (a config written by a newer transformers than the
one installed, whose attribute_map does not know the new name yet).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any, Mapping

logger = logging.getLogger(__name__)

__all__ = ["RENAMES", "attribute_map", "class_default", "get", "rope_settings", "spellings", "ties_word_embeddings"]

#: Spellings one field has had across transformers releases and model families (each group is one
#: field); used after the config class's own attribute_map.
RENAMES: tuple[tuple[str, ...], ...] = (
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "moe_top_k"),
    ("num_shared_experts", "n_shared_experts"),
    ("dtype", "torch_dtype"),
    ("rope_parameters", "rope_scaling"),
)


def _config_class(model_type: Any):
    """transformers' config class for ``model_type`` (no network), or None."""
    if not isinstance(model_type, str) or not model_type:
        return None
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return CONFIG_MAPPING[model_type]
    except (ImportError, KeyError, ValueError) as e:
        logger.debug("no transformers config class for model_type %r (%s)", model_type, e)
        return None


@functools.lru_cache(maxsize=64)
def attribute_map(model_type: str | None) -> dict[str, str]:
    """The ``attribute_map`` of transformers' config class for ``model_type`` (``{}`` when
    transformers is absent or does not know the type).

    Read from the class's source file where it states the map plainly (:func:`_stated_map`):
    importing transformers' config registry costs a process that has not imported transformers
    1.3 s of CPU (``import transformers`` builds its lazy module table from every model folder),
    which a merge otherwise never pays. Else (or when the registry is already imported) from the
    class itself."""
    if "transformers.models.auto.configuration_auto" not in sys.modules:
        stated = _stated_map(model_type)
        if stated is not None:
            return stated
    amap = getattr(_config_class(model_type), "attribute_map", None)
    return {str(k): str(v) for k, v in amap.items()} if isinstance(amap, Mapping) else {}


#: bases and decorators of a config class whose ``attribute_map`` is the one its body states
_PLAIN_BASES = frozenset({"PreTrainedConfig", "PretrainedConfig"})
_PLAIN_DECORATORS = frozenset({"auto_docstring", "strict"})


def _stated_map(model_type: Any) -> dict[str, str] | None:
    """The ``attribute_map`` that the installed transformers' ``models/<type>/configuration_<type>.py``
    states for the config class whose ``model_type`` is ``model_type``, read without importing
    transformers; None where that is not certain (no such file or class, a base class other than
    ``PreTrainedConfig`` that could hold the map, a decorator that could change it, a map that is
    not a literal): the caller then imports the class."""
    if not isinstance(model_type, str) or not model_type.replace("-", "_").isidentifier():
        return None
    try:
        spec = importlib.util.find_spec("transformers")  # finds the package; does not import it
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    module = model_type.replace("-", "_")
    source = Path(list(spec.submodule_search_locations)[0]) / "models" / module / f"configuration_{module}.py"
    try:
        tree = ast.parse(source.read_bytes(), str(source))
    except (OSError, SyntaxError, ValueError):
        return None
    found = [node for node in tree.body if isinstance(node, ast.ClassDef) and _class_constant(node, "model_type") == model_type]
    if len(found) != 1:
        return None
    cls = found[0]
    decorators = [d.func if isinstance(d, ast.Call) else d for d in cls.decorator_list]
    if cls.keywords or {_name(b) for b in cls.bases} - _PLAIN_BASES or {_name(d) for d in decorators} - _PLAIN_DECORATORS:
        return None
    amap = _class_constant(cls, "attribute_map", default={})
    if not isinstance(amap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in amap.items()):
        return None
    return amap


def _name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


_UNSTATED = object()


def _class_constant(cls: ast.ClassDef, field: str, default: Any = _UNSTATED) -> Any:
    """The literal a class body assigns to ``field`` (``default`` when it assigns none; a value no
    literal gives, or an assignment made twice, gives :data:`_UNSTATED`)."""
    values = []
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(_name(t) == field for t in node.targets):
            values.append(node.value)
        elif isinstance(node, ast.AnnAssign) and _name(node.target) == field and node.value is not None:
            values.append(node.value)
    if not values:
        return default
    if len(values) > 1:
        return _UNSTATED
    try:
        return ast.literal_eval(values[0])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _UNSTATED


@functools.lru_cache(maxsize=64)
def class_default(model_type: str | None, name: str) -> Any:
    """The value transformers' config class for ``model_type`` gives field ``name`` when
    config.json does not set it (None when unknown)."""
    cls = _config_class(model_type)
    if cls is None:
        return None
    try:
        return getattr(cls(), name, None)
    except Exception as e:  # noqa: BLE001 - a config class that needs arguments: no default to tell
        logger.debug("%s() not built for its default %s (%s)", cls.__name__, name, e)
        return None


def ties_word_embeddings(config: Mapping[str, Any]) -> bool:
    """``tie_word_embeddings`` as transformers reads it: the config's, else its text config's,
    else the config class's default (True for many classes: a config.json may leave it out)."""
    for holder in (config, config.get("text_config") or {}):
        if isinstance(holder, Mapping) and holder.get("tie_word_embeddings") is not None:
            return bool(holder["tie_word_embeddings"])
    return bool(class_default(config.get("model_type"), "tie_word_embeddings"))


def spellings(config: Mapping[str, Any], name: str) -> tuple[str, ...]:
    """Every key ``name`` may be stored under in ``config``, in the order they are tried."""
    amap = attribute_map(config.get("model_type"))
    keys = [name]
    if name in amap:
        keys.append(amap[name])
    keys.extend(alias for alias, stored in amap.items() if stored == name)
    for group in RENAMES:
        if name in group:
            keys.extend(group)
    return tuple(dict.fromkeys(keys))


def get(config: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """``config``'s value of field ``name`` under whichever spelling it holds (a None value
    counts as absent), else ``default``."""
    value = config.get(name)
    if value is not None:
        return value  # the common case: no transformers import
    for key in spellings(config, name)[1:]:
        value = config.get(key)
        if value is not None:
            return value
    return default


def rope_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE settings wherever the config keeps them: top-level ``rope_theta`` and ``rope_scaling``
    (transformers 4.x), ``rope_parameters`` (5.x, per layer type when it has ``full_attention``),
    which wins; ``type`` read as ``rope_type``."""
    out: dict[str, Any] = {}
    if config.get("rope_theta") is not None:
        out["rope_theta"] = config["rope_theta"]
    out.update(config.get("rope_scaling") or {})
    params = config.get("rope_parameters") or {}
    out.update(params.get("full_attention", params))
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out["type"]
    return out
