"""Tensor specs: what a tensor is, known before any of its bytes are read.

This module imports torch only when a torch dtype is asked for (:data:`SAFETENSORS_DTYPES`,
:data:`SAFETENSORS_TO_TORCH`, :data:`DTYPE_NAMES`, :func:`parse_dtype`), so a file can be planned
without it from :class:`DTypeName`\\ s (see :mod:`hf_merge.write.head_start`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

#: safetensors dtype codes, as the format spells them, by torch dtype name.
SAFETENSORS_CODES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
#: bytes per element of each of those dtypes
ITEMSIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}

_DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


@dataclass(frozen=True)
class DTypeName:
    """A dtype known by its torch name only, for plans made without importing torch: what a
    :class:`TensorSpec` and :mod:`hf_merge.write.plan` ask of a dtype (``itemsize``, ``str``)."""

    name: str

    @property
    def itemsize(self) -> int:
        return ITEMSIZES[self.name]

    @property
    def is_floating_point(self) -> bool:
        return self.name.startswith(("float", "bfloat"))

    def __str__(self) -> str:
        return f"torch.{self.name}"


def safetensors_code(dtype: Any) -> str | None:
    """``torch.bfloat16`` (or ``DTypeName("bfloat16")``) -> ``"BF16"``; None for a dtype safetensors lacks."""
    return SAFETENSORS_CODES.get(dtype_name(dtype))


@functools.cache
def _torch_tables() -> dict[str, dict]:
    import torch

    by_name = {name: getattr(torch, name) for name in SAFETENSORS_CODES}
    return {
        "SAFETENSORS_DTYPES": {by_name[n]: code for n, code in SAFETENSORS_CODES.items()},
        "SAFETENSORS_TO_TORCH": {code: by_name[n] for n, code in SAFETENSORS_CODES.items()},
        "DTYPE_NAMES": {alias: by_name[n] for alias, n in _DTYPE_ALIASES.items()},
    }


def __getattr__(name: str) -> Any:  # SAFETENSORS_DTYPES, SAFETENSORS_TO_TORCH, DTYPE_NAMES: torch dtype tables, lazily
    tables = _torch_tables() if name in ("SAFETENSORS_DTYPES", "SAFETENSORS_TO_TORCH", "DTYPE_NAMES") else {}
    if name in tables:
        return tables[name]
    raise AttributeError(name)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling config.json uses)."""
    return str(dtype).removeprefix("torch.")


def dtype_alias(value: str) -> str | None:
    """``"bf16"`` / ``"torch.bfloat16"`` / ``"BFloat16"`` -> ``"bfloat16"``: the floating dtype a
    name means (:data:`DTYPE_NAMES`' keys), None for any other; no torch needed."""
    return _DTYPE_ALIASES.get(str(value).removeprefix("torch.").lower())


def config_dtype_name(config: dict[str, Any]) -> str | None:
    """The floating dtype config.json asks for, by name: ``dtype``, older ``torch_dtype``, or the
    text config's (``"auto"`` and unknown names skipped); no torch needed."""
    for holder in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = holder.get(key)
            if isinstance(value, str) and value != "auto" and dtype_alias(value) is not None:
                return dtype_alias(value)
    return None


def output_dtype_name(requested: "str | torch.dtype | None", config: dict[str, Any]) -> str | None:
    """The dtype floating tensors are written in, by name (None: each keeps its own, ``auto``):
    config.json's for None / ``"config"``; no torch needed."""
    if requested is None or requested == "config":
        return config_dtype_name(config)
    if requested == "auto":
        return None
    return _known_dtype_name(requested)


def _known_dtype_name(value: "str | torch.dtype") -> str:
    """:func:`dtype_alias` of ``value``; raises ValueError for a name that is not a floating dtype."""
    name = dtype_alias(str(value))
    if name is None:
        raise ValueError(f"unknown dtype {value!r}; use one of float32, bfloat16, float16")
    return name


def parse_dtype(value: "str | torch.dtype") -> torch.dtype:
    import torch

    if isinstance(value, torch.dtype):
        return value
    return getattr(torch, _known_dtype_name(value))


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
