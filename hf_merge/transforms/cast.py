"""Explicit dtype policy: floating tensors to one dtype (those the model keeps in float32 to
float32, :mod:`hf_merge.transforms.keep_fp32`), everything else untouched.

The cast itself happens in ``read_into`` (``Tensor.copy_`` into a buffer of the target dtype),
piece by piece as each rank's shard lands: one rounding (round-to-nearest-even), no full-size
temporary.
"""

from __future__ import annotations

import torch

from ..checkpoint import ROW_CHUNK_BYTES, LazyCheckpoint
from ..spec import TensorSpec


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

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def read_into(self, name: str, out: torch.Tensor) -> None:
        self.base.read_into(name, out)

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        return self.base.read_rows(name, dtype, max_bytes)

    def close(self) -> None:
        self.base.close()
