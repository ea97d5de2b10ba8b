"""The file-writing engine (``hf_merge.write.engine``, driven by ``hf_merge.write.shards``).

Whatever way the bytes reach the output file (``preadv`` from the rank files or copied from memory;
``O_DIRECT`` or the page cache; buffers or a mapped region for a large tensor without row runs;
a sha256 hashed on the filling thread or on a thread of its own, or a CRC-32) the file must be the
same bytes, the recorded checksum its digest; a full disk on a writer thread is one line and no target.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import threading
import zlib

import pytest
import torch

import hf_merge
from hf_merge.readers import file_runs
from hf_merge.write import engine, shards

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")


def _merge(source, target, **kw) -> tuple[dict[str, bytes], dict[str, str]]:
    hf_merge.merge(source, target, workers=1, **kw)
    files = {p.name: p.read_bytes() for p in sorted(target.iterdir()) if p.suffix == ".safetensors"}
    recorded = json.loads((target / "hf_merge.json").read_text()).get("files") or {}
    return files, {n: d for n, d in recorded.items() if n in files}  # the weight files' (config.json's too)


def _digests(files: dict[str, bytes], kind: str = "crc32") -> dict[str, str]:
    """Each file's checksum as hf_merge.json records it, computed here by zlib / hashlib."""
    if kind == "crc32":
        return {n: f"crc32:{zlib.crc32(b):08x}" for n, b in files.items()}
    return {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}


#: how the checksum is taken: (kind, on a thread of its own)
HASHING = {"sha256-thread": ("sha256", True), "sha256-inline": ("sha256", False), "crc32": ("crc32", False)}


@pytest.fixture
def small_buffers(monkeypatch):
    """Small buffers and pieces, so that tensors cross many buffer boundaries; returns the sizes of
    the regions the engine mapped (large tensors without row runs)."""
    monkeypatch.setattr(engine, "CHUNK", 16 << 10)
    monkeypatch.setattr(engine, "PIECE", 4 << 10)
    regions: list[int] = []
    real = engine.Sink.add_region

    def counting(self, n, fill):
        regions.append(n)
        return real(self, n, fill)

    monkeypatch.setattr(engine.Sink, "add_region", counting)
    return regions


def _hash_on(monkeypatch, apart: bool) -> list[int]:
    """Hash apart (or inline) whatever the CPUs; returns a list that grows with each sha256 thread."""
    monkeypatch.setattr(engine, "hash_apart", lambda cores, checksum: apart)
    monkeypatch.setattr(engine, "HASH_BACKLOG", 16 << 10)  # computed bytes wait for the hasher
    threads: list[int] = []
    real = threading.Thread.start

    def start(self):
        if self.name == "sha256":
            threads.append(1)
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return threads


@pytest.mark.parametrize(
    "fixture, kw",
    [
        ("llama_tied_bf16_ws4", {}),  # rank-file bytes: preadv from the files
        ("qwen2_fp32_ws2", {"dtype": "bfloat16"}),  # converted runs: copied from memory
        ("lora_ckpt", {}),  # fused LoRA: computed runs
        ("uneven_ckpt", {}),  # uneven and empty rank pieces
    ],
)
@pytest.mark.parametrize("hashing", list(HASHING))
def test_bytes_from_the_files_and_from_memory_are_the_same_file(fixture, kw, hashing, request, tmp_path, monkeypatch,
                                                                 small_buffers):
    ck = request.getfixturevalue(fixture)
    kind, apart = HASHING[hashing]
    threads = _hash_on(monkeypatch, apart)
    preads = []
    real = engine.file_bytes
    monkeypatch.setattr(engine, "file_bytes", lambda t: preads.append(1) or real(t))
    files, recorded = _merge(ck.actor, tmp_path / "files", max_shard_size="40KB", checksums=kind, **kw)
    assert files and recorded == _digests(files, kind)
    assert len(threads) >= (len(files) if apart else 0) and (apart or not threads)
    assert preads
    monkeypatch.setattr(engine, "file_bytes", lambda t: None)  # every byte copied from memory
    memory, recorded_memory = _merge(ck.actor, tmp_path / "memory", max_shard_size="40KB", checksums=kind, **kw)
    assert files == memory and recorded == recorded_memory


