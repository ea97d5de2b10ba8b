"""Fused QKV / gate-up tensors: pure split functions, their inverses, and the declared splits
(the name-table transform reads role tensors as row ranges of the fused one: tests/test_name_tables.py)."""

from __future__ import annotations

import pytest
import torch

from hf_merge.errors import MappingError
from hf_merge.transforms.fused import (
    FusedSplit,
    gate_up_row_ranges,
    merge_gate_up,
    merge_qkv,
    qkv_row_ranges,
    split_gate_up,
    split_qkv,
)

HEAD_SHAPES = [  # (num_heads, num_kv_heads, head_dim)
    (4, 2, 8),  # GQA
    (4, 4, 8),  # MHA
    (8, 1, 4),  # MQA
    (6, 3, 16),
    (4, 2, 16),  # Qwen3-like: heads * head_dim != hidden
]


def _labelled_qkv(nq: int, nkv: int, hd: int, hidden: int = 3):
    """A fused tensor whose every row says what it is: (kind, head, row-in-head)."""
    per = nq // nkv
    rows = []
    for g in range(nkv):
        for j in range(per):
            rows += [("q", g * per + j, r) for r in range(hd)]
        rows += [("k", g, r) for r in range(hd)]
        rows += [("v", g, r) for r in range(hd)]
    code = {"q": 0, "k": 1, "v": 2}
    t = torch.tensor([[code[k] * 10000 + h * 100 + r] * hidden for k, h, r in rows], dtype=torch.float32)
    return t


@pytest.mark.parametrize("nq,nkv,hd", HEAD_SHAPES)
def test_split_qkv_follows_megatron_query_groups(nq, nkv, hd):
    q, k, v = split_qkv(_labelled_qkv(nq, nkv, hd), num_heads=nq, num_kv_heads=nkv, head_dim=hd)
    assert q.shape == (nq * hd, 3) and k.shape == (nkv * hd, 3) and v.shape == (nkv * hd, 3)
    for name, t, heads, code in (("q", q, nq, 0), ("k", k, nkv, 1), ("v", v, nkv, 2)):
        want = torch.tensor([code * 10000 + h * 100 + r for h in range(heads) for r in range(hd)], dtype=torch.float32)
        assert torch.equal(t[:, 0], want), name


@pytest.mark.parametrize("nq,nkv,hd", HEAD_SHAPES)
def test_merge_then_split_returns_inputs(nq, nkv, hd):
    g = torch.Generator().manual_seed(nq * 100 + nkv * 10 + hd)
    q = torch.randn(nq * hd, 5, generator=g)
    k = torch.randn(nkv * hd, 5, generator=g)
    v = torch.randn(nkv * hd, 5, generator=g)
    fused = merge_qkv(q, k, v, num_heads=nq, num_kv_heads=nkv, head_dim=hd)
    q2, k2, v2 = split_qkv(fused, num_heads=nq, num_kv_heads=nkv, head_dim=hd)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    # biases (1-D) too
    b = torch.arange((nq + 2 * nkv) * hd, dtype=torch.float64)
    assert torch.equal(merge_qkv(*split_qkv(b, num_heads=nq, num_kv_heads=nkv, head_dim=hd), num_heads=nq, num_kv_heads=nkv, head_dim=hd), b)


def test_row_ranges_cover_every_row_once():
    for nq, nkv, hd in HEAD_SHAPES:
        ranges = qkv_row_ranges(nq, nkv, hd)
        src_rows = sorted(r for rr in ranges.values() for s, _, n in rr for r in range(s, s + n))
        assert src_rows == list(range((nq + 2 * nkv) * hd))
    assert qkv_row_ranges(4, 4, 8)["q"] == [(0, 0, 8), (24, 8, 8), (48, 16, 8), (72, 24, 8)]
    assert qkv_row_ranges(8, 1, 4) == {"q": [(0, 0, 32)], "k": [(32, 0, 4)], "v": [(36, 0, 4)]}
    assert gate_up_row_ranges(6) == {"gate": [(0, 0, 3)], "up": [(3, 0, 3)]}


def test_gate_up_round_trip_and_errors():
    gate, up = torch.randn(4, 3), torch.randn(4, 3)
    fused = merge_gate_up(gate, up)
    g2, u2 = split_gate_up(fused)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    with pytest.raises(MappingError, match="even"):
        split_gate_up(torch.zeros(5, 2))
    with pytest.raises(MappingError):
        merge_gate_up(torch.zeros(2, 2), torch.zeros(3, 2))


def test_split_qkv_errors_name_the_problem():
    with pytest.raises(MappingError, match="need 64"):
        split_qkv(torch.zeros(60, 2), num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(MappingError, match="multiple"):
        qkv_row_ranges(5, 2, 8)
    with pytest.raises(MappingError, match="roles"):
        FusedSplit("qkv", {"q": "a", "k": "b"}, num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(MappingError, match="unknown fused kind"):
        FusedSplit("qkvz", {"q": "a"})
    with pytest.raises(MappingError, match="head_dim"):
        FusedSplit("qkv", {"q": "a", "k": "b", "v": "c"})  # qkv without head counts
    with pytest.raises(MappingError, match="head_dim"):
        FusedSplit("qkv", {"q": "a", "k": "b", "v": "c"}, num_heads=4, num_kv_heads=2, head_dim=8).ranges(60)
