"""K-quants (``q4_k_m``, ``q6_k``, ...): only llama.cpp's C quantizer makes them.

When llama-cpp-python is installed, the model is first written as a BF16 GGUF (streaming, as any
type), then ``llama_cpp.llama_model_quantize`` turns that file into the k-quant one (llama.cpp
reads and writes tensor by tensor); the BF16 file is removed. Without it, a clear refusal.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from ..errors import QuantizationError


def require_llama_cpp(name: str):
    try:
        import llama_cpp
    except ImportError:
        raise QuantizationError(
            f"--gguf {name} is a k-quant, which only llama.cpp's C quantizer produces: pip install llama-cpp-python "
            f"(it builds llama.cpp from source), or write --gguf bf16 and run llama.cpp's "
            f"`llama-quantize MODEL-bf16.gguf MODEL-{name}.gguf {name.upper()}`"
        ) from None
    if not hasattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}"):
        raise QuantizationError(f"this llama-cpp-python has no {name.upper()} file type; upgrade it (pip install -U llama-cpp-python)")
    return llama_cpp


def quantize_file(source: Path, target: Path, name: str) -> None:
    """``llama_model_quantize(source, target)`` to the k-quant ``name``; a QuantizationError on failure."""
    llama_cpp = require_llama_cpp(name)
    if hasattr(llama_cpp, "llama_backend_init"):
        llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if rc != 0 or not Path(target).is_file():
        raise QuantizationError(f"llama.cpp's quantizer failed ({rc}) turning {Path(source).name} into {name}; see its log above")
