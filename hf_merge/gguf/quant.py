"""GGUF tensor types: which type each tensor gets, and quantization by row chunks.

The rules are llama.cpp's converter's (``convert_hf_to_gguf.py``, written here from its public
behaviour): 1-D tensors, norms and the MoE router stay F32; everything else takes the file's type;
a row length that is not a multiple of the type's block size falls back to F16. Tensors are encoded
by row chunks of at most ``CHUNK_BYTES`` (as float32) in the source's dtype, so no tensor is ever
held as a whole float32 copy: Q8_0 by a torch transcription of ggml's reference quantizer, the
other block types by the ``gguf`` package's (``gguf.quants.quantize``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
import numpy as np

from ..errors import QuantizationError

CHUNK_BYTES = 16 << 20  # float32 bytes per quantized row chunk


@dataclass(frozen=True)
class FileType:
    """A ``--gguf TYPE``: the tensor type of the weight matrices and the file's ``general.file_type``."""

    name: str
    tensor_type: str  # gguf.GGMLQuantizationType member name
    file_type: str  # gguf.LlamaFileType member name
    k_quant: bool = False  # written as BF16, then quantized by llama.cpp's C quantizer (kquant.py)

    @property
    def quantized(self) -> bool:
        return self.tensor_type not in ("F32", "F16", "BF16")


FILE_TYPES: dict[str, FileType] = {
    t.name: t
    for t in (
        FileType("f32", "F32", "ALL_F32"),
        FileType("f16", "F16", "MOSTLY_F16"),
        FileType("bf16", "BF16", "MOSTLY_BF16"),
        FileType("q8_0", "Q8_0", "MOSTLY_Q8_0"),
        FileType("q4_0", "Q4_0", "MOSTLY_Q4_0"),
        FileType("q4_1", "Q4_1", "MOSTLY_Q4_1"),
        FileType("q5_0", "Q5_0", "MOSTLY_Q5_0"),
        FileType("q5_1", "Q5_1", "MOSTLY_Q5_1"),
    )
}
# llama.cpp's k-quant file types: only its C quantizer (llama-quantize / llama-cpp-python) makes them.
K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
ALL_TYPES = tuple(FILE_TYPES) + K_QUANTS

# GGUF tensors (by name suffix) that llama.cpp keeps in float32 whatever the file type.
F32_SUFFIXES = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def file_type(name: str) -> FileType:
    """The FileType called ``name``; K-quants and unknown names are QuantizationErrors."""
    key = name.lower()
    if key in FILE_TYPES:
        return FILE_TYPES[key]
    if key in K_QUANTS:
        from .kquant import require_llama_cpp

        require_llama_cpp(key)
        return FileType(key, "BF16", "MOSTLY_BF16", k_quant=True)
    raise QuantizationError(f"unknown GGUF type {name!r}; use one of {', '.join(ALL_TYPES)}")


def tensor_type(gguf_name: str, shape: tuple[int, ...], ftype: FileType) -> str:
    """The GGMLQuantizationType name the tensor ``gguf_name`` is written as."""
    import gguf

    if len(shape) <= 1 or gguf_name.endswith(F32_SUFFIXES) or not gguf_name.endswith((".weight", ".lora_a", ".lora_b")):
        return "F32"
    block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ftype.tensor_type]]
    if shape[-1] % block:
        return "F16"
    return ftype.tensor_type


