"""Legacy Megatron per-rank files, ``model/mp_rank_XX[_PPP]/model.pt``, put together as one lazy
checkpoint under Megatron-Core's own names.

Each rank file is one ``torch.save`` of ``GPTModel.state_dict()`` per virtual pipeline stage. TP
shards are joined along the dims Megatron splits them on (:data:`TENSOR_PARALLEL`), PP and virtual
stages placed by their layer offsets (global layer numbers in the result). This is the legacy
counterpart of :class:`~hf_merge.readers.dcp.DcpCheckpoint` for ``torch_dist`` folders: the HF
names, the head (actor / critic, tied) and the config checks are :mod:`hf_merge.readers.megatron`'s,
the same for both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .. import config_fields
from .file_runs import MappedFile, source_of
from . import contained, record_crc
from ..checkpoint import CheckpointInfo, LazyCheckpoint, check_out
from ..errors import CorruptCheckpointError, MappingError, UnsupportedCheckpointError
from ..transforms.name_tables.megatron_gpt import EMBEDDING, LAYER, LAYER_INDEX, OUTPUT_BIAS, OUTPUT_LAYER
from ..spec import TensorSpec
from ..transforms.name_table import NameTable
from .safe_pickle import TENSOR_FILE, Allowlist, torch_load

if TYPE_CHECKING:  # the probe (legacy_dir) runs before torch is imported
    import torch

__all__ = ["LEGACY_RANK_FILE", "Assembled", "RankGrid", "assemble", "legacy_dir", "load_rank_file", "rank_grid"]

MP_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_MAX_NAMED = 12
# How legacy per-rank files split a tensor over TP ranks: the dim, or "gate_up" (each rank holds
# [gate_r; up_r]); unlisted names are replicated. A data layout, the same for every family.
TENSOR_PARALLEL: dict[str, int | str] = {
    EMBEDDING: 0,
    OUTPUT_LAYER: 0,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "self_attention.linear_proj.bias": 0,
    "mlp.linear_fc1.weight": "gate_up",
    "mlp.linear_fc1.bias": "gate_up",
    "mlp.linear_fc2.weight": 1,
}


def legacy_dir(root: Path) -> Path | None:
    """The folder holding ``mp_rank_*/model.pt`` under ``root`` (``root/model`` or ``root``), or None."""
    for cand in (root / "model", root):
        if cand.is_dir() and any(MP_RANK.match(p.name) and (p / "model.pt").is_file() for p in cand.iterdir()):
            return cand
    return None


@dataclass(frozen=True)
class RankGrid:
    """The rank files of one legacy checkpoint: ``files[(tp_rank, pp_rank)]``."""

    folder: Path
    files: dict[tuple[int, int], Path]
    tp: int
    pp: int


def rank_grid(folder: Path) -> RankGrid:
    """The ``mp_rank_XX[_PPP]`` files in ``folder``, every (TP, PP) rank present (file names only)."""
    grid: dict[tuple[int, int], Path] = {}
    for d in sorted(folder.iterdir()):
        m = MP_RANK.match(d.name)
        if not m or not (d / "model.pt").is_file():
            continue
        tp_rank, pp_rank = int(m.group(1)), int(m.group(2) or 0)
        if m.group(3) is not None:
            raise UnsupportedCheckpointError(
                f"{d}: expert-parallel legacy files (mp_rank_XX_PPP_EEE) are not supported; re-save with "
                "dist checkpointing (torch_dist)"
            )
        grid[(tp_rank, pp_rank)] = d / "model.pt"
    tp = max(t for t, _ in grid) + 1
    pp = max(p for _, p in grid) + 1
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp) if (t, p) not in grid]
    if missing:
        raise CorruptCheckpointError(f"{folder}: rank files missing for {', '.join(missing)} (TP={tp}, PP={pp})")
    return RankGrid(folder, grid, tp, pp)


def _name_list(names: Sequence[str]) -> str:
    shown = ", ".join(sorted(names)[:_MAX_NAMED])
    more = len(names) - _MAX_NAMED
    return shown + (f" (and {more} more)" if more > 0 else "")


#: Legacy ``model.pt``: tensors plus ``_extra_state`` entries that are ``io.BytesIO`` values.
LEGACY_RANK_FILE = TENSOR_FILE | Allowlist.of(calls=[("_io", "BytesIO")], classes=[("_io", "BytesIO")])


def load_rank_file(path: Path) -> list[dict[str, Any]]:
    """``torch.load`` one legacy rank file under :data:`LEGACY_RANK_FILE` (records checked,
    memory-mapped, weights only) -> list of state dicts (one per virtual pipeline stage)."""
    obj = torch_load(contained.check(path), LEGACY_RANK_FILE, str(path))
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        sds = [obj["model"]]
    elif isinstance(obj, dict) and any(re.fullmatch(r"model\d+", k) for k in obj):
        sds = [obj[k] for k in sorted((k for k in obj if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))]
    elif isinstance(obj, (list, tuple)):
        sds = list(obj)
    elif isinstance(obj, dict):
        sds = [obj]
    else:
        raise UnsupportedCheckpointError(f"{path}: holds a {type(obj).__name__}, not a model state dict")
    import torch

    out = []
    for sd in sds:
        if not isinstance(sd, dict):
            raise UnsupportedCheckpointError(f"{path}: holds a {type(sd).__name__}, not a model state dict")
        tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
        if tensors and all(k.startswith("module.") for k in tensors):
            tensors = {k[len("module.") :]: v for k, v in tensors.items()}
        out.append(tensors)
    return out


class _AssembledTensors(LazyCheckpoint):
    """Global tensors put together from local pieces (memory-mapped tensors) at known offsets."""

    def __init__(self, info: CheckpointInfo):
        self.info = info
        self._specs: dict[str, TensorSpec] = {}
        self._pieces: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        self._mapped: list[MappedFile] = []  # the files, open until close()

    def track(self, path: Path, tensors: list[torch.Tensor]) -> None:
        """Make the records of ``path`` (whose mapped ``tensors`` this object keeps) CRC-checkable."""
        source = record_crc.mapped_file(path, tensors)
        if source is not None:
            self._mapped.append(source)

    def close(self) -> None:
        for source in self._mapped:
            source.close()
        self._mapped.clear()

    def add(self, name: str, shape: tuple[int, ...], pieces: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        dtypes = {t.dtype for _, t in pieces}
        if len(dtypes) != 1:
            raise CorruptCheckpointError(f"{self.info.path}: the pieces of {name} have different dtypes {sorted(map(str, dtypes))}")
        covered = sum(t.numel() for _, t in pieces)
        numel = 1
        for d in shape:
            numel *= d
        if covered != numel:
            raise CorruptCheckpointError(f"{self.info.path}: the pieces of {name} cover {covered} of {numel} elements")
        self._specs[name] = TensorSpec(name, shape, dtypes.pop())
        self._pieces[name] = pieces

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def read_into(self, name: str, out: torch.Tensor) -> None:
        spec = self._specs[name]
        check_out(spec, out)
        self.read_region_into(name, (0,) * len(spec.shape), out)

    def read_region_into(self, name: str, start: Sequence[int], out: torch.Tensor) -> None:
        size = tuple(out.shape)
        for offsets, t in self._pieces[name]:
            lo = [max(s, o) for s, o in zip(start, offsets)]
            hi = [min(s + n, o + z) for s, n, o, z in zip(start, size, offsets, t.shape)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            record_crc.check_tensor(t, source_of(t, self._mapped))
            src = t[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))]
            out[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))].copy_(src)


def _tp_pieces(
    name: str, rule: Any, local: list[torch.Tensor], where: str
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]:
    """Global shape and pieces of one tensor from its TP-rank-ordered local shards."""
    shapes = {tuple(t.shape) for t in local}
    if len(shapes) != 1:
        raise CorruptCheckpointError(f"{where}: {name} has different shapes on the TP ranks: {sorted(shapes)}")
    shape = shapes.pop()
    tp = len(local)
    zero = (0,) * len(shape)
    if rule is None or tp == 1:
        return shape, [(zero, local[0])]
    if rule in (0, 1):
        if rule >= len(shape):
            raise MappingError(f"{where}: {name} has no dim {rule} to join the TP shards along")
        g = list(shape)
        g[rule] *= tp
        pieces = []
        for r, t in enumerate(local):
            off = [0] * len(shape)
            off[rule] = r * shape[rule]
            pieces.append((tuple(off), t))
        return tuple(g), pieces
    if rule == "gate_up":
        if shape[0] % 2:
            raise MappingError(f"{where}: {name} has an odd number of rows; cannot be a [gate; up] shard")
        f = shape[0] // 2
        total = f * tp
        pieces = []
        for r, t in enumerate(local):
            pieces.append(((r * f,) + zero[1:], t[:f]))
            pieces.append(((total + r * f,) + zero[1:], t[f:]))
        return (2 * total,) + shape[1:], pieces
    raise MappingError(f"{where}: unknown tensor_parallel rule {rule!r} for {name}")


@dataclass
class Assembled:
    """The rank files as one checkpoint under Megatron names, and what the layout said."""

    tensors: LazyCheckpoint
    vpp: int
    num_layers: int
    notes: list[str]


def assemble(grid: RankGrid, table: NameTable, config: Mapping[str, Any], info: CheckpointInfo) -> Assembled:
    """Load every rank file (memory-mapped) and put the global tensors together: TP shards joined,
    PP / virtual stages given global layer numbers, Megatron's copy of a tied output layer on the
    last stage dropped. ``table`` says which entries are not model tensors; ``config`` gives the
    layer count the files must add up to and whether the embeddings are tied."""
    tp, pp = grid.tp, grid.pp
    lp = LAYER
    rules = TENSOR_PARALLEL
    if tp > 1 and "expert" in table.sizes:
        raise UnsupportedCheckpointError(
            f"{grid.folder}: legacy per-rank files of an MoE model ({table.name}) saved at TP={tp} are not "
            "supported (expert tensor-parallel layouts vary); re-save with dist checkpointing (torch_dist)"
        )

    # files[p][t] = list over virtual stages of state dicts
    files = [[load_rank_file(grid.files[(t, p)]) for t in range(tp)] for p in range(pp)]
    vpp = {len(files[p][t]) for p in range(pp) for t in range(tp)}
    if len(vpp) != 1:
        raise CorruptCheckpointError(f"{grid.folder}: rank files hold different numbers of virtual pipeline stages {sorted(vpp)}")
    vpp_n = vpp.pop()

    def local_layers(sd: dict[str, Any]) -> list[int]:
        idx = set()
        for k in sd:
            if k.startswith(lp):
                m = LAYER_INDEX.match(k[len(lp) :])
                if m:
                    idx.add(int(m.group(1)))
        return sorted(idx)

    src = _AssembledTensors(info)
    src.zip_archives = lambda: [(grid.files[k], 0, None) for k in sorted(grid.files)]  # for CRC checks
    for (t, p), rank_file in grid.files.items():  # each tensor's record is found through its file offset
        src.track(rank_file, [x for sd in files[p][t] for x in sd.values()])
    notes: list[str] = []
    offset = 0
    where = str(grid.folder)
    seen_globals: dict[str, tuple[int, int]] = {}
    drop_tied_copy = config_fields.ties_word_embeddings(config) and pp * vpp_n > 1
    for v in range(vpp_n):
        for p in range(pp):
            sds = [files[p][t][v] for t in range(tp)]
            keys = list(sds[0])
            for t in range(1, tp):
                if set(sds[t]) != set(keys):
                    raise CorruptCheckpointError(
                        f"{where}: TP ranks 0 and {t} of pipeline stage {p} hold different tensors: "
                        f"{_name_list(sorted(set(sds[t]) ^ set(keys)))}"
                    )
            layers = local_layers(sds[0])
            if layers and layers != list(range(len(layers))):
                raise CorruptCheckpointError(f"{where}: pipeline stage {p} has non-contiguous local layers {layers}")
            for k in keys:
                if table.ignored(k):
                    continue
                m = LAYER_INDEX.match(k[len(lp) :]) if k.startswith(lp) else None
                if m:
                    suffix = m.group(2)
                    name = f"{lp}{offset + int(m.group(1))}.{suffix}"
                    rule = rules.get(suffix)
                else:
                    name = k
                    rule = rules.get(k)
                    if k in seen_globals:
                        if k == OUTPUT_LAYER and drop_tied_copy:
                            continue
                        raise CorruptCheckpointError(
                            f"{where}: {k} is on pipeline stages {seen_globals[k][1]} and {p}; only a tied "
                            "output layer may repeat"
                        )
                    seen_globals[k] = (v, p)
                    if k == OUTPUT_LAYER and drop_tied_copy and EMBEDDING in seen_globals:
                        notes.append(f"{k} on the last pipeline stage is Megatron's copy of the tied embedding; not written")
                        del seen_globals[k]
                        continue
                local = [sd[k] for sd in sds]
                if k in (OUTPUT_LAYER, OUTPUT_BIAS) and local[0].ndim >= 1 and local[0].shape[0] == 1:
                    rule = None  # a [1, H] value head is replicated, not vocab-parallel
                shape, pieces = _tp_pieces(name, rule, local, where)
                src.add(name, shape, pieces)
            offset += len(layers)
    if offset != config_fields.get(config, "num_hidden_layers"):  # an int or absent (checked by the caller)
        raise MappingError(
            f"{where}: the rank files hold {offset} layers but config.json has num_hidden_layers="
            f"{config_fields.get(config, 'num_hidden_layers')}; is config.json the right one?"
        )
    if drop_tied_copy and OUTPUT_LAYER in src.specs():
        # The copy was seen before the embedding (cannot happen in stage order); keep it honest.
        raise CorruptCheckpointError(f"{where}: tied output layer found before the embedding")
    return Assembled(src, vpp_n, offset, notes)
