"""Start-up: bad paths, flags and targets are refused before torch is imported; --help and
--version import no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs the CLI in a fresh interpreter and prints, as JSON, its exit code and whether torch got imported.
PROBE = """
import json, sys
from hf_merge.cli.app import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def _probe(*argv: str) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=60)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["merge", "--help"]])
def test_help_and_version_import_no_torch(argv):
    result, _ = _probe(*argv)
    assert result == {"code": 0, "torch": False}


def test_bad_inputs_fail_before_torch(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    source = tmp_path / "src"
    source.mkdir()
    cases = [
        (["merge", str(tmp_path / "missing"), str(tmp_path / "out")], "does not exist"),
        (["merge", str(source), str(full)], "not empty; pass --overwrite"),
        (["merge", str(source), str(tmp_path / "o"), "--config", str(tmp_path / "nocfg")], "nocfg does not exist"),
        (["verify", str(tmp_path / "missing"), "--against", str(source)], "does not exist"),
    ]
    for argv, message in cases:
        result, stderr = _probe(*argv)
        assert result == {"code": 2, "torch": False}, (argv, stderr)
        assert stderr.strip().count("\n") == 0 and message in stderr, stderr
