"""DeepSpeed ZeRO 1/2/3 checkpoints (``engine.save_checkpoint``; 0.19.x), without importing deepspeed.

A save folder holds ``latest`` (the newest tag) and one folder per tag (``global_stepN/``) with:

- stage 1/2: ``mp_rank_00_model_states.pt`` (the 16-bit ``module`` state dict, ``param_shapes``,
  ``buffer_names``, ``frozen_param_shapes`` / ``frozen_param_fragments``, ``shared_params``) and per
  rank ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` whose
  ``single_partition_of_fp32_groups[g]`` is that rank's slice of param group ``g``'s flat fp32
  master vector. Concatenated over the ranks, a group is its parameters in ``param_shapes[g]``
  order, each followed by ``param_alignment_paddings[g][i]`` unused elements.
- stage 3: per rank ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (``module`` holds placeholders;
  frozen parameters as per-rank fragments) and the optim file whose ``fp32_flat_groups`` (the
  sub-groups, concatenated) hold, for every parameter in ``param_shapes`` order (all groups
  flattened), a slice of ``ceil(numel / world)`` elements: rank ``r`` holds elements
  ``r*k .. (r+1)*k`` of the flattened parameter, zero-padded past its end.
- BF16_Optimizer files (bf16 + stage 1 + fp32 gradient accumulation): the stage 1/2 layout
  without ``zero_stage`` and without per-parameter padding; the last rank's slice keeps the group's
  padding at its end.

Tensors are read on demand from memory-mapped files (``torch.load(mmap=True)``), piece by piece
straight into the caller's buffer; a parameter may span two ranks' partitions, and no flat group is
ever concatenated. ``source_weights="module"`` reads the 16-bit module weights instead (stage 1/2).

The files are pickles: they are loaded with ``weights_only=True`` plus the exact DeepSpeed class
names in :data:`DEEPSPEED_GLOBALS`, bound to inert stand-in classes defined here (deepspeed is
never imported and none of its code runs).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .file_runs import MappedFile, read_into, source_of
from ..checkpoint import ROW_CHUNK_BYTES, CheckpointInfo, LazyCheckpoint, check_out, row_runs
from ..errors import CorruptCheckpointError, SourceNotFoundError, UnsupportedCheckpointError
from .formats import CliOption, SourceFormat
from ..spec import TensorSpec
from .deepspeed_universal import LATEST as LATEST_UNIVERSAL
from .deepspeed_universal import UniversalCheckpoint, is_universal_tag_dir
from . import contained, record_crc
from .safe_pickle import TENSOR_FILE, Allowlist, torch_load

logger = logging.getLogger(__name__)

MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
TRAINER_DIR = re.compile(r"^checkpoint-(\d+)$")
STEP_TAG = re.compile(r"(\d+)$")
SOURCE_WEIGHTS = ("master", "module")


class _Inert:
    """Stand-in for a DeepSpeed class in a pickle: keeps the pickled attributes, runs nothing."""

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state


class _ZeroStageEnum(int):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an ``int`` Enum)."""


class _LossScaler(_Inert):
    pass


class _DynamicLossScaler(_Inert):
    pass


class _FragmentAddress(_Inert):
    pass


# The exact (module, name) pairs DeepSpeed 0.19 optimizer files pickle besides tensors and builtins,
# with the inert class each one is bound to. Model-state files need none.
DEEPSPEED_GLOBALS: tuple[tuple[str, str, type], ...] = (
    ("deepspeed.runtime.zero.config", "ZeroStageEnum", _ZeroStageEnum),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", _LossScaler),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", _DynamicLossScaler),
    ("deepspeed.utils.tensor_fragment", "fragment_address", _FragmentAddress),
)


_PAIRS = [(module, name) for module, name, _ in DEEPSPEED_GLOBALS]
# Flat fp32 partitions with attributes are pickled through torch's own ``_rebuild_from_type_v2``.
DEEPSPEED_FILE = TENSOR_FILE | Allowlist.of(
    calls=[*_PAIRS, ("torch._tensor", "_rebuild_from_type_v2")],
    classes=_PAIRS,
    names=[("torch", "Tensor"), ("torch.nn.parameter", "Parameter")],
)


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


