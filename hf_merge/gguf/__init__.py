"""GGUF output (llama.cpp): architecture tables, tensor plan, quantization, tokenizer, writer.

Needs the ``gguf`` package (``pip install 'hf-merge[gguf]'``); nothing here imports it at module
load, so ``hf_merge`` works without it.
"""

from .quant import ALL_TYPES, FILE_TYPES, K_QUANTS

__all__ = ["ALL_TYPES", "FILE_TYPES", "K_QUANTS"]
