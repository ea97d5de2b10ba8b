"""Rename and select tensors (a name table, or a dropped tied alias)."""

from __future__ import annotations

import torch

from ..checkpoint import ROW_CHUNK_BYTES, LazyCheckpoint
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

    def _read_region_into(self, name: str, start, out: torch.Tensor) -> None:
        self.base.read_region_into(self._table[name], start, out)

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
    return Renamed(base, {n: n for n in specs if n not in dropped}), dropped