def _fails_after(monkeypatch, module, name: str, calls: int, error: OSError) -> None:
    """``module.name`` raises ``error`` from its call number ``calls + 1`` on."""
    real = getattr(module, name)
    seen = []

    def failing(*args):
        seen.append(1)
        if len(seen) > calls:
            raise error
        return real(*args)

    monkeypatch.setattr(module, name, failing)


def _one_error_line_and_no_target(source, tmp_path, capsys, *flags: str) -> str:
    from hf_merge.cli.app import main as cli

    target = tmp_path / "out"
    assert cli(["merge", str(source), str(target), "--workers", "1", *flags]) != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1, err
    assert not target.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []
    return err[0]


def test_a_full_disk_on_a_writer_thread_is_one_line_and_no_target(llama_tied_bf16_ws4, tmp_path, capsys, monkeypatch, small_buffers):
    _fails_after(monkeypatch, file_runs, "pwrite_exact", 1, OSError(errno.ENOSPC, "No space left on device"))
    line = _one_error_line_and_no_target(llama_tied_bf16_ws4.actor, tmp_path, capsys)
    assert "no space left on the device" in line, line


def test_a_read_error_while_gathering_is_one_line_and_no_target(llama_tied_bf16_ws4, tmp_path, capsys, monkeypatch, small_buffers):
    _fails_after(monkeypatch, file_runs, "pread_exact", 5, OSError(errno.EIO, "Input/output error"))
    line = _one_error_line_and_no_target(llama_tied_bf16_ws4.actor, tmp_path, capsys)
    assert "unexpected" not in line, line


def test_a_read_error_on_the_hashing_thread_is_one_line_and_no_target(llama_tied_bf16_ws4, tmp_path, capsys, monkeypatch, small_buffers):
    _hash_on(monkeypatch, True)
    real = file_runs.pread_exact

    def failing_on_the_hasher(*args):
        if threading.current_thread().name == "sha256":
            raise OSError(errno.EIO, "Input/output error")
        return real(*args)

    monkeypatch.setattr(file_runs, "pread_exact", failing_on_the_hasher)
    line = _one_error_line_and_no_target(llama_tied_bf16_ws4.actor, tmp_path, capsys, "--checksum", "sha256")
    assert "unexpected" not in line and "input/output error" in line.lower(), line


def _direct_writes(monkeypatch) -> list[int]:
    """Offsets written through an ``O_DIRECT`` descriptor."""
    real = file_runs.pwrite_exact
    seen = []

    def spying(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen.append(offset)
        real(fd, data, offset)

    monkeypatch.setattr(file_runs, "pwrite_exact", spying)
    return seen


def test_a_file_system_that_refuses_o_direct_at_open_is_written_through_the_page_cache(llama_tied_bf16_ws4, tmp_path, monkeypatch, small_buffers):
    reference, _ = _merge(llama_tied_bf16_ws4.actor, tmp_path / "direct")
    real_open = os.open

    def no_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_direct)
    direct = _direct_writes(monkeypatch)
    files, recorded = _merge(llama_tied_bf16_ws4.actor, tmp_path / "out")
    assert direct == [] and files == reference and recorded == _digests(files)


def test_o_direct_writes_refused_after_open_go_through_the_page_cache(llama_tied_bf16_ws4, tmp_path, monkeypatch, small_buffers):
    real = file_runs.pwrite_exact
    refused = []

    def einval_on_direct(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, data, offset)

    monkeypatch.setattr(file_runs, "pwrite_exact", einval_on_direct)
    files, recorded = _merge(llama_tied_bf16_ws4.actor, tmp_path / "out")
    assert refused == [0]  # the first O_DIRECT write was refused, and no other was tried
    assert recorded == _digests(files)
    monkeypatch.undo()
    assert _merge(llama_tied_bf16_ws4.actor, tmp_path / "reference")[0] == files


