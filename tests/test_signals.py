"""Kills and interrupts at each phase of a merge, placed by events (tests/phase_driver.py holds the
merge at a phase and says so on a pipe), never by delays.

- SIGKILL: before the rename there is no target; after it the target is complete; the next run
  on the target works and leaves nothing else behind; no writer process outlives the merge.
- SIGTERM / SIGINT: the merge stops while the phase's work is still held (so it did not wait for
  that work), exits 130 with one line, and leaves no target, temporary folder, lock or process.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import folder_tensors, no_leftovers, processes, run_cli

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

DRIVER = Path(__file__).parent / "phase_driver.py"
HANG_GUARD_S = 300  # only against a hung test (generous: a loaded machine); nothing is timed


def _group_alive(pgid: int) -> list[int]:
    """Processes of the process group ``pgid`` that are not zombies."""
    return [pid for pid, fields in processes() if int(fields[2]) == pgid and fields[0] != "Z"]


def _wait_gone(pids: list[int]) -> None:
    """Wait until each process has ended (its pidfd becomes readable): an event, bounded only by the guard."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            ready, _, _ = select.select([fd], [], [], HANG_GUARD_S)
            assert ready, f"process {pid} outlived the killed merge"
        finally:
            os.close(fd)


class Held:
    """A merge started by the phase driver, held at ``phase`` once :meth:`reached` returns."""

    def __init__(self, phase: str, args: list, env: dict | None = None):
        events_r, events_w = os.pipe()
        self._hold_r, self._hold_w = os.pipe()
        full_env = {k: v for k, v in os.environ.items() if k != "HF_MERGE_DEBUG"}
        full_env.update({"HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})})
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER), phase, str(events_w), str(self._hold_r), *map(str, args)],
            pass_fds=(events_w, self._hold_r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=full_env, start_new_session=True,
        )
        os.close(events_w)
        os.close(self._hold_r)
        self._events = os.fdopen(events_r)
        self.phase = phase

    def reached(self) -> int:
        """Wait for the phase (an event on the pipe); the pid of the process holding it."""
        line = self._events.readline()  # "" when every writer end closed: the merge ended first
        if not line:
            out, err = self.proc.communicate(timeout=HANG_GUARD_S)
            pytest.fail(f"the merge never reached {self.phase} (exit {self.proc.returncode}): {err[-2000:]}")
        phase, pid = line.split()
        assert phase == self.phase
        return int(pid)

    def signal(self, signum: int) -> subprocess.CompletedProcess:
        self.proc.send_signal(signum)
        out, err = self.proc.communicate(timeout=HANG_GUARD_S)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in _group_alive(self.proc.pid):  # stragglers of this run only
            os.kill(pid, signal.SIGKILL)
        self._events.close()
        os.close(self._hold_w)


def _merge_args(phase: str, src: Path, target: Path) -> list:
    if phase == "encoding":
        return ["merge", src, target, "--gguf", "q8_0", "--gguf-pre-tokenizer", "gpt-2"]
    workers = "2" if phase == "forked" else "1"
    return ["merge", src, target, "--max-shard-size", "20KB", "--workers", workers]


PHASES = ["locked", "writing", "forked", "encoding", "syncing", "placed"]
# `make test` runs one kill before the rename (with forked writers), one after it and one SIGTERM
# (each a merge process of its own); every other phase and signal is in the slow tier
FAST = {"forked", "placed", ("writing", signal.SIGTERM)}


def _tiered(*cases):
    return [pytest.param(*c, marks=() if (c[0] if len(c) == 1 else c) in FAST else pytest.mark.slow) for c in cases]


@pytest.mark.parametrize("phase", _tiered(*[(p,) for p in PHASES]))
def test_sigkill_at_each_phase_leaves_no_partial_target_and_a_rerun_works(phase, qwen2_fp32_ws2, tmp_path):
    if phase == "encoding":
        pytest.importorskip("gguf")
    target = tmp_path / "out"
    held = Held(phase, _merge_args(phase, qwen2_fp32_ws2.actor, target))
    try:
        held.reached()
        done = held.signal(signal.SIGKILL)
        assert done.returncode == -signal.SIGKILL
        _wait_gone(_group_alive(held.proc.pid))  # forked writers, the head start's child: they die with it
        assert not _group_alive(held.proc.pid)
        if phase == "placed":  # renamed into place: complete
            assert len(folder_tensors(target)) == len(folder_tensors(qwen2_fp32_ws2.reference))
            assert (target / "model.safetensors.index.json").is_file() and (target / "hf_merge.json").is_file()
        else:
            assert not target.exists()
    finally:
        held.close()
    args = _merge_args(phase, qwen2_fp32_ws2.actor, target) + (["--overwrite"] if phase == "placed" else [])
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert no_leftovers(target)


@pytest.mark.parametrize("phase,signum", _tiered(
    ("locked", signal.SIGTERM), ("writing", signal.SIGTERM), ("forked", signal.SIGTERM), ("encoding", signal.SIGTERM),
    ("syncing", signal.SIGTERM), ("writing", signal.SIGINT), ("forked", signal.SIGINT), ("syncing", signal.SIGINT),
))
def test_sigterm_and_sigint_stop_a_held_phase_and_leave_nothing(phase, signum, qwen2_fp32_ws2, tmp_path):
    """The phase's work is held for good: the merge can only exit by leaving it, at once."""
    if phase == "encoding":
        pytest.importorskip("gguf")
    target = tmp_path / "sub" / "out"
    held = Held(phase, _merge_args(phase, qwen2_fp32_ws2.actor, target))
    try:
        held.reached()
        done = held.signal(signum)
        assert done.returncode == 130, done.stderr
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
        assert lines == ["error: interrupted; nothing was written to the target"], done.stderr
        assert "Traceback" not in done.stderr
        assert not (tmp_path / "sub").exists()  # no target, temporary folder or lock; the parent made for it gone
        assert not _group_alive(held.proc.pid)  # no writer, head start or other child left
    finally:
        held.close()
