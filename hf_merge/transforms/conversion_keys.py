"""Which model types and class names transformers declares a weight conversion for, without importing it.

``save_pretrained`` looks a model's conversions up with
``transformers.conversion_mapping.get_checkpoint_conversion_mapping(key)`` (class name, model type,
base ``XModel`` class). Importing that module imports ``transformers.core_model_loading`` and with it
much of transformers and torch (about 1.5 s of CPU), only to learn that a dense model has no
conversion. The keys are transformers' own declarations, so they are read here from the source of
``conversion_mapping.py`` (its syntax tree, nothing executed): the dict literal that
``_build_checkpoint_conversion_mapping`` starts from, every ``mapping["<key>"] = ...`` / ``+=`` in
it, and the keys of ``_MODEL_TO_CONVERSION_PATTERN``, which its last loop copies.

Any statement of another shape (a conditional, ``mapping.update``, a computed key, the loop over
something else...) makes the answer unknown (None): the caller then imports transformers and asks
it, as before. When ``transformers.conversion_mapping`` is already imported (a user may have
registered mappings), the caller asks it directly too.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from pathlib import Path

from ..transformers_compat import major_version

__all__ = ["declared_keys", "keys_from_source", "may_convert"]

_BUILD = "_build_checkpoint_conversion_mapping"
_PATTERNS = "_MODEL_TO_CONVERSION_PATTERN"
_MAPPING = "mapping"


def declared_keys() -> frozenset[str] | None:
    """The keys transformers declares conversions for, or None when they cannot be read without
    importing it (not installed, already imported, or a source shape not recognised)."""
    major = major_version()
    if major is not None and major < 5:
        return frozenset()  # transformers 4.x declares no weight conversions (a VLM's renames: nested config)
    if "transformers.conversion_mapping" in sys.modules:
        return None
    spec = importlib.util.find_spec("transformers")  # the package's location; nothing is imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return _keys_of(Path(next(iter(spec.submodule_search_locations))) / "conversion_mapping.py")


def may_convert(config: dict, arch: str, *, ask_transformers: bool = True) -> bool | None:
    """Whether transformers declares a conversion for this class, its model type or a sub-model
    (nested configs); False only for a plain model whose names ``save_pretrained`` keeps.

    From the declared keys read from transformers' source when they can be (no import of
    transformers for a dense model), else asked of ``transformers.conversion_mapping`` — or None
    (unknown) when ``ask_transformers`` is False."""
    nested = [v for v in config.values() if isinstance(v, dict) and "model_type" in v]
    if nested:
        return True
    base = arch.split("For")[0]
    keys = [k for k in (arch, config.get("model_type"), f"{base}Model") if k]  # sub-models are looked up by class name too
    declared = declared_keys()
    if declared is not None:
        return any(k in declared for k in keys)
    if not ask_transformers:
        return None
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return any(get_checkpoint_conversion_mapping(k) for k in keys)


@functools.lru_cache(maxsize=4)
def _keys_of(path: Path) -> frozenset[str] | None:
    try:
        return keys_from_source(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def keys_from_source(source: str) -> frozenset[str] | None:
    """The keys of the mapping ``_build_checkpoint_conversion_mapping`` returns, from the module's
    source; None when any statement is of a shape this reader does not know."""
    tree = ast.parse(source)
    patterns = _pattern_keys(tree)
    build = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == _BUILD]
    if patterns is None or len(build) != 1:
        return None
    body = build[0].body
    if not body or not (_assigns_name(body[0], _MAPPING) and isinstance(body[0].value, ast.Dict)):
        return None
    keys = _const_keys(body[0].value)
    if keys is None:
        return None
    for stmt in body[1:]:
        if isinstance(stmt, ast.Return):
            if not (isinstance(stmt.value, ast.Name) and stmt.value.id == _MAPPING):
                return None
        elif isinstance(stmt, ast.For):
            if not _is_patterns_loop(stmt):
                return None
            keys |= patterns
        elif isinstance(stmt, (ast.Assign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id != _MAPPING:
                    continue  # a local helper value
                key = _mapping_key(target)
                if key is None:
                    return None
                keys.add(key)
        elif isinstance(stmt, ast.Expr):
            if not _is_entry_method_call(stmt.value):
                return None
        else:
            return None
    return frozenset(keys)


def _assigns_name(stmt: ast.stmt, name: str) -> bool:
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == name)


def _const_keys(d: ast.Dict) -> set[str] | None:
    keys = set()
    for k in d.keys:
        if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
            return None  # ``**other`` (None) or a computed key
        keys.add(k.value)
    return keys


def _mapping_key(target: ast.expr) -> str | None:
    """``mapping["key"]`` -> ``"key"``; anything else None."""
    if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == _MAPPING
            and isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str)):
        return target.slice.value
    return None


def _is_entry_method_call(value: ast.expr) -> bool:
    """``mapping["key"].append(...)`` and the like: changes an entry, adds no key."""
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and _mapping_key(value.func.value) is not None)


def _is_patterns_loop(stmt: ast.For) -> bool:
    """``for model_type, base in _MODEL_TO_CONVERSION_PATTERN.items(): ... mapping[model_type] = ...``"""
    it = stmt.iter
    return (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items"
            and isinstance(it.func.value, ast.Name) and it.func.value.id == _PATTERNS and not it.args and not stmt.orelse)


def _pattern_keys(tree: ast.Module) -> set[str] | None:
    """Keys of the module-level ``_MODEL_TO_CONVERSION_PATTERN`` dict literal, assigned once and
    never changed in the module; else None."""
    assigned = [n for n in tree.body if _assigns_name(n, _PATTERNS)]
    if len(assigned) != 1 or not isinstance(assigned[0].value, ast.Dict):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == _PATTERNS and not isinstance(node.ctx, ast.Load):
            if node is not assigned[0].targets[0]:
                return None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == _PATTERNS \
                and not isinstance(node.ctx, ast.Load):
            return None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == _PATTERNS \
                and node.attr not in ("items", "keys", "values", "get"):
            return None
    return _const_keys(assigned[0].value)
