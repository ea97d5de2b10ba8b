"""ColossalAI save folders as files, without torch: what the reader and the head start share.

The names a ``booster.save_model(shard=True)`` folder and a per-rank distributed save use, how a
folder is recognised (its index, stage shards or ``pytorch_model-meta-dist-*.json``, itself or as
``modeling/`` of a Colossal-LLaMA / ColossalChat save), the index read into files and tensor names,
and :class:`BoosterIndex`: a booster folder of ``.bin`` shards laid out as
:class:`~hf_merge.readers.colossalai.ColossalAICheckpoint` lays it out, its pickles read under a
subset of :data:`~hf_merge.readers.safe_pickle.TENSOR_FILE` with nothing looked up in torch
(the CLI's head start, :mod:`hf_merge.write.head_start`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

from . import contained
from ..errors import CorruptCheckpointError, IncompleteStepError, SourceNotFoundError
from .file_runs import FileRun
from .step_choice import newest_step
from ..spec import TensorSpec

INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# booster shard names: model-00001.safetensors, pytorch_model-00001.bin, model-stage-00001-shard-00001.safetensors
SHARD = re.compile(r"^(?:pytorch_)?model(?:-stage-(\d{5})-shard)?-(\d{5})\.(safetensors|bin)$")
DIST_META = re.compile(r"^pytorch_model-meta-dist-(\d{5})(?:\.index)?\.json$")
DIST_FILE = re.compile(r"^(?:pytorch_)?model-dist-(\d{5})(?:-shard-\d{5})?\.(?:safetensors|bin)$")
SMALL_JSON = 64 << 20  # an index / metadata file larger than this is not one
# Colossal-LLaMA / ColossalChat: save_dir/epoch-{e}_step-{s}/modeling/ (optimizer/, lr_scheduler beside)
MODEL_SUBDIR = "modeling"
RUN_DIR = re.compile(r"^epoch-(\d+)_step-(\d+)$")


def load_json(path: Path) -> Any:
    contained.check(path)
    try:
        if path.stat().st_size > SMALL_JSON:
            raise CorruptCheckpointError(f"{path.name} is {path.stat().st_size} bytes, too large for a ColossalAI index; re-copy it")
        return json.loads(path.read_bytes())
    except ValueError as e:  # also UnicodeDecodeError
        raise CorruptCheckpointError(f"{path.name} is not valid JSON ({str(e)[:80]}); re-copy it from the training run") from None


def member(folder: Path, name: Any, pattern: re.Pattern[str], where: str, *, written_path: bool = False) -> str:
    """A file named by an index / metadata entry: a bare name of the expected pattern, in ``folder``.

    ``written_path``: the entry may be the path the saving rank wrote to (DistributedCheckpointIO's
    unsharded save records the checkpoint folder joined with the name); only its last part is used,
    always inside ``folder`` (the path itself is never opened, so a moved folder still reads).
    """
    if not isinstance(name, str) or not name:
        raise CorruptCheckpointError(f"{where} names the file {str(name)[:60]!r}, which is not a file name; re-copy it")
    base = Path(name).name
    if (base != name and not written_path) or ".." in Path(name).parts or not pattern.match(base):
        raise CorruptCheckpointError(f"{where} names {name[:80]!r}, which is not a ColossalAI weight file inside {folder}; refusing")
    return base


# ------------------------------------------------------------------------------------------
# Probing
# ------------------------------------------------------------------------------------------


def index_file(folder: Path) -> Path | None:
    return next((folder / n for n in INDEX_NAMES if (folder / n).is_file()), None)


def _looks_like_booster(index: Path) -> bool:
    """ColossalAI's index: shard names without ``-of-N``, or ``total_size`` in MB as a float."""
    if index.stat().st_size > SMALL_JSON:
        return False
    data = json.loads(index.read_bytes())
    if not isinstance(data, dict):
        return False
    files = (data.get("weight_map") or {}).values() if isinstance(data.get("weight_map"), dict) else []
    named = [f for f in files if isinstance(f, str)]
    if named and all(SHARD.match(f) for f in named):
        return True
    total = (data.get("metadata") or {}).get("total_size") if isinstance(data.get("metadata"), dict) else None
    return isinstance(total, float) and not any("-of-" in f for f in named)


def _probe_folder(path: Path) -> bool:
    try:
        return _looks_like_colossalai(path)
    except (OSError, ValueError):  # an unreadable / undecodable index: not recognisably ColossalAI
        return False


def _looks_like_colossalai(path: Path) -> bool:
    if not path.is_dir():
        return False
    names = [p.name for p in path.iterdir()]
    if any(DIST_META.match(n) for n in names):
        return True
    index = index_file(path)
    if index is not None:
        return _looks_like_booster(index)
    return any(SHARD.match(n) and "-stage-" in n for n in names)  # stage files without their index: open() says so


def _runs(path: Path) -> dict[tuple[int, int], Path]:
    return {(int(m.group(1)), int(m.group(2))): p for p in path.iterdir() if (m := RUN_DIR.match(p.name)) and p.is_dir()}


def resolve_folder(path: Path) -> tuple[Path, list[str]]:
    """The folder holding the weights: ``path`` itself, its ``modeling/`` (a Colossal-LLaMA /
    ColossalChat ``epoch-E_step-S`` folder), or the newest ``epoch-E_step-S/modeling/`` of a save root."""
    path = Path(path)
    if _probe_folder(path) or not path.is_dir():
        return path, []
    if _probe_folder(path / MODEL_SUBDIR):
        return path / MODEL_SUBDIR, [f"reading {path.name}/{MODEL_SUBDIR}/ (the model of this ColossalAI save)"]
    runs = _runs(path)
    newest = newest_step(runs, lambda run: _probe_folder(run / MODEL_SUBDIR))  # an incomplete newest save: an error
    if newest is not None:
        return runs[newest] / MODEL_SUBDIR, [
            f"using {runs[newest].name}/{MODEL_SUBDIR} (the newest of {len(runs)} ColossalAI saves; pass another epoch-E_step-S folder to choose)"
        ]
    return path, []


