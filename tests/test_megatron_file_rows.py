"""Megatron-Core layers as file runs: a layer's slice of a stacked ``[L, rows, H]`` tensor and the
q/k/v and gate/up rows of a fused one are the ``.distcp`` files' bytes unchanged, so ``read_rows``
hands them out as :class:`~hf_merge.readers.file_runs.FileRun`\\ s (the loader maps or reads them
straight into place, its CRC-32 over the placed bytes; a writer copies them file to file), and a
loaded tensor starts at the page phase most of its bytes agree with."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from hf_merge.readers import file_runs, record_crc
from hf_merge.readers.dcp import DcpCheckpoint
from hf_merge.readers.megatron import open_megatron
from hf_merge.readers.torch_zip import read_records

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import make_megatron_checkpoint as mk  # noqa: E402
from helpers import dcp_no_dist  # noqa: E402

LINUX = pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="mapping files needs Linux")
SPLIT = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight")


def _actor(megatron_root: Path, tmp_path: Path) -> Path:
    # a fresh copy: the shared fixture's records may have been checked by an earlier test in this process
    return shutil.copytree(megatron_root / "qwen2_v1", tmp_path / "qwen2_v1") / "actor"


def test_split_and_layer_rows_are_file_runs_equal_to_region_reads(megatron_root):
    """Before: every q/k/v/gate/up row came from a region read into a buffer (no run was file-backed)."""
    ckpt = open_megatron(megatron_root / "qwen2_v1" / "actor")
    fam = mk.FAMILIES["qwen2"]
    checked = 0
    for i in range(fam.layers):
        for suffix in SPLIT + ("input_layernorm.weight",):
            name = f"model.layers.{i}.{suffix}"
            spec = ckpt.specs()[name]
            runs = list(ckpt.read_rows(name, spec.dtype))
            assert runs and all(file_runs.run_of(p) is not None for _, p in runs), name
            firsts = [first for first, _ in runs]
            assert firsts[0] == 0 and firsts == sorted(firsts), name
            assert torch.equal(torch.cat([file_runs.values(p) for _, p in runs]), ckpt.read(name)), name
            checked += 1
        # another dtype, and a tensor TP cuts along its columns (linear_proj): region reads, as before
        name = f"model.layers.{i}.self_attn.q_proj.weight"
        assert not any(file_runs.run_of(p) for _, p in ckpt.read_rows(name, torch.bfloat16))
        name = f"model.layers.{i}.self_attn.o_proj.weight"
        assert not any(file_runs.run_of(p) for _, p in ckpt.read_rows(name, ckpt.specs()[name].dtype))
    assert checked == fam.layers * 6
    ckpt.close()


@LINUX
def test_loaded_split_tensors_are_crc_checked_from_their_placed_bytes(megatron_root, tmp_path, monkeypatch):
    """Every tensor through the page mapper (``MIN_MAPPED_PAGES=0``): the fused records' CRC-32
    comes from the q/k/v and gate/up bytes where the model holds them, none is read again for its
    check (before: each fused record read once more in full), and the weights equal the reader's."""
    from transformers import AutoModelForCausalLM

    import hf_merge.load.auto
    import hf_merge.load.page_mapper

    hf_merge.load.auto.install()
    monkeypatch.setattr(hf_merge.load.page_mapper, "MIN_MAPPED_PAGES", 0)
    actor = _actor(megatron_root, tmp_path)
    with DcpCheckpoint(actor / "dist_ckpt") as dcp:
        fused = [(c.file, dcp._layout(k, c).data_start, dcp._layout(k, c).storage_nbytes)
                 for k in ("decoder.layers.self_attention.linear_qkv.weight", "decoder.layers.mlp.linear_fc1.weight")
                 for c in dcp._chunks[k]]
    read_again: list[tuple[str, int, int]] = []
    real = record_crc._crc

    def counting(fd, start, size, where):
        read_again.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), start, size))
        return real(fd, start, size, where)

    monkeypatch.setattr(record_crc, "_crc", counting)
    before = record_crc.stats()
    model = AutoModelForCausalLM.from_sharded_pretrained(actor, dtype="keep")
    assert record_crc.stats()["records"] > before["records"]
    assert read_again  # the other records (o_proj's, cut along its columns) are read for it
    assert not [(f, a) for f, a, n in read_again for g, b, m in fused if f == g and a < b + m and b < a + n]
    ours = model.state_dict()
    ckpt = open_megatron(actor)
    for name in ckpt.keys():
        assert torch.equal(ours[name], ckpt.read(name)), name
    ckpt.close()


