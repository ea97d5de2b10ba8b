"""The threads that follow an output file while it is written: its sha256 and the start of its
disk write (``hf_merge.following``), and the digests of earlier files finished while the next file
is written (``hf_merge.writer.TrailingDigests``)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import threading

import pytest

from hf_merge import following
from hf_merge.copypool import CompletedRanges
from hf_merge.following import FollowingSha256, FollowingWriteback
from hf_merge.writer import TrailingDigests

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")


def _write_out_of_order(path, data: bytes, header: int, on_prefix) -> None:
    """``data`` written as a header, then pieces out of order (shuffled within windows of eight),
    reporting the finished prefix."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, data[:header], 0)
        os.ftruncate(fd, len(data))
        done = CompletedRanges(header, on_prefix)
        pieces = [(a, min(a + 1000, len(data))) for a in range(header, len(data), 1000)]
        rng = random.Random(0)
        order = []
        for w in range(0, len(pieces), 8):
            window = pieces[w : w + 8]
            rng.shuffle(window)
            order += window
        for a, b in order:
            os.pwrite(fd, data[a:b], a)
            done.add(a, b)
    finally:
        os.close(fd)


def test_the_hash_follows_pieces_finished_out_of_order(tmp_path):
    data = random.Random(1).randbytes(123_457)
    path = tmp_path / "f.bin"
    path.touch()
    hasher = FollowingSha256(path)
    _write_out_of_order(path, data, 77, hasher.advance)
    assert hasher.finish() == hashlib.sha256(data).hexdigest()


def test_a_read_error_reaches_finish_and_cancel_drops_it(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    failing = FollowingSha256(path)
    failing.advance(1000)  # more than the file holds
    with pytest.raises(OSError, match="unexpected end of file"):
        failing.finish()
    cancelled = FollowingSha256(path)
    cancelled.advance(1000)
    cancelled.cancel()  # no error, and the thread is gone
    assert not cancelled._thread.is_alive()


class _Recorder:
    """Stands in for libc's sync_file_range: records (path, offset, length)."""

    def __init__(self, result: int = 0):
        self.calls: list[tuple[str, int, int]] = []
        self.result = result
        self._cv = threading.Condition()

    def __call__(self, fd: int, offset: int, length: int, flags: int) -> int:
        assert flags == following._SYNC_FILE_RANGE_WRITE
        with self._cv:
            self.calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
            self._cv.notify_all()
        return self.result

    def wait_for_calls(self, n: int) -> None:
        """Until ``n`` calls were made (an event, not a deadline)."""
        with self._cv:
            self._cv.wait_for(lambda: len(self.calls) >= n)


@linux_only
def test_writeback_starts_the_finished_prefix_in_stretches_then_the_rest(tmp_path, monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(following, "_SYNC_FILE_RANGE", recorder)
    monkeypatch.setattr(following, "WRITEBACK_STEP", 10_000)
    path = tmp_path / "f.bin"
    path.write_bytes(b"w" * 100_003)
    writeback = FollowingWriteback(path)

    def calls_after(final_up_to: int, expected: int) -> None:
        writeback.advance(final_up_to)
        recorder.wait_for_calls(expected)  # the thread has made this stretch's call before the next advance

    calls_after(5_000, 0)  # under one stretch: nothing yet
    calls_after(12_000, 1)
    calls_after(15_000, 1)  # 3,000 more: still under one stretch
    calls_after(30_000, 2)
    writeback.advance(100_003)
    writeback.finish()  # the rest, whatever its length
    assert [(a, n) for _, a, n in recorder.calls] == [(0, 12_000), (12_000, 18_000), (30_000, 70_003)]
    assert {p for p, _, _ in recorder.calls} == {str(path)}


@linux_only
def test_a_file_system_that_refuses_writeback_is_left_to_the_kernel(tmp_path, monkeypatch):
    recorder = _Recorder(result=-1)
    monkeypatch.setattr(following, "_SYNC_FILE_RANGE", recorder)
    monkeypatch.setattr(following, "WRITEBACK_STEP", 10)
    path = tmp_path / "f.bin"
    path.write_bytes(b"y" * 1000)
    writeback = FollowingWriteback(path)
    for end in range(100, 1001, 100):
        writeback.advance(end)
    writeback.finish()  # no error
    assert len(recorder.calls) == 1  # asked once, then never again for this file


@linux_only
def test_the_real_call_is_bound_and_accepted_by_this_file_system(tmp_path):
    assert FollowingWriteback.available()
    path = tmp_path / "f.bin"
    path.write_bytes(b"z" * (1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert following._SYNC_FILE_RANGE(fd, 0, 1 << 20, following._SYNC_FILE_RANGE_WRITE) == 0
    finally:
        os.close(fd)


def test_trailing_digests_finish_all_but_the_newest_and_cancel_on_error(tmp_path):
    paths = []
    for i in range(3):
        p = tmp_path / f"{i}.bin"
        p.write_bytes(bytes([i]) * (1000 + i))
        paths.append(p)

    def started(p):
        h = FollowingSha256(p)
        h.advance(p.stat().st_size)
        return h

    with TrailingDigests(keep=1) as trailing:
        trailing.add("0", started(paths[0]))
        assert trailing.finished() == []
        trailing.add("none", None)  # a file written without a digest
        trailing.add("2", started(paths[2]))
        assert trailing.finished() == [("0", hashlib.sha256(paths[0].read_bytes()).hexdigest()), ("none", None)]
        assert trailing.finish_all() == [("2", hashlib.sha256(paths[2].read_bytes()).hexdigest())]

    left = started(paths[1])
    with pytest.raises(KeyError):
        with TrailingDigests() as trailing:
            trailing.add("1", left)
            raise KeyError("a later file failed")
    assert not left._thread.is_alive() and left._fd == -1  # cancelled, descriptor closed


@linux_only
def test_a_merge_starts_the_disk_write_of_every_output_file_whole(llama_tied_bf16_ws4, tmp_path, monkeypatch):
    import hf_merge

    monkeypatch.setenv("HF_MERGE_DIRECT_IO", "0")  # the page-cache path; O_DIRECT leaves nothing to write back
    recorder = _Recorder()
    monkeypatch.setattr(following, "_SYNC_FILE_RANGE", recorder)
    target = tmp_path / "out"
    hf_merge.merge(llama_tied_bf16_ws4.actor, target, max_shard_size="60KB", workers=1)
    files = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"].values()
    sizes = {name: (target / name).stat().st_size for name in set(files)}
    assert len(sizes) > 1
    covered: dict[str, int] = {}
    for path, offset, length in recorder.calls:
        name = os.path.basename(path)
        assert offset == covered.get(name, 0), (name, offset)  # in order, no gap
        covered[name] = offset + length
    assert covered == sizes
