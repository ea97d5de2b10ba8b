"""Rename a source's tensors to Hugging Face names through a typed name table.

A :class:`NameTable` is data: one :class:`NameRule` per source tensor pattern, with named
placeholders (``{layer}``, ``{expert}``, any identifier) that match decimal indices. A rule maps a
source name to an HF name (``None``: not a weight, drop it) and may name a row operation:

- placeholders in both names carry the index over (``layers.{layer}.attention.wo.weight`` ->
  ``model.layers.{layer}.self_attn.o_proj.weight``);
- a placeholder only in the HF name unstacks dim 0 of the source tensor (torchtitan's grouped
  experts ``[E, F, D]`` -> one ``[F, D]`` tensor per ``{expert}``);
- ``op="rope_q"`` / ``"rope_k"`` undo a per-head rotary row permutation (Meta's interleaved
  layout -> HF's half-split layout), head counts from the HF config.

Tables are validated when they are built and found by :func:`find_table` among the modules of
:mod:`hf_merge.name_tables` (each module defines ``TABLES``). :class:`NameTableView` applies one
lazily: nothing is read until a consumer asks, the fast row path (``read_rows``) and region reads
survive renaming, and a source tensor no rule accounts for is an error naming it.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from ..checkpoint import ROW_CHUNK_BYTES, LazyCheckpoint, check_out, row_runs
from ..errors import MappingError
from ..spec import TensorSpec

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
ROW_OPS = ("rope_q", "rope_k")


@dataclass(frozen=True)
class NameRule:
    """``source`` pattern -> ``target`` HF pattern (None: drop), with an optional row ``op``."""

    source: str
    target: str | None
    op: str | None = None

    def __post_init__(self) -> None:
        src = _PLACEHOLDER.findall(self.source)
        if len(set(src)) != len(src):
            raise ValueError(f"name rule {self.source!r}: a placeholder appears twice")
        if self.target is None:
            if self.op is not None:
                raise ValueError(f"name rule {self.source!r}: a dropped tensor has no op")
            return
        tgt = _PLACEHOLDER.findall(self.target)
        if len(set(tgt)) != len(tgt):
            raise ValueError(f"name rule {self.target!r}: a placeholder appears twice")
        if len(set(tgt) - set(src)) > 1:
            raise ValueError(f"name rule {self.source!r} -> {self.target!r}: at most one placeholder may unstack dim 0")
        if set(src) - set(tgt):
            raise ValueError(f"name rule {self.source!r} -> {self.target!r}: placeholder(s) {sorted(set(src) - set(tgt))} lost")
        if self.op is not None and self.op not in ROW_OPS:
            raise ValueError(f"name rule {self.source!r}: unknown op {self.op!r} (known: {', '.join(ROW_OPS)})")
        if self.op is not None and self.unstack is not None:
            raise ValueError(f"name rule {self.source!r}: an unstacked tensor cannot also have op {self.op!r}")

    @property
    def unstack(self) -> str | None:
        """The placeholder only the HF name has (it indexes dim 0 of the source tensor)."""
        if self.target is None:
            return None
        extra = set(_PLACEHOLDER.findall(self.target)) - set(_PLACEHOLDER.findall(self.source))
        return next(iter(extra), None)

    @functools.cached_property
    def pattern(self) -> re.Pattern[str]:
        parts = _PLACEHOLDER.split(self.source)  # literal, name, literal, name, ...
        rx = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>\\d+)" for i, p in enumerate(parts))
        return re.compile(rx + r"\Z")


@dataclass(frozen=True)
class NameTable:
    """One source family's names: ``source`` (e.g. ``"torchtitan"``) x HF ``model_types``.

    ``skip`` are prefixes of entries that are not model weights (optimizer state...). Rules are
    tried in order; the first match wins.
    """

    name: str
    source: str
    model_types: tuple[str, ...]
    rules: tuple[NameRule, ...]
    skip: tuple[str, ...] = ()
    description: str = ""
    citation: str = ""  # where the mapping comes from (file at version)

    def __post_init__(self) -> None:
        if not self.rules or not self.model_types:
            raise ValueError(f"name table {self.name!r} has no rules or no model types")
        seen: set[str] = set()
        targets: set[str] = set()
        for rule in self.rules:
            if not isinstance(rule, NameRule):
                raise TypeError(f"name table {self.name!r}: {rule!r} is not a NameRule")
            if rule.source in seen:
                raise ValueError(f"name table {self.name!r}: {rule.source!r} appears twice")
            seen.add(rule.source)
            if rule.target is not None:
                key = _PLACEHOLDER.sub("{}", rule.target)
                if key in targets:
                    raise ValueError(f"name table {self.name!r}: two rules write {rule.target!r}")
                targets.add(key)

    def match(self, name: str) -> tuple[NameRule, dict[str, str]] | None:
        for rule in self.rules:
            m = rule.pattern.match(name)
            if m:
                return rule, m.groupdict()
        return None

    def skipped(self, name: str) -> bool:
        return any(name == p.rstrip(".") or name.startswith(p) for p in self.skip)


@functools.cache
def all_tables() -> tuple[NameTable, ...]:
    """Every table in :mod:`hf_merge.name_tables` (each module's ``TABLES``)."""
    from .. import name_tables

    found: list[NameTable] = []
    for mod in pkgutil.iter_modules(name_tables.__path__):
        module = importlib.import_module(f"{name_tables.__name__}.{mod.name}")
        found.extend(t for t in getattr(module, "TABLES", ()) if isinstance(t, NameTable))
    names = [t.name for t in found]
    if len(set(names)) != len(names):
        raise RuntimeError(f"two name tables share a name: {names}")
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
        f"no {source} name table for model_type {model_type!r} (config.json); known: {', '.join(known) or 'none'}; "
        "pass --config with the matching Hugging Face config, or add a table in hf_merge/name_tables/"
    )


