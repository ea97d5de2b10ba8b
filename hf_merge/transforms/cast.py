"""Explicit dtype policy: floating tensors to one dtype (those the model keeps in float32 to
float32, :mod:`hf_merge.transforms.keep_fp32`), everything else untouched.

The cast itself happens in ``read_into`` (``Tensor.copy_`` into a buffer of the target dtype),
piece by piece as each rank's shard lands: one rounding (round-to-nearest-even), no full-size
temporary.
"""

from __future__ import annotations

import logging

import torch

from ..checkpoint import ROW_CHUNK_BYTES, LazyCheckpoint
from ..spec import TensorSpec

logger = logging.getLogger(__name__)


def cast_policy(spec: TensorSpec, dtype: torch.dtype | None, fp32: "frozenset[str]" = frozenset()) -> torch.dtype:
    """The dtype ``spec`` is written in: ``dtype`` for floating tensors (float32 for those named
    in ``fp32``), else unchanged."""
    if dtype is None or not spec.dtype.is_floating_point:
        return spec.dtype
    return torch.float32 if spec.name in fp32 else dtype


class Cast(LazyCheckpoint):
    def __init__(self, base: LazyCheckpoint, dtype: torch.dtype | None, fp32: "frozenset[str]" = frozenset()):
        self.base = base
        self.info = base.info
        self.dtype = dtype
        self._specs = {n: s.with_dtype(cast_policy(s, dtype, fp32)) for n, s in base.specs().items()}
        self._warned: set[str] = set()

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def read_into(self, name: str, out: torch.Tensor) -> None:
        self.base.read_into(name, out)
        self._check_range(name, out)

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        rows = self.base.read_rows(name, dtype, max_bytes)
        if rows is None or not self._narrows(name, dtype):
            return rows
        return ((first, self._check_range(name, piece)) for first, piece in rows)

    def _narrows(self, name: str, dtype: torch.dtype) -> bool:
        """Whether ``name`` is cast to float16 from a dtype with a wider range (values may overflow)."""
        return dtype == torch.float16 and self.base.specs()[name].dtype in (torch.float32, torch.bfloat16, torch.float64)

    def _check_range(self, name: str, piece):
        """``piece``; a warning, once per tensor, when its cast to float16 made infinities (a value
        beyond float16's +-65504): ``save_pretrained`` of a ``.half()`` model writes them silently."""
        if (isinstance(piece, torch.Tensor) and name not in self._warned and self._narrows(name, piece.dtype)
                and bool(torch.isinf(piece).any())):
            self._warned.add(name)
            logger.warning(f"{name} has values beyond float16's range (+-65504), written as inf; merge with "
                           "--dtype bfloat16 or float32 to keep them")
        return piece

    def close(self) -> None:
        self.base.close()
