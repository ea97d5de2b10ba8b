"""Rank-file bytes copied by several threads, in pieces, with the sha256 following the finished prefix.

The output must be the same bytes as one thread writes, the recorded sha256 the digest of the
written file, and an error on a copy thread must reach the caller unchanged with nothing left behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load

import hf_merge
from hf_merge import copypool, writer
from hf_merge.copypool import CompletedRanges, PiecePool

pytestmark = pytest.mark.skipif(not hasattr(os, "copy_file_range"), reason="needs copy_file_range (Linux)")


@pytest.fixture(autouse=True)
def _page_cache_path(monkeypatch):
    """These tests are about the page-cache path (the O_DIRECT one: tests/test_sequential.py)."""
    monkeypatch.setenv("HF_MERGE_DIRECT_IO", "0")


def test_completed_ranges_report_only_the_contiguous_prefix():
    seen = []
    done = CompletedRanges(10, seen.append)
    done.add(30, 40)
    done.add(20, 30)
    assert done.prefix == 10 and seen == []
    done.add(10, 20)
    assert done.prefix == 40 and seen == [40]
    done.add(50, 60)
    done.add(40, 40)  # empty: nothing
    assert done.prefix == 40
    done.add(40, 50)
    assert done.prefix == 60 and seen == [40, 60]


def test_an_error_on_a_pool_thread_is_raised_unchanged_and_drops_the_queued_pieces():
    """Pieces 0 and 1 hold both threads; 2..5 are queued behind them. Piece 0 fails: the queued
    pieces never run, piece 1 (in flight) ends, and the caller gets the very error, also on a
    later submit. Every step waits on an event, none on a clock."""
    ran = []
    error = OSError(errno.ENOSPC, "No space left on device")
    go = threading.Event()
    pool = PiecePool(2)

    def piece(i):
        if i == 0:
            go.wait()
            raise error
        if i == 1:
            go.wait()
            with pool._cv:  # end only once piece 0's error is recorded: 2..5 are still queued then
                pool._cv.wait_for(lambda: pool._error is not None)
        ran.append(i)

    for i in range(6):  # the queue holds 4: submitting 4 and 5 waits until 0 and 1 are running
        pool.submit(piece, i)
    go.set()
    with pytest.raises(OSError) as e:
        pool.wait()
    assert e.value is error
    with pytest.raises(OSError) as e:
        pool.submit(piece, 6)
    assert e.value is error
    pool.close()
    assert ran == [1]  # the queued pieces were dropped, not run after the error


def test_close_waits_for_the_pieces_in_flight():
    """Three pieces are running when close() is called, and each can end only from then on:
    close() must return after all three, not drop or abandon them. Events only, no clock."""
    finished = []
    running = [threading.Event() for _ in range(3)]
    closing = threading.Event()
    pool = PiecePool(3)

    def piece(i):
        running[i].set()
        closing.wait()
        finished.append(i)

    for i in range(3):
        pool.submit(piece, i)
    for event in running:
        event.wait()
    closing.set()
    pool.close()
    assert sorted(finished) == [0, 1, 2]


def _merge(source, target, **kw) -> tuple[dict[str, bytes], dict[str, str]]:
    hf_merge.merge(source, target, workers=1, **kw)
    files = {p.name: p.read_bytes() for p in sorted(target.iterdir()) if p.suffix == ".safetensors"}
    recorded = json.loads((target / "hf_merge.json").read_text()).get("files") or {}
    return files, recorded


def test_threads_and_small_pieces_give_the_same_bytes_and_the_true_sha256(llama_tied_bf16_ws4, tmp_path, monkeypatch):
    one, _ = _merge(llama_tied_bf16_ws4.actor, tmp_path / "one", copy_threads=1, checksums=False)
    pieces = []
    real = writer._write_piece

    def counting(piece, fd, offset, done):
        pieces.append((threading.get_ident(), offset))
        time.sleep(0.001 * (len(pieces) % 3))  # finish out of order
        real(piece, fd, offset, done)

    monkeypatch.setattr(writer, "PIECE_BYTES", 4096)  # many pieces per tensor
    monkeypatch.setattr(writer, "_write_piece", counting)
    many, recorded = _merge(llama_tied_bf16_ws4.actor, tmp_path / "many", copy_threads=3, max_shard_size="30KB")
    assert len({t for t, _ in pieces}) > 1 and len(pieces) > 20
    assert len(many) > 1 and set(recorded) == set(many)
    for name, data in many.items():
        assert recorded[name] == hashlib.sha256(data).hexdigest(), name
    whole = load(one["model.safetensors"])
    parts = {k: v for data in many.values() for k, v in load(data).items()}
    assert whole.keys() == parts.keys() and all(whole[k].view(-1).view(torch.uint8).equal(parts[k].view(-1).view(torch.uint8)) for k in whole)


def test_one_file_is_the_same_bytes_with_any_number_of_threads(llama_tied_bf16_ws4, tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "PIECE_BYTES", 8192)
    one, _ = _merge(llama_tied_bf16_ws4.actor, tmp_path / "one", copy_threads=1, checksums=False)
    four, recorded = _merge(llama_tied_bf16_ws4.actor, tmp_path / "four", copy_threads=4)
    assert four == one and recorded["model.safetensors"] == hashlib.sha256(one["model.safetensors"]).hexdigest()


def test_disk_full_on_a_copy_thread_reaches_the_user_and_leaves_no_target(llama_tied_bf16_ws4, tmp_path, capsys, monkeypatch):
    from hf_merge.cli.app import main as cli

    calls = []
    real = os.copy_file_range

    def fills_up(*args):
        calls.append(threading.get_ident())
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(copypool, "PIECE_BYTES", 4096)
    monkeypatch.setattr(writer, "PIECE_BYTES", 4096)
    monkeypatch.setattr(os, "copy_file_range", fills_up)
    target = tmp_path / "out"
    assert cli(["merge", str(llama_tied_bf16_ws4.actor), str(target), "--copy-threads", "2", "--workers", "1"]) != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and "no space left on the device" in err[0], err
    assert threading.get_ident() not in calls  # the copies ran on the pool's threads
    assert not target.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []
