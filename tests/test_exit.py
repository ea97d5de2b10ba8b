"""The console entry point leaves with ``os._exit`` once a command is done (no interpreter
teardown), after flushing what the command printed; inside a torch.distributed program it exits
normally."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]

# Runs the console entry point with an atexit hook that marks a normal interpreter exit.
PROBE = """
import atexit, os, sys
atexit.register(lambda: os.write(2, b"TEARDOWN\\n"))
if os.environ.get("PROBE_DIST"):
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
sys.argv = ["hf-merge", *sys.argv[1:]]
from hf_merge.cli.app import run
run()
"""


def _run(*argv: str, dist: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if dist:
        env["PROBE_DIST"] = "1"
    return subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=300)


def test_merge_then_fast_exit(qwen2_fp32_ws2, tmp_path):
    out = tmp_path / "out"
    proc = _run("merge", str(qwen2_fp32_ws2.actor), str(out))
    assert proc.returncode == 0, proc.stderr
    assert "TEARDOWN" not in proc.stderr  # left with os._exit
    assert f"wrote {out}" in proc.stderr  # the closing note, flushed before leaving
    index = sorted(out.glob("*.safetensors"))
    assert index and (out / "config.json").is_file() and (out / "README.md").is_file()
    with safe_open(str(index[0]), "pt") as f:
        assert list(f.keys())
    assert not list(tmp_path.glob(".out.hf-merge-*"))  # temporary folder and lock gone


@pytest.mark.slow  # a fresh interpreter; make test keeps test_merge_then_fast_exit and test_error_code_kept
def test_piped_output_is_complete(qwen2_fp32_ws2):
    proc = _run("inspect", str(qwen2_fp32_ws2.actor), "--json", "--tensors")
    assert proc.returncode == 0, proc.stderr
    assert "TEARDOWN" not in proc.stderr
    info = json.loads(proc.stdout)  # the whole document reached the pipe
    assert info


def test_error_code_kept(tmp_path):
    proc = _run("merge", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "does not exist" in proc.stderr


@pytest.mark.slow  # a fresh interpreter; make test keeps test_merge_then_fast_exit and test_error_code_kept
def test_error_after_torch_import_keeps_code(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "model_world_size_2_rank_0.pt").write_bytes(b"not a zip")
    (source / "model_world_size_2_rank_1.pt").write_bytes(b"not a zip")
    proc = _run("merge", str(source), str(tmp_path / "out"))
    assert proc.returncode not in (0, None), proc.stderr
    assert "TEARDOWN" not in proc.stderr
    assert proc.stderr.strip() and not (tmp_path / "out").exists()


@pytest.mark.slow  # a process that starts torch.distributed
def test_distributed_program_exits_normally(qwen2_fp32_ws2):
    proc = _run("inspect", str(qwen2_fp32_ws2.actor), "--json", dist=True)
    assert proc.returncode == 0, proc.stderr
    assert "TEARDOWN" in proc.stderr  # a live process group: the interpreter's own exit
    assert json.loads(proc.stdout)


def test_a_read_only_target_says_what_to_do(capsys):
    """A target on a read-only mount (seen with `mount -o remount,bind,ro`: the lock file beside the
    target is the first write). Before: "error: Read-only file system (PATH)", nothing to do."""
    import errno

    from hf_merge.cli._errors import report

    code = report(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/.merged.hf-merge-lock"))
    line = capsys.readouterr().err.strip()
    assert code == 3 and line == (
        "error: read-only file system: cannot write /mnt/ro/.merged.hf-merge-lock; choose a target on a writable file system"
    ), line
