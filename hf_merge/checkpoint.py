"""The lazy checkpoint: every source and every transform looks like this.

A :class:`LazyCheckpoint` knows the full list of tensor specs without reading data and reads one
full tensor on demand, assembled from its pieces straight into a caller-given buffer. Transforms
(``hf_merge.transforms``) wrap one lazy checkpoint in another; consumers (writer, model loader,
verifier) pull from the top of the stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from .readers.config_overrides import ConfigOverrides
from .readers.file_runs import FileRun, MappedFile, Piece, read_into, values
from .spec import TensorSpec

if TYPE_CHECKING:  # the head start plans through name tables without torch; tensors import it
    import torch

ROW_CHUNK_BYTES = 32 << 20  # converted / computed runs of rows are at most about this big


@dataclass
class CheckpointInfo:
    """What a source is, for ``inspect``, the model card and the provenance record.

    ``hf_dir`` is the folder holding config.json / tokenizer files (None when unknown).
    ``details`` is free-form, JSON-serialisable and format specific (mesh, placements, step...).
    ``notes`` say what was chosen (which step, which role); ``warnings`` what the user should fix.
    ``config_overrides``: config.json values the checkpoint itself decides (a critic's value head,
    ties), applied on top of config.json by every consumer.
    """

    format: str
    path: Path
    reader: str | None = None  # the registry name of the format that opened it (hf_merge.readers.formats)
    hf_dir: Path | None = None
    world_size: int | None = None
    step: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    config_overrides: ConfigOverrides = field(default_factory=ConfigOverrides)


class LazyCheckpoint:
    """Base class: subclasses implement :meth:`specs` and :meth:`read_into`.

    Contract of ``read_into(name, out)``: ``out`` has exactly the spec's shape (any dtype, any
    strides, possibly a view into a memory-mapped output file); the full tensor is written into it,
    cast element-wise by ``Tensor.copy_`` if dtypes differ. Implementations never allocate the
    full tensor themselves unless they must (a transform that computes, like LoRA fusion).
    """

    info: CheckpointInfo

    def specs(self) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """The default: the tensor's :meth:`read_rows` runs, each read into its rows of ``out``."""
        spec = self.specs()[name]
        check_out(spec, out)
        runs = self.read_rows(name, spec.dtype) if spec.shape else None
        if runs is None:
            raise NotImplementedError
        for first, piece in runs:
            read_into(piece, out[first : first + len(values(piece))])

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return the full tensor ``name`` (in ``dtype``, default the spec's) as a new tensor."""
        import torch

        spec = self.specs()[name]
        out = torch.empty(spec.shape, dtype=dtype or spec.dtype)
        self.read_into(name, out)
        return out

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES) -> Iterator[tuple[int, Piece]] | None:
        """Optional streaming fast path: the tensor as contiguous runs of rows (along dim 0).

        Returns None when not supported (the caller then uses :meth:`read_into`), else an iterator
        of ``(first_row, piece)`` where ``piece`` holds the rows ``first_row .. first_row + n`` of
        the full tensor in ``dtype``, in order, covering it exactly. A piece that is a source
        file's bytes unchanged is a :class:`~hf_merge.readers.file_runs.FileRun` (descriptor, offset, byte
        count, and the rows as a view of the file's mapping): it must not be modified. Any other
        piece is a contiguous tensor; a converted or computed one holds at most about ``max_bytes``
        and is only valid until the next run is requested (a buffer may be reused): consume it, or
        clone it to keep it. :func:`~hf_merge.readers.file_runs.values` gives either as a tensor; values are
        identical to what :meth:`read_into` produces.

        The default serves checkpoints that can read a box of a tensor (``read_region_into``:
        DCP / Megatron readers and the views over them) as chunks of rows read by ``pread``;
        others return None.
        """
        region = getattr(self, "read_region_into", None)
        spec = self.specs()[name]
        if region is None or not spec.shape or spec.shape[0] == 0:
            return None
        return _rows_by_region(region, name, spec.shape, dtype, max_bytes)

    def keys(self) -> list[str]:
        return list(self.specs())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.specs():
            yield name, self.read(name)

    def close(self) -> None:
        """Release file handles / maps. Safe to call twice."""

    def __enter__(self) -> "LazyCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rows_by_region(
    region, name: str, shape: tuple[int, ...], dtype: torch.dtype, max_bytes: int
) -> Iterator[tuple[int, torch.Tensor]]:
    import torch

    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    step = max(1, max_bytes // max(1, row_bytes))
    # One buffer for every run (a fresh ~32 MB allocation per run costs the kernel a page fault and
    # zeroing per page); the read_rows contract makes a run valid only until the next is requested.
    buf = torch.empty((min(step, shape[0]),) + tuple(shape[1:]), dtype=dtype)
    for first in range(0, shape[0], step):
        out = buf[: min(step, shape[0] - first)]
        region(name, (first,) + (0,) * (len(shape) - 1), out)
        yield first, out


def check_out(spec: TensorSpec, out: torch.Tensor) -> None:
    """Raise ValueError unless ``out`` has the spec's shape (the read_into contract)."""
    if tuple(out.shape) != spec.shape:
        raise ValueError(f"{spec.name}: buffer shape {tuple(out.shape)} != tensor shape {spec.shape}")


def detect_backend(path: Path) -> str:
    """The name of the format that reads ``path`` (see :func:`hf_merge.readers.formats.detect`)."""
    from .readers.formats import detect

    return detect(path).chosen.name


def open_checkpoint(
    source: "str | Path",
    *,
    backend: str = "auto",
    config: "str | Path | None" = None,
    is_value_model: bool | None = None,
    base_model: "str | Path | None" = None,
    **options: Any,
) -> LazyCheckpoint:
    """Open any supported source as a lazy checkpoint with its training names and dtypes.

    Args:
        source: a checkpoint folder of any registered format (``hf-merge --help`` lists them:
            verl FSDP ``actor/`` / ``global_step_N`` / checkpoints root, Megatron, a Hugging Face
            safetensors folder, ...).
        backend: ``auto`` (detect from file names) or a format name from
            :func:`hf_merge.readers.formats.format_names`.
        config: a folder with config.json (and tokenizer) to use instead of the checkpoint's own.
        is_value_model, options: format-specific options; each format receives the ones it declares.
        base_model: the base model's folder of a PEFT checkpoint (``--base-model``): its config.json
            is the checkpoint's config when the checkpoint has none (an HF Trainer PEFT
            ``checkpoint-N`` saves only the adapter), as a PEFT adapter's config is its base's.
    """
    from .readers.formats import open_source

    config_dir = Path(config) if config is not None else None
    ckpt = open_source(Path(source), backend, config_dir, {"is_value_model": is_value_model, **options})
    hf_dir = ckpt.info.hf_dir
    if base_model is not None and not (hf_dir is not None and (Path(hf_dir) / "config.json").is_file()) \
            and (Path(base_model) / "config.json").is_file():
        ckpt.info.hf_dir = Path(base_model)
        ckpt.info.notes.append(f"config.json and tokenizer from the base model {base_model} (the checkpoint has none)")
    return ckpt


def row_runs(
    tensor: torch.Tensor, first_row: int, dtype: torch.dtype, max_bytes: int, source: MappedFile | FileRun | None = None
) -> Iterator[tuple[int, Piece]]:
    """``tensor`` (rows ``first_row..``) as :meth:`LazyCheckpoint.read_rows` runs in ``dtype``.

    Same dtype and contiguous: one zero-copy run, a :class:`~hf_merge.readers.file_runs.FileRun` where it is
    bytes of ``source`` (the file the reader mapped it from, or a run it is a view of). Otherwise runs of about ``max_bytes``
    each, converted by ``copy_`` (round to nearest even, as ``Tensor.to``) into one reused buffer.
    """
    if tensor.dtype == dtype and tensor.is_contiguous():
        yield first_row, source.piece(tensor) if source is not None else tensor
        return
    import torch

    row_bytes = max(1, (tensor[0].numel() if tensor.dim() and len(tensor) else 1) * dtype.itemsize)
    step = max(1, max_bytes // row_bytes)
    buf = torch.empty((min(step, tensor.shape[0]),) + tuple(tensor.shape[1:]), dtype=dtype)
    for start in range(0, tensor.shape[0], step):
        rows = tensor[start : start + step]
        out = buf[: len(rows)]
        out.copy_(rows)
        yield first_row + start, out
