"""A safetensors file's tensors as runs of the file: where each one's bytes are, from its header.

``safe_open`` reads a tensor into fresh memory. A reader of safetensors shards (a Hugging Face
folder, ColossalAI's safetensors booster shards) that hands its tensors out as
:class:`~hf_merge.readers.file_runs.FileRun` s lets a merge copy the bytes file to file and a load map
the file's pages, as for every other format. The header (8-byte little-endian length, then JSON:
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets from the end of the header)
is read here; ``safe_open`` has validated the file first (offsets in order, inside the file, no
overlap), and each run is checked again against the spec the reader holds.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import torch

from .file_runs import FileRun, PrivateMapping, map_private

#: a header larger than this is not read (safetensors' own limit is 100 MB)
MAX_HEADER = 100 << 20


class SafetensorsRuns:
    """The tensors of one safetensors file ``path`` as file runs; the file is mapped copy-on-write
    on first use and stays open until :meth:`close`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n <= MAX_HEADER else {}
        self._start = 8 + n
        self._offsets = {
            k: tuple(v["data_offsets"]) for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
        }
        self._lock = threading.Lock()
        self._mapped: PrivateMapping | None = None
        self._tried = False

    def run(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> FileRun | None:
        """Tensor ``name`` (of ``shape`` and ``dtype``, as the reader's spec says) as a run of this
        file; None when the header places it otherwise or the file cannot be mapped."""
        begin, end = self._offsets.get(name, (0, -1))
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or not nbytes:
            return None
        with self._lock:
            if not self._tried:
                self._mapped, self._tried = map_private(self.path), True
            mapped = self._mapped
        if mapped is None or self._start + end > mapped.whole.numel():
            return None
        view = torch.frombuffer(mapped.buffer, dtype=dtype, count=math.prod(shape), offset=self._start + begin).view(shape)
        return mapped.source.run(view)

    def close(self) -> None:
        with self._lock:
            if self._mapped is not None:
                self._mapped.source.close()
                self._mapped = None  # the views handed out keep the buffer alive
