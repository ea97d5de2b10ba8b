"""How a verl FSDP checkpoint's tensors are spread over its rank files: the one layout, torch-free.

The FSDP reader (:mod:`hf_merge.readers.fsdp`, from tensors torch maps) and the CLI's head start
(:class:`RankIndex`, from :func:`~hf_merge.readers.rank_records.index_rank_file`, before torch is
imported) both lay a tensor out with :func:`layout`, check each rank's copy with
:func:`check_local` and take row runs in :func:`row_pieces` order, so they cannot disagree on
which bytes of which rank file make a tensor.

Sharding follows DTensor's ``Shard(d)`` semantics (``torch.chunk``): chunk size ``ceil(n/k)``, the
last chunks short or empty. ``Replicate`` mesh dimensions are read from coordinate 0 only.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..spec import TensorSpec
from .file_runs import FileRun
from .fsdp_files import chunk_range, rank_file_name


@dataclass(frozen=True)
class Piece:
    rank: int
    index: tuple[slice, ...]  # where this rank's local tensor goes in the global tensor


@dataclass(frozen=True)
class Layout:
    """How one tensor is spread over the ranks."""

    spec: TensorSpec
    pieces: tuple[Piece, ...]
    placements: str  # for inspect, e.g. "(Shard(dim=0),)" or "plain"
    replicas: tuple[tuple[int, int], ...] = ()  # (rank, rank of the piece read): copies not read (HSDP)


def layout(spec: TensorSpec, world_size: int, placements: "Sequence[Any] | None" = None,
           mesh_shape: Sequence[int] = (), ranks: Sequence[int] = ()) -> Layout:
    """``spec``'s pieces: a plain tensor (``placements`` None: the whole tensor, read from rank 0,
    a replica in every other rank), or a DTensor's ``placements`` (``kind``, ``dim``) on the device
    mesh of ``mesh_shape`` whose global ranks are ``ranks`` (row-major)."""
    name, shape = spec.name, tuple(spec.shape)
    if placements is None:
        pieces = (Piece(0, tuple(slice(0, n) for n in shape)),)
        lay = Layout(spec, pieces, "plain", tuple((r, 0) for r in range(1, world_size)))
    else:
        lay = _dtensor_layout(spec, world_size, tuple(placements), tuple(mesh_shape), tuple(ranks))
    covered = sum(math.prod(s.stop - s.start for s in p.index) for p in lay.pieces)
    if covered != spec.numel:
        raise CorruptCheckpointError(f"{name}: the pieces cover {covered} of {spec.numel} elements")
    return lay


def _dtensor_layout(spec: TensorSpec, world_size: int, placements: tuple, mesh_shape: tuple[int, ...],
                    ranks: tuple[int, ...]) -> Layout:
    name, shape = spec.name, tuple(spec.shape)
    for p in placements:
        if p.kind not in ("Shard", "Replicate"):
            raise UnsupportedCheckpointError(
                f"{name} has placement {p!r}; only Shard and Replicate are supported "
                "(a Partial tensor is not reduced yet; _StridedShard comes from FSDP+TP and needs the TP layout)"
            )
    if len(ranks) != world_size or math.prod(mesh_shape) != len(ranks):
        raise CorruptCheckpointError(
            f"{name}: device mesh {mesh_shape} has {len(ranks)} ranks but the world size is {world_size}"
        )
    if not mesh_shape or len(placements) != len(mesh_shape) or any(
        p.kind == "Shard" and not 0 <= p.dim < len(shape) for p in placements
    ):
        raise CorruptCheckpointError(
            f"{name}: placements {placements} do not fit its {len(shape)}-D shape on a {len(mesh_shape)}-D device mesh"
        )

    def rank_at(coord: Sequence[int]) -> int:
        flat = 0
        for c, n in zip(coord, mesh_shape):
            flat = flat * n + c
        return int(ranks[flat])

    pieces, replicas = [], []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        if any(p.kind == "Replicate" and c != 0 for p, c in zip(placements, coord)):
            # another replica of a piece read from coordinate 0 (verify checks that they agree)
            replicas.append((rank_at(coord), rank_at([0 if p.kind == "Replicate" else c for p, c in zip(placements, coord)])))
            continue
        bounds = [(0, n) for n in shape]
        for mesh_dim, (p, c) in enumerate(zip(placements, coord)):
            if p.kind == "Shard":
                lo, hi = bounds[p.dim]
                bounds[p.dim] = chunk_range(lo, hi, mesh_shape[mesh_dim], c)
        pieces.append(Piece(rank_at(coord), tuple(slice(lo, hi) for lo, hi in bounds)))
    return Layout(spec, tuple(pieces), str(placements), tuple(replicas))


def check_keys(fname: str, names: Iterable[str], layouts: dict[str, Layout]) -> None:
    """A rank file holds exactly rank 0's tensors."""
    names = set(names)
    if names != layouts.keys():
        extra = sorted(names - layouts.keys())[:3]
        missing = sorted(layouts.keys() - names)[:3]
        raise CorruptCheckpointError(
            f"{fname} has other tensors than rank 0 (missing {missing}, extra {extra}); the files are from different runs"
        )


