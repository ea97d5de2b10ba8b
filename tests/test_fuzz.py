"""A short seeded run of the fuzz harness (``fuzz/harness.py``; ``make fuzz`` runs it for longer)
over real checkpoints: any outcome in a bad class (unexpected error, traceback, crash, hang,
silent change of the weights, leftovers beside the target) fails the test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
import harness  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_short_seeded_fuzz_run_has_no_bad_outcome(qwen2_fp32_ws2, megatron_root, tmp_path):
    from hf_merge.cli.app import main as cli

    hf = tmp_path / "hf"
    assert cli(["--quiet", "merge", str(qwen2_fp32_ws2.actor), str(hf)]) == 0
    meg = megatron_root / "qwen2_v1" / "actor"
    targets = [
        harness.Target("fsdp", qwen2_fp32_ws2.actor, harness.default_files(qwen2_fp32_ws2.actor)),
        harness.Target("megatron", meg, harness.default_files(meg)),
        harness.Target("hf", hf, [f for f in harness.default_files(hf) if f.endswith((".json", ".safetensors"))]),
    ]
    result = harness.run_campaign(targets, seconds=12, seed=13, work=tmp_path / "fuzz")
    print(result.table())
    assert result.cases >= 6
    assert result.bad() == 0, result.table()