def probe(path: Path) -> bool:
    """A folder with ``pytorch_model-meta-dist-*.json`` or a ColossalAI-style index / shard files,
    itself or as ``modeling/`` of a Colossal-LLaMA / ColossalChat save (or of its newest save)."""
    try:
        folder, _ = resolve_folder(Path(path))
    except IncompleteStepError:
        return True  # a save root whose newest save is incomplete: open() names the save to pass
    return _probe_folder(folder)


def find_config(folder: Path) -> Path | None:
    """config.json in the save folder (booster writes it there), or one folder up."""
    for candidate in (folder, folder.parent):
        if (candidate / "config.json").is_file():
            return candidate
    return None


# ------------------------------------------------------------------------------------------
# Booster folders
# ------------------------------------------------------------------------------------------


def shard_path(folder: Path, file: str) -> Path:
    """Shard ``file`` (a name an index or metadata file gave) in ``folder``, checked to be there."""
    path = contained.check(Path(folder) / file)
    if not path.is_file():
        raise CorruptCheckpointError(f"{file} is named by the checkpoint's index but missing from {folder}; re-copy it")
    return path


def booster_files(folder: Path) -> tuple[Path, Any, dict[str, list[str]]]:
    """A booster folder's index: ``(its path, its JSON, file -> the tensor names it holds)``, every
    file a shard name of :data:`SHARD` inside ``folder``."""
    index = index_file(folder)
    if index is None:
        stages = [p.name for p in folder.iterdir() if SHARD.match(p.name)]
        if not stages:
            raise SourceNotFoundError(
                f"{folder} holds no ColossalAI save (no model shard files, index or "
                "pytorch_model-meta-dist-*.json); pass the folder booster.save_model wrote"
            )
        raise SourceNotFoundError(
            f"{folder} holds ColossalAI shard files ({', '.join(sorted(stages)[:3])}) but no "
            f"{' or '.join(INDEX_NAMES)}; copy the index the save wrote beside them"
        )
    data = load_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptCheckpointError(f"{index.name} has no \"weight_map\" object of tensor names to files; re-copy it")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(member(folder, file, SHARD, index.name), []).append(name)
    return index, data, dict(sorted(files.items()))


def _named_tensor_policy() -> tuple[Any, Any, dict]:
    """The FSDP rank-file index's torch-free policy (:func:`~hf_merge.readers.rank_records.named_policy`)
    cut to the pairs of :data:`~hf_merge.readers.safe_pickle.TENSOR_FILE`, the reader's own: plain
    tensors and parameters, no DTensor."""
    from .rank_records import named_policy
    from .safe_pickle import TENSOR_FILE, Allowlist

    allow, names, subs = named_policy()
    allow = Allowlist.of(calls=[p for p in allow.calls if p in TENSOR_FILE.calls],
                         classes=[p for p in allow.classes if p in TENSOR_FILE.classes])
    return allow, names, subs


class BoosterIndex:
    """A booster folder of ``.bin`` shards as the ColossalAI reader lays it out, read without torch:
    ``specs()`` and ``read_rows`` whose runs are :class:`~hf_merge.readers.file_runs.FileRun`\\ s
    (no tensor), what the head start's writer takes. A tensor that is not one dense span of its
    file, or asked for in another dtype, is not offered (None)."""

    def __init__(self, folder: Path, index: Path, files: dict[str, list[str]]):
        from .rank_records import record_meta, record_span, unpickle_records

        allow, names, subs = _named_tensor_policy()
        self._specs: dict[str, TensorSpec] = {}
        self._spans: dict[str, tuple[str, int, int] | None] = {}
        for file, wanted in files.items():
            state, records, prefix = unpickle_records(shard_path(folder, file), allow, subs, names)
            if not isinstance(state, dict):
                raise CorruptCheckpointError(f"{file} holds a {type(state).__name__}, not a state dict of tensors; re-copy it")
            for name in wanted:
                meta = record_meta(state.get(name))
                if meta is None:
                    raise CorruptCheckpointError(f"{index.name} puts {name[:80]} in {file}, which does not hold it; re-copy the checkpoint")
                span = record_span(state[name], records, prefix)
                self._specs[name] = TensorSpec(name, meta[0], meta[1])
                self._spans[name] = None if span is None else (file, *span)
        self.fds = {file: os.open(Path(folder) / file, os.O_RDONLY) for file in files}

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def read_rows(self, name: str, dtype: Any) -> Iterator[tuple[int, FileRun]] | None:
        spec, span = self._specs[name], self._spans[name]
        if dtype != spec.dtype or span is None or not spec.shape or not spec.shape[0]:
            return None  # as the reader: no rows to run
        file, offset, nbytes = span
        return iter([(0, FileRun(self.fds[file], offset, nbytes, None))] if nbytes else [])

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def open_index(source: Path, config: Path | None) -> "tuple[BoosterIndex, Path] | None":  # the head start's
    """The booster folder ``source`` resolves to, read without torch, and the folder of its
    config.json; None for a distributed save, safetensors shards, or no config.json."""
    folder, _notes = resolve_folder(Path(source))
    config_dir = config or find_config(folder)
    if config_dir is None or any(DIST_META.match(p.name) for p in folder.iterdir()):
        return None
    index, _data, files = booster_files(folder)
    if any(not file.endswith(".bin") for file in files):
        return None
    return BoosterIndex(folder, index, files), config_dir