def check_local(fname: str, lay: Layout, rank: int, dtype: Any, local_shape: tuple[int, ...]) -> None:
    """Rank ``rank``'s local copy of ``lay``'s tensor (``dtype``: a dtype, or what the pickle holds
    instead of a tensor) has the dtype rank 0 declares and the shape its placement gives."""
    name = lay.spec.name
    if dtype != lay.spec.dtype:
        raise CorruptCheckpointError(
            f"{name} in {fname} is {dtype}, rank 0 declares {lay.spec.dtype}; the file is damaged or from another run"
        )
    for piece in lay.pieces:
        if piece.rank == rank:
            expected = tuple(s.stop - s.start for s in piece.index)
            if local_shape != expected:
                raise CorruptCheckpointError(
                    f"{name} in {fname} has shape {local_shape} but its placement "
                    f"{lay.placements} on this mesh gives {expected}; the sharding layout is inconsistent"
                )
    if lay.placements == "plain" and local_shape != tuple(lay.spec.shape):
        raise CorruptCheckpointError(f"{name} in {fname} has shape {local_shape}, rank 0 has {tuple(lay.spec.shape)}")


def row_pieces(lay: Layout) -> list[Piece] | None:
    """The pieces in row order when they split dim 0 only (FSDP's usual ``Shard(0)``): runs of
    whole rows, one per piece. None otherwise."""
    shape = lay.spec.shape
    if not shape or any(s.start != 0 or s.stop != n for p in lay.pieces for s, n in zip(p.index[1:], shape[1:])):
        return None
    return sorted(lay.pieces, key=lambda p: p.index[0].start)


class RankIndex:
    """A rank-file folder laid out as the FSDP reader lays it out, read without torch: ``specs()``
    and ``read_rows`` whose runs are :class:`~hf_merge.readers.file_runs.FileRun`\\ s (no tensor),
    what :func:`hf_merge.write.engine.byte_recipe` and the engine's sink take. Runs that would
    need a conversion or that are not one dense span of their file are not offered (None)."""

    def __init__(self, folder: Path, world_size: int):
        from .rank_records import index_rank_file

        paths = [Path(folder) / rank_file_name(world_size, r) for r in range(world_size)]
        self._index = {0: index_rank_file(paths[0])}
        self.layouts = {
            name: layout(TensorSpec(name, t.shape, t.dtype), world_size, t.placements, t.mesh_shape or (), t.mesh or ())
            for name, t in self._index[0].items()
        }
        for rank in sorted({p.rank for lay in self.layouts.values() for p in lay.pieces} | {0}):
            if rank not in self._index:
                self._index[rank] = index_rank_file(paths[rank])
            check_keys(paths[rank].name, self._index[rank], self.layouts)
            for name, lay in self.layouts.items():
                check_local(paths[rank].name, lay, rank, self._index[rank][name].dtype, self._index[rank][name].local_shape)
        self.fds = {rank: os.open(paths[rank], os.O_RDONLY) for rank in self._index}

    def specs(self) -> dict[str, TensorSpec]:
        return {name: lay.spec for name, lay in self.layouts.items()}

    def read_rows(self, name: str, dtype: Any) -> Iterator[tuple[int, FileRun]] | None:
        lay = self.layouts[name]
        pieces = row_pieces(lay) if dtype == lay.spec.dtype else None
        if pieces is None:
            return None
        runs = []
        for piece in pieces:
            local = self._index[piece.rank][name]
            if math.prod(local.local_shape):
                if local.span is None:
                    return None
                runs.append((piece.index[0].start, FileRun(self.fds[piece.rank], *local.span, None)))
        return iter(runs)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
