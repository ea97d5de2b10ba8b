"""DeepSpeed universal checkpoints (``ds_to_universal`` output; 0.19.x), without importing deepspeed.

``python -m deepspeed.checkpoint.ds_to_universal --input_folder RUN/global_stepN --output_folder
RUN/global_stepN_universal`` writes ``RUN/latest_universal`` (the tag) and the tag folder with:

- ``zero/<parameter name>/fp32.pt``: the full fp32 master of that parameter, as
  ``{"param": tensor, "cat_dim": ...}`` (ZeRO 1/2) or the bare tensor (ZeRO 3); beside it
  ``exp_avg.pt``, ``exp_avg_sq.pt`` (and ``step.pt``), Adam's moments, which are not read;
- ``zero/optimizer_state.pt``: the optimizer's common state (not read);
- copies of the source's ``*_model_states.pt`` (``param_shapes``, ``shared_params``, ``buffer_names``,
  the 16-bit ``module`` at stage 1/2).

Stage 1/2 conversions also write an fp32.pt for every module tensor without optimizer state — a
tied alias (``lm_head.weight``) or a frozen parameter — from the 16-bit module weights. A tied alias
named in ``shared_params`` is read from its source's fp32 master instead, so both names hold the
trained master (what the source checkpoint itself gives).

Every file goes through the same pickle policy as the rest of hf-merge (:mod:`.safe_pickle`): the
fp32.pt and model_states files need nothing beyond torch's tensor records. Each fp32.pt's record is
handed out as a file run and CRC-32-checked like any rank file's (:mod:`.record_crc`), while the
reader keeps at most :data:`OPEN_FILES` of them open (then the masters are read as plain mapped
tensors, unchecked, as torch.load would).
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from . import contained, record_crc
from ..checkpoint import ROW_CHUNK_BYTES, CheckpointInfo, LazyCheckpoint, check_out, row_runs
from ..errors import CorruptCheckpointError
from ..spec import TensorSpec
from .file_runs import MappedFile, read_into
from .safe_pickle import TENSOR_FILE, torch_load

if TYPE_CHECKING:  # torch is imported where tensors are read: the head start's probe imports this module
    import torch

ZERO_DIR = "zero"
MASTER_FILE = "fp32.pt"
LATEST = "latest_universal"
#: fp32.pt files kept open for file runs and CRC checks: a quarter of the process's open-file limit
#: (a universal checkpoint has one per parameter: tens of thousands for a large MoE)
OPEN_FILES = max(0, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)


def is_universal_tag_dir(folder: Path) -> bool:
    """A ds_to_universal tag folder: ``zero/<name>/fp32.pt`` entries. File names only."""
    zero = Path(folder) / ZERO_DIR
    try:
        return zero.is_dir() and any((p / MASTER_FILE).is_file() for p in zero.iterdir())
    except OSError:
        return False


@dataclass(frozen=True)
class UniversalEntry:
    """One tensor of a universal folder: its spec, its value as the caller loaded it (the master of
    an fp32.pt, or a buffer of the model_states file), and the fp32.pt it came from (None: a buffer)."""

    spec: TensorSpec
    value: Any
    path: Path | None


def universal_layout(tag_dir: Path, ms: dict[str, Any], load_master: Callable[[Path, str], Any],
                     meta: Callable[[Any], "tuple[tuple[int, ...], Any] | None"]) -> tuple[dict[str, UniversalEntry], dict[str, str]]:
    """``(entries in the training order, aliases -> their source)`` of the universal tag folder
    ``tag_dir`` whose model_states state is ``ms``; ``load_master(path, name)`` gives an fp32.pt's
    master, ``meta(value)`` its ``(shape, dtype)`` (None: not a tensor). Reads no value: the torch
    reader and the head start's torch-free index (:class:`~hf_merge.readers.deepspeed_files.UniversalIndex`)
    lay a folder out by this one function.

    Raises:
        CorruptCheckpointError: a master of another size than its shape, or one missing.
    """
    zero = Path(tag_dir) / ZERO_DIR
    entries: dict[str, UniversalEntry] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for group in ms.get("param_shapes") or []:
        shapes.update({n: tuple(int(d) for d in s) for n, s in group.items()})
    shapes.update({n: tuple(int(d) for d in s) for n, s in (ms.get("frozen_param_shapes") or {}).items()})
    shared = {a: s for a, s in (ms.get("shared_params") or {}).items() if isinstance(a, str) and isinstance(s, str)}
    found = sorted(p.name for p in zero.iterdir() if (p / MASTER_FILE).is_file())
    # the training order (param_shapes) first, then what only the module had
    order = [n for n in shapes if n in found] + [n for n in found if n not in shapes]
    for name in order:
        if name in shared and shared[name] in found:
            continue  # an alias: read from its source below
        path = zero / name / MASTER_FILE
        value = load_master(path, name)
        got = meta(value)
        if got is None:
            raise CorruptCheckpointError(f"{ZERO_DIR}/{name}/{MASTER_FILE} holds no tensor; re-run ds_to_universal")
        shape = shapes.get(name, tuple(got[0]))
        if math.prod(got[0]) != math.prod(shape):
            raise CorruptCheckpointError(
                f"{ZERO_DIR}/{name}/{MASTER_FILE} holds {math.prod(got[0])} elements, the model_states shape "
                f"{list(shape)} needs {math.prod(shape)}; the folders are from different runs"
            )
        entries[name] = UniversalEntry(TensorSpec(name, shape, got[1]), value, path)
    module = ms.get("module") if isinstance(ms.get("module"), dict) else {}
    for name in ms.get("buffer_names") or []:  # buffers are not parameters: only in the module
        got = meta(module.get(name))
        if name not in entries and got is not None:
            entries[name] = UniversalEntry(TensorSpec(name, tuple(got[0]), got[1]), module[name], None)
    missing = [n for n in shapes if n not in entries]
    if missing:
        raise CorruptCheckpointError(
            f"{zero} has no {MASTER_FILE} for {len(missing)} parameter(s) of the model_states, e.g. {missing[0]}; "
            "copy the whole universal checkpoint"
        )
    aliases = {alias: source for alias, source in shared.items() if source in entries and alias not in entries}
    return entries, aliases


def _master(path: Path, name: str) -> torch.Tensor:
    import torch

    state = torch_load(contained.check(path), TENSOR_FILE, where=f"{ZERO_DIR}/{name}/{MASTER_FILE}")
    tensor = state.get("param") if isinstance(state, dict) else state
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(f"{ZERO_DIR}/{name}/{MASTER_FILE} holds no tensor (a {type(state).__name__}); re-run ds_to_universal")
    return tensor.detach()


def _tensor_meta(value: Any) -> "tuple[tuple[int, ...], torch.dtype] | None":
    import torch

    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None


class UniversalCheckpoint(LazyCheckpoint):
    """One ds_to_universal tag folder as a lazy checkpoint with the training names, fp32 masters."""

    def __init__(self, tag_dir: Path, model_states: list[dict[str, Any]], info: CheckpointInfo):
        self.info = info
        self._tensors: dict[str, torch.Tensor] = {}
        self._sources: dict[str, MappedFile] = {}  # name -> the fp32.pt its master is a run of
        self._specs: dict[str, TensorSpec] = {}
        entries, aliases = universal_layout(tag_dir, model_states[0], _master, _tensor_meta)
        for name, entry in entries.items():
            tensor, shape = entry.value, entry.spec.shape
            self._specs[name] = entry.spec
            if entry.path is None:  # a buffer
                self._tensors[name] = tensor.detach()
                continue
            self._tensors[name] = tensor.reshape(shape) if tensor.is_contiguous() else tensor.contiguous().reshape(shape)
            if len(self._sources) < OPEN_FILES:
                source = record_crc.mapped_file(entry.path, [tensor], where=f"{ZERO_DIR}/{name}/{MASTER_FILE}")
                if source is not None:
                    self._sources[name] = source
        for alias, source in aliases.items():
            self._tensors[alias] = self._tensors[source]
            self._specs[alias] = self._specs[source].renamed(alias)
            if source in self._sources:
                self._sources[alias] = self._sources[source]

    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def _checked(self, name: str) -> tuple[torch.Tensor, MappedFile | None]:
        """The master of ``name``, its record's CRC-32 checked, and the file it is a run of."""
        tensor, source = self._tensors[name], self._sources.get(name)
        record_crc.check_tensor(tensor, source)
        return tensor, source

    def read_into(self, name: str, out: torch.Tensor) -> None:
        check_out(self._specs[name], out)
        tensor, source = self._checked(name)
        read_into(source.piece(tensor) if source is not None else tensor, out)  # preadv where it can, else copy_

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        shape = self._specs[name].shape
        if not shape or shape[0] == 0:
            return None
        tensor, source = self._checked(name)
        return row_runs(tensor, 0, dtype, max_bytes, source)

    def close(self) -> None:
        for source in set(self._sources.values()):
            source.close()
        self._sources.clear()
        self._tensors.clear()
