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
fp32.pt and model_states files need nothing beyond torch's tensor records.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from . import contained
from ..checkpoint import ROW_CHUNK_BYTES, CheckpointInfo, LazyCheckpoint, check_out, row_runs
from ..errors import CorruptCheckpointError
from ..spec import TensorSpec
from .safe_pickle import TENSOR_FILE, torch_load

ZERO_DIR = "zero"
MASTER_FILE = "fp32.pt"
LATEST = "latest_universal"


def is_universal_tag_dir(folder: Path) -> bool:
    """A ds_to_universal tag folder: ``zero/<name>/fp32.pt`` entries. File names only."""
    zero = Path(folder) / ZERO_DIR
    try:
        return zero.is_dir() and any((p / MASTER_FILE).is_file() for p in zero.iterdir())
    except OSError:
        return False


def _master(path: Path, name: str) -> torch.Tensor:
    state = torch_load(contained.check(path), TENSOR_FILE, where=f"{ZERO_DIR}/{name}/{MASTER_FILE}")
    tensor = state.get("param") if isinstance(state, dict) else state
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(f"{ZERO_DIR}/{name}/{MASTER_FILE} holds no tensor (a {type(state).__name__}); re-run ds_to_universal")
    return tensor.detach()


class UniversalCheckpoint(LazyCheckpoint):
    """One ds_to_universal tag folder as a lazy checkpoint with the training names, fp32 masters."""

    def __init__(self, tag_dir: Path, model_states: list[dict[str, Any]], info: CheckpointInfo):
        self.info = info
        zero = Path(tag_dir) / ZERO_DIR
        self._tensors: dict[str, torch.Tensor] = {}
        self._specs: dict[str, TensorSpec] = {}
        ms = model_states[0]
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
            tensor = _master(zero / name / MASTER_FILE, name)
            shape = shapes.get(name, tuple(tensor.shape))
            if tensor.numel() != math.prod(shape):
                raise CorruptCheckpointError(
                    f"{ZERO_DIR}/{name}/{MASTER_FILE} holds {tensor.numel()} elements, the model_states shape "
                    f"{list(shape)} needs {math.prod(shape)}; the folders are from different runs"
                )
            self._tensors[name] = tensor.reshape(shape) if tensor.is_contiguous() else tensor.contiguous().reshape(shape)
            self._specs[name] = TensorSpec(name, shape, tensor.dtype)
        module = ms.get("module") if isinstance(ms.get("module"), dict) else {}
        for name in ms.get("buffer_names") or []:  # buffers are not parameters: only in the module
            if name not in self._specs and isinstance(module.get(name), torch.Tensor):
                self._tensors[name] = module[name].detach()
                self._specs[name] = TensorSpec(name, tuple(module[name].shape), module[name].dtype)
        missing = [n for n in shapes if n not in self._specs]
        if missing:
            raise CorruptCheckpointError(
                f"{zero} has no {MASTER_FILE} for {len(missing)} parameter(s) of the model_states, e.g. {missing[0]}; "
                "copy the whole universal checkpoint"
            )
        for alias, source in shared.items():
            if source in self._specs and alias not in self._specs:
                self._tensors[alias] = self._tensors[source]
                self._specs[alias] = self._specs[source].renamed(alias)

    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        check_out(self._specs[name], out)
        out.copy_(self._tensors[name])

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        tensor = self._tensors[name]
        if not tensor.dim() or tensor.shape[0] == 0:
            return None
        return row_runs(tensor, 0, dtype, max_bytes)

    def close(self) -> None:
        self._tensors.clear()