# --------------------------------------------------------------------------------------------
# Rotary permutation (pure functions)
# --------------------------------------------------------------------------------------------


def rope_source_rows(rows: int, n_heads: int) -> torch.Tensor:
    """For each HF row of a q/k projection, the source row it comes from.

    Meta / torchtitan order the rows of each head as interleaved pairs; HF (after
    ``convert_llama_weights_to_hf``'s permute, which torchtitan's Llama3 state-dict adapter
    applies in ``to_hf``) as two halves:
    ``hf = w.view(n_heads, rows // n_heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)``.
    So HF row ``(h, b, a)`` is source row ``(h, a, b)`` (``b`` in {0, 1}, ``a`` < head_dim / 2).
    """
    if rows % n_heads or (rows // n_heads) % 2:
        raise MappingError(f"cannot undo the rotary permutation: {rows} rows are not {n_heads} heads of an even size")
    return torch.arange(rows).view(n_heads, rows // n_heads // 2, 2).transpose(1, 2).reshape(rows)


def _heads(config: Mapping[str, Any], op: str) -> int:
    try:
        n_q = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        raise MappingError("config.json has no num_attention_heads; the q/k rotary permutation needs it") from None
    if op == "rope_q":
        return n_q
    return int(config.get("num_key_value_heads") or n_q)


# --------------------------------------------------------------------------------------------
# The view
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    source: str
    rule: NameRule
    index: int | None = None  # unstacked: the dim-0 index of the source
    heads: int | None = None  # rope ops: head count


@dataclass
class _Plan:
    targets: dict[str, _Target] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


class NameTableView(LazyCheckpoint):
    """``base`` under HF names by ``table`` (see the module docstring).

    Raises:
        MappingError: a base tensor no rule (and no skip prefix) accounts for, or two source
            tensors that would get the same HF name.
    """

    def __init__(self, base: LazyCheckpoint, table: NameTable, config: Mapping[str, Any]):
        self.base, self.table = base, table
        self.info = base.info
        plan = _Plan()
        base_specs = base.specs()
        unknown: list[str] = []
        self._specs: dict[str, TensorSpec] = {}
        self._targets: dict[str, _Target] = {}
        for name, spec in base_specs.items():
            if table.skipped(name):
                plan.skipped.append(name)
                continue
            hit = table.match(name)
            if hit is None:
                unknown.append(name)
                continue
            rule, values = hit
            if rule.target is None:
                plan.dropped.append(name)
                continue
            heads = _heads(config, rule.op) if rule.op else None
            if rule.unstack is not None:
                if not spec.shape:
                    raise MappingError(f"{name}: a scalar cannot be unstacked into {rule.target}")
                for i in range(spec.shape[0]):
                    self._add(rule.target.format(**values, **{rule.unstack: i}), _Target(name, rule, i), spec.shape[1:], spec)
            else:
                if heads is not None and len(spec.shape) != 2:
                    raise MappingError(f"{name}: rotary un-permutation needs a 2-D weight, got shape {list(spec.shape)}")
                self._add(rule.target.format(**values), _Target(name, rule, None, heads), spec.shape, spec)
        if unknown:
            more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
            raise MappingError(
                f"{unknown[0]}{more}: no rule of name table {table.name!r} maps it to a Hugging Face name; "
                f"is the config's model_type right (pass --config), or does the table need a rule?"
            )
        self._plan = plan

    def _add(self, hf: str, target: _Target, shape: tuple[int, ...], spec: TensorSpec) -> None:
        if hf in self._specs:
            raise MappingError(
                f"{target.source} and {self._targets[hf].source} both map to {hf} (name table {self.table.name!r})"
            )
        self._specs[hf] = TensorSpec(hf, tuple(shape), spec.dtype)
        self._targets[hf] = target

    @property
    def dropped(self) -> list[str]:
        """Source tensors the table drops (not weights), and those under a skip prefix."""
        return self._plan.dropped + self._plan.skipped

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def source_name(self, name: str) -> str:
        return self._targets[name].source

    def read_into(self, name: str, out: torch.Tensor) -> None:
        check_out(self._specs[name], out)
        t = self._targets[name]
        if t.index is not None:
            self._read_unstacked(t, out)
        elif t.heads is not None:
            for first, rows in self._rope_rows(t, out.dtype, ROW_CHUNK_BYTES):
                out[first : first + len(rows)].copy_(rows)
        else:
            self.base.read_into(t.source, out)

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        t = self._targets[name]
        if t.index is None and t.heads is None:
            return self.base.read_rows(t.source, dtype, max_bytes)
        if t.heads is not None and hasattr(self.base, "read_region_into"):
            return self._rope_rows(t, dtype, max_bytes)
        return None

    def _read_unstacked(self, t: _Target, out: torch.Tensor) -> None:
        region = getattr(self.base, "read_region_into", None)
        spec = self.base.specs()[t.source]
        if region is not None:
            region(t.source, (t.index,) + (0,) * (len(spec.shape) - 1), out.unsqueeze(0))
        else:  # a base without box reads: the stacked tensor, once per expert
            out.copy_(self.base.read(t.source)[t.index])

    def _rope_rows(self, t: _Target, dtype: torch.dtype, max_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """The HF rows, one head at a time: a head's rows are a permutation of the same head's
        source rows, so memory is one head (``head_dim x dim``) whatever the model size."""
        rows, dim = self.base.specs()[t.source].shape
        perm = rope_source_rows(rows, t.heads)
        head = rows // t.heads
        region = getattr(self.base, "read_region_into", None)
        full = None if region is not None else self.base.read(t.source)
        src = torch.empty(head, dim, dtype=self.base.specs()[t.source].dtype)
        local = perm[:head]  # the same permutation inside every head
        for h in range(t.heads):
            if full is None:
                region(t.source, (h * head, 0), src)
            else:
                src.copy_(full[h * head : (h + 1) * head])
            yield from row_runs(src[local], h * head, dtype, max_bytes)

    def close(self) -> None:
        self.base.close()
