"""Name tables: how a source family's tensor names map to Hugging Face names. Data, not code.

Each table is a plain dict, validated against :data:`SCHEMA` when it is registered (unknown fields,
wrong types, fused declarations without exactly their roles, duplicate targets and tensor-parallel
entries for names the table does not map are all errors), and looked up in one place:
:func:`get_table`. Adding a model family means adding one module here that calls :func:`register`
(and listing it in :data:`_TABLE_MODULES`).

Table fields (``"megatron"`` source):

- ``name``, ``source``, ``summary``: identity; ``model_types``: the HF ``config.model_type`` values
  it serves (one table per model type).
- ``architectures``: ``{"causal_lm": ..., "value": ...}`` HF class names for the actor and for a
  critic / value model (token classification, head ``score``).
- ``layer_prefix`` (source) and ``hf_layer_prefix`` (HF, with ``{layer}``): per-layer tensors are
  ``<layer_prefix><suffix>`` with a leading layer axis (stacked) or ``<layer_prefix><i>.<suffix>``.
- ``tensors`` (outside layers) and ``layer_tensors`` (suffixes): 1:1 renames.
- ``fused``: layer suffix -> ``{"split": "qkv", "q": ..., "k": ..., "v": ...}`` or
  ``{"split": "gate_up", "gate": ..., "up": ...}`` (HF suffixes), split by
  :mod:`hf_merge.transforms.fused`.
- ``lm_head`` / ``value_head``: source name -> HF name of the output layer of an actor / critic;
  ``tied_alias``: the source name that is absent when embeddings are tied.
- ``required``: source names (layer suffixes for per-layer ones) every checkpoint of the family has.
- ``config_checks``: source name -> ``{config key: value}`` that config.json must agree with when
  the tensor is present (e.g. ``attention_bias: true`` for an o_proj bias).
- ``ignore``: fnmatch patterns of entries that are not weights (``*._extra_state``).
- ``not_model``: fnmatch patterns of entries that belong to other state (optimizer, rng).
- ``tensor_parallel``: source name -> ``0`` / ``1`` (dim TP ranks split) or ``"gate_up"``
  (each rank holds ``[gate_r; up_r]``); unlisted names are replicated. Used for per-rank files.
- ``experts_config_key``: the config.json key giving the number of routed experts
  (``num_experts``, ``n_routed_experts``, ``num_local_experts``); required when a layer entry
  uses ``{expert}``.

Placeholders and stacked axes. A layer suffix (a key of ``layer_tensors`` / ``fused``) may
contain ``{expert}``: the expert index is then part of the source name
(``mlp.experts.local_experts.{expert}.linear_fc2.weight``, ``mlp.experts.linear_fc2.weight{expert}``).
An HF target may contain ``{expert}`` where its source does not: the source then stacks the experts
on an axis (after the layer axis when that is stacked too), e.g. ``[L, E, 2F, H]``. Every
placeholder of a source suffix must appear in its target. :func:`match_suffix` finds the entry a
source name spells. (Legacy per-rank files of MoE tables are read at TP=1 only, so
``tensor_parallel`` needs no expert entries.)
"""

from __future__ import annotations

import importlib
import re
import string
from types import MappingProxyType
from typing import Any, Mapping

from ..errors import MappingError

__all__ = ["SCHEMA", "PLACEHOLDERS", "register", "get_table", "tables", "describe", "validate_table", "placeholders", "match_suffix"]

_STR_MAP = "str->str"
_FUSED_ROLES = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}

#: field -> (kind, required). Kinds: "str", "str-list", "str->str", "architectures", "fused",
#: "checks", "tp".
SCHEMA: dict[str, tuple[str, bool]] = {
    "name": ("str", True),
    "source": ("str", True),
    "summary": ("str", True),
    "model_types": ("str-list", True),
    "architectures": ("architectures", True),
    "layer_prefix": ("str", True),
    "hf_layer_prefix": ("str", True),
    "tensors": (_STR_MAP, True),
    "layer_tensors": (_STR_MAP, True),
    "fused": ("fused", False),
    "lm_head": (_STR_MAP, False),
    "value_head": (_STR_MAP, False),
    "tied_alias": ("str", False),
    "required": ("str-list", False),
    "config_checks": ("checks", False),
    "ignore": ("str-list", False),
    "not_model": ("str-list", False),
    "tensor_parallel": ("tp", False),
    "experts_config_key": ("str", False),
}

#: The placeholders a layer suffix or its HF target may hold (besides the layer prefix's ``{layer}``).
PLACEHOLDERS = ("expert",)

_REGISTRY: dict[tuple[str, str], Mapping[str, Any]] = {}
_TABLE_MODULES = ("megatron_gpt", "megatron_moe")
_loaded = False


def _fail(table: Mapping[str, Any], msg: str) -> None:
    raise MappingError(f"mapping table {table.get('name', '?')!r}: {msg}")


