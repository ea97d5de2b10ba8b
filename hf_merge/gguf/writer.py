"""Streaming GGUF writer: a lazy checkpoint of Hugging Face tensors -> one ``.gguf`` file.

Every tensor's GGUF name, type, shape and byte size is planned from the specs alone; the
``gguf.GGUFWriter`` then writes the header, the metadata keys and all tensor infos, and the data
follows tensor by tensor (``write_tensor_data``), each produced as float32 row chunks read from the
checkpoint, permuted when llama.cpp's RoPE layout needs it, and quantized chunk by chunk. Memory in
use is one row chunk (about 16 MB of float32) plus its encoded bytes; a tensor that must be permuted
(attention q / k: rows of whole heads) or whose source cannot give row runs is read whole.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..checkpoint import LazyCheckpoint
from ..errors import MappingError
from . import quant
from .arch import GgufArch, arch_for, map_names
from .hparams import add_hparams, rope_freqs
from .tokenizer import Vocab, add_to_writer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor: ``shape`` in numpy order (rows last), the HF tensor it comes from."""

    gguf_name: str
    hf_name: str | None  # None: computed from the config (rope_freqs)
    shape: tuple[int, ...]
    type_name: str
    nbytes: int
    permute_heads: int | None = None  # permute rows per head, with this many heads


def plan_tensors(view: LazyCheckpoint, config: dict[str, Any], arch: GgufArch, ftype: quant.FileType) -> list[PlannedTensor]:
    """The GGUF tensors of ``view`` in file order, from specs only (nothing is read)."""
    specs = view.specs()
    heads = {"heads": config["num_attention_heads"], "kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"]}
    planned: list[PlannedTensor] = []
    freqs = rope_freqs(config)
    if freqs is not None:
        planned.append(PlannedTensor("rope_freqs.weight", None, tuple(freqs.shape), "F32", freqs.nbytes))
    for hf_name, mapped in map_names(arch, list(specs)).items():
        spec = specs[hf_name]
        if not spec.dtype.is_floating_point:
            raise MappingError(f"tensor {hf_name} has dtype {spec.dtype}; GGUF output expects floating-point weights")
        shape = tuple(spec.shape)
        type_name = quant.tensor_type(mapped.gguf_name, shape, ftype)
        n_heads = heads[mapped.permute_heads] if mapped.permute_heads else None
        if n_heads is not None and shape[0] % (2 * n_heads):
            raise MappingError(f"{hf_name}: {shape[0]} rows do not split into {n_heads} heads of even size")
        planned.append(PlannedTensor(mapped.gguf_name, hf_name, shape, type_name, quant.nbytes(shape, type_name), n_heads))
    return planned


def permute_rows(weights: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face's rotate-half rows of each head -> llama.cpp's interleaved pairs.

    Per head, rows ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]`` become ``[x_0, y_0, x_1, y_1, ...]``
    (weights and biases alike; the inverse of what transformers' GGUF loader undoes).
    """
    rows = weights.shape[0]
    return weights.reshape(n_heads, 2, rows // n_heads // 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape)


def _float_chunks(view: LazyCheckpoint, t: PlannedTensor) -> Iterator[np.ndarray]:
    """The tensor as float32 numpy row chunks of at most ``quant.CHUNK_BYTES``, in row order."""
    assert t.hf_name is not None
    step = quant.rows_per_chunk(t.shape[-1] if len(t.shape) > 1 else 1)
    runs = None
    if t.permute_heads is None and len(t.shape) > 1:
        runs = view.read_rows(t.hf_name, torch.float32, max_bytes=quant.CHUNK_BYTES)
    if runs is None:
        whole = view.read(t.hf_name)  # the stored dtype: at most the size of the source tensor
        if t.permute_heads is not None:
            whole = permute_rows(whole, t.permute_heads)
        runs = iter([(0, whole)])
    for _, rows in runs:
        for first in range(0, max(1, rows.shape[0]), step):
            yield rows[first:first + step].to(torch.float32).contiguous().numpy()


class _StreamedTensor:
    """What ``GGUFWriter.write_tensor_data`` needs from an array: ``nbytes`` and ``tofile``.

    ``tofile`` writes the encoded row chunks one after another as they are produced, so the
    writer's padding and bookkeeping stay the ``gguf`` package's while no whole tensor exists.
    """

    def __init__(self, planned: PlannedTensor, chunks: Callable[[], Iterator[np.ndarray]]):
        self.nbytes = planned.nbytes
        self._planned = planned
        self._chunks = chunks

    def tofile(self, fout) -> None:
        written = 0
        for encoded in self._chunks():
            encoded.tofile(fout)
            written += encoded.nbytes
        if written != self.nbytes:
            raise RuntimeError(f"{self._planned.gguf_name}: wrote {written} bytes, planned {self.nbytes}")


def write_gguf(
    view: LazyCheckpoint,
    config: dict[str, Any],
    path: Path,
    ftype: quant.FileType,
    *,
    vocab: Vocab,
    name: str,
    progress: Callable[[int], None] | None = None,
) -> list[PlannedTensor]:
    """Write ``view`` (HF names, LoRA already fused) as the GGUF file ``path``; return the plan."""
    import gguf

    arch = arch_for(config)
    planned = plan_tensors(view, config, arch, ftype)
    freqs = rope_freqs(config)
    writer = gguf.GGUFWriter(path, arch.name)
    try:
        writer.add_type("model")
        writer.add_name(name)
        add_hparams(writer, arch, config, ftype)
        add_to_writer(writer, vocab)
        for t in planned:
            writer.add_tensor_info(
                t.gguf_name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=gguf.GGMLQuantizationType[t.type_name]
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in planned:
            if t.hf_name is None:  # rope_freqs, computed from the config
                chunks = lambda: iter([freqs])  # noqa: E731
            else:
                chunks = lambda t=t: quant.encode_chunks(_float_chunks(view, t), t.type_name)  # noqa: E731
            writer.write_tensor_data(_StreamedTensor(t, chunks))
            if progress is not None:
                progress(t.nbytes)
        writer.flush()
    finally:
        writer.close()
    logger.debug("wrote %s: %d tensors, %d bytes of tensor data", path, len(planned), sum(t.nbytes for t in planned))
    return planned


def total_bytes(planned: list[PlannedTensor]) -> int:
    return sum(t.nbytes for t in planned)


def params(planned: list[PlannedTensor]) -> int:
    return sum(math.prod(t.shape) for t in planned if t.hf_name is not None)
