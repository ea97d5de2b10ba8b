"""DeepSpeed ZeRO 1/2/3 checkpoints (``engine.save_checkpoint``; 0.19.x), without importing deepspeed.

The files and their layout are :mod:`.deepspeed_files`' (shared with the head start's torch-free
index). Tensors are read on demand from memory-mapped files (``torch.load(mmap=True)``), piece by piece
straight into the caller's buffer; a parameter may span two ranks' partitions, and no flat group is
ever concatenated. ``source_weights="module"`` reads the 16-bit module weights instead (stage 1/2).

The files are pickles: they are loaded with ``weights_only=True`` plus the exact DeepSpeed class
names in :data:`DEEPSPEED_GLOBALS`, bound to the inert stand-ins of :mod:`.deepspeed_files` (deepspeed is
never imported and none of its code runs).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from .file_runs import ColumnGather, FileRun, MappedFile, read_into, source_of
from ..checkpoint import ROW_CHUNK_BYTES, CheckpointInfo, LazyCheckpoint, check_out, row_runs
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from .formats import CliOption, SourceFormat
from ..spec import TensorSpec
from .deepspeed_files import (  # noqa: F401 - DEEPSPEED_GLOBALS, resolve_deepspeed_dir, probe: this reader's API
    DEEPSPEED_FILE, DEEPSPEED_GLOBALS, OPTIM_STATES, DeepSpeedLocation, TensorLayout, check_model_states,
    find_config, pieces_of_range, probe, read_zero_layout, resolve_deepspeed_dir, row_segments, step_of, universal_model_states,
)
from .deepspeed_universal import UniversalCheckpoint, is_universal_tag_dir
from . import contained, record_crc
from .safe_pickle import torch_load

logger = logging.getLogger(__name__)


def load_deepspeed_file(path: Path) -> dict[str, Any]:
    """One DeepSpeed file, memory-mapped, ``weights_only`` with exactly :data:`DEEPSPEED_GLOBALS`.

    Raises:
        UnsafeCheckpointError: the pickle asks for anything else (nothing from it is run).
        CorruptCheckpointError: truncated or not a torch.save file.
    """
    pairs = [(cls, f"{module}.{name}") for module, name, cls in DEEPSPEED_GLOBALS]
    # the policy scans the pickle first (stand-ins only); torch's unpickler then binds the names
    # to the inert classes above
    with torch.serialization.safe_globals(pairs):
        state = torch_load(contained.check(path), DEEPSPEED_FILE)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{Path(path).name} holds a {type(state).__name__}, not a DeepSpeed state dict")
    return state


class DeepSpeedCheckpoint(LazyCheckpoint):
    """One tag of a DeepSpeed ZeRO checkpoint as a lazy checkpoint with the training names."""

    def __init__(self, loc: DeepSpeedLocation, *, hf_dir: Path | None = None, source_weights: str = "master"):
        self.loc = loc
        self._states: list[dict[str, Any]] = []  # keep the mapped files alive
        self._mapped: list[MappedFile] = []  # the files, open until close(): tensors copied through them
        layout = read_zero_layout(loc.tag_dir, lambda _kind, _rank, path: self._load(path), source_weights, _tensor_meta)
        self._layouts = layout.layouts
        self._files: dict[tuple, torch.Tensor] = {key: _flat(t) for key, t in layout.parts.items()}
        self.world_size, self.stage, self.bf16_optimizer = layout.world_size, layout.stage, layout.bf16_optimizer
        ms = layout.model_states
        self.info = CheckpointInfo(
            format="deepspeed",
            path=loc.reopen,
            hf_dir=hf_dir or find_config(loc),
            world_size=self.world_size,
            step=step_of(loc.tag_dir.name),
            details={
                "zero_stage": self.stage,
                "optimizer": "BF16_Optimizer" if self.bf16_optimizer else f"DeepSpeedZeroOptimizer{'_Stage3' if self.stage == 3 else ''}",
                "tag": loc.tag_dir.name,
                "source_weights": source_weights,
                "ds_version": ms.get("ds_version"),
                "flat_groups": len(ms["param_shapes"]),  # param groups (stage 3: sub-groups)
                "dtypes": sorted({str(lay.spec.dtype).removeprefix("torch.") for lay in self._layouts.values()}),
            },
            notes=list(loc.notes),
        )

    def _load(self, path: Path) -> dict[str, Any]:
        state = load_deepspeed_file(path)
        self._states.append(state)
        optim = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if isinstance(optim, dict):  # only the weights: the partitions (not Adam's moments)
            tensors = [t for key in ("single_partition_of_fp32_groups", "fp32_flat_groups")
                       for t in (optim.get(key) or []) if isinstance(t, torch.Tensor)]
        else:
            tensors = [t for key in ("module", "frozen_param_fragments")
                       for t in (state.get(key) or {}).values() if isinstance(t, torch.Tensor)]
        source = record_crc.mapped_file(path, tensors)  # its records' CRC-32, checked when bytes are first used
        if source is not None:
            self._mapped.append(source)
        return state

    # ---- the LazyCheckpoint interface ---------------------------------------------------------

    def specs(self) -> dict[str, TensorSpec]:
        return {name: lay.spec for name, lay in self._layouts.items()}

    def read_into(self, name: str, out: torch.Tensor) -> None:
        lay = self._layouts[name]
        check_out(lay.spec, out)
        flat = out.view(-1) if out.is_contiguous() else torch.empty(lay.spec.shape, dtype=out.dtype).view(-1)
        for p in lay.pieces:
            part, source = self._checked(p.source)
            src = part[p.src_start : p.src_start + p.numel]
            read_into(source.piece(src) if source is not None else src, flat[p.dst_start : p.dst_start + p.numel])
        if not out.is_contiguous():
            out.copy_(flat.view(lay.spec.shape))

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        """The rows that lie whole in one partition are zero-copy runs in their own dtype (copied
        file to file by the writer); a row cut by a partition boundary (a parameter spanning two
        ranks at stage 1/2, or slices not cut at a row at stage 3) is its pieces side by side (a
        one-row :class:`~hf_merge.readers.file_runs.ColumnGather`) in its own dtype, else
        assembled alone in a small buffer."""
        lay = self._layouts[name]
        segments = row_segments(lay)
        if segments is None:
            return None
        shape = lay.spec.shape
        row = math.prod(shape[1:])

        def runs():
            for lo, hi, p in segments:
                if p is None:  # a row cut by a partition boundary
                    gathered = self._cut_row(lay, lo * row, row) if dtype == lay.spec.dtype else None
                    if gathered is not None:
                        yield lo, gathered
                        continue
                    rows = torch.empty((1,) + shape[1:], dtype=lay.spec.dtype)
                    self._read_range(lay, lo * row, rows.view(-1))
                    source = None
                else:
                    part, source = self._checked(p.source)
                    start = p.src_start + lo * row - p.dst_start
                    rows = part[start : start + (hi - lo) * row].view((hi - lo,) + shape[1:])
                yield from row_runs(rows, lo, dtype, max_bytes, source)

        return runs()

    def _cut_row(self, lay: TensorLayout, first: int, row: int) -> ColumnGather | None:
        """The row at element ``first`` as its pieces' file runs side by side, or None where one is not file bytes."""
        runs = []
        for p, start, n in pieces_of_range(lay, first, first + row):
            part, source = self._checked(p.source)
            run = source.run(part[start : start + n]) if source is not None else None
            if run is None:
                return None
            runs.append(FileRun(run.fd, run.offset, run.nbytes, run.tensor.view(1, -1)))
        return ColumnGather(tuple(runs), 1)

    def _read_range(self, lay: TensorLayout, first: int, out: torch.Tensor) -> None:
        """Elements ``first .. first + len(out)`` of the flattened tensor into the 1-D ``out``."""
        done = 0
        for p, start, n in pieces_of_range(lay, first, first + out.numel()):
            part, _ = self._checked(p.source)
            out[done : done + n].copy_(part[start : start + n])
            done += n

    def _checked(self, key: tuple) -> tuple[torch.Tensor, MappedFile | None]:
        """Flat partition ``key``, its record's CRC checked, and the file it was mapped from."""
        part = self._files[key]
        source = source_of(part, self._mapped)
        record_crc.check_tensor(part, source)
        return part, source

    def close(self) -> None:
        for source in self._mapped:
            source.close()
        self._mapped.clear()
        self._files.clear()
        self._states.clear()