def test_a_flipped_byte_in_a_q_row_stops_the_load(megatron_root, tmp_path):
    from transformers import AutoModelForCausalLM

    import hf_merge.load.auto

    hf_merge.load.auto.install()
    actor = _actor(megatron_root, tmp_path)
    with DcpCheckpoint(actor / "dist_ckpt") as dcp:
        chunk = dcp._chunks["decoder.layers.self_attention.linear_qkv.weight"][-1]
        where = dcp._layout("decoder.layers.self_attention.linear_qkv.weight", chunk).data_start + 5
    path = actor / "dist_ckpt" / chunk.file
    raw = bytearray(path.read_bytes())
    raw[where] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(record_crc.SourceCrcError, match=chunk.file):
        AutoModelForCausalLM.from_sharded_pretrained(actor, dtype="keep")


@LINUX
def test_the_tensor_takes_the_page_phase_most_of_its_bytes_agree_with(tmp_path):
    """One row from one file, then 64 rows from another written the same way: a row of 4,160 bytes
    puts the second run 64 bytes off the first's page phase. Before, the first (small) run chose
    the phase and nothing was mapped; now the large run's pages are mapped and the small one read."""
    from hf_merge.load.page_mapper import PAGE, Mapper

    row = 1040  # float32 elements
    parts = {"a": torch.randn(1, row), "b": torch.randn(64, row)}
    runs, sources = [], []  # a MappedFile closes its descriptor when dropped: keep them
    for first, (name, tensor) in zip((0, 1), parts.items()):
        path = tmp_path / f"{name}.pt"
        torch.save({name: tensor}, path)
        loaded = torch.load(path, mmap=True, weights_only=True)[name]
        with open(path, "rb") as f:
            records = read_records(f, path.name)
        source = file_runs.MappedFile.from_records(path, [loaded], records)
        sources.append(source)
        runs.append((first, source.piece(loaded)))
    assert all(file_runs.run_of(p) is not None for _, p in runs)
    assert (runs[0][1].offset - runs[1][1].offset) % PAGE == 0  # the same place in their files
    mapper = Mapper()
    out = mapper.tensor((65, row), torch.float32, iter(runs))
    assert torch.equal(out, torch.cat(list(parts.values())))
    assert mapper.mapped_bytes >= 62 * PAGE and mapper.read_bytes < 3 * PAGE


def test_column_pieces_are_read_straight_into_their_rows(megatron_root, monkeypatch):
    """o_proj / down_proj: TP cuts them along their columns, so a rank's piece fills a slice of
    every row. Its bytes are scattered into those rows by ``preadv`` (before: read into a buffer
    of the piece, then copied); the values equal torch's own DCP loader's."""
    import torch.distributed.checkpoint as dcp_api
    from torch.distributed.checkpoint import FileSystemReader

    from hf_merge.readers import dcp as dcp_module

    monkeypatch.setattr(dcp_module, "_MIN_ROW_BYTES", 1)  # the fixture's rows are a few bytes long
    root = megatron_root / "qwen2_v1" / "actor"
    dist = root / "dist_ckpt"
    with DcpCheckpoint(dist) as plain:
        official = {k: torch.empty(s.shape, dtype=s.dtype) for k, s in plain.specs().items()}
    dcp_api.load(official, storage_reader=FileSystemReader(str(dist)), **dcp_no_dist())
    ckpt = open_megatron(root)
    fam = mk.FAMILIES["qwen2"]
    targets: list[list[int]] = []
    real = os.preadv

    def spying(fd, buffers, offset, *args):
        targets.append([torch.frombuffer(b, dtype=torch.uint8).data_ptr() for b in buffers])
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", spying)
    for i in range(fam.layers):
        for name, source in (("self_attn.o_proj.weight", "decoder.layers.self_attention.linear_proj.weight"),
                             ("mlp.down_proj.weight", "decoder.layers.mlp.linear_fc2.weight")):
            targets.clear()
            out = torch.empty(ckpt.specs()[f"model.layers.{i}.{name}"].shape, dtype=official[source].dtype)
            ckpt.read_into(f"model.layers.{i}.{name}", out)
            assert torch.equal(out, official[source][i]), name
            lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
            assert targets and all(lo <= p < hi for ptrs in targets for p in ptrs), name
            assert max(len(ptrs) for ptrs in targets) == out.shape[0]  # one call: a row slice per row
    ckpt.close()


def test_preadv_batch_size_when_the_system_sets_no_iov_limit(monkeypatch):
    """``sysconf(SC_IOV_MAX)`` is -1 where the system sets no fixed limit: the row scatter must still
    pass a positive number of buffers per ``preadv`` (-1 sliced the row list from the wrong end)."""
    import os

    from hf_merge.readers import dcp

    monkeypatch.setattr(os, "sysconf", lambda name: -1)
    assert dcp._iov_max() == 16
    monkeypatch.setattr(os, "sysconf", lambda name: 4096)
    assert dcp._iov_max() == 1024
