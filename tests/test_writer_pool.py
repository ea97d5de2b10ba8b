"""Forked writer processes (write/shards.py on hf_merge.forks.Forked) when one of them dies, fails,
cannot be forked or is interrupted: never a hang; a typed one-line error or the same bytes as one
writer; nothing in the target; no process left. Real FSDP2 fixtures; kills placed by events (the
phase driver holds a writer; a pipe found full), never by delays."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import signal
import threading
from pathlib import Path

import pytest
from helpers import no_leftovers, run_cli
from test_rank_pool import _wait_for_a_full_pipe
from test_signals import HANG_GUARD_S, Held, _group_alive

import hf_merge
from hf_merge.errors import PickleRefusedError, WriterDiedError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

ARGS = ["--max-shard-size", "20KB", "--workers", "3"]


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.suffix == ".safetensors" or p.name.endswith(".index.json")}


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error: ")]


def test_a_writer_killed_mid_run_stops_the_merge_with_one_line(qwen2_fp32_ws2, tmp_path):
    """The OOM killer's SIGKILL to a writer: exit 3 with a line that names it and what to do.
    Before: ``error: unexpected RuntimeError: a writer process exited with code -9 ... please report it``, exit 1."""
    target = tmp_path / "sub" / "out"
    held = Held("forked", ["merge", qwen2_fp32_ws2.actor, target, *ARGS])
    try:
        os.kill(held.reached(), signal.SIGKILL)
        out, err = held.proc.communicate(timeout=HANG_GUARD_S)
        assert held.proc.returncode == 3, err
        lines = _error_lines(err)
        assert len(lines) == 1 and "writer process was killed by SIGKILL" in lines[0], err
        assert "lower --workers" in lines[0] and "nothing was written" in lines[0]
        assert "Traceback" not in err
        assert not (tmp_path / "sub").exists()
        assert not _group_alive(held.proc.pid)
    finally:
        held.close()


@pytest.mark.slow  # passed before too
def test_ctrl_c_to_the_group_while_the_writers_run_ends_them_quietly(qwen2_fp32_ws2, tmp_path):
    """Ctrl-C in a terminal signals the merge and its writers: exit 130, one line, no writer's traceback."""
    target = tmp_path / "sub" / "out"
    held = Held("forked", ["merge", qwen2_fp32_ws2.actor, target, *ARGS])
    try:
        held.reached()
        os.killpg(held.proc.pid, signal.SIGINT)
        out, err = held.proc.communicate(timeout=HANG_GUARD_S)
        assert held.proc.returncode == 130, err
        assert _error_lines(err) == ["error: interrupted; nothing was written to the target"], err
        assert "Traceback" not in err and "Process " not in err, err
        assert not (tmp_path / "sub").exists()
        assert not _group_alive(held.proc.pid)
    finally:
        held.close()


def test_a_writer_killed_halfway_through_a_message_never_hangs_the_merge(qwen2_fp32_ws2, tmp_path, monkeypatch):
    """The parent is busy (its progress bar held) while the writers send; a writer's large message
    (the records it hands over: at scale, a ZeRO checkpoint's many partitions; 1 MB here) fills
    the pipe and the writer blocks halfway through it. The writers are SIGKILLed there. Before, the
    parent read the cut message from the one shared queue for ever (it holds the queue's writing
    end); now the merge raises WriterDiedError and leaves no target and no process."""
    from hf_merge import progress
    from hf_merge.readers import record_crc

    monkeypatch.setattr(record_crc.Placed, "hand_over", lambda self, inherited: [bytes(1 << 20)])

    class Held:
        def __init__(self, *a, **k):
            self.first = True

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            if self.first and multiprocessing.active_children():
                self.first = False
                _wait_for_a_full_pipe()
                for child in multiprocessing.active_children():
                    os.kill(child.pid, signal.SIGKILL)

    monkeypatch.setattr(progress, "progress_bar", Held)
    target = tmp_path / "out"
    raised: list[BaseException] = []

    def merge() -> None:
        try:
            hf_merge.merge(str(qwen2_fp32_ws2.actor), str(target), max_shard_size="20KB", workers=3)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            raised.append(e)

    merging = threading.Thread(target=merge, daemon=True)
    merging.start()
    merging.join(HANG_GUARD_S)
    assert not merging.is_alive(), "the merge hangs on a message cut short"
    assert len(raised) == 1 and isinstance(raised[0], WriterDiedError), raised
    assert not target.exists() and no_leftovers(target)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("refused_from", [1, 2])
def test_when_a_writer_cannot_be_forked_its_files_are_written_here(refused_from, qwen2_fp32_ws2, tmp_path, monkeypatch):
    """fork fails (ENOMEM: a large process on a node without overcommit; EAGAIN under a process
    limit) from the first or the second writer on: the files of the writers not forked are written
    by the merge itself, the same bytes. Before: the merge stopped with ``Cannot allocate memory``."""
    hf_merge.merge(str(qwen2_fp32_ws2.actor), str(tmp_path / "one"), max_shard_size="20KB", workers=1)
    real_fork, forks_made = os.fork, []

    def fork():
        if len(forks_made) + 1 >= refused_from:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        forks_made.append(1)
        return real_fork()

    monkeypatch.setattr(os, "fork", fork)
    hf_merge.merge(str(qwen2_fp32_ws2.actor), str(tmp_path / "three"), max_shard_size="20KB", workers=3)
    assert len(forks_made) == refused_from - 1
    assert len(_files(tmp_path / "three")) > 3
    assert _files(tmp_path / "three") == _files(tmp_path / "one")
    assert multiprocessing.active_children() == []


def test_an_error_a_writer_raises_reaches_the_user_as_its_own_line(qwen2_fp32_ws2, tmp_path, monkeypatch):
    """A refused pickle met by a writer (a DCP chunk's pickle is read by the writer that needs it)
    is the security line, exit 2. Before: the error did not unpickle in the parent (its __init__
    takes more than its message) and the user read ``unexpected RuntimeError: a writer process
    exited with code 1``."""
    from hf_merge.write import shards

    def refuse(ckpt, plan, folder, **kw):
        raise PickleRefusedError(plan.name, "asks for posix.system")

    monkeypatch.setattr(shards, "write_file", refuse)  # inherited by the forked writers
    target = tmp_path / "sub" / "out"
    proc = run_cli("merge", str(qwen2_fp32_ws2.actor), str(target), *ARGS)
    assert proc.returncode == 2, proc.stderr
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "asks for posix.system, which is outside hf_merge's pickle allowlist" in lines[0], proc.stderr
    assert not (tmp_path / "sub").exists()
    assert multiprocessing.active_children() == []


def test_typed_errors_come_back_whole_from_another_process():
    """What a forked writer sends: the class, the message and the attributes (PickleRefusedError's
    ``where`` and ``what``)."""
    import pickle

    from hf_merge import errors, forks

    e = PickleRefusedError("rank_3.pt", "asks for posix.system")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is PickleRefusedError and str(back) == str(e) and (back.where, back.what) == (e.where, e.what)
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.HfMergeError) and cls is not PickleRefusedError:
            assert str(pickle.loads(pickle.dumps(cls("message")))) == "message"

    class Local(Exception):  # not importable in the parent: its text comes back
        pass

    assert str(forks.sendable(Local("text"))) == "Local: text"
