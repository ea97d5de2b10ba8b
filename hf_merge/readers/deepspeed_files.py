"""DeepSpeed ZeRO 1/2/3 save folders as files and layouts, without torch: what both readers share.

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

:class:`ZeroLayout` says, from the files' states, where each tensor's elements are (which flat
partition, which elements); it never looks at a value, so the torch reader
(:class:`~hf_merge.readers.deepspeed.DeepSpeedCheckpoint`, tensors memory-mapped by
``torch.load``) and :class:`DeepSpeedIndex` (the head start's, pickles interpreted without torch:
each partition a zip record's byte span) lay a folder out by the same code.

The files are pickles: DeepSpeed's own classes in them are bound to the inert stand-ins here
(:data:`DEEPSPEED_GLOBALS`); deepspeed is never imported and none of its code runs.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from . import contained
from .deepspeed_universal import LATEST as LATEST_UNIVERSAL
from ..errors import CorruptCheckpointError, IncompleteStepError, SourceNotFoundError, UnsupportedCheckpointError
from .file_runs import ColumnGather, FileRun
from .rank_records import named_policy, record_meta, record_span, tensor_record_builder, unpickle_records
from .safe_pickle import TENSOR_FILE, Allowlist
from .step_choice import newest_step
from ..spec import TensorSpec

MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
TRAINER_DIR = re.compile(r"^checkpoint-(\d+)$")
STEP_TAG = re.compile(r"(\d+)$")
DEFAULT_TAG = re.compile(r"^global_step[0-9]{1,18}$")  # engine.save_checkpoint's tag when none is given
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

# ------------------------------------------------------------------------------------------
# Finding the files
# ------------------------------------------------------------------------------------------


def _is_tag_dir(folder: Path) -> bool:
    # optim_states alone is a tag too: an incomplete one, which opening names (ZeroLayout)
    return folder.is_dir() and any(MODEL_STATES.match(p.name) or OPTIM_STATES.match(p.name) for p in folder.iterdir())


def _has_model_states(folder: Path) -> bool:
    """A tag folder a newer incomplete one must not hide (the step choice's "complete")."""
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
    trainer = {int(m.group(1)): p for p in path.iterdir() if (m := TRAINER_DIR.match(p.name)) and p.is_dir()}
    holding = [n for n, p in trainer.items() if tag is not None and tag in _tags(p)]
    if not _tags(path) and holding:
        path = trainer[max(holding)]
        notes.append(f"using checkpoint-{max(holding)} (it holds tag {tag})")
    elif not _tags(path) and (newest := newest_step(trainer, lambda p: bool(_tags(p)))) is not None:
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
        # a tag name; echoed only in DeepSpeed's own form (other text is compared with the tag folders, never shown)
        text = contained.check(latest).read_bytes()[:256].decode(errors="replace").strip() if latest.is_file() else ""
        # the tags, and the folders a save cut short left (DeepSpeed's tag names, or the one `latest` names)
        steps = {p.name: p for p in path.iterdir() if p.name in tags or ((DEFAULT_TAG.match(p.name) or p.name == text) and p.is_dir())}
        said = f"names {text}, which is not here" if DEFAULT_TAG.match(text) else "names no tag folder here"
        order = lambda t: (int(m.group(1)) if (m := STEP_TAG.search(t)) else -1, t)  # noqa: E731
        chosen = newest_step(steps, _has_model_states, pointer=(text, f"{path / latest.name} {said}") if text else None,
                             order=order)
        if chosen is None:  # no tag has its model_states: opening the newest says which files it lacks
            chosen = text if text in tags else max(tags, key=order)
        if chosen == text:
            notes.append(f"using tag {chosen} (from {path.name}/{latest.name})")
        else:
            notes.append(f"using tag {chosen} (no `latest` file; the highest of {len(tags)} tags; pass --tag to choose)")
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
    except IncompleteStepError:
        return True  # a save root whose newest tag (or checkpoint-N) is incomplete: open() names the one to pass
    except SourceNotFoundError:
        return False
    return True


def numbered_files(folder: Path, pattern: re.Pattern, rank_group: int) -> dict[int, Path]:
    """The files of ``folder`` that ``pattern`` matches, by rank (group ``rank_group``; none: 0),
    every rank from 0 present, none model-parallel."""
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


def step_of(tag: str) -> int | None:
    m = STEP_TAG.search(tag)
    return int(m.group(1)) if m else None


def deepspeed_files(folder: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    """``(model_states by rank, optim_states by rank)`` of a tag folder, every rank present."""
    model_files = numbered_files(folder, MODEL_STATES, rank_group=1)
    optim_files = numbered_files(folder, OPTIM_STATES, rank_group=2)
    if not optim_files:
        raise CorruptCheckpointError(f"no *_optim_states.pt files in {folder}; copy every rank's files of the checkpoint")
    return model_files, optim_files


def universal_model_states(tag_dir: Path) -> Path:
    """The model_states file a universal tag folder's layout is read from (its lowest rank's)."""
    files = numbered_files(tag_dir, MODEL_STATES, rank_group=1)
    if not files:
        raise CorruptCheckpointError(f"{tag_dir} has zero/ but no *_model_states.pt; copy the whole universal checkpoint")
    return files[min(files)]


def check_model_states(state: Any, path: Path) -> dict[str, Any]:
    """``state``, read from the model_states file ``path``, when it holds what every layout reads
    (``module``, ``param_shapes``)."""
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{path.name} holds a {type(state).__name__}, not a DeepSpeed state dict")
    for key in ("module", "param_shapes"):
        if key not in state:
            raise CorruptCheckpointError(f"{path.name} has no {key!r}; is it a DeepSpeed model_states file?")
    return state


def find_config(loc: DeepSpeedLocation) -> Path | None:
    """config.json beside the DeepSpeed folder (HF Trainer's checkpoint-N/), or in huggingface/."""
    for folder in (loc.save_dir, loc.save_dir / "huggingface"):
        if contained.check(folder / "config.json").is_file():
            return folder
    return None

# ------------------------------------------------------------------------------------------
# Layout: where each tensor's elements are
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartSlice:
    source: tuple  # key into DeepSpeedCheckpoint._flat: ("group", rank, g) / ("frozen", rank) ...
    src_start: int  # first element in that flat tensor
    dst_start: int  # first element in the flattened parameter
    numel: int


@dataclass(frozen=True)
class TensorLayout:
    spec: TensorSpec
    pieces: tuple[PartSlice, ...]
    kind: str  # "master", "frozen", "buffer", "module"
    alias_of: str | None = None


def _numel(shape: Any) -> int:
    return math.prod(int(n) for n in shape)


def _cut(name: str, starts: list[int], sizes: list[int], offset: int, numel: int, key) -> list[PartSlice]:
    """Pieces of the range ``[offset, offset+numel)`` of a vector split into consecutive parts.

    ``starts[i]``/``sizes[i]``: where part ``i`` begins in the vector and how long it is;
    ``key(i)`` names the flat tensor of part ``i``.
    """
    pieces, end = [], offset + numel
    for i, (lo, n) in enumerate(zip(starts, sizes)):
        a, b = max(lo, offset), min(lo + n, end)
        if a < b:
            pieces.append(PartSlice(key(i), a - lo, a - offset, b - a))
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


#: what a layout asks of a value of a file's state: ``(shape, dtype)`` when it is a tensor, else None
TensorMeta = Callable[[Any], "tuple[tuple[int, ...], Any] | None"]


def part_file(key: tuple) -> tuple[str, int]:
    """The file a flat partition of :attr:`ZeroLayout.parts` is in: ``("optim", rank)`` or ``("model", rank)``."""
    if key[0] in ("group", "sub"):
        return "optim", key[1]
    if key[0] == "frozen":
        return "model", key[1]
    return "model", 0  # "buffer", "module": the (first) model_states file


class ZeroLayout:
    """Where each tensor of a ZeRO checkpoint is, from its files' states (``models``: the
    model_states, one per rank at stage 3, else one; ``optims``: each rank's
    ``optimizer_state_dict``): ``layouts`` (name -> :class:`TensorLayout`), ``parts`` (flat partition
    key -> the state's value: a tensor as the caller loaded it, read through ``meta``), ``stage``,
    ``bf16_optimizer``, ``world_size``, ``model_states`` (the first model_states file's state). Every check that the files fit together is made here.

    Raises:
        CorruptCheckpointError / UnsupportedCheckpointError: naming the file and what is off.
    """

    def __init__(self, folder: Path, model_files: list[Path], optim_files: list[Path], models: list[dict[str, Any]],
                 optims: list[Any], source_weights: str, meta: TensorMeta):
        self._meta = meta
        self.parts: dict[tuple, Any] = {}
        self.layouts: dict[str, TensorLayout] = {}
        self.world_size = len(optim_files)
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
        names = {p.name for p in model_files}
        lacking = [n for n in ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(self.world_size)]
                               if self.stage == 3 else ["mp_rank_00_model_states.pt"]) if n not in names]
        if lacking and len(model_files) < expected_models:
            more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
            raise CorruptCheckpointError(
                f"{folder} lacks {', '.join(lacking[:3])}{more} (ZeRO stage {self.stage} at world size {self.world_size}): "
                "a DeepSpeed step folder without its model_states is incomplete; copy every file of the checkpoint"
            )
        if len(model_files) != expected_models:
            raise CorruptCheckpointError(
                f"{folder} holds {len(model_files)} model_states files, ZeRO stage {self.stage} at world size "
                f"{self.world_size} writes {expected_models}; copy every rank's files"
            )
        ms = self.model_states = check_model_states(models[0], model_files[0])
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

    def _tensor(self, value: Any) -> "tuple[tuple[int, ...], Any, int] | None":
        """``(shape, dtype, numel)`` of a tensor of the states, None for anything else."""
        got = self._meta(value)
        return None if got is None else (got[0], got[1], _numel(got[0]))

    def _add(self, name: str, shape, dtype: Any, pieces: list[PartSlice], kind: str) -> None:
        self.layouts[name] = TensorLayout(TensorSpec(name, tuple(int(n) for n in shape), dtype), tuple(pieces), kind)

    def _whole(self, key: tuple, value: Any, name: str, kind: str) -> None:
        got = self._tensor(value)
        if got is None:
            raise CorruptCheckpointError(f"{name} in the model_states file is a {type(value).__name__}, not a tensor")
        self.parts[key] = value
        self._add(name, got[0], got[1], [PartSlice(key, 0, 0, got[2])], kind)

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
                got = self._tensor(frag)
                if got is None or got[2] != numel:
                    raise CorruptCheckpointError(f"frozen parameter {name}: no full fragment of {numel} elements in model_states")
                self.parts[("frozen", 0, name)] = frag
                self._add(name, shape, got[1], [PartSlice(("frozen", 0, name), 0, 0, numel)], "frozen")
                continue
            frags, dtype = [], None
            per_rank = math.ceil(numel / len(models))
            for r, m in enumerate(models):
                frag = (m.get("frozen_param_fragments") or {}).get(name)
                got = self._tensor(frag)
                if got is None:
                    raise CorruptCheckpointError(f"frozen parameter {name}: rank {r}'s model_states has no fragment of it")
                if got[2] != per_rank:  # ZeRO 3: ceil(numel / world) per rank, the last zero-padded
                    raise CorruptCheckpointError(
                        f"frozen parameter {name}: rank {r}'s fragment has {got[2]} elements, ZeRO 3 gives each of "
                        f"{len(models)} ranks {per_rank}; the model_states file is damaged"
                    )
                self.parts[("frozen", r, name)] = frag
                frags.append(got[2])
                dtype = dtype or got[1]
            starts = [sum(frags[:r]) for r in range(len(frags))]
            pieces = _cut(name, starts, frags, 0, numel, lambda r, n=name: ("frozen", r, n))
            self._add(name, shape, dtype, pieces, "frozen")

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
            metas = [self._tensor(p) for p in parts]
            if any(m is None for m in metas):
                raise CorruptCheckpointError(f"param group {g}: a rank's fp32 partition is not a tensor; the optim_states file is damaged")
            sizes = [m[2] for m in metas]
            starts = [sum(sizes[:r]) for r in range(self.world_size)]
            for r, part in enumerate(parts):
                self.parts[("group", r, g)] = part
            pad = list(paddings[g]) if paddings is not None and paddings[g] else [0] * len(shapes)
            numels = [_numel(shape) for shape in shapes.values()]
            check_group_tiling(g, numels, pad, sum(sizes), self._kept_group_padding(optims, g))
            offset = 0
            for (name, shape), numel, extra in zip(shapes.items(), numels, pad):
                pieces = _cut(name, starts, sizes, offset, numel, lambda r, g=g: ("group", r, g))
                self._add(name, shape, metas[0][1], pieces, "master")
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
        metas = [[self._tensor(t) for t in subs] for subs in flats]
        if any(m is None for subs in metas for m in subs):
            raise CorruptCheckpointError("a stage 3 optim_states file's fp32_flat_groups hold something that is not a tensor")
        sub_sizes = [m[2] for m in metas[0]]
        sub_starts = [sum(sub_sizes[:i]) for i in range(len(sub_sizes))]
        for r, subs in enumerate(flats):
            if [m[2] for m in metas[r]] != sub_sizes:
                raise CorruptCheckpointError(f"rank {r}'s fp32_flat_groups differ in size from rank 0's; the files are from different runs")
            for i, t in enumerate(subs):
                self.parts[("sub", r, i)] = t
        dtype = metas[0][0][1]
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
                        pieces.append(PartSlice(p.source, p.src_start, lo + p.dst_start, p.numel))
                self._add(name, shape, dtype, pieces, "master")
                offset += per_rank
        if offset != sum(sub_sizes):
            raise CorruptCheckpointError(
                f"the parameters take {offset} elements per rank but fp32_flat_groups hold {sum(sub_sizes)}; "
                "param_shapes and the optimizer files disagree"
            )

    def _add_shared(self, ms: dict[str, Any]) -> None:
        for alias, source in (ms.get("shared_params") or {}).items():
            if source in self.layouts and alias not in self.layouts:
                lay = self.layouts[source]
                self.layouts[alias] = TensorLayout(lay.spec.renamed(alias), lay.pieces, lay.kind, alias_of=source)