# ------------------------------------------------------------------------------------------
# Finding the files
# ------------------------------------------------------------------------------------------


def _is_tag_dir(folder: Path) -> bool:
    return folder.is_dir() and any(MODEL_STATES.match(p.name) for p in folder.iterdir())


@dataclass(frozen=True)
class DeepSpeedLocation:
    save_dir: Path  # the folder engine.save_checkpoint wrote into (holds `latest` and the tag folders)
    tag_dir: Path
    notes: tuple[str, ...]
    reopen: Path  # the folder that opens this same tag again (verify): the tag folder if given, else save_dir


def resolve_deepspeed_dir(path: Path, tag: str | None = None) -> DeepSpeedLocation:
    """Find the tag folder under what the user gave.

    Accepts a tag folder (``global_stepN/``), a save folder (``latest`` + tag folders; ``tag``
    or ``latest`` picks one, else the highest step), an HF Trainer ``checkpoint-N/`` folder, or an
    HF Trainer output folder of ``checkpoint-N/`` folders (the highest N).
    """
    path = Path(path)
    notes: list[str] = []
    if not path.is_dir():
        raise SourceNotFoundError(f"{path} is not a folder; pass the DeepSpeed save folder (holding `latest`)")
    if _is_tag_dir(path):
        if tag is not None and tag != path.name:
            raise SourceNotFoundError(f"{path} is the tag folder {path.name}, not {tag}; pass its parent with --tag {tag}")
        return DeepSpeedLocation(path.parent, path, (), path)
    trainer = {int(m.group(1)): p for p in path.iterdir() if (m := TRAINER_DIR.match(p.name)) and _tags(p)}
    if not _tags(path) and trainer:
        holding = [n for n, p in trainer.items() if tag in _tags(p)]
        if tag is not None and holding:
            path = trainer[max(holding)]
            notes.append(f"using checkpoint-{max(holding)} (it holds tag {tag})")
        else:
            newest = max(trainer)
            path = trainer[newest]
            notes.append(f"using checkpoint-{newest} (the newest of {len(trainer)} HF Trainer checkpoints)")
    tags = _tags(path)
    if not tags:
        raise SourceNotFoundError(
            f"no DeepSpeed files (*_model_states.pt) in {path} or its tag folders; pass the folder "
            "engine.save_checkpoint wrote (it holds `latest` and global_stepN/)"
        )
    if tag is not None:
        if tag not in tags:
            raise SourceNotFoundError(f"no tag {tag!r} in {path} (it has {', '.join(sorted(tags))}); pass one of those to --tag")
        chosen = tag
    else:
        # `latest` names the training tag; a folder holding only ds_to_universal output has `latest_universal`
        latest = next((path / n for n in ("latest", LATEST_UNIVERSAL) if (path / n).is_file()), path / "latest")
        # a tag name; never echoed (only compared with the tag folders that exist)
        text = contained.check(latest).read_bytes()[:256].decode(errors="replace").strip() if latest.is_file() else ""
        if text in tags:
            chosen = text
            notes.append(f"using tag {chosen} (from {path.name}/{latest.name})")
        else:
            chosen = max(tags, key=lambda t: (int(m.group(1)) if (m := STEP_TAG.search(t)) else -1, t))
            why = f"`{latest.name}` names no tag folder here" if text else "no `latest` file"
            notes.append(f"using tag {chosen} ({why}; the highest of {len(tags)} tags; pass --tag to choose)")
    return DeepSpeedLocation(path, path / chosen, tuple(notes), path)


def _tags(folder: Path) -> set[str]:
    try:
        return {p.name for p in folder.iterdir() if _is_tag_dir(p)}
    except OSError:
        return set()


def probe(path: Path) -> bool:
    """True for a DeepSpeed save / tag folder or an HF Trainer folder of them. File names only."""
    try:
        resolve_deepspeed_dir(Path(path))
    except SourceNotFoundError:
        return False
    return True


