"""ColossalAI 0.5 checkpoints: ``booster.save_model(shard=True)`` folders and per-rank distributed saves.

Two layouts, both under Hugging Face tensor names:

- **booster folders** (``GeneralCheckpointIO`` / ``TorchDDPCheckpointIO`` / ``HybridParallelCheckpointIO``
  ``save_sharded_model``): ``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``
  (``{"metadata": {"total_size": <MB, a float>}, "weight_map": {name: file}}``) naming shards
  ``model-00001.safetensors`` / ``pytorch_model-00001.bin`` (no ``-of-N``), or, with pipeline
  parallelism, ``model-stage-00001-shard-00001.safetensors`` (one set per stage). Tensors are full
  (gathered over tensor parallelism, the padded vocabulary cut back); ``.bin`` shards are plain
  ``torch.save`` state dicts; ``config.json`` lies beside them.
- **per-rank distributed saves** (``DistributedCheckpointIO``, ColossalAI pull request #6181, not in
  a release): per rank ``id = tp_size * pp_rank + tp_rank`` a metadata file
  ``pytorch_model-meta-dist-{id:05d}[.index].json`` (``{"checkpoint_version": "1.0", "metadata":
  {name: {"offsets", "lengths", "global_shape", "file", "rank"}}}``) and the rank's local slices in
  ``[pytorch_]model-dist-{id:05d}[-shard-0000k].{bin|safetensors}``; a tensor is assembled from the
  boxes of every rank that holds part of it.

Every tensor is a list of boxes (``_Piece``); a booster tensor is one box covering it. Reads are
lazy:
safetensors through ``safe_open`` slices, ``.bin`` files memory-mapped through the one pickle
policy (:func:`~hf_merge.readers.safe_pickle.torch_load` with :data:`TENSOR_FILE`), each box copied
straight into the caller's buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .file_runs import FileRun, MappedFile, Piece, read_into, run_of, values
from .safetensors_runs import SafetensorsRuns
from . import record_crc
from ..checkpoint import ROW_CHUNK_BYTES, CheckpointInfo, LazyCheckpoint, check_out, row_runs
from ..errors import CorruptCheckpointError, SourceNotFoundError, UnsupportedCheckpointError
from .formats import SourceFormat
from ..spec import SAFETENSORS_TO_TORCH, TensorSpec
from .safe_pickle import TENSOR_FILE, torch_load
from .colossalai_files import DIST_FILE, DIST_META, SHARD, booster_files, find_config, load_json, member, probe, resolve_folder, shard_path


@dataclass(frozen=True)
class _Piece:
    """A box of a tensor held in one file under ``key``: ``offsets`` / ``lengths`` per dimension."""

    file: str
    key: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


# ------------------------------------------------------------------------------------------
# Small JSON
# ------------------------------------------------------------------------------------------


def _ints(value: Any, rank: int | None, what: str, where: str) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or (rank is not None and len(value) != rank)
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise CorruptCheckpointError(f"{where}: {what} is {str(value)[:60]}, not a list of non-negative integers; re-copy it")
    return tuple(value)


# ------------------------------------------------------------------------------------------
# The checkpoint
# ------------------------------------------------------------------------------------------


class ColossalAICheckpoint(LazyCheckpoint):
    """A ColossalAI save folder as a lazy checkpoint under its (Hugging Face) tensor names."""

    def __init__(self, folder: Path, *, config_dir: Path | None = None):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise SourceNotFoundError(f"{folder} is not a folder; pass the folder booster.save_model wrote")
        self._pieces: dict[str, list[_Piece]] = {}
        self._specs: dict[str, TensorSpec] = {}
        self._safe: dict[str, Any] = {}  # file -> safe_open handle
        self._bins: dict[str, dict[str, torch.Tensor]] = {}  # file -> memory-mapped state dict
        self._mapped: dict[str, MappedFile | None] = {}  # .bin file -> its mapping, open until close()
        self._safe_runs: dict[str, SafetensorsRuns] = {}  # safetensors file -> its tensors as file runs (made with its specs)
        metas = sorted(p for p in self.folder.iterdir() if DIST_META.match(p.name))
        if metas:
            layout = "distributed"
            details = self._add_distributed(metas)
        else:
            layout = "booster"
            details = self._add_booster()
        hf_dir = config_dir or find_config(self.folder)
        self.info = CheckpointInfo(
            format="colossalai", path=self.folder, hf_dir=hf_dir, details={"layout": layout, **details}
        )
        if hf_dir is None:
            self.info.warnings.append("no config.json beside the checkpoint; pass --config with the model's config folder")

    # ---- booster folders ----------------------------------------------------------------------

    def _add_booster(self) -> dict[str, Any]:
        index, data, files = booster_files(self.folder)
        stages = set()
        for file, names in sorted(files.items()):
            m = SHARD.match(file)
            if m.group(1):
                stages.add(int(m.group(1)))
            found = self._file_specs(file)
            for name in names:
                if name not in found:
                    raise CorruptCheckpointError(f"{index.name} puts {name[:80]} in {file}, which does not hold it; re-copy the checkpoint")
                spec = found[name]
                self._specs[name] = spec
                self._pieces[name] = [_Piece(file, name, (0,) * len(spec.shape), spec.shape)]
        total = (data.get("metadata") or {}).get("total_size") if isinstance(data.get("metadata"), dict) else None
        return {"files": len(files), "pipeline_stages": len(stages) or None, "index": index.name, "index_total_size_mb": total}

    # ---- per-rank distributed saves --------------------------------------------------------

    def _add_distributed(self, metas: list[Path]) -> dict[str, Any]:
        boxes: dict[str, list[tuple[_Piece, tuple[int, ...]]]] = {}
        for meta in metas:
            data = load_json(meta)
            entries = data.get("metadata") if isinstance(data, dict) else None
            if not isinstance(entries, dict):
                raise CorruptCheckpointError(f"{meta.name} has no \"metadata\" object; re-copy it")
            for name, item in entries.items():
                where = f"{meta.name} ({name[:60]})"
                if not isinstance(item, dict):
                    raise CorruptCheckpointError(f"{where} is not an object; re-copy it")
                shape = _ints(item.get("global_shape"), None, "global_shape", where)
                offsets = _ints(item.get("offsets"), len(shape), "offsets", where)
                lengths = _ints(item.get("lengths"), len(shape), "lengths", where)
                if any(o + n > s for o, n, s in zip(offsets, lengths, shape)):
                    raise CorruptCheckpointError(f"{where}: the box at {list(offsets)} of {list(lengths)} lies outside {list(shape)}; re-copy it")
                file = member(self.folder, item.get("file"), DIST_FILE, where, written_path=True)
                boxes.setdefault(name, []).append((_Piece(file, name, offsets, lengths), shape))
        specs_by_file: dict[str, dict[str, TensorSpec]] = {}
        for name, pieces in boxes.items():
            shapes = {shape for _, shape in pieces}
            if len(shapes) != 1:
                raise CorruptCheckpointError(f"{name}: the ranks' metadata disagree on its global shape ({sorted(shapes)}); the files are from different saves")
            shape = shapes.pop()
            dtypes = set()
            for piece, _ in pieces:
                found = specs_by_file.setdefault(piece.file, self._file_specs(piece.file))
                local = found.get(name)
                if local is None or local.shape != piece.lengths:
                    raise CorruptCheckpointError(
                        f"{piece.file}: {name[:80]} is {None if local is None else list(local.shape)}, "
                        f"its metadata says {list(piece.lengths)}; re-copy the checkpoint"
                    )
                dtypes.add(local.dtype)
            if len(dtypes) != 1:
                raise CorruptCheckpointError(f"{name}: the ranks saved it in different dtypes ({sorted(map(str, dtypes))})")
            _check_tiling(name, shape, [p for p, _ in pieces])
            self._specs[name] = TensorSpec(name, shape, dtypes.pop())
            self._pieces[name] = _distinct([p for p, _ in pieces])
        return {"ranks": len(metas), "files": len(specs_by_file)}

    # ---- files -----------------------------------------------------------------------------

    def _file_specs(self, file: str) -> dict[str, TensorSpec]:
        path = shard_path(self.folder, file)
        if file.endswith(".safetensors"):
            return self._safetensors_specs(file, path)
        state = self._bin(file)
        return {k: TensorSpec(k, tuple(v.shape), v.dtype) for k, v in state.items()}

    def _safetensors_specs(self, file: str, path: Path) -> dict[str, TensorSpec]:
        from safetensors import safe_open

        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own SafetensorError
            raise CorruptCheckpointError(f"{file} is not a valid safetensors file ({str(e)[:100]}); re-copy it") from None
        self._safe[file] = handle
        self._safe_runs[file] = SafetensorsRuns(path)
        out = {}
        for key in handle.keys():
            sl = handle.get_slice(key)
            dtype = SAFETENSORS_TO_TORCH.get(sl.get_dtype())
            if dtype is None:
                raise UnsupportedCheckpointError(f"{file}: {key[:80]} has dtype {sl.get_dtype()}, which hf_merge cannot read")
            out[key] = TensorSpec(key, tuple(sl.get_shape()), dtype)
        return out

    def _bin(self, file: str) -> dict[str, torch.Tensor]:
        if file not in self._bins:
            path = self.folder / file
            state = torch_load(path, TENSOR_FILE)
            if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
                raise CorruptCheckpointError(f"{file} holds a {type(state).__name__}, not a state dict of tensors; re-copy it")
            self._bins[file] = state
            self._mapped[file] = record_crc.mapped_file(path, state.values())  # open until close()
        return self._bins[file]

    def _safe_run(self, piece: _Piece) -> FileRun | None:
        """A safetensors box as a run of its file (None: read it with ``safe_open``)."""
        return self._safe_runs[piece.file].run(piece.key, piece.lengths, self._specs[piece.key].dtype)

    def _box(self, piece: _Piece) -> Piece:
        """The piece's own bytes: a run of its memory-mapped or safetensors file, else read from
        the safetensors slice."""
        if piece.file in self._safe:
            return self._safe_run(piece) or self._safe[piece.file].get_tensor(piece.key)
        tensor = self._bin(piece.file)[piece.key]
        source = self._mapped.get(piece.file)
        record_crc.check_tensor(tensor, source)
        return source.piece(tensor) if source is not None else tensor

    # ---- the LazyCheckpoint interface ---------------------------------------------------------

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def read_into(self, name: str, out: torch.Tensor) -> None:
        check_out(self._specs[name], out)
        for piece in self._pieces[name]:
            read_into(self._box(piece), out[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.lengths))])

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        """Boxes that split dim 0 only (a booster shard's whole tensor, the ranks' row slices of a
        distributed save) are runs of whole rows of their files: ``.bin`` files memory-mapped,
        safetensors files placed by their header."""
        spec = self._specs[name]
        pieces = [p for p in sorted(self._pieces[name], key=lambda p: p.offsets[0]) if math.prod(p.lengths)]
        if not spec.shape or not spec.shape[0] or any(p.lengths[1:] != spec.shape[1:] for p in pieces):
            return None
        if any(p.file in self._safe and self._safe_run(p) is None for p in pieces):
            return None

        def runs():
            for piece in pieces:
                box = self._box(piece)
                yield from row_runs(values(box), piece.offsets[0], dtype, max_bytes, run_of(box))

        return runs()

    def close(self) -> None:
        for source in self._mapped.values():
            if source is not None:
                source.close()
        self._mapped.clear()
        for runs in self._safe_runs.values():
            runs.close()
        self._safe_runs.clear()
        self._bins.clear()
        self._safe.clear()


def _distinct(pieces: list[_Piece]) -> list[_Piece]:
    """One piece per box (ranks of a data-parallel replica hold the same box)."""
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], _Piece] = {}
    for p in pieces:
        seen.setdefault((p.offsets, p.lengths), p)
    return list(seen.values())


def _check_tiling(name: str, shape: tuple[int, ...], pieces: list[_Piece]) -> None:
    """The distinct boxes cover the tensor exactly: volumes add up and no two overlap."""
    boxes = _distinct(pieces)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if all(max(ao, bo) < min(ao + an, bo + bn) for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths)):
                raise CorruptCheckpointError(f"{name}: two ranks' boxes overlap ({list(a.offsets)} and {list(b.offsets)}); the files are from different saves")
    if sum(math.prod(p.lengths) for p in boxes) != math.prod(shape):
        raise CorruptCheckpointError(f"{name}: the ranks' boxes do not cover its {list(shape)} elements; a rank's files are missing")


def open_colossalai(path: Path, *, config_dir: Path | None = None) -> ColossalAICheckpoint:
    folder, notes = resolve_folder(Path(path))
    ckpt = ColossalAICheckpoint(folder, config_dir=config_dir)
    ckpt.info.notes.extend(notes)
    return ckpt


FORMAT = SourceFormat(
    name="colossalai",
    description="ColossalAI booster.save_model(shard=True) folders (model-00001.safetensors, -stage-0000S-shard-, .bin) and per-rank pytorch_model-dist-* saves",
    probe=probe,
    open=open_colossalai,
    priority=40,
    framework="colossalai",
    # dist meta, an index or stage shards in the folder, its modeling/ or a save root's epoch-E_step-S/modeling/
    marks=(
        "pytorch_model-meta-dist-*", "*.index.json", "*model-stage-*",
        "modeling/pytorch_model-meta-dist-*", "modeling/*.index.json", "modeling/*model-stage-*",
        "epoch-*_step-*/modeling/pytorch_model-meta-dist-*", "epoch-*_step-*/modeling/*.index.json",
        "epoch-*_step-*/modeling/*model-stage-*",
    ),
)