def placeholders(template: str) -> list[str]:
    """The ``{name}`` fields of ``template``, in order."""
    return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]


def _suffix_regex(suffix: str) -> re.Pattern[str]:
    parts = []
    for literal, field_name, _, _ in string.Formatter().parse(suffix):
        parts.append(re.escape(literal))
        if field_name is not None:
            parts.append(f"(?P<{field_name}>\\d+)")
    return re.compile("".join(parts))


def match_suffix(table: Mapping[str, Any], suffix: str) -> tuple[str, dict[str, int]] | None:
    """The layer entry of ``table`` that ``suffix`` spells, and the placeholder values in it.

    ``match_suffix(t, "mlp.experts.local_experts.3.linear_fc2.weight")`` ->
    ``("mlp.experts.local_experts.{expert}.linear_fc2.weight", {"expert": 3})``; ``None`` if no
    entry matches. A suffix without placeholders matches only itself.
    """
    if suffix in table["layer_tensors"] or suffix in table.get("fused", {}):
        return suffix, {}
    for key in list(table["layer_tensors"]) + list(table.get("fused", {})):
        if "{" not in key:
            continue
        m = _suffix_regex(key).fullmatch(suffix)
        if m:
            return key, {k: int(v) for k, v in m.groupdict().items()}
    return None


def _is_str_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, str) and x for x in v)


def _is_str_map(v: Any) -> bool:
    return isinstance(v, Mapping) and all(isinstance(k, str) and k and isinstance(x, str) and x for k, x in v.items())


def validate_table(table: Mapping[str, Any]) -> None:
    """Raise :class:`MappingError` unless ``table`` matches :data:`SCHEMA` and is consistent."""
    if not isinstance(table, Mapping):
        raise MappingError(f"mapping table must be a dict, got {type(table).__name__}")
    unknown = set(table) - set(SCHEMA)
    if unknown:
        _fail(table, f"unknown field(s) {sorted(unknown)}; allowed: {sorted(SCHEMA)}")
    for key, (kind, required) in SCHEMA.items():
        if key not in table:
            if required:
                _fail(table, f"missing required field {key!r}")
            continue
        v = table[key]
        ok = {
            "str": lambda: isinstance(v, str) and bool(v),
            "str-list": lambda: _is_str_list(v),
            _STR_MAP: lambda: _is_str_map(v),
            "architectures": lambda: _is_str_map(v) and set(v) <= {"causal_lm", "value"} and "causal_lm" in v,
            "fused": lambda: isinstance(v, Mapping),
            "checks": lambda: isinstance(v, Mapping)
            and all(isinstance(c, Mapping) and all(isinstance(k, str) for k in c) for c in v.values()),
            "tp": lambda: isinstance(v, Mapping) and all(x in (0, 1, "gate_up") and not isinstance(x, bool) for x in v.values()),
        }[kind]()
        if not ok:
            _fail(table, f"field {key!r} does not have the expected form ({kind})")

    fields = placeholders(table["hf_layer_prefix"])
    if fields != ["layer"]:
        _fail(table, "hf_layer_prefix must contain exactly one '{layer}' placeholder")
    if not table["layer_prefix"].endswith("."):
        _fail(table, "layer_prefix must end with '.'")

    # Several source spellings may share one HF target (fused vs. separate layer norms, stacked
    # fc1 vs. singleton `_w`/`_v`); a checkpoint holding two of them is rejected at run time.
    hf_globals = list(table["tensors"].values())
    if len(set(hf_globals)) != len(hf_globals):
        _fail(table, "two 'tensors' entries map to the same HF name")
    for src, spec in table.get("fused", {}).items():
        if not isinstance(spec, Mapping) or not isinstance(spec.get("split"), str):
            _fail(table, f"fused entry {src!r} needs a 'split' kind")
        roles = _FUSED_ROLES.get(spec["split"])
        if roles is None:
            _fail(table, f"fused entry {src!r}: unknown split {spec['split']!r}; known: {sorted(_FUSED_ROLES)}")
        given = set(spec) - {"split"}
        if given != set(roles):
            _fail(table, f"fused entry {src!r}: a {spec['split']} split needs exactly the roles {list(roles)}, got {sorted(given)}")
        if not all(isinstance(spec[r], str) and spec[r] for r in roles):
            _fail(table, f"fused entry {src!r}: role targets must be names")
        if src in table["layer_tensors"]:
            _fail(table, f"{src!r} is both a fused and a 1:1 layer tensor")
    uses_experts = False
    layer_targets: list[tuple[str, list[str]]] = [(s, [h]) for s, h in table["layer_tensors"].items()]
    layer_targets += [(s, [f[r] for r in _FUSED_ROLES[f["split"]]]) for s, f in table.get("fused", {}).items()]
    for src, targets in layer_targets:
        src_fields = placeholders(src)
        if len(set(src_fields)) != len(src_fields) or not set(src_fields) <= set(PLACEHOLDERS):
            _fail(table, f"layer entry {src!r}: placeholders must be distinct and among {list(PLACEHOLDERS)}")
        for hf in targets:
            hf_fields = placeholders(hf)
            if len(set(hf_fields)) != len(hf_fields) or not set(hf_fields) <= set(PLACEHOLDERS):
                _fail(table, f"target {hf!r}: placeholders must be distinct and among {list(PLACEHOLDERS)}")
            if not set(src_fields) <= set(hf_fields):
                _fail(table, f"layer entry {src!r} names {src_fields} but its target {hf!r} does not")
            uses_experts = uses_experts or "expert" in hf_fields
    if uses_experts and "experts_config_key" not in table:
        _fail(table, "entries use '{expert}' but the table has no experts_config_key")
    layer_known = set(table["layer_tensors"]) | set(table.get("fused", {}))
    global_known = set(table["tensors"]) | set(table.get("lm_head", {})) | set(table.get("value_head", {}))
    for name in table.get("required", ()):
        if name not in layer_known and name not in global_known:
            _fail(table, f"required entry {name!r} is not mapped by the table")
    for name in table.get("config_checks", {}):
        if name not in layer_known and name not in global_known:
            _fail(table, f"config_checks entry {name!r} is not mapped by the table")
    for name in table.get("tensor_parallel", {}):
        if name not in layer_known and name not in global_known:
            _fail(table, f"tensor_parallel entry {name!r} is not mapped by the table")
    tied = table.get("tied_alias")
    if tied is not None and tied not in table.get("lm_head", {}):
        _fail(table, f"tied_alias {tied!r} must be an lm_head entry")
    for pat in list(table.get("ignore", ())) + list(table.get("not_model", ())):
        try:
            re.compile(pat.replace("*", ".*"))
        except re.error as e:  # pragma: no cover - fnmatch patterns hardly fail
            _fail(table, f"bad pattern {pat!r}: {e}")


