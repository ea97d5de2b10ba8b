"""Rank files read by forked processes (readers/rank_pool.py): the same merge, the same errors.

The pool starts only where rank pickles are large (many tensors x many ranks); these tests lower
that bar to 0 on the real FSDP2 fixtures of 4 ranks (FSDP2, HSDP with replicas, uneven shards)."""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from pathlib import Path

import pytest
from safetensors import safe_open

import hf_merge
from hf_merge.errors import CorruptCheckpointError
from hf_merge.readers import dcp, dcp_index, fsdp, rank_pool, rank_records, record_crc


def _weights(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.suffix == ".safetensors" or p.name.endswith(".index.json") or p.name == "config.json"}


@pytest.fixture
def pooled(monkeypatch) -> list[Path]:
    """Every FSDP open reads ranks 1.. in other processes; the list gets each rank file so read."""
    monkeypatch.setattr(rank_pool, "PARALLEL_PICKLE_BYTES", 0)
    taken: list[Path] = []

    def counted(path, read):
        got = rank_records.load_local_records(path, read)
        if got is not None:
            taken.append(Path(path))
        return got

    monkeypatch.setattr(fsdp, "load_local_records", counted)
    return taken


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("reference"))
    return dst


@pytest.mark.parametrize("fixture", ["llama_tied_bf16_ws4", "hsdp_ckpt", "uneven_ckpt"])
def test_ranks_read_by_other_processes_merge_the_same_bytes(fixture, request, tmp_path, monkeypatch):
    ck = request.getfixturevalue(fixture)
    hf_merge.merge(str(ck.actor), str(tmp_path / "serial"), dtype="auto", max_shard_size="100KB")
    taken = request.getfixturevalue("pooled")
    hf_merge.merge(str(ck.actor), str(tmp_path / "pooled"), dtype="auto", max_shard_size="100KB")
    needed = fsdp.open_fsdp(ck.actor).info.details["ranks_read"]
    assert sorted(p.name for p in set(taken)) == sorted(f"model_world_size_{ck.world_size}_rank_{r}.pt" for r in needed if r)
    assert any(name.endswith(".safetensors") for name in _weights(tmp_path / "pooled"))
    assert _weights(tmp_path / "pooled") == _weights(tmp_path / "serial")