def _tensor_meta(value: Any) -> "tuple[tuple[int, ...], torch.dtype] | None":
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view (DeepSpeed pickles its fp32 partitions with ``requires_grad=True``: detached)."""
    tensor = tensor.detach()
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def open_universal(loc: DeepSpeedLocation, *, hf_dir: Path | None = None) -> UniversalCheckpoint:
    """A ds_to_universal tag folder (see :mod:`.deepspeed_universal`): the fp32 masters."""
    path = universal_model_states(loc.tag_dir)
    ms = check_model_states(load_deepspeed_file(path), path)
    zero = (ms.get("ds_config") or {}).get("zero_optimization") or {}
    stage = zero.get("stage") if isinstance(zero, dict) else None
    info = CheckpointInfo(
        format="deepspeed",
        path=loc.reopen,
        hf_dir=hf_dir or find_config(loc),
        world_size=ms.get("dp_world_size") if isinstance(ms.get("dp_world_size"), int) else None,
        step=step_of(loc.tag_dir.name.removesuffix("_universal")),
        details={
            "layout": "universal",
            "zero_stage": int(stage) if isinstance(stage, int) else None,
            "tag": loc.tag_dir.name,
            "source_weights": "master",
            "ds_version": ms.get("ds_version"),
        },
        notes=list(loc.notes),
    )
    ckpt = UniversalCheckpoint(loc.tag_dir, [ms], info)
    info.details["dtypes"] = sorted({str(s.dtype).removeprefix("torch.") for s in ckpt.specs().values()})
    return ckpt


def open_deepspeed(
    path: Path, *, config_dir: Path | None = None, tag: str | None = None, source_weights: str | None = None
) -> LazyCheckpoint:
    loc = resolve_deepspeed_dir(Path(path), tag)
    if is_universal_tag_dir(loc.tag_dir) and not any(OPTIM_STATES.match(p.name) for p in loc.tag_dir.iterdir()):
        if source_weights == "module":
            raise UnsupportedCheckpointError(
                f"{loc.tag_dir} is a universal checkpoint (ds_to_universal): it holds the fp32 masters only; "
                "drop --source-weights module"
            )
        return open_universal(loc, hf_dir=config_dir)
    return DeepSpeedCheckpoint(loc, hf_dir=config_dir, source_weights=source_weights or "master")


FORMAT = SourceFormat(
    name="deepspeed",
    description="DeepSpeed ZeRO 1/2/3 checkpoints (latest + global_stepN/ *_model_states.pt, *_optim_states.pt; HF Trainer checkpoint-N/; ds_to_universal output)",
    probe=probe,
    open=open_deepspeed,
    options=frozenset({"tag", "source_weights"}),
    cli=(
        CliOption("--tag", "tag", "DeepSpeed: the checkpoint tag to read (default: the one named in `latest`)"),
        CliOption(
            "--source-weights", "source_weights",
            "DeepSpeed: master (default): the fp32 master weights; module: the 16-bit module weights (ZeRO 1/2)",
            choices=("master", "module"),
        ),
    ),
    priority=30,
    # model states in the tag folder, the save folder's tags or an HF Trainer folder's checkpoint-N/ tags
    # (optim_states alone: a tag folder missing its model_states, which opening names)
    marks=("*mp_rank_*_model_states.pt", "*/*mp_rank_*_model_states.pt", "*/*/*mp_rank_*_model_states.pt",
           "*_optim_states.pt", "*/*_optim_states.pt", "*/*/*_optim_states.pt"),
    framework="deepspeed",
)