def nbytes(shape: tuple[int, ...], type_name: str) -> int:
    """Bytes of a tensor of ``shape`` (numpy order, rows last) stored as ``type_name``."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return math.prod(shape[:-1]) * (shape[-1] // block) * size


def rows_per_chunk(row_len: int) -> int:
    return max(1, CHUNK_BYTES // (4 * max(1, row_len)))


# Q8_0 works on groups of this many values at a time: 64 KB of float32, so each of its element-wise
# passes runs in the CPU cache instead of streaming a 16 MB chunk through memory, and below torch's
# grain size, so no op pays for waking a thread pool (measured faster on the 2-core machine).
_Q8_GROUP = 1 << 14
# On a thread that runs torch with one intra-op thread (the encoder threads, see
# :func:`one_torch_thread`) no op can wake a pool, and groups of 256 KB halve the per-op dispatch
# cost: 12.5 vs 23.5 ms of CPU per 16 MB bf16 chunk (measured under load ~8, process_time).
_Q8_GROUP_ALONE = 1 << 16
# roundf(x) = trunc(x + copysign(0.5 - 2**-25, x)) exactly for every float32 x (0.5 - 2**-25 is the
# float32 just below one half: a sum that lands on a tie rounds to the even neighbour, which is the
# one roundf picks), and the int8 cast truncates.
_HALF_BELOW = float(np.nextafter(np.float32(0.5), np.float32(0)))


def encode(rows: "torch.Tensor | np.ndarray", type_name: str) -> np.ndarray:
    """Rows (any float dtype, rows last) -> the bytes (or values) GGUF stores for them, in ``type_name``.

    F32 / F16 / BF16 are casts (round to nearest even, as ggml's); Q8_0 is ggml's reference
    ``quantize_row_q8_0`` computed here with torch (bit-identical to ``gguf.quants``, faster, and
    straight from bf16 without a float32 copy of the chunk); the other types use
    the ``gguf`` package's quantizers on float32.
    """
    import torch

    rows = torch.as_tensor(rows)
    cast = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(type_name)
    if cast is not None:  # numpy has no bfloat16: its bytes go out as uint16
        out = rows.to(cast).contiguous()
        return (out.view(torch.uint16) if cast == torch.bfloat16 else out).numpy()
    if type_name == "Q8_0":
        return _q8_0(rows)
    import gguf

    return gguf.quants.quantize(rows.to(torch.float32).contiguous().numpy(), gguf.GGMLQuantizationType[type_name])


def _q8_0(rows: "torch.Tensor") -> np.ndarray:
    """ggml's ``quantize_row_q8_0_ref``: blocks of 32 values, ``d = amax / 127`` stored as fp16,
    ``q = roundf(x * (1 / d))`` as int8 (0 where ``d`` is 0); block bytes = d then the 32 q's.

    A large chunk is split in two halves quantized on two threads (torch's kernels release the
    GIL), each writing its own rows of the output."""
    import torch

    blocks = rows.reshape(-1, 32)
    out = torch.empty((blocks.shape[0], 34), dtype=torch.uint8)
    half = blocks.shape[0] // 2
    if _SPLIT_WORKERS > 1 and half >= 8 * (_Q8_GROUP // 32):
        second = _pool().submit(_q8_0_into, blocks[half:], out[half:])
        _q8_0_into(blocks[:half], out[:half])
        second.result()
    else:
        _q8_0_into(blocks, out)
    return out.numpy()


def _q8_0_into(blocks: "torch.Tensor", out: "torch.Tensor") -> None:
    import torch

    group = max(1, (_Q8_GROUP_ALONE if torch.get_num_threads() == 1 else _Q8_GROUP) // 32)
    quants = out[:, 2:].view(torch.int8)  # the float -> int8 cast writes straight into the blocks
    for first in range(0, blocks.shape[0], group):
        x = blocks[first:first + group].to(torch.float32, copy=True)
        d = x.abs().amax(dim=1, keepdim=True).div_(127)
        inv = d.reciprocal().masked_fill_(d == 0, 0.0)
        x.mul_(inv)
        x.add_(torch.sign(x), alpha=_HALF_BELOW)
        quants[first:first + group].copy_(x)  # truncates toward zero, as .to(torch.int8)
        out[first:first + group, :2] = d.to(torch.float16).view(torch.uint8)


_SPLIT_WORKERS = min(2, os.cpu_count() or 1)
_POOL = None


def _pool():
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gguf-q8_0", initializer=one_torch_thread)
    return _POOL


def one_torch_thread() -> None:
    """Run torch's ops on the calling thread with one intra-op thread, where that setting is the
    thread's own (the OpenMP backend of the Linux and Windows builds: ``omp_set_num_threads`` sets
    the calling thread's value), so the rest of the process keeps its threads. For the GGUF
    encoder threads, which already split the work in two themselves."""
    import torch

    if _OPENMP is None:
        _probe_openmp()
    if _OPENMP:
        torch.set_num_threads(1)


_OPENMP = None


def _probe_openmp() -> None:
    global _OPENMP
    import torch

    _OPENMP = "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