def _flip_pickle_byte(path: Path, word: bytes) -> None:
    raw = bytearray(path.read_bytes())
    pos = raw.find(b"PK\x03\x04")
    while not raw[pos + 30 : pos + 30 + struct.unpack_from("<H", raw, pos + 26)[0]].endswith(b"/data.pkl"):
        pos = raw.find(b"PK\x03\x04", pos + 4)
    raw[raw.index(word, pos) + 1] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_damaged_rank_read_by_another_process_gets_the_readers_own_error(llama_tied_bf16_ws4, pooled, tmp_path):
    """The other process's failure is not reported as such: the rank is read here, and the error is
    the one a serial read gives (the pickle's CRC-32), with nothing written."""
    actor = _copy(llama_tied_bf16_ws4.actor, tmp_path / "actor")
    _flip_pickle_byte(actor / "model_world_size_4_rank_2.pt", b"Shard")
    with pytest.raises(CorruptCheckpointError, match=r"model_world_size_4_rank_2.pt.*data.pkl.*CRC-32"):
        hf_merge.merge(str(actor), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    assert {p.name for p in pooled} == {"model_world_size_4_rank_1.pt"}  # read elsewhere; rank 2 was not


def test_tensor_bytes_of_a_rank_read_by_another_process_are_still_crc_checked(llama_tied_bf16_ws4, pooled, tmp_path):
    """The records' CRC-32 are noted by this process from the zip directory it reads itself: a
    flipped tensor byte in a rank read elsewhere stops the merge as it does in a serial read."""
    actor = _copy(llama_tied_bf16_ws4.actor, tmp_path / "actor")
    rank3 = actor / "model_world_size_4_rank_3.pt"
    offset, _ = rank_records.index_rank_file(rank3)["model.norm.weight"].span
    raw = bytearray(rank3.read_bytes())
    raw[offset] ^= 0x01
    rank3.write_bytes(bytes(raw))
    with pytest.raises(record_crc.SourceCrcError, match=rank3.name):
        hf_merge.merge(str(actor), str(tmp_path / "out"))
    assert rank3 in pooled
    assert not (tmp_path / "out").exists()


def test_a_rank_read_elsewhere_maps_the_tensors_a_serial_read_maps(llama_tied_bf16_ws4, tmp_path):
    """Each tensor made from the other process's records is the serial reader's view: same dtype,
    shape, strides and file offset; a file changed since (its modification time) is read again."""
    path = llama_tied_bf16_ws4.actor / "model_world_size_4_rank_1.pt"
    read = rank_records.local_records(path)
    state, source = rank_records.load_local_records(path, read)
    serial, serial_source = rank_records.load_mapped_rank_records(path)
    try:
        assert list(state) == list(serial) and len(state) > 10
        for key in state:
            tensor, local = state[key], fsdp._local(serial[key])
            assert (tensor.dtype, tensor.shape, tensor.stride(), source.offset(tensor)) == (
                local.dtype, local.shape, local.stride(), serial_source.offset(local))
            assert state.meta(key) == (local.dtype, tuple(local.shape), local.is_contiguous(), local.storage_offset())
    finally:
        source.close()
        serial_source.close()
    copy = shutil.copy2(path, tmp_path / path.name)
    read = rank_records.local_records(copy)
    os.utime(copy, ns=(os.stat(copy).st_atime_ns, os.stat(copy).st_mtime_ns + 1))
    assert rank_records.load_local_records(copy, read) is None


def test_a_rank_its_process_cannot_read_is_left_to_the_caller(llama_tied_bf16_ws4, tmp_path):
    good = llama_tied_bf16_ws4.actor / "model_world_size_4_rank_1.pt"
    pool = rank_pool.RankPool({1: good, 2: tmp_path / "missing.pt"}, processes=2, read=rank_records.local_records)
    try:
        assert pool.take(2) is None
        assert pool.take(1) == rank_records.local_records(good)
        assert pool.take(3) is None  # not one of its ranks
    finally:
        pool.close()


def test_a_process_that_dies_leaves_its_ranks_to_the_caller(llama_tied_bf16_ws4):
    """A reader process killed (e.g. by the kernel's OOM killer) sends nothing more: its ranks come
    back as None (the caller reads them) once it is gone, or as what it sent before; never a hang."""
    paths = {r: llama_tied_bf16_ws4.actor / f"model_world_size_4_rank_{r}.pt" for r in (1, 2, 3)}
    pool = rank_pool.RankPool(paths, processes=1, read=rank_records.local_records)
    try:
        pool._procs[0].kill()
        pool._procs[0].join()
        for rank, path in paths.items():
            got = pool.take(rank)
            assert got is None or got == rank_records.local_records(path)
    finally:
        pool.close()


# --------------------------------------------------------------------------------------------
# DCP: chunk archives read by other processes (dcp.PARALLEL_CHUNKS lowered to 0)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def chunks_pooled(monkeypatch) -> list[int]:
    """Every DCP read has its chunk archives read by other processes; the list counts the chunks taken."""
    monkeypatch.setattr(dcp, "PARALLEL_CHUNKS", 0)
    taken: list[int] = []
    real = dcp._from_tuples

    def counted(read):
        taken.append(1)
        return real(read)

    monkeypatch.setattr(dcp, "_from_tuples", counted)
    return taken


@pytest.mark.parametrize("family", ["accelerate", "torchtitan", "dcp_plain"])
def test_chunks_read_by_other_processes_merge_the_same_bytes(family, dcp_root, chunks_pooled, tmp_path, monkeypatch):
    src, config = {
        "accelerate": (dcp_root / "accelerate" / "ckpt", dcp_root / "accelerate" / "config"),
        "torchtitan": (dcp_root / "torchtitan" / "dump", dcp_root / "torchtitan" / "config"),
        "dcp_plain": (dcp_root / "dcp_plain" / "ckpt", None),
    }[family]
    extra = {"config": str(config)} if config else {}
    # one output file: written in this process, which reads the chunks (forked writers read their own);
    # pooled first, so that its records are checked afresh (a process remembers the records found good)
    hf_merge.merge(str(src), str(tmp_path / "pooled"), **extra)
    written = [n for f in (tmp_path / "pooled").glob("*.safetensors") for n in safe_open(str(f), "pt").keys()]
    assert len(chunks_pooled) >= len(written) > 0  # every tensor written came from chunks read elsewhere
    monkeypatch.setattr(dcp, "PARALLEL_CHUNKS", 1 << 62)
    hf_merge.merge(str(src), str(tmp_path / "serial"), **extra)
    assert _weights(tmp_path / "pooled") == _weights(tmp_path / "serial")


def test_a_damaged_chunk_read_by_another_process_gets_the_readers_own_error(chunks_pooled, tmp_path):
    """The chunk the other process could not read is read here: its data.pkl's CRC-32, as serially."""
    import torch
    import torch.distributed.checkpoint as tdcp

    path = tmp_path / "c"
    state = {f"l{i}.weight": torch.randn(4, 6) for i in range(3)}
    tdcp.save(state, storage_writer=tdcp.FileSystemWriter(str(path), thread_count=2), no_dist=True)
    files = sorted(path.glob("*.distcp"))
    assert len(files) > 1
    raw = files[-1].read_bytes()
    at = raw.index(b"_rebuild_tensor_v2") + 3
    files[-1].write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:])
    dcp_index._CHUNK_PICKLES.clear()
    with dcp.DcpCheckpoint(path) as ck, pytest.raises(CorruptCheckpointError, match=r"data\.pkl.*fails its CRC-32.*re-copy"):
        for name in sorted(state):
            assert torch.equal(ck.read(name), state[name])
    assert chunks_pooled  # the good chunks came from the other processes