def read_zero_layout(folder: Path, load: Callable[[str, int, Path], dict[str, Any]], source_weights: str,
                     meta: TensorMeta) -> ZeroLayout:
    """The :class:`ZeroLayout` of tag folder ``folder``, each file's state read by
    ``load(kind, rank, path)`` (``kind``: ``"optim"`` or ``"model"``, as :func:`part_file` names
    them): every rank's optim_states, then the model_states."""
    if source_weights not in SOURCE_WEIGHTS:
        raise UnsupportedCheckpointError(f"unknown source_weights {source_weights!r}; use master or module")
    model_files, optim_files = deepspeed_files(folder)
    optims = [load("optim", r, optim_files[r]).get("optimizer_state_dict") for r in range(len(optim_files))]
    models = [load("model", r, model_files[r]) for r in sorted(model_files)]
    return ZeroLayout(folder, [model_files[r] for r in sorted(model_files)], [optim_files[r] for r in range(len(optim_files))],
                      models, optims, source_weights, meta)


#: a band of rows of one tensor: ``(first row, end row, piece)`` where the rows lie whole in the
#: piece, or ``(row, row + 1, None)`` for one row cut by a partition boundary
Segment = tuple[int, int, "PartSlice | None"]


def row_segments(lay: TensorLayout) -> list[Segment] | None:
    """The rows of ``lay``'s tensor as bands of its pieces, in row order; None when the tensor has
    no rows or its pieces do not tile them (the whole-tensor read checks and reports it)."""
    shape = lay.spec.shape
    if not shape or shape[0] == 0:
        return None
    row = math.prod(shape[1:])
    if row == 0:
        return None
    segments: list[Segment] = []
    for p in sorted(lay.pieces, key=lambda p: p.dst_start):
        lo, hi = -(-p.dst_start // row), (p.dst_start + p.numel) // row
        if lo < hi:
            segments.append((lo, hi, p))
        if (p.dst_start + p.numel) % row and (p.dst_start + p.numel) < math.prod(shape):
            cut = (p.dst_start + p.numel) // row
            if not segments or segments[-1][:2] != (cut, cut + 1):
                segments.append((cut, cut + 1, None))
    segments.sort(key=lambda s: s[0])
    if [s[0] for s in segments] != [0] + [s[1] for s in segments[:-1]] or segments[-1][1] != shape[0]:
        return None
    return segments


def pieces_of_range(lay: TensorLayout, first: int, end: int) -> Iterator[tuple[PartSlice, int, int]]:
    """``(piece, first element in its partition, elements)`` for elements ``first .. end`` of
    ``lay``'s flattened tensor, in order."""
    for p in sorted(lay.pieces, key=lambda p: p.dst_start):
        a, b = max(p.dst_start, first), min(p.dst_start + p.numel, end)
        if a < b:
            yield p, p.src_start + a - p.dst_start, b - a


# ------------------------------------------------------------------------------------------
# The head start's index: the same layout from the pickles interpreted without torch
# ------------------------------------------------------------------------------------------


class _TensorName:
    """What ``torch.Tensor`` / ``torch.nn.parameter.Parameter`` stand for in a DeepSpeed pickle:
    the type ``_rebuild_from_type_v2`` is asked to give a partition (it is given its record)."""

    def __init__(self, pair: tuple[str, str]):
        self.pair = pair


_TENSOR_NAMES = {pair: _TensorName(pair) for pair in DEEPSPEED_FILE.names}


def _named_policy() -> tuple[Allowlist, Allowlist, dict]:
    """``(allow, names, substitutes)`` that read a DeepSpeed file with no torch module looked up:
    :data:`DEEPSPEED_FILE`'s pairs, each torch one bound to a recorder or a name (what the FSDP
    rank-file index does, :func:`~hf_merge.readers.rank_records.named_policy`), DeepSpeed's to
    the inert stand-ins above, and ``_rebuild_from_type_v2`` to one that accepts only a plain
    tensor record given the type ``Tensor`` or ``Parameter`` (its attributes, e.g. ``ds_id``, dropped)."""
    _allow, names, subs = named_policy()
    subs = dict(subs)
    rebuild = tensor_record_builder()

    def rebuild_from_type(func: Any, new_type: Any, args: Any, _state: Any) -> Any:
        if func is not rebuild or not isinstance(new_type, _TensorName) or not isinstance(args, tuple):
            raise TypeError("a tensor subclass, or a tensor rebuilt another way")
        return func(*args)

    subs[("torch._tensor", "_rebuild_from_type_v2")] = rebuild_from_type
    subs.update(_TENSOR_NAMES)
    subs.update({(module, name): cls for module, name, cls in DEEPSPEED_GLOBALS})

    def kept(pairs: frozenset) -> list:
        return [p for p in pairs if p in subs or p[0] in ("builtins", "collections")]

    allow = Allowlist.of(calls=kept(DEEPSPEED_FILE.calls), classes=kept(DEEPSPEED_FILE.classes))
    return allow, names | Allowlist.of(names=list(_TENSOR_NAMES)), subs


class DeepSpeedIndex:
    """A ZeRO tag folder laid out by :class:`ZeroLayout`, read without torch: ``specs()`` and
    ``read_rows`` whose runs are :class:`~hf_merge.readers.file_runs.FileRun`\\ s (a row cut by a
    partition boundary: a one-row :class:`~hf_merge.readers.file_runs.ColumnGather` of its
    pieces), as the torch reader's are; None for what needs a cast or is not dense file bytes."""

    def __init__(self, loc: DeepSpeedLocation):
        allow, names, subs = _named_policy()
        self.fds: dict[tuple[str, int], int] = {}
        self._records: dict[tuple[str, int], tuple[dict, str]] = {}  # each file's zip records and their prefix

        def load(kind: str, rank: int, path: Path) -> dict[str, Any]:
            state, records, prefix = unpickle_records(path, allow, subs, names)
            if not isinstance(state, dict):
                raise CorruptCheckpointError(f"{path.name} holds a {type(state).__name__}, not a DeepSpeed state dict")
            self._records[(kind, rank)] = records, prefix
            self.fds[(kind, rank)] = os.open(path, os.O_RDONLY)
            return state

        try:
            self.layout = read_zero_layout(loc.tag_dir, load, "master", record_meta)
        except BaseException:
            self.close()
            raise

    def specs(self) -> dict[str, TensorSpec]:
        return {name: lay.spec for name, lay in self.layout.layouts.items()}

    def _run(self, key: tuple, first: int, numel: int) -> FileRun | None:
        """Elements ``first .. first + numel`` of flat partition ``key`` as a run of its file
        (None when the partition is not one dense span of it)."""
        where, record = part_file(key), self.layout.parts[key]
        span = record_span(record, *self._records[where])
        if span is None:
            return None
        item = record.storage.dtype.itemsize
        return FileRun(self.fds[where], span[0] + first * item, numel * item, None)

    def read_rows(self, name: str, dtype: Any) -> Iterator[tuple[int, Any]] | None:
        lay = self.layout.layouts[name]
        segments = row_segments(lay) if dtype == lay.spec.dtype else None
        if segments is None:
            return None
        row = math.prod(lay.spec.shape[1:])
        runs: list[tuple[int, Any]] = []
        for lo, hi, p in segments:
            if p is not None:
                run = self._run(p.source, p.src_start + lo * row - p.dst_start, (hi - lo) * row)
            else:  # a row cut by partition boundaries: its pieces side by side
                parts = [self._run(q.source, start, n) for q, start, n in pieces_of_range(lay, lo * row, hi * row)]
                run = None if None in parts else ColumnGather(tuple(parts), 1)
            if run is None:
                return None
            runs.append((lo, run))
        return iter(runs)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class UniversalIndex:
    """A ds_to_universal tag folder laid out by :func:`~hf_merge.readers.deepspeed_universal.universal_layout`,
    read without torch: each master one run of its ``fp32.pt`` (the first
    :data:`~hf_merge.readers.deepspeed_universal.OPEN_FILES` of them, as the reader keeps open), as
    the torch reader's ``read_rows`` gives it; None for a buffer, a cast, or a master past that."""

    def __init__(self, loc: DeepSpeedLocation):
        from .deepspeed_universal import OPEN_FILES, universal_layout
        allow, names, subs = _named_policy()
        path = universal_model_states(loc.tag_dir)
        ms = check_model_states(unpickle_records(path, allow, subs, names)[0], path)
        records: dict[Path, tuple[dict, str]] = {}

        def master(path: Path, _name: str) -> Any:
            state, zip_records, prefix = unpickle_records(path, allow, subs, names)
            records[path] = zip_records, prefix
            return state.get("param") if isinstance(state, dict) else state

        entries, aliases = universal_layout(loc.tag_dir, ms, master, record_meta)
        self._specs = {name: e.spec for name, e in entries.items()}
        self._specs.update({alias: entries[source].spec.renamed(alias) for alias, source in aliases.items()})
        self._runs: dict[str, FileRun | None] = {}
        self.fds: dict[Path, int] = {}
        try:
            for name, entry in entries.items():
                span = None
                if entry.path is not None and len(self.fds) < OPEN_FILES:
                    span = record_span(entry.value, *records[entry.path])
                    self.fds[entry.path] = os.open(entry.path, os.O_RDONLY)
                self._runs[name] = FileRun(self.fds[entry.path], *span, None) if span is not None else None
        except BaseException:
            self.close()
            raise
        self._runs.update({alias: self._runs[source] for alias, source in aliases.items()})

    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def read_rows(self, name: str, dtype: Any) -> Iterator[tuple[int, Any]] | None:
        spec, run = self._specs[name], self._runs[name]
        if run is None or dtype != spec.dtype or not spec.shape or spec.shape[0] == 0:
            return None
        return iter([(0, run)])

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def open_index(source: Path, config: Path | None) -> "tuple[DeepSpeedIndex, Path] | None":  # the head start's
    """The tag folder ``source`` resolves to, laid out as the DeepSpeed reader lays out its fp32
    masters (a universal folder's too), read without torch, and the folder of its config.json;
    None without a config.json."""
    from .deepspeed_universal import is_universal_tag_dir

    loc = resolve_deepspeed_dir(Path(source))
    config_dir = config or find_config(loc)
    if config_dir is None:
        return None
    if is_universal_tag_dir(loc.tag_dir) and not any(OPTIM_STATES.match(p.name) for p in loc.tag_dir.iterdir()):
        return UniversalIndex(loc), config_dir
    return DeepSpeedIndex(loc), config_dir
