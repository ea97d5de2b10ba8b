"""Typed name tables: the language in which a source's tensor names are mapped to Hugging Face names.

Readers return their format's own names (torchtitan ``layers.0.attention.wo.weight``, Megatron
``decoder.layers.self_attention.linear_qkv.weight``); a name table turns them into HF names. A
:class:`NameTable` is data: one :class:`NameRule` per source tensor pattern, with named
placeholders (``{layer}``, ``{expert}``, any identifier) that match decimal indices. A rule maps a
source name to an HF name (``None``: not a weight, drop it), or to several by role (:class:`Split`):

- placeholders in both names carry the index over (``layers.{layer}.attention.wo.weight`` ->
  ``model.layers.{layer}.self_attn.o_proj.weight``);
- placeholders only in the HF name index the leading dims of the source tensor, in the order the
  HF name lists them (Megatron's stacked ``decoder.layers.mlp.experts.experts.linear_fc2.weight``
  ``[L, E, H, F]`` -> ``model.layers.{layer}.mlp.experts.{expert}.down_proj.weight``; torchtitan's
  grouped experts ``[E, F, D]`` -> one ``[F, D]`` tensor per ``{expert}``);
- a :class:`Split` target cuts the rows of a fused tensor into role tensors (``qkv``: Megatron's
  per-query-group ``linear_qkv``, head counts from the HF config; ``gate_up``: ``[gate; up]``);
  the row arithmetic is :mod:`hf_merge.transforms.fused`'s;
- ``op="rope_q"`` / ``"rope_k"`` undo a per-head rotary row permutation (Meta's interleaved
  layout -> HF's half-split layout), head counts from the HF config.

A table may also say what its model's checkpoints must hold (checked when the view is built):
``sizes`` (placeholder -> config.json key: indices run over ``range(config[key])``, a stacked dim
must have that length), ``required`` (rules whose tensors every index of their sized placeholders
must have), ``complete`` (placeholders whose every index must be present wherever one is: all
experts of a layer), ``config_checks`` (a present tensor needs these config.json values), and
``value_rules`` (the rules of a critic / value model's head, :meth:`NameTable.for_value_model`).

Tables are validated when they are built and found by :func:`find_table` among the modules of
:mod:`hf_merge.transforms.name_tables` (each module defines ``TABLES``). This module is the table language:
the types, their validation, matching a source name to its rule and finding a family's table.
:class:`~hf_merge.transforms.name_table_view.NameTableView` applies one to a checkpoint.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import itertools
import pkgutil
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..errors import MappingError
from .fused import FUSED_ROLES

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_DIGITS = re.compile(r"\d+")
ROW_OPS = ("rope_q", "rope_k")
ORDERS = ("source", "table")


def placeholders(template: str) -> list[str]:
    """The ``{name}`` fields of ``template``, in order."""
    return _PLACEHOLDER.findall(template)


def pattern_key(template: str) -> str:
    """``model.layers.{layer}.x`` -> ``model.layers.{}.x`` (two patterns that can write one name)."""
    return _PLACEHOLDER.sub("{}", template)


def _skeleton(text: str) -> str:
    """Digits and placeholders as ``#`` (runs collapsed): the index under which rules are looked up."""
    return re.sub("#+", "#", _DIGITS.sub("#", _PLACEHOLDER.sub("#", text)))


@dataclass(frozen=True)
class Split:
    """A fused tensor's role targets, in storage order: ``Split("qkv", (("q", ...), ("k", ...), ("v", ...)))``."""

    kind: str
    targets: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        roles = FUSED_ROLES.get(self.kind)
        if roles is None:
            raise ValueError(f"unknown split {self.kind!r} (known: {', '.join(FUSED_ROLES)})")
        if tuple(r for r, _ in self.targets) != roles:
            raise ValueError(f"a {self.kind} split needs exactly the roles {list(roles)} in that order, got {[r for r, _ in self.targets]}")
        if not all(isinstance(t, str) and t for _, t in self.targets):
            raise ValueError(f"a {self.kind} split's targets must be names")


def qkv(q: str, k: str, v: str) -> Split:
    """Megatron-Core's per-query-group fused ``linear_qkv`` -> q, k, v."""
    return Split("qkv", (("q", q), ("k", k), ("v", v)))


def gate_up(gate: str, up: str) -> Split:
    """A gated MLP's ``[gate; up]`` fused ``linear_fc1`` -> gate, up."""
    return Split("gate_up", (("gate", gate), ("up", up)))