def test_processes_that_all_read_share_the_cpus_for_their_readers(monkeypatch):
    """torchrun with --dist-writers rank: every rank of a node reads the source and forks readers."""
    from hf_merge import forks

    monkeypatch.setattr(forks, "usable_cpus", lambda: 16)
    monkeypatch.setattr(forks, "_processes_here", 1)
    assert forks.helper_cpus() == 16
    forks.share_cpus(4)
    assert forks.helper_cpus() == 4
    forks.share_cpus(32)
    assert forks.helper_cpus() == 1


# --------------------------------------------------------------------------------------------
# A process killed halfway through a result; an interrupt while the processes are forked
# --------------------------------------------------------------------------------------------

HANG_GUARD_S = 300  # only against a hung test; nothing is timed


def _wait_for_a_full_pipe() -> None:
    """Until one of this process's pipes holds a pipe's worth of bytes (its writer then blocks
    halfway through a message): the kernel's state, read until it is so; no delay."""
    import fcntl
    import termios

    while True:
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                if not os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                    continue
                held = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
                if held and held >= fcntl.fcntl(fd, 1032) - 4096:  # F_GETPIPE_SZ, less a page
                    return
            except OSError:
                continue


def test_a_process_killed_halfway_through_a_result_leaves_its_items_to_the_caller(qwen2_vocab2k_ws2):
    """The OOM killer's SIGKILL lands while a reader is blocked sending a large result (the parent
    busy elsewhere): what it sent is cut short. Its items come back as None; no hang."""
    import threading

    paths = {r: qwen2_vocab2k_ws2.actor / f"model_world_size_2_rank_{r}.pt" for r in (0, 1)}
    assert min(p.stat().st_size for p in paths.values()) > 1 << 17  # more than a pipe holds
    pool = rank_pool.RankPool(paths, processes=1, read=Path.read_bytes)
    try:
        _wait_for_a_full_pipe()
        pool._procs[0].kill()
        pool._procs[0].join()
        got: list = []
        taker = threading.Thread(target=lambda: got.extend(pool.take(r) for r in paths), daemon=True)
        taker.start()
        taker.join(HANG_GUARD_S)
        assert not taker.is_alive(), "take() hangs on a result cut short"
        assert got == [None, None]
    finally:
        pool.close()


def test_an_interrupt_while_the_readers_are_forked_leaves_no_reader_running(llama_tied_bf16_ws4, pooled, monkeypatch):
    """Ctrl-C while the pool forks (a large process forks slowly) is raised once the forks are done,
    from inside the pool's constructor: the processes already started are ended there, not left
    reading (a notebook's kernel would keep them until it exits)."""
    import multiprocessing
    import signal

    start = multiprocessing.context.ForkProcess.start

    def start_then_interrupt(self):
        start(self)
        os.kill(os.getpid(), signal.SIGINT)  # deferred by the pool until its forks are done

    monkeypatch.setattr(multiprocessing.context.ForkProcess, "start", start_then_interrupt)
    # Python's own Ctrl-C handler, also where this run was started with SIGINT ignored (a background job)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            fsdp.open_fsdp(llama_tied_bf16_ws4.actor)
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    assert multiprocessing.active_children() == []


# --------------------------------------------------------------------------------------------
# The CLI while its reader processes run (tests/phase_driver.py holds a reader: an event, no delay)
# --------------------------------------------------------------------------------------------


def _held_reader(src: Path, target: Path):
    from test_signals import Held

    held = Held("reading", ["merge", src, target, "--max-shard-size", "20KB", "--workers", "1"])
    reader = held.reached()
    with open(f"/proc/{reader}/status") as f:  # a child of the merge, not the merge itself
        assert f"PPid:\t{held.proc.pid}\n" in f.read()
    return held, reader