def _freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return MappingProxyType({k: _freeze(x) for k, x in v.items()})
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def register(table: Mapping[str, Any]) -> Mapping[str, Any]:
    """Validate and register ``table`` (once per ``(source, model_type)``); return it frozen."""
    validate_table(table)
    frozen = _freeze(dict(table))
    for mt in table["model_types"]:
        key = (table["source"], mt)
        if key in _REGISTRY and _REGISTRY[key]["name"] != table["name"]:
            raise MappingError(
                f"model_type {mt!r} of source {table['source']!r} is claimed by both "
                f"{_REGISTRY[key]['name']!r} and {table['name']!r}"
            )
        _REGISTRY[key] = frozen
    return frozen


def _load() -> None:
    global _loaded
    if not _loaded:
        for mod in _TABLE_MODULES:
            importlib.import_module(f"{__name__}.{mod}")
        _loaded = True


def get_table(source: str, model_type: str) -> Mapping[str, Any]:
    """The table of ``source`` (e.g. ``"megatron"``) for HF ``model_type``; MappingError if none."""
    _load()
    try:
        return _REGISTRY[(source, model_type)]
    except KeyError:
        known = sorted(mt for s, mt in _REGISTRY if s == source)
        raise MappingError(
            f"no {source} name table for model_type {model_type!r}; supported: {', '.join(known) or 'none'}. "
            "Add one in hf_merge/mappings/ (see megatron_gpt.py)"
        ) from None


def tables(source: str | None = None) -> dict[tuple[str, str], Mapping[str, Any]]:
    """All registered tables, keyed by ``(source, model_type)``."""
    _load()
    return {k: v for k, v in _REGISTRY.items() if source is None or k[0] == source}


def describe(source: str | None = None) -> str:
    """Human-readable listing of the registered tables (for review and ``inspect``)."""
    lines = []
    seen = set()
    for (_src, _mt), t in sorted(tables(source).items()):
        if t["name"] in seen:
            continue
        seen.add(t["name"])
        lines.append(f"{t['name']} [{t['source']}] model_types={list(t['model_types'])}: {t['summary']}")
        for s, h in t["tensors"].items():
            lines.append(f"  {s} -> {h}")
        for s, h in t["layer_tensors"].items():
            lines.append(f"  {t['layer_prefix']}*.{s} -> {t['hf_layer_prefix']}{h}")
        for s, f in t.get("fused", {}).items():
            roles = ", ".join(f"{r}={f[r]}" for r in _FUSED_ROLES[f["split"]])
            lines.append(f"  {t['layer_prefix']}*.{s} -> split {f['split']}: {roles}")
        for s, h in t.get("lm_head", {}).items():
            lines.append(f"  {s} -> {h} (actor)")
        for s, h in t.get("value_head", {}).items():
            lines.append(f"  {s} -> {h} (critic)")
    return "\n".join(lines)
