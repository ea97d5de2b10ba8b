"""Tensor specs: what a tensor is, known before any of its bytes are read."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# safetensors dtype codes, as the format spells them.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
SAFETENSORS_TO_TORCH = {v: k for k, v in SAFETENSORS_DTYPES.items()}

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling config.json uses)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: "str | torch.dtype") -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    key = str(value).removeprefix("torch.").lower()
    if key not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {value!r}; use one of float32, bfloat16, float16")
    return DTYPE_NAMES[key]


@dataclass(frozen=True)
class TensorSpec:
    """Name, global shape and dtype of one full (unsharded) tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def with_dtype(self, dtype: torch.dtype) -> "TensorSpec":
        return TensorSpec(self.name, self.shape, dtype)

    def renamed(self, name: str) -> "TensorSpec":
        return TensorSpec(name, self.shape, self.dtype)


def c_contiguous(size: "tuple[int, ...] | list[int]", stride: "tuple[int, ...] | list[int]") -> bool:
    """True if a box of ``size`` with element ``stride`` is one C-ordered run of elements."""
    expect = 1
    for n, st in zip(reversed(size), reversed(stride)):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True