@dataclass(frozen=True)
class NameRule:
    """``source`` pattern -> ``target`` HF pattern (None: drop; a :class:`Split`: role tensors),
    with an optional row ``op``. ``alt``: another spelling of tensors an earlier rule of the table
    writes (a checkpoint holding both spellings is an error)."""

    source: str
    target: str | Split | None
    op: str | None = None
    alt: bool = False

    def __post_init__(self) -> None:
        src = placeholders(self.source)
        if len(set(src)) != len(src):
            raise ValueError(f"name rule {self.source!r}: a placeholder appears twice")
        if self.target is None:
            if self.op is not None:
                raise ValueError(f"name rule {self.source!r}: a dropped tensor has no op")
            return
        fields = {tuple(placeholders(t)) for _, t in self.targets}
        for tgt in fields:
            if len(set(tgt)) != len(tgt):
                raise ValueError(f"name rule {self.source!r}: a placeholder appears twice in a target")
        if len({frozenset(t) for t in fields}) != 1:
            raise ValueError(f"name rule {self.source!r}: its targets name different placeholders")
        tgt = set(next(iter(fields)))
        if set(src) - tgt:
            raise ValueError(f"name rule {self.source!r} -> {self.target!r}: placeholder(s) {sorted(set(src) - tgt)} lost")
        if self.op is not None and self.op not in ROW_OPS:
            raise ValueError(f"name rule {self.source!r}: unknown op {self.op!r} (known: {', '.join(ROW_OPS)})")
        if self.op is not None and (self.stacked or isinstance(self.target, Split)):
            raise ValueError(f"name rule {self.source!r}: an unstacked or split tensor cannot also have op {self.op!r}")

    @property
    def targets(self) -> tuple[tuple[str | None, str], ...]:
        """``((role, HF pattern), ...)``: one ``(None, target)`` for a 1:1 rule, none for a dropped one."""
        if self.target is None:
            return ()
        if isinstance(self.target, Split):
            return self.target.targets
        return ((None, self.target),)

    @property
    def stacked(self) -> tuple[str, ...]:
        """The placeholders only the HF name has: they index the source's leading dims, in this order."""
        if not self.targets:
            return ()
        src = set(placeholders(self.source))
        return tuple(p for p in placeholders(self.targets[0][1]) if p not in src)

    @functools.cached_property
    def pattern(self) -> re.Pattern[str]:
        parts = _PLACEHOLDER.split(self.source)  # literal, name, literal, name, ...
        rx = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>\\d+)" for i, p in enumerate(parts))
        return re.compile(rx + r"\Z")


