"""`hf merge ...` through huggingface_hub's extension mechanism, with a manifest written offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # hf, hf-merge and two merges, each a fresh interpreter
def test_hf_merge_runs_as_hf_extension(qwen2_fp32_ws2, tmp_path):
    env = dict(os.environ, HOME=str(tmp_path / "home"), HF_HUB_DISABLE_UPDATE_CHECK="1", HF_HUB_OFFLINE="1")
    bindir = Path(sys.executable).parent
    proc = subprocess.run([str(bindir / "hf-merge"), "install-extension"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "home/.local/share/hf/extensions/hf-merge/manifest.json").read_text())
    assert manifest["short_name"] == "merge" and Path(manifest["executable_path"]).is_file()
    # `hf extensions list` shows this: the formats hf-merge reads, as `hf-merge --help` says (it said verl only)
    from hf_merge.cli.app import build_parser
    from hf_merge.version import SUMMARY

    assert SUMMARY in manifest["description"] and SUMMARY in build_parser().description and "DeepSpeed" in SUMMARY
    proc = subprocess.run([str(bindir / "hf"), "merge", "inspect", str(qwen2_fp32_ws2.actor), "--json"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["format"] == "fsdp"
    target = tmp_path / "merged"
    # `hf merge SOURCE TARGET` (merge is the default command)
    proc = subprocess.run([str(bindir / "hf"), "merge", str(qwen2_fp32_ws2.actor), str(target)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (target / "model.safetensors").is_file()
    listed = subprocess.run([str(bindir / "hf"), "extensions", "list", "--format", "json"], env=env, capture_output=True, text=True)
    assert "merge" in listed.stdout
