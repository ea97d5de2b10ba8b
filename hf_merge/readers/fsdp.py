"""verl FSDP checkpoints: ``model_world_size_{N}_rank_{r}.pt`` files of DTensors.

Each rank file holds that rank's local shard of every parameter as a DTensor (FSDP1 with a device
mesh, FSDP2 ``fully_shard``), or plain tensors at world size 1 and for buffers (a full copy in every
rank). A DTensor's device mesh and placements say exactly which slice of the global tensor a rank
holds; this reader reads them per tensor (never guessing from one key or a mesh name) and copies
each rank's piece straight into its place in the caller's buffer.

Sharding follows DTensor's ``Shard(d)`` semantics (``torch.chunk``): chunk size ``ceil(n/k)``, the
last chunks short or empty. ``Replicate`` mesh dimensions are read from coordinate 0 only, so an
HSDP checkpoint reads one replica group (``verify`` compares the other groups with it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import ROW_CHUNK_BYTES, CheckpointInfo, LazyCheckpoint, check_out, row_runs
from .file_runs import MappedFile, Piece, read_into, values
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from .formats import SourceFormat
from ..spec import TensorSpec
from ..hf_files import checkpoint_side_dir
from .fsdp_files import (
    Layout, check_keys, check_local, check_rank_files_present, detect_world_size, layout, probe, rank_file_name,
    resolve_fsdp_dir, row_pieces,
)
from . import contained, record_crc
from ..forks import helper_cpus
from . import rank_pool
from .rank_records import LazyLocals, LocalDTensor, load_local_records, load_mapped_rank_records, local_records

logger = logging.getLogger(__name__)

class FsdpCheckpoint(LazyCheckpoint):
    """A verl FSDP rank-file folder as a lazy checkpoint with the training names and dtype."""

    def __init__(self, folder: Path, *, hf_dir: Path | None = None, step: int | None = None, notes=()):
        self.folder = Path(folder)
        self.world_size, ws_warnings = detect_world_size(self.folder)
        check_rank_files_present(self.folder, self.world_size)
        self._states: dict[int, dict[str, Any]] = {}
        self._files: dict[int, MappedFile | None] = {}
        paths = [self.folder / rank_file_name(self.world_size, r) for r in range(self.world_size)]
        # many tensors x many ranks: ranks 1.. are read by other processes while this one reads rank 0
        self._pool = (rank_pool.RankPool(dict(enumerate(paths[1:], 1)), helper_cpus(), read=local_records)
                      if rank_pool.worth(paths) else None)
        try:
            first = self._state(0)
            self._layouts: dict[str, Layout] = {}
            mesh_info: dict[str, Any] = {}
            for name, value in first.items():
                with _malformed(rank_file_name(self.world_size, 0), name):
                    self._layouts[name] = self._layout(name, value, mesh_info)
            # Load (and so validate) every rank file a piece comes from, and check it agrees with rank 0.
            needed = sorted({p.rank for lay in self._layouts.values() for p in lay.pieces} | {0})
            for rank in needed:
                with _malformed(rank_file_name(self.world_size, rank), None):
                    self._check_rank(rank)
        finally:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
        fsdp_version = None
        cfg = self.folder / "fsdp_config.json"
        if contained.check(cfg).is_file():
            fsdp_version = json.loads(cfg.read_text()).get("FSDP_version")
        if hf_dir is None and (self.folder / "huggingface" / "config.json").is_file():
            hf_dir = checkpoint_side_dir(self.folder / "huggingface", self.folder)
        dtypes = sorted({str(lay.spec.dtype).removeprefix("torch.") for lay in self._layouts.values()})
        self.info = CheckpointInfo(
            format="fsdp",
            path=self.folder,
            hf_dir=hf_dir,
            world_size=self.world_size,
            step=step,
            details={
                "fsdp_version": fsdp_version,
                "mesh": mesh_info.get("mesh"),
                "mesh_dim_names": mesh_info.get("names"),
                "ranks_read": needed,
                "placements": sorted({lay.placements for lay in self._layouts.values()}),
                "dtypes": dtypes,
            },
            notes=list(notes),
            warnings=ws_warnings,
        )

    def _state(self, rank: int) -> dict[str, Any]:
        if rank not in self._states:
            path = self.folder / rank_file_name(self.world_size, rank)
            # the file stays open (its tensors' bytes are copied through it) until close()
            read = self._pool.take(rank) if self._pool is not None else None
            mapped = load_local_records(path, read) if read is not None else None
            self._states[rank], source = mapped if mapped is not None else load_mapped_rank_records(path)
            self._files[rank] = source
            if source is not None and mapped is None:  # (LazyLocals checked each view as it was made)
                with _malformed(path.name, None):  # a damaged storage record fails here, not later
                    for value in self._states[rank].values():
                        if isinstance(local := _local(value), torch.Tensor):
                            source.storage_span(local)
        return self._states[rank]

    def _layout(self, name: str, value: Any, mesh_info: dict[str, Any]) -> Layout:
        if isinstance(value, LocalDTensor):
            if value.meta_shape is not None and value.meta_shape != tuple(value.shape):
                raise CorruptCheckpointError(f"{name}: DTensor shape {tuple(value.shape)} != its spec {value.meta_shape}")
            mesh_info.setdefault("mesh", list(value.mesh.shape))
            mesh_info.setdefault("names", list(value.mesh_dim_names or ()))
            spec = TensorSpec(name, tuple(value.shape), value.dtype)
            return layout(spec, self.world_size, value.placements, tuple(value.mesh.shape), value.mesh.reshape(-1).tolist())
        if isinstance(value, torch.Tensor):
            # Plain tensors: the whole tensor at world size 1, or a buffer replicated on every rank.
            return layout(TensorSpec(name, tuple(value.shape), value.dtype), self.world_size)
        raise UnsupportedCheckpointError(
            f"{name} in rank 0 is a {type(value).__name__}, not a tensor; is this a model state dict?"
        )

    def _check_rank(self, rank: int) -> None:
        state = self._state(rank)
        fname = rank_file_name(self.world_size, rank)
        check_keys(fname, state.keys(), self._layouts)
        for name, lay in self._layouts.items():
            if isinstance(state, LazyLocals):
                dtype, shape, dense, offset = state.meta(name)
            else:
                local = _local(state[name])
                if not isinstance(local, torch.Tensor):  # something else pickled in its place: check_local says what
                    check_local(fname, lay, rank, type(local).__name__, ())
                dtype, shape, dense, offset = local.dtype, tuple(local.shape), local.is_contiguous(), local.storage_offset()
            check_local(fname, lay, rank, dtype, shape)
            if lay.placements != "plain" and math.prod(shape) and (not dense or offset):
                # torch.save of a DTensor shard writes a dense local tensor at the start of its storage;
                # anything else is a damaged data.pkl whose view would silently read other bytes
                raise CorruptCheckpointError(
                    f"{name} in {fname} is a strided view (offset {offset}) of its storage; the file is damaged: re-copy it"
                )

    def specs(self) -> dict[str, TensorSpec]:
        return {name: lay.spec for name, lay in self._layouts.items()}

    def zip_archives(self) -> list[tuple[Path, int, int | None]]:
        """``(file, 0, None)`` of every rank file (for CRC checks)."""
        return [(self.folder / rank_file_name(self.world_size, r), 0, None) for r in range(self.world_size)]

    def placements(self) -> dict[str, str]:
        return {name: lay.placements for name, lay in self._layouts.items()}

    def replica_differences(self) -> tuple[int, list[str]]:
        """Compare every copy that is not read (HSDP replica groups, plain buffers saved by every
        rank) byte for byte with the copy that is: ``(copies compared, differences)``. A diverged
        replica means the replicas trained apart."""
        compared, differ = 0, []
        for rank in sorted({r for lay in self._layouts.values() for r, _ in lay.replicas}):
            self._check_rank(rank)
        for name, lay in self._layouts.items():
            for rank, primary in lay.replicas:
                a, b = _local(self._state(rank)[name]), _local(self._state(primary)[name])
                compared += 1
                if a.shape != b.shape or not torch.equal(_bytes(a), _bytes(b)):
                    diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape and a.numel() else float("nan")
                    differ.append(
                        f"{name}: rank {rank} holds other values than rank {primary}, its replica "
                        f"(max abs diff {diff:.3g}); the replicas diverged in training"
                    )
        return compared, differ

    def _piece(self, rank: int, name: str) -> Piece | None:
        """Rank ``rank``'s local tensor of ``name``, its record checked (None when empty)."""
        local = _local(self._state(rank)[name])
        if not local.numel():
            return None
        source = self._files.get(rank)
        record_crc.check_tensor(local, source)
        return source.piece(local) if source is not None else local

    def read_into(self, name: str, out: torch.Tensor) -> None:
        lay = self._layouts[name]
        check_out(lay.spec, out)
        for piece in lay.pieces:
            local = self._piece(piece.rank, name)
            if local is not None:
                read_into(local, out[piece.index])

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        """Rank pieces that split dim 0 only (FSDP's usual ``Shard(0)``) are runs of whole rows."""
        pieces = row_pieces(self._layouts[name])
        if pieces is None:
            return None

        def runs():
            for piece in pieces:
                local = self._piece(piece.rank, name)
                if local is not None:
                    yield from row_runs(values(local), piece.index[0].start, dtype, max_bytes, self._files.get(piece.rank))

        return runs()

    def close(self) -> None:
        for source in self._files.values():
            if source is not None:
                source.close()
        self._files.clear()
        self._states.clear()


