"""Fused tensors, declared by role and split by pure functions.

A fused tensor stacks several Hugging Face tensors along dim 0 (rows):

- ``qkv``: Megatron-Core's ``linear_qkv`` is grouped **per query group**: for each of the
  ``num_kv_heads`` groups, its ``num_heads / num_kv_heads`` query heads, then one key head, then one
  value head, each ``head_dim`` rows (weights ``[rows, hidden]`` and biases ``[rows]`` alike). This
  holds for the *global* tensor of a ``torch_dist`` checkpoint whatever the training TP size
  (each TP rank owns whole groups; when ``num_kv_heads < tp`` Megatron splits a group across
  ranks, still contiguously). Checked against ``megatron/core/transformer/attention.py``
  (``get_query_key_value_tensors``) of Megatron-Core 0.16.
- ``gate_up``: a gated MLP's ``linear_fc1``: the first half of the rows is the gate projection,
  the second half the up projection (Megatron's ``apply_swiglu_sharded_factory`` stores the global
  tensor as ``[gate; up]`` whatever the TP size).

The arithmetic is a list of row ranges per role (:func:`qkv_row_ranges`,
:func:`gate_up_row_ranges`); :func:`split_qkv` / :func:`split_gate_up` apply them to in-memory
tensors and :func:`merge_qkv` / :func:`merge_gate_up` invert them. The name-table transform
(:mod:`hf_merge.transforms.name_table_view`) applies a :class:`FusedSplit` lazily: each output role is
read as a few row regions of the fused tensor, straight into the caller's buffer, so the fused
tensor is never held whole (when the base supports region reads; see :func:`read_region_into`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from ..checkpoint import LazyCheckpoint
from ..errors import MappingError

if TYPE_CHECKING:  # the row arithmetic needs no torch (the head start plans with it)
    import torch

__all__ = [
    "RowRange",
    "FusedSplit",
    "qkv_row_ranges",
    "gate_up_row_ranges",
    "split_qkv",
    "merge_qkv",
    "split_gate_up",
    "merge_gate_up",
    "read_region_into",
    "FUSED_ROLES",
]

#: The roles each fused kind is made of, in storage order.
FUSED_ROLES: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}

RowRange = tuple[int, int, int]  # (first row in the fused tensor, first row in the output, rows)


def _merge_adjacent(ranges: list[RowRange]) -> list[RowRange]:
    out: list[RowRange] = []
    for src, dst, n in ranges:
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((src, dst, n))
    return out


def qkv_row_ranges(num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, list[RowRange]]:
    """Row ranges of q, k and v inside a per-query-group fused QKV tensor.

    Returns ``{"q": [...], "k": [...], "v": [...]}``; each range is ``(fused_row, out_row, rows)``.
    The fused tensor has ``(num_heads + 2 * num_kv_heads) * head_dim`` rows; q has
    ``num_heads * head_dim``, k and v ``num_kv_heads * head_dim`` each.
    """
    if min(num_heads, num_kv_heads, head_dim) <= 0:
        raise MappingError(f"qkv split needs positive sizes, got heads={num_heads} kv_heads={num_kv_heads} head_dim={head_dim}")
    if num_heads % num_kv_heads:
        raise MappingError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    per = num_heads // num_kv_heads
    group = (per + 2) * head_dim
    q, k, v = [], [], []
    for g in range(num_kv_heads):
        base = g * group
        q.append((base, g * per * head_dim, per * head_dim))
        k.append((base + per * head_dim, g * head_dim, head_dim))
        v.append((base + (per + 1) * head_dim, g * head_dim, head_dim))
    return {"q": _merge_adjacent(q), "k": _merge_adjacent(k), "v": _merge_adjacent(v)}


def gate_up_row_ranges(rows: int) -> dict[str, list[RowRange]]:
    """Row ranges of gate and up inside a ``[gate; up]`` fused tensor of ``rows`` rows."""
    if rows <= 0 or rows % 2:
        raise MappingError(f"a fused gate/up tensor needs an even number of rows, got {rows}")
    half = rows // 2
    return {"gate": [(0, 0, half)], "up": [(half, 0, half)]}


def _role_rows(ranges: Sequence[RowRange]) -> int:
    return sum(n for _, _, n in ranges)


def _apply(fused: torch.Tensor, ranges: dict[str, list[RowRange]]) -> dict[str, torch.Tensor]:
    out = {}
    for role, rr in ranges.items():
        t = fused.new_empty((_role_rows(rr),) + tuple(fused.shape[1:]))
        for src, dst, n in rr:
            t[dst : dst + n] = fused[src : src + n]
        out[role] = t
    return out


def split_qkv(
    qkv: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a per-query-group fused QKV weight or bias into new ``(q, k, v)`` tensors."""
    ranges = qkv_row_ranges(num_heads, num_kv_heads, head_dim)
    expect = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[0] != expect:
        raise MappingError(
            f"fused qkv has {qkv.shape[0]} rows; heads={num_heads}, kv_heads={num_kv_heads}, "
            f"head_dim={head_dim} need {expect}"
        )
    parts = _apply(qkv, ranges)
    return parts["q"], parts["k"], parts["v"]


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    ranges = qkv_row_ranges(num_heads, num_kv_heads, head_dim)
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    out = q.new_empty((rows,) + tuple(q.shape[1:]))
    for role, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != _role_rows(ranges[role]):
            raise MappingError(f"{role} has {t.shape[0]} rows, expected {_role_rows(ranges[role])}")
        for src, dst, n in ranges[role]:
            out[src : src + n] = t[dst : dst + n]
    return out


