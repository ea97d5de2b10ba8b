"""Size strings (``5GB``, ``2G``, ``4GiB``): parsed without importing torch (CLI argument checks)."""

from __future__ import annotations

import re

# Units huggingface_hub accepts (``serialization``: KB/MB/GB/TB, ``utils``: k/m/g/t with or
# without B, any case), all decimal, plus transformers' binary KiB/MiB/GiB/TiB.
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")


def parse_size(size: "int | str") -> int:
    """``"5GB"``, ``"2G"``, ``"500mb"``, ``"1.5GB"``, ``"4GiB"``, ``2000000000`` -> bytes (decimal
    units as huggingface_hub reads them, KiB/MiB/GiB binary as transformers does)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"the size must be positive, not {size}")
        return size
    match = _SIZE.fullmatch(str(size).strip().lower())
    if not match or match[2] not in _SIZE_UNITS or float(match[1]) <= 0:
        raise ValueError(f"cannot read the size {size!r}; write it like 5GB, 2G, 500MB, 4GiB or 2000000000")
    return int(float(match[1]) * _SIZE_UNITS[match[2]])
