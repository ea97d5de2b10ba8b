"""A Hugging Face safetensors folder (single file or sharded with an index), via ``safe_open``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from . import contained
from ..checkpoint import ROW_CHUNK_BYTES, CheckpointInfo, LazyCheckpoint, check_out
from ..errors import CorruptCheckpointError, SourceNotFoundError, UnsupportedCheckpointError
from .file_runs import FileRun, read_into
from .formats import SourceFormat
from .safetensors_runs import SafetensorsRuns
from ..write.plan import INDEX_NAME
from ..spec import SAFETENSORS_TO_TORCH, TensorSpec


def _safe_member(folder: Path, name: str) -> Path:
    """A file named by an index, refused if it points outside the folder."""
    candidate = Path(name)
    if candidate.is_absolute() or ".." in candidate.parts or len(candidate.parts) != 1:
        raise CorruptCheckpointError(f"the index names {name!r}, which is not a file inside {folder}; refusing")
    return folder / candidate


class HfDirCheckpoint(LazyCheckpoint):
    def __init__(self, folder: Path, *, config_dir: Path | None = None):
        from safetensors import safe_open

        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise SourceNotFoundError(f"{folder} is not a folder")
        index = self.folder / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise ValueError('"weight_map" is not an object of file names')
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptCheckpointError(f"{index} is not a valid index ({str(e)[:120]}); fix or delete it") from None
            files = sorted({_safe_member(self.folder, f) for f in weight_map.values()})
        else:
            files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise SourceNotFoundError(f"no *.safetensors files in {self.folder}; pass a Hugging Face model folder")
        self._handles = {}
        self._where: dict[str, object] = {}
        self._file_of: dict[str, Path] = {}
        self._runs: dict[Path, SafetensorsRuns] = {}  # one per file, made here: threads share them
        self._specs: dict[str, TensorSpec] = {}
        for path in [index] * index.is_file() + files:
            contained.check(path)
        for path in files:
            if not path.is_file():
                raise CorruptCheckpointError(f"{path.name} is named by the index but missing from {self.folder}")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own SafetensorError
                raise CorruptCheckpointError(f"{path.name} is not a valid safetensors file ({e})") from None
            self._handles[path.name] = handle
            self._runs[path] = SafetensorsRuns(path)
            for name in handle.keys():
                if name in self._where:
                    raise CorruptCheckpointError(
                        f"{name[:80]} is in two files of {self.folder} ({path.name} and another); which one is meant "
                        "is unknown: fix the files or the index"
                    )
                sl = handle.get_slice(name)
                dtype = SAFETENSORS_TO_TORCH.get(sl.get_dtype())
                if dtype is None:
                    raise UnsupportedCheckpointError(
                        f"{path.name}: {name[:80]} has dtype {sl.get_dtype()}, which hf_merge cannot read; "
                        "convert that tensor to a torch dtype first"
                    )
                self._specs[name] = TensorSpec(name, tuple(sl.get_shape()), dtype)
                self._where[name] = handle
                self._file_of[name] = path
        hf_dir = config_dir or (self.folder if (self.folder / "config.json").is_file() else None)
        self.info = CheckpointInfo(format="hf", path=self.folder, hf_dir=hf_dir, details={"files": len(files)})

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def tensor_files(self) -> dict[str, list[str]]:
        """Each safetensors file's name (in the folder) -> the tensors it holds, files in name order."""
        by_file: dict[str, list[str]] = {name: [] for name in sorted(self._handles)}
        names = {id(h): n for n, h in self._handles.items()}
        for tensor, handle in self._where.items():
            by_file[names[id(handle)]].append(tensor)
        return by_file

    def _run(self, name: str) -> FileRun | None:
        """Tensor ``name`` as a run of its file (its bytes unchanged), or None."""
        spec = self._specs[name]
        return self._runs[self._file_of[name]].run(name, spec.shape, spec.dtype)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        check_out(self._specs[name], out)
        run = self._run(name)  # preadv straight into ``out`` where it can, else copied from the mapped view
        read_into(run if run is not None else self._where[name].get_tensor(name), out)

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        """The tensor as one run of its file where it is wanted in its own dtype (a merge copies
        it file to file, a load maps it), else runs of about ``max_bytes`` rows read with
        ``get_slice`` (only those rows leave the file), so a consumer of row runs (the GGUF writer)
        never holds a whole embedding."""
        spec = self._specs[name]
        if not spec.shape or spec.shape[0] == 0:
            return None
        run = self._run(name) if dtype == spec.dtype else None
        return iter([(0, run)]) if run is not None else self._row_slices(name, spec, dtype, max_bytes)

    def _row_slices(self, name: str, spec: TensorSpec, dtype: torch.dtype, max_bytes: int):
        rows = self._where[name].get_slice(name)
        row_bytes = max(1, math.prod(spec.shape[1:]) * max(dtype.itemsize, spec.dtype.itemsize))
        step = max(1, max_bytes // row_bytes)
        buf = None
        for first in range(0, spec.shape[0], step):
            run = rows[first:first + step]
            if run.dtype != dtype:  # converted into one reused buffer (the read_rows contract)
                if buf is None:
                    buf = torch.empty((min(step, spec.shape[0]),) + tuple(spec.shape[1:]), dtype=dtype)
                run = buf[: len(run)].copy_(run)
            yield first, run

    def close(self) -> None:
        for runs in self._runs.values():
            runs.close()
        self._runs.clear()
        self._handles.clear()
        self._where.clear()


def open_hf_dir(path: Path, *, config_dir: Path | None = None) -> HfDirCheckpoint:
    return HfDirCheckpoint(Path(path), config_dir=config_dir)


def probe(path: Path) -> bool:
    """A folder with safetensors weights (``model.safetensors`` or an index) and a config.json."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


FORMAT = SourceFormat(
    name="hf",
    hf_folder=True,
    description="a Hugging Face folder of safetensors weights (as --base-model or verify --against, or to re-shard/quantize)",
    probe=probe,
    open=open_hf_dir,
    priority=90,  # other frameworks' folders may hold a safetensors copy beside their own files
    marks=("*.safetensors",),
)
