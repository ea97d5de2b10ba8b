"""The one interpreter of name tables: a source checkpoint under Hugging Face names.

:class:`NameTableView` applies a :class:`~hf_merge.transforms.name_table.NameTable` (the table
language, its rules and their matching, is :mod:`hf_merge.transforms.name_table`) lazily: nothing is
read until a consumer asks, stacked dims are unstacked and fused tensors split as row regions (head
counts from the HF config, the row arithmetic of :mod:`hf_merge.transforms.fused`), rotary rows
un-permuted, the fast row path (``read_rows``) and region reads survive renaming, and a source
tensor no rule accounts for is an error naming it.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from .. import config_fields
from ..checkpoint import ROW_CHUNK_BYTES, LazyCheckpoint, check_out, row_runs
from ..readers.file_runs import FileRun, Piece, RowGather
from ..errors import MappingError, MissingConfigError
from ..spec import TensorSpec
from .fused import FusedSplit, RowRange, read_region_into
from .name_table import NameRule, NameTable, Split, pattern_key, placeholders

if TYPE_CHECKING:  # planning and file runs need no torch (the head start plans with a view over a DcpIndex)
    import torch

_MAX_NAMED = 3  # names an error lists; the rest are counted


def _few(names: Sequence[str]) -> str:
    """The first :data:`_MAX_NAMED` names, and how many more there are: a line, not a listing."""
    more = f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
    return ", ".join(names[:_MAX_NAMED]) + more


# --------------------------------------------------------------------------------------------
# Head counts and the rotary permutation (pure functions)
# --------------------------------------------------------------------------------------------


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def attention_heads(config: Mapping[str, Any], where: str = "config.json") -> tuple[int, int, int]:
    """``(num_attention_heads, num_key_value_heads, head_dim)`` of an HF config (kv heads default to
    the query heads, head_dim to hidden_size // heads). MissingConfigError if they are not positive."""
    nq, hidden = (config_fields.get(config, k) for k in ("num_attention_heads", "hidden_size"))
    missing = [k for k, v in (("num_attention_heads", nq), ("hidden_size", hidden)) if not _positive_int(v)]
    if missing:
        raise MissingConfigError(f"{where}: config.json has no positive integer {missing[0]}; cannot split the fused QKV tensors")
    nkv = config_fields.get(config, "num_key_value_heads") or nq
    hd = config_fields.get(config, "head_dim") or hidden // nq
    if not (_positive_int(nkv) and _positive_int(hd)):
        raise MissingConfigError(
            f"{where}: num_key_value_heads={nkv!r} and head_dim={hd!r} (hidden_size // num_attention_heads if "
            "absent) must be positive integers; cannot split the fused QKV tensors"
        )
    return nq, nkv, hd


def rope_source_rows(rows: int, n_heads: int) -> list[int]:
    """For each HF row of a q/k projection, the source row it comes from.

    Meta / torchtitan order the rows of each head as interleaved pairs; HF (after
    ``convert_llama_weights_to_hf``'s permute, which torchtitan's Llama3 state-dict adapter
    applies in ``to_hf``) as two halves:
    ``hf = w.view(n_heads, rows // n_heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)``.
    So HF row ``(h, b, a)`` is source row ``(h, a, b)`` (``b`` in {0, 1}, ``a`` < head_dim / 2).
    """
    if rows % n_heads or (rows // n_heads) % 2:
        raise MappingError(f"cannot undo the rotary permutation: {rows} rows are not {n_heads} heads of an even size")
    head, half = rows // n_heads, rows // n_heads // 2
    return [h * head + a * 2 + b for h in range(n_heads) for b in (0, 1) for a in range(half)]


def _rope_heads(config: Mapping[str, Any], op: str) -> int:
    try:
        n_q = int(config_fields.get(config, "num_attention_heads"))
    except (TypeError, ValueError):
        raise MappingError("config.json has no num_attention_heads; the q/k rotary permutation needs it") from None
    if op == "rope_q":
        return n_q
    return int(config_fields.get(config, "num_key_value_heads") or n_q)


# --------------------------------------------------------------------------------------------
# The view
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    source: str
    rule: NameRule
    values: Mapping[str, int]  # every placeholder's value (from the name and from the stacked dims)
    index: tuple[int, ...] = ()  # positions on the source's leading stacked dims
    role: str | None = None  # a Split's role
    ranges: tuple[RowRange, ...] | None = None  # a Split role's rows in the (unstacked) source
    heads: int | None = None  # rope ops: head count


@dataclass(frozen=True)
class Resolved:
    """How one HF tensor comes from the source: for ``inspect`` and a reader's own checks."""

    name: str
    source: str
    rule: NameRule
    values: Mapping[str, int]
    role: str | None

    def describe(self) -> str:
        """``decoder.layers.mlp.linear_fc1.weight[1] (gate_up: up)``."""
        text = self.source + "".join(f"[{self.values[p]}]" for p in self.rule.stacked)
        if self.role is not None:
            text += f" ({self.rule.target.kind}: {self.role})"  # type: ignore[union-attr]
        elif self.rule.op:
            text += f" ({self.rule.op})"
        return text


class NameTableView(LazyCheckpoint):
    """``base`` under HF names by ``table`` (see the module docstring).

    Raises:
        MappingError: a base tensor no rule (and no skip / ignore pattern) accounts for, two source
            tensors that would get the same HF name, an index or stacked dim that disagrees with
            the config's sizes, or a table requirement the checkpoint does not meet.
        MissingConfigError: a size or head count the table needs is not in the config.
    """

    def __init__(self, base: LazyCheckpoint, table: NameTable, config: Mapping[str, Any], *, where: str | None = None):
        self.base, self.table = base, table
        self.info = getattr(base, "info", None)
        if hasattr(base, "fds"):  # a DcpIndex's descriptors: the head start checks its records' CRCs by them
            self.fds = base.fds
        self._where = f"{where}: " if where else ""
        self.skipped: list[str] = []
        self.ignored: list[str] = []
        self._dropped: list[str] = []
        self._sizes = self._config_sizes(config)
        self._qkv_heads = None
        unknown: list[str] = []
        found: list[tuple[tuple, str, _Target, tuple[int, ...]]] = []
        base_specs = base.specs()
        for name, spec in base_specs.items():
            if table.skipped(name):
                self.skipped.append(name)
                continue
            if table.ignored(name):
                self.ignored.append(name)
                continue
            hit = table.match(name)
            if hit is None:
                unknown.append(name)
                continue
            rule, named = hit
            if rule.target is None:
                self._dropped.append(name)
                continue
            values = {k: int(v) for k, v in named.items()}
            for key, target, shape in self._expand(name, spec, rule, values, config):
                found.append((key, target.rule.source, target, shape))
        if unknown:  # the table's own example names what was expected: many unknown names are another format's
            example = re.sub(r"\{\w+\}", "0", table.rules[0].source)
            raise MappingError(
                f"{self._where}{_few(unknown)}: no rule of name table {table.name!r} (model_type {config.get('model_type')!r}) "
                f"maps {'it' if len(unknown) == 1 else 'them'} to a Hugging Face name ({len(unknown)} of {len(base_specs)} "
                f"tensors; {table.source} names look like {example}). Nothing was dropped; is the config's model_type right "
                "(pass --config), or does a table in hf_merge/transforms/name_tables/ need a rule?"
            )
        if table.order == "table":
            found.sort(key=lambda f: f[0])
        self._specs: dict[str, TensorSpec] = {}
        self._targets: dict[str, _Target] = {}
        for _, _, target, shape in found:
            self._add(target, shape, base_specs[target.source])
        self._check(config)
        if hasattr(base, "read_region_into"):  # box reads survive renaming (layer / head slices)
            self.read_region_into = self._read_region_into

    # ---- planning ---------------------------------------------------------------------------

    def _config_sizes(self, config: Mapping[str, Any]) -> dict[str, int | None]:
        sizes: dict[str, int | None] = {}
        for p, key in self.table.sizes.items():
            value = config_fields.get(config, key)
            sizes[p] = value if _positive_int(value) else None
        return sizes

    def _size(self, p: str, source: str) -> int:
        size = self._sizes.get(p)
        if size is None:
            raise MissingConfigError(
                f"{self._where}{source} needs config.json {self.table.sizes[p]} (the number of {p}s, a positive integer); "
                "pass --config DIR with the right one"
            )
        return size

    def _expand(self, name: str, spec: TensorSpec, rule: NameRule, values: dict[str, int], config: Mapping[str, Any]):
        """``(order key, target, shape)`` of every HF tensor ``name`` holds."""
        for p, v in values.items():
            if p in self.table.sizes and v >= self._size(p, name):
                raise MappingError(f"{self._where}{name} is {p} {v}, but config.json has {self.table.sizes[p]}={self._sizes[p]}")
        stacked = rule.stacked
        dims: list[int] = []
        for d, p in enumerate(stacked):
            if p in self.table.sizes:
                dims.append(self._size(p, name))
            elif d < len(spec.shape):
                dims.append(spec.shape[d])
        if len(spec.shape) < len(stacked) or tuple(spec.shape[: len(stacked)]) != tuple(dims):
            want = ", ".join(f"{self.table.sizes.get(p, p)}={n}" for p, n in zip(stacked, dims))
            raise MappingError(
                f"{self._where}{name} has shape {list(spec.shape)}; its leading stacked axes should be {want} "
                "(is config.json the right one?)"
            )
        shape = tuple(spec.shape[len(stacked):])
        heads = _rope_heads(config, rule.op) if rule.op else None
        if heads is not None and len(shape) != 2:
            raise MappingError(f"{self._where}{name}: rotary un-permutation needs a 2-D weight, got shape {list(shape)}")
        split = None
        if isinstance(rule.target, Split):
            if not shape:
                raise MappingError(f"{self._where}{name}: a scalar cannot be split as {rule.target.kind}")
            split = self._split(rule.target, name, config).ranges(shape[0])
        for index in itertools.product(*(range(n) for n in dims)):
            vals = {**values, **dict(zip(stacked, index))}
            for r, (role, pattern) in enumerate(rule.targets):
                target = _Target(name, rule, vals, tuple(index), role, tuple(split[role]) if split else None, heads)
                role_shape = (sum(n for _, _, n in split[role]),) + shape[1:] if split else shape
                yield self._order_key(rule, vals, r), target, role_shape

    def _split(self, split: Split, name: str, config: Mapping[str, Any]) -> FusedSplit:
        outputs = dict(split.targets)
        if split.kind != "qkv":
            return FusedSplit(split.kind, outputs)
        if self._qkv_heads is None:
            self._qkv_heads = attention_heads(config)
        nq, nkv, hd = self._qkv_heads
        return FusedSplit(split.kind, outputs, num_heads=nq, num_kv_heads=nkv, head_dim=hd)

    def _order_key(self, rule: NameRule, values: Mapping[str, int], role: int) -> tuple:
        pos = self.table._position[rule.source]
        rest = tuple(values[p] for p in placeholders(rule.targets[0][1]) if p != "layer")
        if "layer" in values:
            return (1, values["layer"], pos, rest, role)
        return (0 if pos < self._first_layer_rule else 2, pos, 0, rest, role)

    @functools.cached_property
    def _first_layer_rule(self) -> int:
        return next((i for i, r in enumerate(self.table.rules) if r.targets and "layer" in placeholders(r.targets[0][1])), len(self.table.rules))

    def _add(self, target: _Target, shape: tuple[int, ...], spec: TensorSpec) -> None:
        pattern = dict(target.rule.targets)[target.role]
        hf = pattern.format(**target.values)
        if hf in self._specs:
            other = self._targets[hf]
            raise MappingError(
                f"{self._where}both {_label(other)} and {_label(target)} map to {hf} (name table {self.table.name!r}): "
                "the checkpoint holds two spellings of one tensor"
            )
        self._specs[hf] = TensorSpec(hf, tuple(shape), spec.dtype)
        self._targets[hf] = target

    def _check(self, config: Mapping[str, Any]) -> None:
        """The table's requirements: required tensors at every index, complete placeholders, config values."""
        table = self.table
        written: dict[str, set[tuple]] = {}  # HF pattern key -> value tuples present
        for t in self._targets.values():
            pattern = dict(t.rule.targets)[t.role]
            written.setdefault(pattern_key(pattern), set()).add(tuple(t.values[p] for p in placeholders(pattern)))
        rules = {r.source: r for r in table.rules}
        missing = []
        for src in table.required:
            pattern = rules[src].targets[0][1]
            fields = placeholders(pattern)
            have = written.get(pattern_key(pattern), set())
            sized = [p for p in fields if p in table.sizes]
            if not have:
                missing.append(src)
                continue
            if sized and len(sized) == len(fields):
                want = set(itertools.product(*(range(self._size(p, src)) for p in fields)))
                lacking = sorted(want - have)
                if lacking:
                    shown = [v[0] if len(v) == 1 else v for v in lacking]
                    missing.append(f"{src} ({'/'.join(fields)} {shown[:8]}{'...' if len(shown) > 8 else ''})")
        if missing:
            raise MappingError(f"{self._where}the {table.name} table requires tensors this checkpoint lacks: {', '.join(missing)}")
        for p in table.complete:
            size = self._sizes.get(p)
            groups: dict[tuple, tuple[set[int], _Target]] = {}
            for t in self._targets.values():
                if p in t.values:
                    other = tuple(sorted((f, v) for f, v in t.values.items() if f != p))
                    held, _ = groups.setdefault((other, pattern_key(dict(t.rule.targets)[t.role])), (set(), t))
                    held.add(t.values[p])
            for (other, _), (held, t) in sorted(groups.items(), key=lambda g: g[0]):
                absent = sorted(set(range(size or 0)) - held)
                if absent:
                    label = t.rule.source
                    for f, v in other:
                        label = label.replace("{" + f + "}", str(v))
                    raise MappingError(
                        f"{self._where}{label} lacks {p}s {absent[:8]}{'...' if len(absent) > 8 else ''} of "
                        f"{table.sizes[p]}={size}; the checkpoint is incomplete"
                    )
        for src, wants in table.config_checks.items():
            if not any(pattern_key(t) in written for _, t in rules[src].targets):
                continue
            for ckey, want in wants.items():
                if config_fields.get(config, ckey) != want:
                    raise MappingError(
                        f"{self._where}the checkpoint has {src} but config.json has {ckey}={config_fields.get(config, ckey)!r}; "
                        f"set {ckey}: {json.dumps(want)} in config.json (or pass --config DIR with the right one)"
                    )

    # ---- what it resolved -------------------------------------------------------------------

    @property
    def dropped(self) -> list[str]:
        """Source tensors the table drops (not weights), and those skipped or ignored by pattern."""
        return self._dropped + self.skipped + self.ignored

    def resolved(self) -> Iterator[Resolved]:
        """Every HF tensor with the source tensor (and index, role) it comes from, in order."""
        for name, t in self._targets.items():
            yield Resolved(name, t.source, t.rule, t.values, t.role)

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def source_name(self, name: str) -> str:
        return self._targets[name].source

    def describe_source(self, name: str) -> str:
        """Where ``name`` comes from: ``decoder.layers.self_attention.linear_qkv.weight[1] (qkv: q)``."""
        t = self._targets[name]
        return Resolved(name, t.source, t.rule, t.values, t.role).describe()

    # ---- reading ----------------------------------------------------------------------------

    def read_into(self, name: str, out: torch.Tensor) -> None:
        check_out(self._specs[name], out)
        t = self._targets[name]
        if t.heads is not None:
            for first, rows in self._rope_rows(t, out.dtype, ROW_CHUNK_BYTES):
                out[first : first + len(rows)].copy_(rows)
        elif not t.index and t.ranges is None:
            self.base.read_into(t.source, out)
        else:
            self._read_box(t, (0,) * out.dim(), out)

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        t = self._targets[name]
        if t.heads is not None:
            runs = self._rope_file_rows(t, name, dtype)
            if runs is not None:
                return iter(runs)
            return self._rope_rows(t, dtype, max_bytes) if hasattr(self.base, "read_region_into") else None
        if not t.index and t.ranges is None:
            return self.base.read_rows(t.source, dtype, max_bytes)
        runs = self._file_rows(t, name, dtype)
        if runs is not None:
            return iter(runs)
        return super().read_rows(name, dtype, max_bytes)  # row chunks by region reads, when the base has them

    def _file_rows(self, t: _Target, name: str, dtype: torch.dtype) -> list[tuple[int, Piece]] | None:
        """A layer's slice or a fused role's rows as the source's file runs, unchanged bytes in
        place of region reads (the loader maps them, a writer copies them file to file); None
        when the base has no file runs for them (another dtype, a chunk cut along a column)."""
        file_rows = getattr(self.base, "file_rows", None)
        if file_rows is None or dtype != self._specs[name].dtype or not self._specs[name].shape:
            return None
        ranges = t.ranges if t.ranges is not None else ((0, 0, self._specs[name].shape[0]),)
        runs: list[tuple[int, Piece]] = []
        for src, dst, n in sorted(ranges, key=lambda r: r[1]):
            found = file_rows(t.source, t.index, src, n)
            if found is None:
                return None
            runs.extend((dst + row, run) for row, run in found)
        return runs

    def _rope_file_rows(self, t: _Target, name: str, dtype: torch.dtype) -> list[tuple[int, Piece]] | None:
        """A q/k projection un-permuted as file bytes: each head a
        :class:`~hf_merge.readers.file_runs.RowGather` of its source rows (a run per row where a
        chunk boundary cuts the head), so a writer copies it from the files and the head start's
        recipe names every byte. None when the base has no file runs for the tensor."""
        file_rows = getattr(self.base, "file_rows", None)
        spec = self._specs[name]
        if file_rows is None or dtype != spec.dtype or not spec.shape or not spec.shape[0]:
            return None
        rows = spec.shape[0]
        found = file_rows(t.source, t.index, 0, rows)
        if found is None or not all(isinstance(run, FileRun) for _, run in found):
            return None
        row_bytes, head = spec.nbytes // rows, rows // t.heads
        run_of_row: list[tuple[FileRun, int]] = []
        for first, run in found:
            run_of_row.extend((run, i) for i in range(run.nbytes // row_bytes))
        if len(run_of_row) != rows:
            return None
        perm = rope_source_rows(rows, t.heads)
        order = tuple(perm[:head])  # the same permutation inside every head
        out: list[tuple[int, Piece]] = []
        for first in range(0, rows, head):
            (run, i), (last, _) = run_of_row[first], run_of_row[first + head - 1]
            if last is run:  # the head's rows are one run: read once, rows copied in order
                out.append((first, RowGather(run.rows(i, head, row_bytes), order)))
            else:  # a chunk boundary inside the head: a run per row
                out.extend((r, run_of_row[perm[r]][0].rows(run_of_row[perm[r]][1], 1, row_bytes)) for r in range(first, first + head))
        return out

    def _read_region_into(self, name: str, start: Sequence[int], out: torch.Tensor) -> None:
        t = self._targets[name]
        if t.heads is not None:  # rows of a permuted tensor: read it whole, then cut the box
            full = self.read(name, dtype=out.dtype)
            out.copy_(full[tuple(slice(s, s + n) for s, n in zip(start, out.shape))])
        else:
            self._read_box(t, tuple(start), out)

    def _read_box(self, t: _Target, start: Sequence[int], out: torch.Tensor) -> None:
        """The box ``[start, start + out.shape)`` of HF tensor ``t``: region reads of its source."""
        if t.ranges is None:
            self._source_box(t, tuple(start), out)
            return
        r0, nrows = start[0], out.shape[0]
        for src, dst, n in t.ranges:
            lo, hi = max(r0, dst), min(r0 + nrows, dst + n)
            if lo < hi:
                self._source_box(t, (src + lo - dst, *start[1:]), out[lo - r0 : hi - r0])

    def _source_box(self, t: _Target, start: tuple[int, ...], out: torch.Tensor) -> None:
        view = out
        for _ in t.index:
            view = view.unsqueeze(0)
        read_region_into(self.base, t.source, (*t.index, *start), view)

    def _rope_rows(self, t: _Target, dtype: torch.dtype, max_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """The HF rows, one head at a time: a head's rows are a permutation of the same head's
        source rows, so memory is one head (``head_dim x dim``) whatever the model size."""
        rows, dim = self.base.specs()[t.source].shape
        import torch

        perm = torch.tensor(rope_source_rows(rows, t.heads))
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


def _label(t: _Target) -> str:
    return Resolved("", t.source, t.rule, t.values, t.role).describe().split(" (")[0]
