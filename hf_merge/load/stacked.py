"""Stacked model parameters filled slice by slice: transformers 5's fused MoE experts without its weight loop.

transformers 5 holds a MoE layer's experts as one tensor per projection (Qwen3-MoE
``mlp.experts.gate_up_proj [E, 2F, H]``, ``mlp.experts.down_proj [E, H, F]``) while checkpoints
(and ``merge``'s Hub layout) have one tensor per expert; its loader turns one into the other with
many-to-one weight converters: each expert's tensors collected, ``torch.stack``-ed, concatenated.
Where a converter is only that (:class:`hf_merge.transformers_compat.Stacking`), every checkpoint
tensor has a fixed place in the stacked parameter: :func:`slots` works those places out from the
specs alone (nothing read), and :func:`read_slot` reads a tensor straight into its place, as the
dense fill reads a whole tensor: no per-expert copy, no stacked copy of the copies. Where the
experts are file runs that tile the parameter (:func:`tiling`), the loader instead builds it whole
with the page mapper from :func:`flat_runs`, as it maps a dense tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from ..readers.file_runs import OnPlaced, Piece, read_into, run_of, values

if TYPE_CHECKING:
    from ..checkpoint import LazyCheckpoint
    from ..transformers_compat import Stacking


@dataclass(frozen=True)
class Slot:
    """Where checkpoint tensor ``name`` lies in a stacked model tensor ``out``:
    ``out.narrow(*cat).select(*stack)`` (each step only when set)."""

    name: str
    cat: tuple[int, int, int] | None = None  # (dim, start, length)
    stack: tuple[int, int] | None = None  # (dim, index)

    def of(self, out: torch.Tensor) -> torch.Tensor:
        if self.cat is not None:
            out = out.narrow(*self.cat)
        if self.stack is not None:
            out = out.select(*self.stack)
        return out


def slots(
    stacking: "Stacking", sources: list[tuple[str, str]], shapes: dict[str, tuple[int, ...]], want: tuple[int, ...]
) -> list[Slot] | None:
    """The place of each ``(source pattern, checkpoint name)`` of one model tensor of shape ``want``
    (``sources`` in the order transformers' loader collects them), or None when they do not build
    exactly that shape (missing or extra experts, other shapes: left to transformers' loop, which
    reports it)."""
    groups: dict[str, list[str]] = {}
    for pattern, name in sources:
        if pattern not in stacking.sources:
            return None
        groups.setdefault(pattern, []).append(name)
    stack, cat = stacking.stack_dim, stacking.cat_dim
    # the pieces concatenated, in order: (shape, [(name, stack index or None)])
    pieces: list[tuple[list[int], list[tuple[str, int | None]]]] = []
    for names in (groups[p] for p in stacking.sources if p in groups):
        if stack is None:
            pieces.extend((list(shapes[n]), [(n, None)]) for n in names)
            continue
        first = list(shapes[names[0]])
        if any(list(shapes[n]) != first for n in names) or stack > len(first):
            return None
        pieces.append((first[:stack] + [len(names)] + first[stack:], [(n, i) for i, n in enumerate(names)]))
    if not pieces or (cat is None and len(pieces) != 1):
        return None
    rank = len(want)
    if any(len(shape) != rank for shape, _ in pieces) or (cat is not None and cat >= rank):
        return None
    if any(shape[d] != want[d] for shape, _ in pieces for d in range(rank) if d != cat):
        return None
    if cat is not None and sum(shape[cat] for shape, _ in pieces) != want[cat]:
        return None
    out: list[Slot] = []
    start = 0
    for shape, members in pieces:
        narrow = (cat, start, shape[cat]) if cat is not None else None
        out.extend(Slot(name, narrow, None if index is None else (stack, index)) for name, index in members)
        start += shape[cat] if cat is not None else 0
    return out


def read_slot(view: "LazyCheckpoint", name: str, dst: torch.Tensor, placed: OnPlaced | None = None) -> None:
    """Read checkpoint tensor ``name`` into ``dst`` (its place in a CPU tensor, any dtype), as the
    dense fill reads a tensor it does not map: a tensor the checkpoint holds as file runs is
    ``preadv``-ed run by run into place and each run's bytes, as the model now holds them, given to
    ``placed`` (the load's CRC-32 check, :class:`hf_merge.readers.record_crc.Placed`); any other
    (a box of a stacked Megatron tensor, a cast) is ``read_into`` its place. A ``dst`` that is not
    contiguous, or not on the CPU (``mps``, ``xpu``: no numpy view of the bytes it holds for the
    CRC-32), is read and copied in; its record is then checked in full."""
    if not dst.is_contiguous() or dst.device.type != "cpu":
        dst.copy_(view.read(name))
        return
    runs = rows_from_files(view, name, dst.dtype) if dst.dim() else None
    if runs is None:
        view.read_into(name, dst)
        return
    for first, piece in runs:
        part = dst[first : first + len(values(piece))]
        read_into(piece, part)
        run = run_of(piece)
        if run is not None and placed is not None:
            placed(run.fd, run.offset, memoryview(part.reshape(-1).view(torch.uint8).numpy()))


def first_piece(view: "LazyCheckpoint", name: str, dtype: torch.dtype) -> Piece | None:
    """The first row of ``view.read_rows(name, dtype)`` (a one-row probe: one row's read), or None
    when the tensor has no runs of rows."""
    probe = view.read_rows(name, dtype, 1)
    first = next(iter(probe), None) if probe is not None else None
    return None if first is None else first[1]


def rows_from_files(view: "LazyCheckpoint", name: str, dtype: torch.dtype) -> Iterator[tuple[int, Piece]] | None:
    """``view.read_rows(name, dtype)`` when its first run is file bytes unchanged (a
    :class:`~hf_merge.readers.file_runs.FileRun`), else None (no runs, a cast, computed rows)."""
    first = first_piece(view, name, dtype)
    return view.read_rows(name, dtype) if first is not None and run_of(first) is not None else None


def tiling(places: list[Slot], shape: tuple[int, ...]) -> list[tuple[int, Slot]] | None:
    """``(element offset, slot)`` in memory order when every slot is one contiguous block of a
    tensor of ``shape`` and together they cover it exactly, once (the stacked experts of one
    projection: ``[E, 2F, H]`` is gate 0, up 0, gate 1...); else None."""
    probe = torch.empty(shape, device="meta")
    blocks = []
    for slot in places:
        part = slot.of(probe)
        if not part.is_contiguous():
            return None
        blocks.append((part.storage_offset(), part.numel(), slot))
    blocks.sort(key=lambda b: b[0])
    at = 0
    for offset, numel, _ in blocks:
        if offset != at:
            return None
        at += numel
    return [(offset, slot) for offset, _, slot in blocks] if at == probe.numel() else None


def flat_runs(view: "LazyCheckpoint", tiles: list[tuple[int, Slot]], dtype: torch.dtype) -> Iterator[tuple[int, Piece]]:
    """The runs of a stacked tensor flattened to one dimension, ``(first element, piece)``, slot
    after slot in memory order: what :meth:`hf_merge.load.page_mapper.Mapper.tensor` builds a
    tensor of ``(numel,)`` from (its file runs mapped where the pages agree, the rest read)."""
    specs = view.specs()
    for offset, slot in tiles:
        row = math.prod(specs[slot.name].shape[1:])
        runs = view.read_rows(slot.name, dtype)
        if runs is None:
            yield offset, view.read(slot.name).to(dtype)
            continue
        for first, piece in runs:
            yield offset + first * row, piece


__all__ = ["Slot", "first_piece", "flat_runs", "read_slot", "rows_from_files", "slots", "tiling"]
