"""Byte provenance: readers hand out rank-file runs as FileRuns (descriptor, offset, byte count).

The runs must point at the tensor's bytes in the file (found from the zip records, no
/proc/self/maps), copies through the file must equal the page path, the kernel's refusal must fall
back, transforms that pass runs through must keep them, and a closed reader's files are closed.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from hf_merge.readers import file_runs
from hf_merge.checkpoint import open_checkpoint
from hf_merge.readers.file_runs import FileRun, MappedFile
from hf_merge.readers.safe_pickle import load_rank_file
from hf_merge.readers.torch_zip import read_records
from hf_merge.transforms.cast import Cast
from hf_merge.transforms.rename import Renamed


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "rank.pt"
    g = torch.Generator().manual_seed(0)
    torch.save({"a": torch.randn(64, 32, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)}, path)
    state = load_rank_file(path)  # torch.load(mmap=True)
    with open(path, "rb") as f:
        records = read_records(f, path.name)
    source = MappedFile.from_records(path, list(state.values()), records)
    yield path, state, source
    if source is not None:
        source.close()


def test_runs_point_at_the_tensor_bytes_in_the_file(saved):
    path, state, source = saved
    assert source is not None
    raw = path.read_bytes()
    for t in (state["a"], state["b"], state["a"][5:9], state["a"][63]):
        run = source.run(t)
        assert run.nbytes == t.numel() * t.element_size() and run.tensor is t
        assert raw[run.offset : run.offset + run.nbytes] == _bytes(t)
        assert os.pread(run.fd, run.nbytes, run.offset) == _bytes(t)
    assert source.run(state["a"][:, :3]) is None  # not contiguous
    assert source.run(state["a"].clone()) is None  # not from the file
    assert source.run(torch.zeros(3)) is None
    part = source.run(state["a"]).piece(state["a"][10:12])  # a view inside a run stays a run
    assert isinstance(part, FileRun) and os.pread(part.fd, part.nbytes, part.offset) == _bytes(state["a"][10:12])


def test_tensors_of_another_file_are_not_its_mapping(saved, tmp_path):
    path, state, _ = saved
    other = tmp_path / "other.pt"
    torch.save({"a": torch.ones(64, 32), "b": torch.ones(7, dtype=torch.bfloat16)}, other)
    with open(path, "rb") as f:
        records = read_records(f, path.name)
    assert MappedFile.from_records(path, list(load_rank_file(other).values()), records) is None
    assert MappedFile.from_records(path, [t.clone() for t in state.values()], records) is None


def test_read_through_the_file(saved):
    _, state, source = saved
    rows = source.run(state["a"][10:20])
    assert os.pread(rows.fd, rows.nbytes, rows.offset) == _bytes(rows.tensor)
    dst = torch.empty(10, 32)
    file_runs.read_into(rows, dst)  # preadv
    assert torch.equal(dst, rows.tensor)
    cast = torch.empty(10, 32, dtype=torch.float64)
    file_runs.read_into(rows, cast)  # a cast: copied from the values
    assert torch.equal(cast, rows.tensor.double())


def test_a_closed_file_hands_out_no_runs(saved):
    _, state, source = saved
    fd = source.fd
    source.close()
    assert source.run(state["a"]) is None and source.storage_span(state["a"]) is None
    with pytest.raises(OSError):
        os.fstat(fd)
    source.close()  # twice is harmless


def test_readers_hand_out_runs_and_close_their_files(llama_tied_bf16_ws4):
    ckpt = open_checkpoint(llama_tied_bf16_ws4.actor)
    name, spec = next((n, s) for n, s in ckpt.specs().items() if len(s.shape) == 2)
    runs = list(ckpt.read_rows(name, spec.dtype))
    assert runs and all(isinstance(piece, FileRun) for _, piece in runs)
    for _, run in runs:
        assert os.pread(run.fd, run.nbytes, run.offset) == _bytes(run.tensor)
    # pass-through transforms keep the provenance; a conversion makes values
    assert all(isinstance(p, FileRun) for _, p in Cast(ckpt, spec.dtype).read_rows(name, spec.dtype))
    renamed = Renamed(ckpt, {"x": name})
    assert all(isinstance(p, FileRun) for _, p in renamed.read_rows("x", spec.dtype))
    assert not any(isinstance(p, FileRun) for _, p in ckpt.read_rows(name, torch.float64))
    fds = {run.fd for _, run in runs}
    ckpt.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_dropped_reader_closes_its_files():
    folder = Path(__file__).parent / "data" / "colossalai" / "ddp_bin_tied_ws2"
    ck = open_checkpoint(folder)
    name = next(iter(ck.specs()))
    ck.read(name)  # maps a .bin shard, opens it
    fds = [s.fd for s in ck._mapped.values() if s is not None]
    assert fds
    del ck
    gc.collect()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