def split_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a ``[gate; up]`` fused tensor into new ``(gate, up)`` tensors."""
    parts = _apply(fused, gate_up_row_ranges(fused.shape[0]))
    return parts["gate"], parts["up"]


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_gate_up`."""
    if gate.shape != up.shape:
        raise MappingError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    import torch

    return torch.cat([gate, up], dim=0)


# --------------------------------------------------------------------------------------------
# Lazy view
# --------------------------------------------------------------------------------------------


def read_region_into(ckpt: LazyCheckpoint, name: str, start: Sequence[int], out: torch.Tensor) -> None:
    """Fill ``out`` with the box ``[start, start + out.shape)`` of ``ckpt``'s tensor ``name``.

    Uses ``ckpt.read_region_into`` when the checkpoint has it (DCP, Megatron and fused views do,
    reading only the bytes the box needs); otherwise reads the whole tensor once and slices it.
    """
    fn = getattr(ckpt, "read_region_into", None)
    if fn is not None:
        fn(name, tuple(start), out)
        return
    spec = ckpt.specs()[name]
    if tuple(start) == (0,) * len(spec.shape) and tuple(out.shape) == spec.shape:
        ckpt.read_into(name, out)
        return
    full = ckpt.read(name)
    out.copy_(full[tuple(slice(s, s + n) for s, n in zip(start, out.shape))])


@dataclass(frozen=True)
class FusedSplit:
    """One fused tensor, declared by role: ``outputs`` maps each role to its output name.

    ``kind`` is ``"qkv"`` (needs ``num_heads``, ``num_kv_heads``, ``head_dim``) or ``"gate_up"``.
    """

    kind: str
    outputs: Mapping[str, str]
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        roles = FUSED_ROLES.get(self.kind)
        if roles is None:
            raise MappingError(f"unknown fused kind {self.kind!r}; known: {sorted(FUSED_ROLES)}")
        if set(self.outputs) != set(roles):
            raise MappingError(f"a {self.kind} split needs exactly the roles {list(roles)}, got {sorted(self.outputs)}")
        if self.kind == "qkv" and None in (self.num_heads, self.num_kv_heads, self.head_dim):
            raise MappingError("a qkv split needs num_heads, num_kv_heads and head_dim")

    def ranges(self, rows: int) -> dict[str, list[RowRange]]:
        """Row ranges per role for a fused tensor of ``rows`` rows (checked against the heads)."""
        if self.kind == "gate_up":
            return gate_up_row_ranges(rows)
        assert self.num_heads and self.num_kv_heads and self.head_dim
        expect = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if rows != expect:
            raise MappingError(
                f"fused qkv has {rows} rows; num_attention_heads={self.num_heads}, "
                f"num_key_value_heads={self.num_kv_heads}, head_dim={self.head_dim} need {expect}: "
                "check head_dim / num_key_value_heads in config.json"
            )
        return qkv_row_ranges(self.num_heads, self.num_kv_heads, self.head_dim)