@dataclass(frozen=True)
class NameTable:
    """One source family's names: ``source`` (e.g. ``"torchtitan"``) x HF ``model_types``.

    Rules are tried in order; the first match wins. ``skip`` (training state: optimizer...) and
    ``ignore`` (model entries that are not weights: ``*._extra_state``) are fnmatch patterns of
    entries dropped before the rules. ``order``: ``"source"`` keeps the source's order;
    ``"table"`` lists the HF tensors as the table lists its rules, the rules with the ``{layer}``
    placeholder layer by layer (embeddings, layer 0, layer 1, ..., final norm, head). The other
    fields are described in the module docstring.
    """

    name: str
    source: str
    model_types: tuple[str, ...]
    rules: tuple[NameRule, ...]
    skip: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    description: str = ""
    citation: str = ""  # where the mapping comes from (file at version)
    sizes: Mapping[str, str] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    complete: tuple[str, ...] = ()
    config_checks: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    value_rules: tuple[NameRule, ...] = ()
    architectures: Mapping[str, str] = field(default_factory=dict)  # "causal_lm" / "value" -> HF class
    order: str = "source"

    def __post_init__(self) -> None:
        if not self.rules or not self.model_types:
            raise ValueError(f"name table {self.name!r} has no rules or no model types")
        seen: set[str] = set()
        written: set[str] = set()
        used: set[str] = set()
        for rule in self.rules:
            if not isinstance(rule, NameRule):
                raise TypeError(f"name table {self.name!r}: {rule!r} is not a NameRule")
            if rule.source in seen:
                raise ValueError(f"name table {self.name!r}: {rule.source!r} appears twice")
            seen.add(rule.source)
            keys = {pattern_key(t) for _, t in rule.targets}
            if rule.alt and not keys <= written:
                raise ValueError(f"name table {self.name!r}: {rule.source!r} is an alternative spelling but no earlier rule writes {sorted(keys - written)}")
            if not rule.alt and keys & written:
                raise ValueError(f"name table {self.name!r}: two rules write {sorted(keys & written)[0]!r} (mark the later one alt=True if it is another spelling)")
            written |= keys
            used.update(placeholders(rule.source))
            for _, t in rule.targets:
                used.update(placeholders(t))
        for p in list(self.sizes) + list(self.complete):
            if p not in used:
                raise ValueError(f"name table {self.name!r}: sizes / complete name {p!r}, which no rule uses")
        for p in self.complete:
            if p not in self.sizes:
                raise ValueError(f"name table {self.name!r}: complete placeholder {p!r} needs a size (config key)")
        for src in list(self.required) + list(self.config_checks):
            if src not in seen:
                raise ValueError(f"name table {self.name!r}: required / config_checks entry {src!r} is not a rule's source")
        for rule in self.value_rules:
            if not isinstance(rule, NameRule) or rule.target is None:
                raise ValueError(f"name table {self.name!r}: value rule {rule!r} must be a NameRule with a target")
        if self.value_rules and "value" not in self.architectures:
            raise ValueError(f"name table {self.name!r} has value rules but no 'value' architecture")
        if self.order not in ORDERS:
            raise ValueError(f"name table {self.name!r}: order {self.order!r} is not one of {ORDERS}")
        for pat in self.skip + self.ignore:
            if not isinstance(pat, str) or not pat:
                raise ValueError(f"name table {self.name!r}: bad skip / ignore pattern {pat!r}")

    @functools.cached_property
    def _index(self) -> tuple[dict[str, list[NameRule]], list[NameRule]]:
        by_skeleton: dict[str, list[NameRule]] = {}
        loose = []  # a placeholder next to a digit or another placeholder: no reliable skeleton
        for rule in self.rules:
            if re.search(r"\d\{|\}\d|\}\{", rule.source):
                loose.append(rule)
            else:
                by_skeleton.setdefault(_skeleton(rule.source), []).append(rule)
        return by_skeleton, loose

    def match(self, name: str) -> tuple[NameRule, dict[str, str]] | None:
        by_skeleton, loose = self._index
        hits = []
        for rule in itertools.chain(by_skeleton.get(_skeleton(name), ()), loose):
            m = rule.pattern.match(name)
            if m:
                hits.append((self._position[rule.source], rule, m.groupdict()))
        if not hits:
            return None
        _, rule, values = min(hits, key=lambda h: h[0])  # the first rule of the table that matches
        return rule, values

    @functools.cached_property
    def _position(self) -> dict[str, int]:
        return {r.source: i for i, r in enumerate(self.rules)}

    @functools.cached_property
    def _skip_rx(self) -> re.Pattern[str] | None:
        return re.compile("|".join(fnmatch.translate(p) for p in self.skip)) if self.skip else None

    @functools.cached_property
    def _ignore_rx(self) -> re.Pattern[str] | None:
        return re.compile("|".join(fnmatch.translate(p) for p in self.ignore)) if self.ignore else None

    def skipped(self, name: str) -> bool:
        """Training state, not the model (``skip``)."""
        return self._skip_rx is not None and self._skip_rx.match(name) is not None

    def ignored(self, name: str) -> bool:
        """A model entry that is not a weight (``ignore``)."""
        return self._ignore_rx is not None and self._ignore_rx.match(name) is not None

    def for_value_model(self) -> "NameTable":
        """This table for a critic / value model: ``value_rules`` replace the rules of the same
        source (and the others are added after the rules)."""
        if not self.value_rules:
            raise MappingError(f"name table {self.name!r} has no value-model rules")
        by_source = {r.source: r for r in self.value_rules}
        rules = tuple(by_source.pop(r.source, r) for r in self.rules) + tuple(by_source.values())
        return replace(self, name=f"{self.name}+value", rules=rules, value_rules=())

    def describe(self) -> str:
        """The table as text, one rule a line (for review and the README)."""
        lines = [f"{self.name} [{self.source}] model_types={list(self.model_types)}: {self.description}"]
        for r in self.rules:
            if r.target is None:
                lines.append(f"  {r.source} -> (dropped)")
            elif isinstance(r.target, Split):
                roles = ", ".join(f"{role}={t}" for role, t in r.target.targets)
                lines.append(f"  {r.source} -> split {r.target.kind}: {roles}")
            else:
                lines.append(f"  {r.source} -> {r.target}" + (f" ({r.op})" if r.op else ""))
        return "\n".join(lines)


@functools.cache
def all_tables() -> tuple[NameTable, ...]:
    """Every table in :mod:`hf_merge.transforms.name_tables` (each module's ``TABLES``)."""
    from . import name_tables

    found: list[NameTable] = []
    for mod in pkgutil.iter_modules(name_tables.__path__):
        module = importlib.import_module(f"{name_tables.__name__}.{mod.name}")
        found.extend(t for t in getattr(module, "TABLES", ()) if isinstance(t, NameTable))
    names = [t.name for t in found]
    if len(set(names)) != len(names):
        raise RuntimeError(f"two name tables share a name: {names}")
    claims = [(t.source, m) for t in found for m in t.model_types]
    if len(set(claims)) != len(claims):
        raise RuntimeError(f"two name tables of one source claim one model_type: {sorted(c for c in claims if claims.count(c) > 1)}")
    return tuple(found)


def find_table(source: str, config: Mapping[str, Any]) -> NameTable:
    """The table for ``source`` names of the model ``config`` describes (its ``model_type``)."""
    model_type = str(config.get("model_type") or "")
    candidates = [t for t in all_tables() if t.source == source]
    for table in candidates:
        if model_type in table.model_types:
            return table
    known = sorted({m for t in candidates for m in t.model_types})
    raise MappingError(
        f"no {source} name table for model_type {model_type!r} (config.json); supported: {', '.join(known) or 'none'}; "
        "pass --config with the matching Hugging Face config, or add a table in hf_merge/transforms/name_tables/"
    )