@contextlib.contextmanager
def _malformed(fname: str, name: str | None):
    """Turn what a damaged rank file's metadata makes torch raise into one typed line."""
    try:
        yield
    except (IndexError, TypeError, ValueError, AttributeError, RuntimeError, OverflowError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:150]
        where = f"{name} in {fname}" if name else fname
        raise CorruptCheckpointError(
            f"{where}: inconsistent tensor metadata ({type(e).__name__}: {first}); the file is damaged, re-copy it"
        ) from None


def _local(value: Any) -> torch.Tensor:
    return value._local_tensor if hasattr(value, "_local_tensor") else value


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def open_fsdp(path: Path, *, config_dir: Path | None = None) -> FsdpCheckpoint:
    folder, step, notes = resolve_fsdp_dir(Path(path))
    return FsdpCheckpoint(folder, hf_dir=config_dir, step=step, notes=notes)


FORMAT = SourceFormat(
    name="fsdp",
    aliases=("verl-fsdp",),
    description="verl FSDP1/FSDP2 rank files (model_world_size_N_rank_r.pt of DTensors)",
    probe=probe,
    open=open_fsdp,
    priority=10,
    framework="verl",
    # rank files in the role folder, its global_step_N, or a checkpoints root
    marks=("model_world_size_*_rank_*.pt", "*/model_world_size_*_rank_*.pt", "*/*/model_world_size_*_rank_*.pt"),
)
