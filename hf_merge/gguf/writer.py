"""Streaming GGUF writer: a lazy checkpoint of Hugging Face tensors -> one ``.gguf`` file.

Every tensor's GGUF name, type, shape and byte size is planned from the specs alone; the
``gguf.GGUFWriter`` then writes the header, the metadata keys and all tensor infos, and the data
follows tensor by tensor (``write_tensor_data``), each produced as row chunks read from the
checkpoint in its stored dtype, permuted when llama.cpp's RoPE layout needs it, and encoded chunk by
chunk. Memory in use is one row chunk (at most 16 MB as float32) plus its encoded bytes; a tensor that must be permuted
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
from ..readers.file_runs import values
from ..errors import MappingError
from ..write import digest as digests
from . import quant
from .pipeline import prefetched
from .arch import GgufArch, Piece, arch_for, map_names
from .hparams import add_hparams, head_counts, rope_freqs
from .tokenizer import add_to_writer
from .vocab import Vocab

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor: ``shape`` in numpy order (rows last), the HF tensor(s) it comes from."""

    gguf_name: str
    pieces: tuple[Piece, ...]  # empty: computed from the config (rope_freqs)
    shape: tuple[int, ...]
    type_name: str
    nbytes: int
    permute_heads: int | None = None  # permute rows per head, with this many heads


def plan_tensors(view: LazyCheckpoint, config: dict[str, Any], arch: GgufArch, ftype: quant.FileType) -> list[PlannedTensor]:
    """The GGUF tensors of ``view`` in file order, from specs only (nothing is read)."""
    specs = view.specs()
    heads = head_counts(config)
    planned: list[PlannedTensor] = []
    freqs = rope_freqs(config)
    if freqs is not None:
        planned.append(PlannedTensor("rope_freqs.weight", (), tuple(freqs.shape), "F32", freqs.nbytes))
    for mapped in map_names(arch, list(specs)):
        shapes = {_piece_shape(specs, p) for p in mapped.pieces}
        if len(shapes) != 1:
            raise MappingError(f"{mapped.gguf_name}: its experts have different shapes {sorted(shapes)}")
        shape = shapes.pop()
        if mapped.stacked:
            shape = (len(mapped.pieces),) + shape
        if mapped.flatten:
            shape = (math.prod(shape),)
        type_name = quant.tensor_type(mapped.gguf_name, shape, ftype)
        n_heads = heads[mapped.permute_heads] if mapped.permute_heads else None
        if n_heads is not None and shape[0] % (2 * n_heads):
            raise MappingError(f"{mapped.pieces[0].hf_name}: {shape[0]} rows do not split into {n_heads} heads of even size")
        planned.append(PlannedTensor(
            mapped.gguf_name, tuple(mapped.pieces), shape, type_name, quant.nbytes(shape, type_name), n_heads
        ))
    return planned