def test_full_buffers_are_written_with_o_direct(llama_tied_bf16_ws4, tmp_path, monkeypatch, small_buffers):
    direct = _direct_writes(monkeypatch)
    files, _ = _merge(llama_tied_bf16_ws4.actor, tmp_path / "out")
    size = sum(len(b) for b in files.values())
    assert len(direct) >= size // engine.CHUNK - len(files) and all(o % engine.BLOCK == 0 for o in direct)


@pytest.mark.parametrize("hashing", list(HASHING))
def test_large_tensors_without_row_runs_are_read_into_the_mapped_output(shard1_dtensor_ckpt, hashing, tmp_path, monkeypatch, small_buffers):
    """``Shard(1)`` pieces are not runs of whole rows: with a small whole-read limit their tensors
    are read into mapped regions of the output file, between buffers written with O_DIRECT (which
    then resume at the block boundary below each region's end)."""
    reference, _ = _merge(shard1_dtensor_ckpt.actor, tmp_path / "default")
    assert small_buffers == []
    kind, apart = HASHING[hashing]
    _hash_on(monkeypatch, apart)
    monkeypatch.setattr(shards, "WHOLE_TENSOR_LIMIT", 1024)
    direct = _direct_writes(monkeypatch)
    files, recorded = _merge(shard1_dtensor_ckpt.actor, tmp_path / "out", checksums=kind)
    assert len(small_buffers) > 1 and direct and all(o % engine.BLOCK == 0 for o in direct)
    assert files == reference and recorded == _digests(files, kind)


def test_colossalai_tp2_weights_go_through_mapped_regions(tmp_path, monkeypatch, small_buffers):
    """A ColossalAI distributed TP=2 save: its row-parallel weights are cut along dim 1, so the
    reader has no row runs of them; they are read into mapped regions, and the file is the bytes
    the real library's weights make (checked against tests/test_colossalai.py's reference by that
    test's merge)."""
    from pathlib import Path

    source = Path(__file__).parent / "data" / "colossalai" / "dist_tp2_ws2"
    config = source / "reference" / "config"
    reference, _ = _merge(source, tmp_path / "default", dtype="float32", config=config)
    assert small_buffers == []
    monkeypatch.setattr(shards, "WHOLE_TENSOR_LIMIT", 1024)
    files, recorded = _merge(source, tmp_path / "out", dtype="float32", config=config)
    assert len(small_buffers) > 1 and files == reference and recorded == _digests(files)


def test_a_region_on_a_file_system_without_o_direct(shard1_dtensor_ckpt, tmp_path, monkeypatch, small_buffers):
    monkeypatch.setattr(shards, "WHOLE_TENSOR_LIMIT", 1024)
    reference, _ = _merge(shard1_dtensor_ckpt.actor, tmp_path / "direct")
    monkeypatch.setattr(engine, "open_output", lambda path: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
    direct = _direct_writes(monkeypatch)
    files, recorded = _merge(shard1_dtensor_ckpt.actor, tmp_path / "out")
    assert direct == [] and small_buffers and files == reference and recorded == _digests(files)


def test_hash_apart_where_the_writer_has_a_second_core():
    assert not engine.hash_apart(1, "sha256") and engine.hash_apart(2, "sha256") and engine.hash_apart(8, "sha256")
    assert not engine.hash_apart(8, "crc32") and not engine.hash_apart(8, None)  # a CRC-32 stays on the filling thread


def test_buffers_are_page_aligned_and_chunks_block_aligned():
    import mmap

    assert engine.CHUNK % engine.BLOCK == 0 and engine.PIECE <= engine.CHUNK
    buf = mmap.mmap(-1, engine.CHUNK)
    try:
        addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
        assert addr % 4096 == 0
    finally:
        buf.close()


def test_the_sink_imports_without_torch(tmp_path):
    """The head start's child writes with the sink before torch is imported."""
    import subprocess
    import sys

    code = "import sys, hf_merge.write.engine; assert 'torch' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path)
