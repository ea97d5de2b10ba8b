"""Files written front to back through aligned buffers with O_DIRECT (``hf_merge.sequential``).

The output must be byte for byte what the page-cache path writes (``HF_MERGE_DIRECT_IO=0``), the
recorded sha256 the digest of the written file, a full disk on a writer thread one line and no
target, and a file system or a file the path cannot serve must take the page-cache path.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import threading

import pytest
import torch

import hf_merge
from hf_merge import filemap, sequential, writer

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")


def _merge(source, target, **kw) -> tuple[dict[str, bytes], dict[str, str]]:
    hf_merge.merge(source, target, workers=1, **kw)
    files = {p.name: p.read_bytes() for p in sorted(target.iterdir()) if p.suffix == ".safetensors"}
    recorded = json.loads((target / "hf_merge.json").read_text()).get("files") or {}
    return files, recorded


@pytest.fixture
def direct_calls(monkeypatch):
    """Counts the files written by the direct path; small buffers and pieces, so that tensors
    cross many buffer boundaries."""
    calls = []
    real = sequential.write_file

    def counting(ckpt, plan, *a, **k):
        calls.append(plan.name)
        return real(ckpt, plan, *a, **k)

    monkeypatch.setattr(sequential, "write_file", counting)
    monkeypatch.setattr(sequential, "CHUNK", 64 << 10)
    monkeypatch.setattr(sequential, "PIECE", 4 << 10)
    return calls


@pytest.mark.parametrize(
    "fixture, kw",
    [
        ("llama_tied_bf16_ws4", {}),  # rank-file bytes: preadv from the files
        ("qwen2_fp32_ws2", {"dtype": "bfloat16"}),  # converted runs: copied from memory
        ("lora_ckpt", {}),  # fused LoRA: computed runs
        ("uneven_ckpt", {}),  # uneven and empty rank pieces
    ],
)
@pytest.mark.parametrize("hash_thread", [True, False], ids=["hash-thread", "hash-inline"])
def test_direct_and_page_cache_paths_write_the_same_bytes(fixture, kw, hash_thread, request, tmp_path, monkeypatch, direct_calls):
    ck = request.getfixturevalue(fixture)
    monkeypatch.setenv(sequential.HASH_THREAD_ENV, "1" if hash_thread else "0")
    monkeypatch.setattr(sequential, "HASH_BACKLOG", 16 << 10)  # computed bytes wait for the hasher
    hashers = []
    real_hasher = sequential._Hasher
    monkeypatch.setattr(sequential, "_Hasher", lambda digest: hashers.append(1) or real_hasher(digest))
    direct, recorded = _merge(ck.actor, tmp_path / "direct", max_shard_size="40KB", **kw)
    assert set(direct) <= set(direct_calls)  # (a LoRA merge also writes its adapter this way)
    assert len(hashers) == (len(direct) if hash_thread else 0)  # one per hashed model file
    calls = len(direct_calls)
    monkeypatch.setenv(sequential.ENV, "0")
    cached, recorded_cached = _merge(ck.actor, tmp_path / "cached", max_shard_size="40KB", **kw)
    assert len(direct_calls) == calls  # the second merge did not use the direct path
    assert direct == cached
    assert recorded == recorded_cached == {n: hashlib.sha256(b).hexdigest() for n, b in direct.items()}


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


def _one_error_line_and_no_target(source, tmp_path, capsys) -> str:
    from hf_merge.cli.app import main as cli

    target = tmp_path / "out"
    assert cli(["merge", str(source), str(target), "--workers", "1"]) != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1, err
    assert not target.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []
    return err[0]


def test_a_full_disk_on_a_writer_thread_is_one_line_and_no_target(llama_tied_bf16_ws4, tmp_path, capsys, monkeypatch, direct_calls):
    _fails_after(monkeypatch, filemap, "pwrite_exact", 1, OSError(errno.ENOSPC, "No space left on device"))
    line = _one_error_line_and_no_target(llama_tied_bf16_ws4.actor, tmp_path, capsys)
    assert "no space left on the device" in line and direct_calls, line


def test_a_read_error_while_gathering_is_one_line_and_no_target(llama_tied_bf16_ws4, tmp_path, capsys, monkeypatch, direct_calls):
    _fails_after(monkeypatch, filemap, "pread_exact", 5, OSError(errno.EIO, "Input/output error"))
    line = _one_error_line_and_no_target(llama_tied_bf16_ws4.actor, tmp_path, capsys)
    assert "unexpected" not in line and direct_calls, line


def test_a_read_error_on_the_hashing_thread_is_one_line_and_no_target(llama_tied_bf16_ws4, tmp_path, capsys, monkeypatch, direct_calls):
    real = filemap.pread_exact

    def failing_on_the_hasher(*args):
        if threading.current_thread().name == "sha256":
            raise OSError(errno.EIO, "Input/output error")
        return real(*args)

    monkeypatch.setattr(filemap, "pread_exact", failing_on_the_hasher)
    line = _one_error_line_and_no_target(llama_tied_bf16_ws4.actor, tmp_path, capsys)
    assert "unexpected" not in line and "input/output error" in line.lower() and direct_calls, line


def test_a_file_system_that_refuses_o_direct_gets_the_page_cache_path(llama_tied_bf16_ws4, tmp_path, monkeypatch, direct_calls):
    real_open = os.open

    def no_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_direct)
    assert sequential.open_direct(tmp_path / "f.bin") is None
    files, recorded = _merge(llama_tied_bf16_ws4.actor, tmp_path / "out")
    assert direct_calls == [] and recorded == {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    monkeypatch.setattr(os, "open", real_open)
    reference, _ = _merge(llama_tied_bf16_ws4.actor, tmp_path / "direct")
    assert direct_calls and files == reference


def test_o_direct_writes_refused_after_open_go_through_the_page_cache(llama_tied_bf16_ws4, tmp_path, monkeypatch, direct_calls):
    real = filemap.pwrite_exact
    refused = []

    def einval_on_direct(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, data, offset)

    monkeypatch.setattr(filemap, "pwrite_exact", einval_on_direct)
    files, recorded = _merge(llama_tied_bf16_ws4.actor, tmp_path / "out")
    assert direct_calls and refused  # the direct path ran, and its O_DIRECT writes were refused
    assert recorded == {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    monkeypatch.undo()
    assert _merge(llama_tied_bf16_ws4.actor, tmp_path / "reference")[0] == files


def test_a_large_tensor_without_row_runs_sends_its_file_to_the_page_cache_path(shard1_dtensor_ckpt, tmp_path, monkeypatch, direct_calls):
    """``Shard(1)`` pieces are not runs of whole rows: with a small whole-read limit, no file of
    this checkpoint can be gathered front to back without holding a large tensor."""
    monkeypatch.setattr(writer, "WHOLE_TENSOR_LIMIT", 1024)
    files, recorded = _merge(shard1_dtensor_ckpt.actor, tmp_path / "out")
    assert direct_calls == []
    assert recorded == {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    monkeypatch.undo()
    assert _merge(shard1_dtensor_ckpt.actor, tmp_path / "default")[0] == files


def test_hash_apart_where_the_writer_has_a_second_core(monkeypatch):
    monkeypatch.delenv(sequential.HASH_THREAD_ENV, raising=False)
    assert not sequential.hash_apart(1) and sequential.hash_apart(2) and sequential.hash_apart(8)
    monkeypatch.setenv(sequential.HASH_THREAD_ENV, "0")
    assert not sequential.hash_apart(8)
    monkeypatch.setenv(sequential.HASH_THREAD_ENV, "1")
    assert sequential.hash_apart(1)


def test_buffers_are_page_aligned_and_chunks_block_aligned():
    import mmap

    assert sequential.CHUNK % 4096 == 0 and sequential.PIECE <= sequential.CHUNK
    buf = mmap.mmap(-1, sequential.CHUNK)
    try:
        addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
        assert addr % 4096 == 0
    finally:
        buf.close()