@pytest.mark.parametrize(("to", "signum"), [
    ("merge", "SIGTERM"), ("group", "SIGINT"),  # each signal and each receiver once in `make test`
    pytest.param("merge", "SIGINT", marks=pytest.mark.slow), pytest.param("group", "SIGTERM", marks=pytest.mark.slow),
])
def test_an_interrupt_while_the_readers_run_leaves_no_target_and_no_reader(signum, to, qwen2_fp32_ws2, tmp_path):
    """To the merge (``kill PID``) or to its whole process group, readers included (Ctrl-C in a
    terminal, a batch system's SIGTERM to the job's processes)."""
    import signal
    import subprocess

    from test_signals import HANG_GUARD_S, _group_alive

    target = tmp_path / "sub" / "out"
    held, _ = _held_reader(qwen2_fp32_ws2.actor, target)
    try:
        if to == "merge":
            done = held.signal(getattr(signal, signum))
        else:
            os.killpg(held.proc.pid, getattr(signal, signum))
            out, err = held.proc.communicate(timeout=HANG_GUARD_S)
            done = subprocess.CompletedProcess(held.proc.args, held.proc.returncode, out, err)
        assert done.returncode == 130, done.stderr
        assert [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")] == [
            "error: interrupted; nothing was written to the target"], done.stderr
        assert "Traceback" not in done.stderr
        assert not (tmp_path / "sub").exists()
        assert not _group_alive(held.proc.pid)  # the reader ended by the merge, not left reading
    finally:
        held.close()


def test_a_reader_killed_mid_run_leaves_its_rank_to_the_merge(qwen2_fp32_ws2, tmp_path):
    """The OOM killer ends a reader process: the merge reads its rank itself and writes the same bytes."""
    import signal

    from test_signals import HANG_GUARD_S

    held, reader = _held_reader(qwen2_fp32_ws2.actor, tmp_path / "pooled")
    try:
        os.kill(reader, signal.SIGKILL)
        out, err = held.proc.communicate(timeout=HANG_GUARD_S)
        assert held.proc.returncode == 0, err
    finally:
        held.close()
    hf_merge.merge(str(qwen2_fp32_ws2.actor), str(tmp_path / "serial"), max_shard_size="20KB")
    assert _weights(tmp_path / "pooled") == _weights(tmp_path / "serial")


@pytest.mark.parametrize("signum", ["SIGINT", pytest.param("SIGTERM", marks=pytest.mark.slow)])  # SIGTERM: make test-slow
def test_a_reader_interrupted_on_its_own_ends_quietly_and_the_merge_reads_its_rank(signum, qwen2_fp32_ws2, tmp_path):
    """A reader that gets the interrupt before the merge ends it (Ctrl-C reaches the whole process
    group; the merge may be inside a long call): it ends without a traceback of its own on the
    terminal, and a merge that goes on reads its rank itself."""
    import signal

    from test_signals import HANG_GUARD_S

    held, reader = _held_reader(qwen2_fp32_ws2.actor, tmp_path / "pooled")
    try:
        os.kill(reader, getattr(signal, signum))
        out, err = held.proc.communicate(timeout=HANG_GUARD_S)
        assert held.proc.returncode == 0, err
        assert "Traceback" not in err and "Process " not in err, err
    finally:
        held.close()


def test_when_no_process_can_be_forked_the_ranks_are_read_here(llama_tied_bf16_ws4, pooled, tmp_path, monkeypatch):
    """A large process on a node without overcommit gets ENOMEM from fork (EAGAIN under a process
    limit): the pool is only a speed-up, so the ranks it could not hand out are read here and the
    merge writes the same bytes; from the second fork on, the first process's ranks still come back."""
    import errno

    monkeypatch.setattr(rank_pool, "PARALLEL_PICKLE_BYTES", 1 << 62)
    hf_merge.merge(str(llama_tied_bf16_ws4.actor), str(tmp_path / "serial"), max_shard_size="100KB")
    monkeypatch.setattr(rank_pool, "PARALLEL_PICKLE_BYTES", 0)
    real_fork, forks_made = os.fork, []

    def fork():
        if forks_made:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        forks_made.append(1)
        return real_fork()

    monkeypatch.setattr(os, "fork", fork)
    monkeypatch.setattr(fsdp, "helper_cpus", lambda: 3)  # a process per rank: ranks 2 and 3 find no fork
    # one writer (this process): forked writers would need fork too (--workers 1 is the way out there)
    hf_merge.merge(str(llama_tied_bf16_ws4.actor), str(tmp_path / "pooled"), max_shard_size="100KB", workers=1)
    assert _weights(tmp_path / "pooled") == _weights(tmp_path / "serial")
    assert {p.name for p in pooled} == {"model_world_size_4_rank_1.pt"}  # the one process forked
