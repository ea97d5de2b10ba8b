"""verl FSDP rank-file folders, torch-free: names, world size and step from the file names, and how
each tensor is laid out over the rank files.

Used before torch is imported (:mod:`hf_merge.write.head_start`, the CLI's checks) and by
:mod:`hf_merge.readers.fsdp`, which reads the files. The FSDP reader (from the tensors torch maps)
and the head start (:class:`RankIndex`, from :func:`~hf_merge.readers.rank_records.index_rank_file`)
both lay a tensor out with :func:`layout`, check each rank's copy with :func:`check_local` and take
row runs in :func:`row_pieces` order, so they cannot disagree on which bytes of which rank file make
a tensor. Sharding follows DTensor's ``Shard(d)`` semantics (``torch.chunk``, :func:`chunk_range`);
``Replicate`` mesh dimensions are read from coordinate 0 only.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..errors import CorruptCheckpointError, SourceNotFoundError, UnsupportedCheckpointError
from ..spec import TensorSpec
from . import contained
from .file_runs import FileRun
from .step_choice import newest_step

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def rank_file_name(world_size: int, rank: int) -> str:
    return f"model_world_size_{world_size}_rank_{rank}.pt"


def has_rank_files(folder: Path) -> bool:
    return folder.is_dir() and any(RANK_FILE.match(p.name) for p in folder.iterdir())


def probe(path: Path) -> bool:
    """True if ``path`` is (or holds, as ``global_step_N/actor`` or a checkpoints root) a folder of
    verl FSDP rank files. Reads file names only."""
    try:
        resolve_fsdp_dir(Path(path))
    except SourceNotFoundError:
        return False
    return True


def resolve_fsdp_dir(path: Path) -> tuple[Path, int | None, list[str]]:
    """Find the folder holding rank files under what the user gave.

    Accepts the ``actor/`` (or ``critic/``) folder itself, a ``global_step_N`` folder, or a
    checkpoints root holding ``global_step_*`` folders (the one named by
    ``latest_checkpointed_iteration.txt``, else the highest step). Returns
    ``(folder, step, notes)``.
    """
    path = Path(path)
    notes: list[str] = []
    if not path.exists():
        raise SourceNotFoundError(f"{path} does not exist; pass the checkpoint's actor/ or global_step_N folder")
    if not path.is_dir():
        raise SourceNotFoundError(f"{path} is a file; pass the folder that holds the model_world_size_*_rank_*.pt files")
    if not any(path.iterdir()):
        raise SourceNotFoundError(f"{path} is empty; pass the folder that holds the model_world_size_*_rank_*.pt files")
    if not has_rank_files(path):
        chosen = choose_step(path, _complete_step)
        if chosen is not None:
            path, note = chosen
            notes.append(note)
        if has_rank_files(path / "actor"):
            if has_rank_files(path / "critic"):
                notes.append(f"{path.name} also has critic/; merging actor/ (pass the critic/ folder for the critic)")
            path = path / "actor"
        elif has_rank_files(path / "critic"):
            path = path / "critic"
    if not has_rank_files(path):
        raise SourceNotFoundError(
            f"no model_world_size_*_rank_*.pt files in {path}; pass a verl FSDP actor/ folder "
            "(or use --backend megatron for Megatron checkpoints)"
        )
    step = None
    for part in reversed(path.parts):
        if m := STEP_DIR.match(part):
            step = int(m.group(1))
            break
    return path, step, notes


def choose_step(root: Path, complete: Callable[[Path], bool]) -> tuple[Path, str] | None:
    """The ``global_step_N`` folder of a verl checkpoints ``root`` (either backend) to read, and a
    note saying why: the step ``latest_checkpointed_iteration.txt`` names, else the highest (see
    :func:`~hf_merge.readers.step_choice.newest_step`). None when ``root`` has no step folders.

    Raises:
        IncompleteStepError: the step chosen is not here or not ``complete`` (empty: a run stopped
            while saving it) and another step is: that one is named, not read in its place.
    """
    steps = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))}
    if not steps:
        return None
    latest_file = root / "latest_checkpointed_iteration.txt"
    named = None
    if contained.check(latest_file).is_file():
        text = latest_file.read_bytes()[:64].decode("ascii", "replace").strip()
        if re.fullmatch(r"[0-9]{1,18}", text):
            named = int(text)
    missing = f"{latest_file} names step {named}, which is not here"
    chosen = newest_step(steps, complete, pointer=None if named is None else (named, missing))
    if named in steps:
        return steps[named], f"using global_step_{named} (from {latest_file.name})"
    if chosen is None:  # no step is complete: the highest, for the caller to say what it lacks
        chosen = max(steps)
    return steps[chosen], f"{missing + '; ' if named is not None else ''}using global_step_{chosen} (the highest of {len(steps)} steps)"


def _complete_step(step: Path) -> bool:
    return has_rank_files(step) or has_rank_files(step / "actor") or has_rank_files(step / "critic")


def detect_world_size(folder: Path) -> tuple[int, list[str]]:
    """World size from ``fsdp_config.json``, checked against the rank file names.

    Returns ``(world size, warnings)``.
    """
    notes: list[str] = []
    sizes = {int(m.group(1)) for p in folder.iterdir() if (m := RANK_FILE.match(p.name))}
    config_path = folder / "fsdp_config.json"
    if contained.check(config_path).is_file():
        try:
            declared = json.loads(config_path.read_bytes())["world_size"]
            if not isinstance(declared, int) or isinstance(declared, bool) or declared < 1:
                raise ValueError(f"world_size is a {type(declared).__name__}, not a positive integer")
        except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError is a ValueError
            raise CorruptCheckpointError(f"{config_path} is not valid ({str(e)[:120]}); fix or delete it") from None
        if sizes != {declared}:
            found = ", ".join(str(s) for s in sorted(sizes))
            raise CorruptCheckpointError(
                f"fsdp_config.json says world_size {declared} but the rank files are for world size {found}; "
                "the folder mixes runs or the config is stale: keep only one run's files"
            )
        return declared, notes
    if len(sizes) != 1:
        found = ", ".join(str(s) for s in sorted(sizes))
        raise CorruptCheckpointError(f"rank files for several world sizes ({found}) in {folder}; keep one run's files")
    (size,) = sizes
    notes.append(f"no fsdp_config.json: world size {size} read from the rank file names")
    return size, notes


def check_rank_files_present(folder: Path, world_size: int) -> None:
    """Every rank's file must be there; the world size a file name claims is bounded by the files
    present (a name saying 1000000 ranks costs one directory listing, not a million look-ups)."""
    present = {int(m.group(2)) for p in folder.iterdir() if (m := RANK_FILE.match(p.name)) and int(m.group(1)) == world_size}
    present = {r for r in present if r < world_size}
    if len(present) == world_size:
        return
    n_missing = world_size - len(present)
    shown = []
    for r in range(world_size):
        if r not in present:
            shown.append(rank_file_name(world_size, r))
            if len(shown) == 3:
                break
    more = f" and {n_missing - len(shown)} more" if n_missing > len(shown) else ""
    raise CorruptCheckpointError(
        f"missing rank file{'s' if n_missing > 1 else ''} {', '.join(shown)}{more} in {folder} "
        f"({len(present)} of {world_size} present); copy every rank's file of the checkpoint"
    )


def chunk_range(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    """Sub-range ``index`` of ``[lo, hi)`` split like ``torch.chunk`` (ceil-sized, trailing empties)."""
    size = hi - lo
    step = math.ceil(size / parts) if size else 0
    start = min(lo + index * step, hi)
    return start, min(start + step, hi)


# --------------------------------------------------------------------------------------------
# How a tensor is spread over the rank files
# --------------------------------------------------------------------------------------------


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


def open_index(source: Path, config: Path | None) -> "tuple[RankIndex, Path] | None":  # the head start's
    """The rank files of ``source`` as the FSDP reader lays them out, read without torch, and the
    folder of their config.json (``config``, else ``huggingface/``); None where the reader would
    read the pickles with a process per CPU (large pickles), which one process without it would slow."""
    from . import rank_pool

    folder, _step, _notes = resolve_fsdp_dir(Path(source))
    world, _ = detect_world_size(folder)
    check_rank_files_present(folder, world)
    if rank_pool.worth([folder / rank_file_name(world, r) for r in range(world)]):
        return None
    return RankIndex(folder, world), config or folder / "huggingface"