# ------------------------------------------------------------------------------------------
# Layout: where each tensor's elements are
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    source: tuple  # key into DeepSpeedCheckpoint._flat: ("group", rank, g) / ("frozen", rank) ...
    src_start: int  # first element in that flat tensor
    dst_start: int  # first element in the flattened parameter
    numel: int


@dataclass(frozen=True)
class _Layout:
    spec: TensorSpec
    pieces: tuple[_Piece, ...]
    kind: str  # "master", "frozen", "buffer", "module"
    alias_of: str | None = None


def _numel(shape: Any) -> int:
    return math.prod(int(n) for n in shape)


def _cut(name: str, starts: list[int], sizes: list[int], offset: int, numel: int, key) -> list[_Piece]:
    """Pieces of the range ``[offset, offset+numel)`` of a vector split into consecutive parts.

    ``starts[i]``/``sizes[i]``: where part ``i`` begins in the vector and how long it is;
    ``key(i)`` names the flat tensor of part ``i``.
    """
    pieces, end = [], offset + numel
    for i, (lo, n) in enumerate(zip(starts, sizes)):
        a, b = max(lo, offset), min(lo + n, end)
        if a < b:
            pieces.append(_Piece(key(i), a - lo, a - offset, b - a))
    if sum(p.numel for p in pieces) != numel:
        raise CorruptCheckpointError(
            f"{name}: the optimizer partitions hold {sum(p.numel for p in pieces)} of its {numel} elements; "
            "a rank's optim_states file is missing or from another run"
        )
    return pieces


#: alignments (elements) a ZeRO 1/2 parameter start may be padded to; powers of two
_ALIGNMENTS = tuple(1 << k for k in range(0, 17))


def check_group_tiling(g: int, numels: list[int], pad: list[Any], held: int, kept_padding: int = 0) -> None:
    """A ZeRO 1/2 param group's parameters and alignment paddings tile its partitions exactly.

    ``numels[i]`` elements of parameter ``i``, then ``pad[i]`` unused ones; the partitions hold
    ``held`` elements, of which the last ``kept_padding`` are the group's own padding. Every padding
    is a non-negative integer and pads the next parameter's start to one power-of-two boundary (a
    padding moved to another parameter, which still adds up, would shift every parameter between);
    the parameters and paddings end exactly where the partitions' data ends.

    Raises:
        CorruptCheckpointError: naming the group and the first parameter that is off.
    """
    if len(pad) != len(numels):
        raise CorruptCheckpointError(f"param group {g}: {len(pad)} alignment paddings for {len(numels)} parameters")
    for i, x in enumerate(pad):
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise CorruptCheckpointError(
                f"param group {g}: the alignment padding after parameter {i} is not a non-negative integer "
                "(it would overlap the parameters); the optim_states file is damaged"
            )
    if any(pad):
        ends, offset = [], 0
        for n, x in zip(numels, pad):
            ends.append(offset + n)
            offset += n + x
        if not any(all(x == (-end) % a for x, end in zip(pad, ends)) for a in _ALIGNMENTS):
            first = next(i for i, x in enumerate(pad) if x)
            raise CorruptCheckpointError(
                f"param group {g}: the alignment paddings (first after parameter {first}) do not pad the parameters "
                "to one boundary; they are shifted or damaged, which would shift the parameters: the optim_states "
                "file is damaged"
            )
    needed = sum(numels) + sum(pad) + kept_padding
    if needed != held:
        raise CorruptCheckpointError(
            f"param group {g}: the parameters and paddings take {needed} elements, the partitions hold {held}; "
            "param_shapes and the optim_states files disagree (damaged, or from different runs)"
        )