def _piece_shape(specs, piece: Piece) -> tuple[int, ...]:
    spec = specs[piece.hf_name]
    if not spec.dtype.is_floating_point:
        raise MappingError(f"tensor {piece.hf_name} has dtype {spec.dtype}; GGUF output expects floating-point weights")
    shape = tuple(spec.shape)
    if piece.part is None:
        return shape
    _, n = piece.part
    if len(shape) < 2 or shape[1] % n:
        raise MappingError(f"{piece.hf_name}: shape {shape} does not split into {n} equal parts along dim 1")
    return (shape[0], shape[1] // n) + shape[2:]


def permute_rows(weights: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face's rotate-half rows of each head -> llama.cpp's interleaved pairs.

    Per head, rows ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]`` become ``[x_0, y_0, x_1, y_1, ...]``
    (weights and biases alike; the inverse of what transformers' GGUF loader undoes).
    """
    rows = weights.shape[0]
    return weights.reshape(n_heads, 2, rows // n_heads // 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape)


def _row_chunks(view: LazyCheckpoint, t: PlannedTensor) -> Iterator[torch.Tensor]:
    """The tensor as 2-D row chunks (rows = the last dim) in the source's dtype, of at most
    ``quant.rows_per_chunk`` rows, in file order: each piece in turn (experts in order).

    Rows come from ``read_rows`` in the stored dtype, so a memory-mapped source (FSDP rank files,
    safetensors) gives zero-copy views and the only conversion is the encoder's own."""
    row_len = t.shape[-1] if len(t.shape) > 1 else 1
    step = quant.rows_per_chunk(row_len)
    specs = view.specs()
    for piece in t.pieces:
        runs = None
        if t.permute_heads is None and len(t.shape) > 1:
            runs = view.read_rows(piece.hf_name, specs[piece.hf_name].dtype, max_bytes=quant.CHUNK_BYTES)
        if runs is None:
            whole = view.read(piece.hf_name)  # the stored dtype: at most the size of the source tensor
            if t.permute_heads is not None:
                whole = permute_rows(whole, t.permute_heads)
            runs = iter([(0, whole)])
        for _, run in runs:
            run = values(run)
            if piece.part is not None:  # the i-th of n slices along dim 1, for every entry of dim 0
                i, n = piece.part
                width = run.shape[1] // n
                run = run[:, i * width:(i + 1) * width]
            rows = run.reshape(-1, row_len)
            for first in range(0, rows.shape[0], step):
                yield rows[first:first + step]


class _StreamedTensor:
    """What ``GGUFWriter.write_tensor_data`` needs from an array: ``nbytes`` and ``tofile``.

    ``tofile`` writes the encoded row chunks one after another as a thread produces them (one
    chunk ahead), so the writer's padding and bookkeeping stay the ``gguf`` package's while no
    whole tensor exists.
    """

    def __init__(self, planned: PlannedTensor, chunks: Callable[[], Iterator[np.ndarray]]):
        self.nbytes = planned.nbytes
        self._planned = planned
        self._chunks = chunks

    def tofile(self, fout) -> None:
        written = 0
        for encoded in prefetched(self._chunks(), one_thread=self._planned.type_name == "Q8_0"):
            fout.write(memoryview(np.ascontiguousarray(encoded)).cast("B"))  # through fout: a _HashingFile sees it
            written += encoded.nbytes
        if written != self.nbytes:
            raise RuntimeError(f"{self._planned.gguf_name}: wrote {written} bytes, planned {self.nbytes}")


def _encoded(view: LazyCheckpoint, t: PlannedTensor) -> Iterator[np.ndarray]:
    """The tensor's bytes in GGUF, chunk by chunk. Each chunk stays valid while the next is being
    produced: a cast that returned its own input (F32 rows written as F32) may point into a read
    buffer that the next run reuses, so that one is copied."""
    for rows in _row_chunks(view, t):
        encoded = quant.encode(rows, t.type_name)
        storage = rows.untyped_storage()
        start = encoded.__array_interface__["data"][0]
        if start < storage.data_ptr() + storage.nbytes() and storage.data_ptr() < start + encoded.nbytes:
            encoded = encoded.copy()
        yield encoded


class _HashingFile:
    """The output file as ``GGUFWriter`` uses it (``write``, ``tell``, ``flush``, ``close``), hashing
    every byte on its way (the file is written front to back, so the digest is the file's)."""

    def __init__(self, raw, checksum: str):
        self._raw, self._hash, self._at = raw, digests.new(checksum), 0

    def write(self, data) -> int:
        self._hash.update(data)  # releases the GIL: the next chunk is encoded meanwhile
        n = self._raw.write(data)
        self._at += n
        return n

    def tell(self) -> int:
        return self._at

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        self._raw.close()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def write_file(
    view: LazyCheckpoint,
    path: Path,
    arch_name: str,
    planned: list[PlannedTensor],
    add_keys: Callable[[Any], None],
    computed: dict[str, np.ndarray] | None = None,
    *,
    checksum: str | None = None,
) -> str | None:
    """Write a GGUF file: ``add_keys(writer)`` adds the metadata, then every planned tensor's info,
    then each tensor's data in order (``computed`` holds the few tensors with no pieces); its digest of
    kind ``checksum`` (:mod:`~hf_merge.write.digest`, hashed as it is written), if asked. The
    folder's commit fsyncs it (:mod:`hf_merge.write.durable`)."""
    import gguf

    from .kv import writer_class

    writer = writer_class()(path, arch_name)
    hashing = None
    try:
        add_keys(writer)
        for t in planned:
            writer.add_tensor_info(
                t.gguf_name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=gguf.GGMLQuantizationType[t.type_name]
            )
        if checksum:  # opened here (after the tensor infos, before the header) to hash what is written
            writer.open_output_file()
            writer.fout = [hashing := _HashingFile(f, checksum) for f in writer.fout]
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in planned:
            if not t.pieces:  # computed from the config (rope_freqs)
                chunks = lambda t=t: iter([(computed or {})[t.gguf_name]])  # noqa: E731
            else:
                chunks = lambda t=t: _encoded(view, t)  # noqa: E731
            writer.write_tensor_data(_StreamedTensor(t, chunks))
        writer.flush()
        writer.close()
    finally:
        writer.close()
    logger.debug("wrote %s: %d tensors, %d bytes of tensor data", path, len(planned), total_bytes(planned))
    return hashing.hexdigest() if hashing is not None else None


def write_gguf(
    view: LazyCheckpoint, config: dict[str, Any], path: Path, ftype: quant.FileType, *, vocab: Vocab, name: str,
    checksum: str | None = None,
) -> str | None:
    """Write ``view`` (HF names, LoRA already fused) as the GGUF model file ``path``; its digest of kind
    ``checksum``, if asked."""
    arch = arch_for(config)
    planned = plan_tensors(view, config, arch, ftype)
    freqs = rope_freqs(config)

    def add_keys(writer) -> None:
        writer.add_type("model")
        writer.add_name(name)
        add_hparams(writer, arch, config, ftype)
        add_to_writer(writer, vocab)

    computed = {"rope_freqs.weight": freqs} if freqs is not None else None
    return write_file(view, path, arch.name, planned, add_keys, computed, checksum=checksum)


def total_bytes(planned: list[PlannedTensor]) -> int:
    return sum(t.nbytes for t in planned)
