"""Rank-file bytes copied through the file (copy_file_range / preadv) instead of the mapped pages.

The fast path must give byte-identical outputs to the page path, be taken on real FSDP2 rank
files, fall back when the kernel refuses, and never answer for memory it did not register.
"""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch

import hf_merge
from hf_merge import filemap
from hf_merge.checkpoint import open_checkpoint
from hf_merge.readers.safe_pickle import load_rank_file

pytestmark = pytest.mark.skipif(not os.path.exists(filemap.MAPS), reason="needs /proc/self/maps (Linux)")


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "rank.pt"
    g = torch.Generator().manual_seed(0)
    torch.save({"a": torch.randn(64, 32, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)}, path)
    state = load_rank_file(path)
    token = filemap.register(path, list(state.values()))
    yield path, state, token
    filemap.unregister(token)


def test_locate_points_at_the_tensor_bytes_in_the_file(saved):
    path, state, token = saved
    assert token is not None
    raw = path.read_bytes()
    for t in (state["a"], state["b"], state["a"][5:9], state["a"][63]):
        fd, offset = filemap.locate(t)
        n = t.numel() * t.element_size()
        assert raw[offset : offset + n] == _bytes(t)
    assert filemap.locate(state["a"][:, :3]) is None  # not contiguous
    assert filemap.locate(state["a"].clone()) is None  # not from the file
    assert filemap.locate(torch.zeros(3)) is None


def test_copy_and_read_through_the_file(saved, tmp_path):
    _, state, _ = saved
    rows = state["a"][10:20]
    out = tmp_path / "out.bin"
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, 100 + rows.numel() * 4)
        assert filemap.copy_to_file(rows, fd, 100)
        assert not filemap.copy_to_file(rows.clone(), fd, 100)  # not file-backed: caller writes it
    finally:
        os.close(fd)
    assert out.read_bytes()[100:] == _bytes(rows)
    dst = torch.empty(10, 32)
    assert filemap.read_into(rows, dst) and torch.equal(dst, rows)
    assert not filemap.read_into(rows, torch.empty(10, 32, dtype=torch.float64))  # a cast: caller copies


def test_unregistered_memory_is_never_located(saved):
    _, state, token = saved
    t = state["a"]
    assert filemap.locate(t) is not None
    filemap.unregister(token)
    assert filemap.locate(t) is None
    filemap.unregister(token)  # twice is harmless


def test_a_dropped_checkpoint_forgets_its_files(llama_tied_bf16_ws4):
    before = len(filemap._storages)
    ckpt = open_checkpoint(llama_tied_bf16_ws4.actor)
    assert len(filemap._storages) > before
    del ckpt
    gc.collect()
    assert len(filemap._storages) == before


def test_a_registration_whose_tensors_are_gone_is_never_trusted(saved):
    """A reader dropped without close() leaves its registration behind; once the registered tensor
    is gone its address may be another file's mapping (seen: a DeepSpeed universal merge copied a
    tensor from a ColossalAI .bin file of an earlier test), so a view that outlives it is not located."""
    path, state, token = saved
    a = state["a"]
    view = torch.empty(0, dtype=a.dtype).set_(a.untyped_storage(), a.storage_offset() + 64, (32,))  # no ._base
    assert filemap.locate(view) is not None
    del a
    del state["a"]
    gc.collect()
    assert filemap.locate(view) is None  # the storage lives on through the view, the registration does not


def test_colossalai_reader_dropped_without_close_is_forgotten():
    from pathlib import Path

    folder = Path(__file__).parent / "data" / "colossalai" / "ddp_bin_tied_ws2"
    ck = open_checkpoint(folder)
    name = next(iter(ck.specs()))
    ck.read(name)  # maps a .bin shard and registers it
    before = len(filemap._registrations)
    assert before
    del ck
    gc.collect()
    assert len(filemap._registrations) < before
