"""Fused QKV / gate-up tensors: pure split functions, their inverses, and the lazy view."""

from __future__ import annotations

import pytest
import torch

from hf_merge.checkpoint import CheckpointInfo, LazyCheckpoint, check_out
from hf_merge.errors import MappingError
from hf_merge.spec import TensorSpec
from hf_merge.transforms.fused import (
    FusedSplit,
    SplitFusedView,
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


class _DictCheckpoint(LazyCheckpoint):
    """In-memory lazy checkpoint that records what is read (optionally with region reads)."""

    def __init__(self, tensors: dict[str, torch.Tensor], *, regions: bool):
        self.t = tensors
        self.reads: list[tuple[str, tuple, tuple]] = []
        self.info = CheckpointInfo(format="test", path=None)  # type: ignore[arg-type]
        if regions:
            self.read_region_into = self._region  # type: ignore[method-assign]

    def specs(self):
        return {k: TensorSpec(k, tuple(v.shape), v.dtype) for k, v in self.t.items()}

    def read_into(self, name, out):
        check_out(self.specs()[name], out)
        self.reads.append((name, (0,) * out.dim(), tuple(out.shape)))
        out.copy_(self.t[name])

    def _region(self, name, start, out):
        self.reads.append((name, tuple(start), tuple(out.shape)))
        out.copy_(self.t[name][tuple(slice(s, s + n) for s, n in zip(start, out.shape))])


@pytest.mark.parametrize("regions", [True, False])
def test_split_fused_view_is_lazy_and_exact(regions):
    nq, nkv, hd, hidden = 4, 2, 8, 6
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn((nq + 2 * nkv) * hd, hidden, generator=g)
    fc1 = torch.randn(20, hidden, generator=g)
    other = torch.randn(3, generator=g)
    base = _DictCheckpoint({"emb": other, "l.qkv": qkv, "l.fc1": fc1}, regions=regions)
    view = SplitFusedView(
        base,
        {
            "l.qkv": FusedSplit("qkv", {"q": "l.q", "k": "l.k", "v": "l.v"}, num_heads=nq, num_kv_heads=nkv, head_dim=hd),
            "l.fc1": FusedSplit("gate_up", {"gate": "l.gate", "up": "l.up"}),
        },
    )
    assert list(view.specs()) == ["emb", "l.q", "l.k", "l.v", "l.gate", "l.up"]
    assert view.specs()["l.q"].shape == (nq * hd, hidden)
    assert base.reads == []  # nothing read at construction
    q, k, v = split_qkv(qkv, num_heads=nq, num_kv_heads=nkv, head_dim=hd)
    gate, up = split_gate_up(fc1)
    for name, want in {"l.q": q, "l.k": k, "l.v": v, "l.gate": gate, "l.up": up, "emb": other}.items():
        got = view.read(name, dtype=torch.float64)  # read_into casts into another dtype
        assert torch.equal(got, want.double()), name
    # A region of an output (rows 5..20 of q) is a region of the fused tensor.
    part = torch.empty(15, hidden)
    view.read_region_into("l.q", (5, 0), part)
    assert torch.equal(part, q[5:20])
    if regions:
        # Every read of the fused tensor was a row region no larger than one role.
        assert all(shape[0] <= nq * hd for name, _, shape in base.reads if name == "l.qkv")
    with pytest.raises(MappingError, match="not in the checkpoint"):
        SplitFusedView(base, {"missing": FusedSplit("gate_up", {"gate": "a", "up": "b"})})
    with pytest.raises(MappingError, match="collides"):
        SplitFusedView(base, {"l.fc1": FusedSplit("gate_up", {"gate": "emb", "up": "b"})})
