"""Rename and select tensors (a name table, or a dropped tied alias)."""

from __future__ import annotations

import torch

from ..checkpoint import ROW_CHUNK_BYTES, LazyCheckpoint
from ..errors import MappingError
from ..readers import record_crc
from ..readers.file_runs import values
from ..spec import TensorSpec


class Renamed(LazyCheckpoint):
    """``base`` seen through a table ``{new name: base name}``; names not in the table are hidden."""

    def __init__(self, base: LazyCheckpoint, table: dict[str, str]):
        self.base = base
        self.info = base.info
        base_specs = base.specs()
        missing = [old for old in table.values() if old not in base_specs]
        if missing:
            raise KeyError(f"not in the checkpoint: {missing[:5]}")
        self._table = dict(table)
        self._specs = {new: base_specs[old].renamed(new) for new, old in table.items()}
        if hasattr(base, "read_region_into"):  # box reads survive renaming (layer / head slices)
            self.read_region_into = self._read_region_into
        if hasattr(base, "file_rows"):  # and row runs of a layer's slice or a permuted tensor
            self.file_rows = self._file_rows

    def _read_region_into(self, name: str, start, out: torch.Tensor) -> None:
        self.base.read_region_into(self._table[name], start, out)

    def _file_rows(self, name: str, index: tuple[int, ...], first: int, rows: int):
        return self.base.file_rows(self._table[name], index, first, rows)

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def read_into(self, name: str, out: torch.Tensor) -> None:
        self.base.read_into(self._table[name], out)

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        return self.base.read_rows(self._table[name], dtype, max_bytes)

    def close(self) -> None:
        self.base.close()


def drop_tied(base: LazyCheckpoint, tied: dict[str, str]) -> tuple[LazyCheckpoint, list[str]]:
    """Hide the alias side of tied pairs ``{alias: source}`` when both are present.

    transformers 5 writes a tied weight once, under its source name (``model.embed_tokens.weight``),
    and re-ties ``lm_head.weight`` on load. Returns the view and the dropped names.
    """
    specs = base.specs()
    dropped = [alias for alias, source in tied.items() if alias in specs and source in specs]
    if not dropped:
        return base, []
    for alias in dropped:
        check_tied(base, alias, tied[alias])
    return Renamed(base, {n: n for n in specs if n not in dropped}), dropped


def check_tied(base: LazyCheckpoint, alias: str, source: str) -> None:
    """Refuse a tie the checkpoint contradicts: the two tensors' shapes differ, or their first
    rows do (a model trained with its own ``lm_head`` merged under a config that ties it would
    silently lose the trained head). A tied model's checkpoint holds the one tensor under both
    names, so the rows are equal; one row of each is read. Tensors without row runs are not read."""
    specs = base.specs()
    a, s = specs[alias], specs[source]
    if a.shape != s.shape or a.dtype != s.dtype:
        differ = f"{alias} is {tuple(a.shape)} {a.dtype}, {source} {tuple(s.shape)} {s.dtype}"
    elif not a.shape or a.nbytes == 0:
        return
    else:
        with record_crc.deferred(check_at_end=False):  # a probe: the records are checked when the merge copies them
            rows = _first_rows(base, (alias, source), a.dtype)
        if rows is None or torch.equal(rows[0], rows[1]):
            return
        _first_rows(base, (alias, source), a.dtype)  # read again, checked: a damaged record is said to be one
        differ = f"the checkpoint's {alias} differs from its {source} (row 0)"
    raise MappingError(
        f"config.json ties {alias} to {source} (tie_word_embeddings), but {differ}: the model was trained "
        "with its own output layer; pass --config with the config of the model that was trained "
        "(tie_word_embeddings: false)"
    )


def _first_rows(base: LazyCheckpoint, names: tuple[str, ...], dtype: torch.dtype) -> "list[torch.Tensor] | None":
    """Row 0 of each tensor as bytes, or None when one has no runs of rows."""
    rows = []
    for name in names:
        runs = base.read_rows(name, dtype, 1)
        first = next(iter(runs), None) if runs is not None else None
        if first is None:
            return None
        rows.append(values(first[1])[:1].reshape(-1).view(torch.uint8).clone())
    return rows