class DeepSpeedCheckpoint(LazyCheckpoint):
    """One tag of a DeepSpeed ZeRO checkpoint as a lazy checkpoint with the training names."""

    def __init__(self, loc: DeepSpeedLocation, *, hf_dir: Path | None = None, source_weights: str = "master"):
        if source_weights not in SOURCE_WEIGHTS:
            raise UnsupportedCheckpointError(f"unknown source_weights {source_weights!r}; use master or module")
        self.loc = loc
        folder = loc.tag_dir
        self._files: dict[tuple, torch.Tensor] = {}
        self._states: list[dict[str, Any]] = []  # keep the mapped files alive
        self._mapped: list[MappedFile] = []  # the files, open until close(): tensors copied through them
        model_files = self._numbered(folder, MODEL_STATES, rank_group=1)
        optim_files = self._numbered(folder, OPTIM_STATES, rank_group=2)
        if not optim_files:
            raise CorruptCheckpointError(f"no *_optim_states.pt files in {folder}; copy every rank's files of the checkpoint")
        self.world_size = len(optim_files)
        optims = [self._load(optim_files[r]).get("optimizer_state_dict") for r in range(self.world_size)]
        if not all(isinstance(o, dict) for o in optims):
            raise CorruptCheckpointError(f"{optim_files[0].name} has no optimizer_state_dict; is it a DeepSpeed optim_states file?")
        first = optims[0]
        self.bf16_optimizer = "zero_stage" not in first
        self.stage = 1 if self.bf16_optimizer else int(first["zero_stage"])
        if self.stage not in (1, 2, 3):
            raise UnsupportedCheckpointError(f"{optim_files[0].name}: ZeRO stage {self.stage} is not one hf-merge reads (1, 2, 3)")
        counts = first.get("partition_count")
        count = max(counts) if isinstance(counts, list) else counts
        if count != self.world_size:
            raise CorruptCheckpointError(
                f"{folder} holds {self.world_size} optim_states files but the checkpoint was saved by {count} ranks; "
                "copy every rank's files"
            )
        expected_models = self.world_size if self.stage == 3 else 1
        if len(model_files) != expected_models:
            raise CorruptCheckpointError(
                f"{folder} holds {len(model_files)} model_states files, ZeRO stage {self.stage} at world size "
                f"{self.world_size} writes {expected_models}; copy every rank's files"
            )
        models = [self._load(model_files[r]) for r in sorted(model_files)]
        ms = models[0]
        for key in ("module", "param_shapes"):
            if key not in ms:
                raise CorruptCheckpointError(f"{model_files[0].name} has no {key!r}; is it a DeepSpeed model_states file?")
        self._layouts: dict[str, _Layout] = {}
        if source_weights == "module":
            if self.stage == 3:
                raise UnsupportedCheckpointError(
                    f"{folder} is ZeRO stage 3: its model_states hold no module weights; use source_weights master (the default)"
                )
            self._add_module(ms)
        else:
            self._check_names_against_module(ms)
            self._add_buffers(ms)
            self._add_frozen(models)
            if self.stage == 3:
                self._add_stage3(ms, optims)
            else:
                self._add_flat_groups(ms, optims)
            self._add_shared(ms)
        self.info = CheckpointInfo(
            format="deepspeed",
            path=loc.reopen,
            hf_dir=hf_dir or _find_config(loc),
            world_size=self.world_size,
            step=_step(loc.tag_dir.name),
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

    # ---- loading ------------------------------------------------------------------------

    @staticmethod
    def _numbered(folder: Path, pattern: re.Pattern, rank_group: int) -> dict[int, Path]:
        found: dict[int, Path] = {}
        for p in folder.iterdir():
            if (m := pattern.match(p.name)) and int(m.group(rank_group + 1)) != 0:
                raise UnsupportedCheckpointError(
                    f"{p.name}: model-parallel DeepSpeed checkpoints (mp_rank > 0: tensor or pipeline parallel) "
                    "are not read yet; convert with ds_to_universal or merge an mp_rank_00-only run"
                )
            if m:
                rank = int(m.group(rank_group) or 0)
                if rank in found:
                    raise CorruptCheckpointError(f"{folder} holds both {found[rank].name} and {p.name}; keep one run's files")
                found[rank] = p
        if found and sorted(found) != list(range(len(found))):
            missing = sorted(set(range(max(found) + 1)) - set(found))
            raise CorruptCheckpointError(f"{folder} lacks the files of rank(s) {missing}; copy every rank's files")
        return found

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

    # ---- layouts ------------------------------------------------------------------------

    def _add(self, name: str, shape, dtype: torch.dtype, pieces: list[_Piece], kind: str) -> None:
        self._layouts[name] = _Layout(TensorSpec(name, tuple(int(n) for n in shape), dtype), tuple(pieces), kind)

    def _whole(self, key: tuple, tensor: Any, name: str, kind: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(f"{name} in the model_states file is a {type(tensor).__name__}, not a tensor")
        self._files[key] = _flat(tensor)
        self._add(name, tensor.shape, tensor.dtype, [_Piece(key, 0, 0, tensor.numel())], kind)

    def _add_module(self, ms: dict[str, Any]) -> None:
        for name, tensor in ms["module"].items():
            self._whole(("module", name), tensor, name, "module")

    @staticmethod
    def _check_names_against_module(ms: dict[str, Any]) -> None:
        # DeepSpeed saves the module's state dict beside the shapes of the parameters it partitions
        # (frozen ones too unless excluded, then both leave them out): a parameter name the state
        # dict does not hold means one of the two lists was damaged, and the merge would write it.
        module = ms["module"]
        frozen = ms.get("frozen_param_shapes") or {}
        shapes = ms["param_shapes"]
        if not isinstance(module, dict) or not isinstance(frozen, dict) or not all(isinstance(g, dict) for g in shapes):
            raise CorruptCheckpointError("the model_states file's module / param_shapes are not name -> value maps")
        for name in [n for group in shapes for n in group] + list(frozen):
            if name not in module:
                raise CorruptCheckpointError(
                    f"parameter {name!r} of param_shapes is not in the model_states module state dict; the file is damaged"
                )

    def _add_buffers(self, ms: dict[str, Any]) -> None:
        module = ms["module"]
        for name in ms.get("buffer_names") or []:
            if name in module:  # non-persistent buffers are listed but not saved
                self._whole(("buffer", name), module[name], name, "buffer")

    def _add_frozen(self, models: list[dict[str, Any]]) -> None:
        shapes = models[0].get("frozen_param_shapes") or {}
        for name, shape in shapes.items():
            numel = _numel(shape)
            if self.stage < 3:
                frag = (models[0].get("frozen_param_fragments") or {}).get(name)
                if not isinstance(frag, torch.Tensor) or frag.numel() != numel:
                    raise CorruptCheckpointError(f"frozen parameter {name}: no full fragment of {numel} elements in model_states")
                self._files[("frozen", 0, name)] = _flat(frag)
                self._add(name, shape, frag.dtype, [_Piece(("frozen", 0, name), 0, 0, numel)], "frozen")
                continue
            frags = []
            per_rank = math.ceil(numel / len(models))
            for r, m in enumerate(models):
                frag = (m.get("frozen_param_fragments") or {}).get(name)
                if not isinstance(frag, torch.Tensor):
                    raise CorruptCheckpointError(f"frozen parameter {name}: rank {r}'s model_states has no fragment of it")
                if frag.numel() != per_rank:  # ZeRO 3: ceil(numel / world) per rank, the last zero-padded
                    raise CorruptCheckpointError(
                        f"frozen parameter {name}: rank {r}'s fragment has {frag.numel()} elements, ZeRO 3 gives each of "
                        f"{len(models)} ranks {per_rank}; the model_states file is damaged"
                    )
                self._files[("frozen", r, name)] = _flat(frag)
                frags.append(frag.numel())
            starts = [sum(frags[:r]) for r in range(len(frags))]
            pieces = _cut(name, starts, frags, 0, numel, lambda r, n=name: ("frozen", r, n))
            self._add(name, shape, models[0]["frozen_param_fragments"][name].dtype, pieces, "frozen")

    def _add_flat_groups(self, ms: dict[str, Any], optims: list[dict[str, Any]]) -> None:
        groups = [o.get("single_partition_of_fp32_groups") for o in optims]
        param_shapes = ms["param_shapes"]
        if any(not isinstance(g, list) or len(g) != len(param_shapes) for g in groups):
            raise CorruptCheckpointError(
                f"the optim_states files do not hold one fp32 partition per param group ({len(param_shapes)} groups in model_states)"
            )
        paddings = optims[0].get("param_alignment_paddings")
        for g, shapes in enumerate(param_shapes):
            parts = [groups[r][g] for r in range(self.world_size)]
            if not all(isinstance(p, torch.Tensor) for p in parts):
                raise CorruptCheckpointError(f"param group {g}: a rank's fp32 partition is not a tensor; the optim_states file is damaged")
            sizes = [p.numel() for p in parts]
            starts = [sum(sizes[:r]) for r in range(self.world_size)]
            for r, part in enumerate(parts):
                self._files[("group", r, g)] = _flat(part)
            pad = list(paddings[g]) if paddings is not None and paddings[g] else [0] * len(shapes)
            numels = [_numel(shape) for shape in shapes.values()]
            check_group_tiling(g, numels, pad, sum(sizes), self._kept_group_padding(optims, g))
            offset = 0
            for (name, shape), numel, extra in zip(shapes.items(), numels, pad):
                pieces = _cut(name, starts, sizes, offset, numel, lambda r, g=g: ("group", r, g))
                self._add(name, shape, parts[0].dtype, pieces, "master")
                offset += numel + extra

    def _kept_group_padding(self, optims: list[dict[str, Any]], g: int) -> int:
        """Elements of group ``g``'s padding still in the saved partitions: DeepSpeedZeroOptimizer
        strips it before saving; BF16_Optimizer keeps it at the end of the last rank's partition
        (each rank records its own ``group_paddings``)."""
        if not self.bf16_optimizer:
            return 0
        kept = 0
        for o in optims:
            gp = o.get("group_paddings")
            value = gp[g] if isinstance(gp, list) and g < len(gp) else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CorruptCheckpointError(f"param group {g}: group padding is not a non-negative integer; the optim_states file is damaged")
            kept += value
        return kept

    def _add_stage3(self, ms: dict[str, Any], optims: list[dict[str, Any]]) -> None:
        flats = [o.get("fp32_flat_groups") for o in optims]
        if any(not isinstance(f, list) or not f for f in flats):
            raise CorruptCheckpointError("a stage 3 optim_states file has no fp32_flat_groups")
        # every rank's sub-groups, concatenated, form one vector per rank: map it onto the sub-groups
        sub_sizes = [t.numel() for t in flats[0]]
        sub_starts = [sum(sub_sizes[:i]) for i in range(len(sub_sizes))]
        for r, subs in enumerate(flats):
            if [t.numel() for t in subs] != sub_sizes:
                raise CorruptCheckpointError(f"rank {r}'s fp32_flat_groups differ in size from rank 0's; the files are from different runs")
            for i, t in enumerate(subs):
                self._files[("sub", r, i)] = _flat(t)
        dtype = flats[0][0].dtype
        offset = 0
        for shapes in ms["param_shapes"]:
            for name, shape in shapes.items():
                numel = _numel(shape)
                per_rank = math.ceil(numel / self.world_size)
                pieces = []
                for r in range(self.world_size):
                    lo = r * per_rank
                    take = min(per_rank, numel - lo)
                    if take <= 0:
                        break
                    for p in _cut(name, sub_starts, sub_sizes, offset, take, lambda i, r=r: ("sub", r, i)):
                        pieces.append(_Piece(p.source, p.src_start, lo + p.dst_start, p.numel))
                self._add(name, shape, dtype, pieces, "master")
                offset += per_rank
        if offset != sum(sub_sizes):
            raise CorruptCheckpointError(
                f"the parameters take {offset} elements per rank but fp32_flat_groups hold {sum(sub_sizes)}; "
                "param_shapes and the optimizer files disagree"
            )

    def _add_shared(self, ms: dict[str, Any]) -> None:
        for alias, source in (ms.get("shared_params") or {}).items():
            if source in self._layouts and alias not in self._layouts:
                lay = self._layouts[source]
                self._layouts[alias] = _Layout(lay.spec.renamed(alias), lay.pieces, lay.kind, alias_of=source)

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
        ranks at stage 1/2, or slices not cut at a row at stage 3) is assembled alone in a small buffer."""
        lay = self._layouts[name]
        shape = lay.spec.shape
        if not shape or shape[0] == 0:
            return None
        row = math.prod(shape[1:])
        if row == 0:
            return None
        pieces = sorted(lay.pieces, key=lambda p: p.dst_start)
        segments: list[tuple[int, int, _Piece | None]] = []  # (first row, end row, piece or None: a cut row)
        for p in pieces:
            lo, hi = -(-p.dst_start // row), (p.dst_start + p.numel) // row
            if lo < hi:
                segments.append((lo, hi, p))
            if (p.dst_start + p.numel) % row and (p.dst_start + p.numel) < math.prod(shape):
                cut = (p.dst_start + p.numel) // row
                if not segments or segments[-1][:2] != (cut, cut + 1):
                    segments.append((cut, cut + 1, None))
        segments.sort(key=lambda s: s[0])
        if [s[0] for s in segments] != [0] + [s[1] for s in segments[:-1]] or segments[-1][1] != shape[0]:
            return None  # not a tiling of the rows: the whole-tensor path checks and reports it

        def runs():
            for lo, hi, p in segments:
                if p is None:  # a row cut by a partition boundary
                    rows = torch.empty((1,) + shape[1:], dtype=lay.spec.dtype)
                    self._read_range(lay, lo * row, rows.view(-1))
                    source = None
                else:
                    part, source = self._checked(p.source)
                    start = p.src_start + lo * row - p.dst_start
                    rows = part[start : start + (hi - lo) * row].view((hi - lo,) + shape[1:])
                yield from row_runs(rows, lo, dtype, max_bytes, source)

        return runs()

    def _read_range(self, lay: _Layout, first: int, out: torch.Tensor) -> None:
        """Elements ``first .. first + len(out)`` of the flattened tensor into the 1-D ``out``."""
        end = first + out.numel()
        for p in lay.pieces:
            a, b = max(p.dst_start, first), min(p.dst_start + p.numel, end)
            if a < b:
                part, _ = self._checked(p.source)
                out[a - first : b - first].copy_(part[p.src_start + a - p.dst_start : p.src_start + b - p.dst_start])

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


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view (DeepSpeed pickles its fp32 partitions with ``requires_grad=True``: detached)."""
    tensor = tensor.detach()
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _step(tag: str) -> int | None:
    m = STEP_TAG.search(tag)
    return int(m.group(1)) if m else None


def _find_config(loc: DeepSpeedLocation) -> Path | None:
    """config.json beside the DeepSpeed folder (HF Trainer's checkpoint-N/), or in huggingface/."""
    for folder in (loc.save_dir, loc.save_dir / "huggingface"):
        if contained.check(folder / "config.json").is_file():
            return folder
    return None


def open_universal(loc: DeepSpeedLocation, *, hf_dir: Path | None = None) -> UniversalCheckpoint:
    """A ds_to_universal tag folder (see :mod:`.deepspeed_universal`): the fp32 masters."""
    files = DeepSpeedCheckpoint._numbered(loc.tag_dir, MODEL_STATES, rank_group=1)
    if not files:
        raise CorruptCheckpointError(f"{loc.tag_dir} has zero/ but no *_model_states.pt; copy the whole universal checkpoint")
    ms = load_deepspeed_file(files[min(files)])
    for key in ("module", "param_shapes"):
        if key not in ms:
            raise CorruptCheckpointError(f"{files[min(files)].name} has no {key!r}; is it a DeepSpeed model_states file?")
    zero = (ms.get("ds_config") or {}).get("zero_optimization") or {}
    stage = zero.get("stage") if isinstance(zero, dict) else None
    info = CheckpointInfo(
        format="deepspeed",
        path=loc.reopen,
        hf_dir=hf_dir or _find_config(loc),
        world_size=ms.get("dp_world_size") if isinstance(ms.get("dp_world_size"), int) else None,
        step=_step(loc.tag_dir.name.removesuffix("_universal")),
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
    marks=("*mp_rank_*_model_states.pt", "*/*mp_rank_*_model_states.pt", "*/*/*mp_rank_*_model_states.pt"),
    framework="deepspeed",
)
