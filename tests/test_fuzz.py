"""A short seeded run of the fuzz harness (``fuzz/harness.py``; ``make fuzz`` runs it for longer)
over real checkpoints: any outcome in a bad class (unexpected error, traceback, crash, hang,
silent change of the weights, leftovers beside the target) fails the test. Also: a bad case is
kept and replays, and the classifier judges a safetensors source by what the mutated file says."""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
import harness  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def hf_folder(qwen2_fp32_ws2, tmp_path_factory) -> Path:
    from hf_merge.cli.app import main as cli

    hf = tmp_path_factory.mktemp("fuzz-hf") / "hf"
    assert cli(["--quiet", "merge", str(qwen2_fp32_ws2.actor), str(hf)]) == 0
    return hf


def _hf_target(hf: Path) -> harness.Target:
    return harness.Target("hf", hf, [f for f in harness.default_files(hf) if f.endswith((".json", ".safetensors"))])


@pytest.mark.slow  # a fuzz campaign: one CLI process per case
def test_short_seeded_fuzz_run_has_no_bad_outcome(qwen2_fp32_ws2, megatron_root, hf_folder, tmp_path):
    meg = megatron_root / "qwen2_v1" / "actor"
    ds = Path(__file__).parent / "data" / "deepspeed" / "z3_fp32_ws3"
    ds_ckpt = harness._with_side_files(ds, ds / "reference" / "step2" / "config", tmp_path / "ds")
    targets = [
        harness.Target("fsdp", qwen2_fp32_ws2.actor, harness.default_files(qwen2_fp32_ws2.actor)),
        harness.Target("megatron", meg, harness.default_files(meg)),
        harness.Target("deepspeed", ds_ckpt, harness.default_files(ds_ckpt)),
        _hf_target(hf_folder),
    ]
    # a fixed number of cases, not a time budget: a loaded machine runs the same campaign
    result = harness.run_campaign(targets, seconds=float("inf"), max_cases=8, seed=13, work=tmp_path / "fuzz")
    print(result.table())
    assert result.cases == 8
    assert result.bad() == 0, result.table()


def test_a_bad_case_is_kept_described_and_replays(qwen2_fp32_ws2, tmp_path, monkeypatch):
    """A merge that fails with an unexpected error (a stand-in bug) lands in ``unexpected``; the case
    is saved with what was mutated, the table's details print it, and ``--replay`` reproduces it."""
    import random

    from hf_merge import merging

    src = qwen2_fp32_ws2.actor
    target = harness.Target("fsdp", src, ["huggingface/generation_config.json"])
    work = tmp_path / "fuzz"
    pristine = harness._pristine(target, work)

    def buggy_open(*args, **kwargs):
        raise ZeroDivisionError("stand-in bug")

    monkeypatch.setattr(merging, "open_checkpoint", buggy_open)
    result = harness.Result()
    assert harness.run_case(target, random.Random(7), work / "case", pristine, result, keep=work / "bad") == "unexpected"
    (saved,) = sorted((work / "bad").iterdir())
    record = json.loads((saved / "case.json").read_text())
    assert record["file"] == "huggingface/generation_config.json" and record["outcome"] == "unexpected"
    assert record["mutation"]["op"] in ("json-value", "flip", "truncate") and record["description"].startswith(record["mutation"]["op"])
    assert (saved / "mutated" / "generation_config.json").read_bytes() == (work / "case" / "src" / record["file"]).read_bytes()
    table = result.table()
    assert record["description"] in table and f"--replay {saved}" in table, table
    outcome, notes, line = harness.replay(saved, work=tmp_path / "replay")
    assert outcome == "unexpected" and line == f"[fsdp] {record['description']}"
    assert notes == record["details"]
    monkeypatch.undo()
    assert harness.replay(saved, work=tmp_path / "replay2")[0] in harness.GOOD  # the "bug" fixed


def _set_header_dtype(path: Path, name: str, dtype: str) -> None:
    raw = path.read_bytes()
    n = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8 : 8 + n])
    header[name]["dtype"] = dtype
    new = json.dumps(header).encode()
    new += b" " * ((-len(new)) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_a_header_change_to_another_valid_file_is_judged_by_what_the_file_says(hf_folder, tmp_path):
    """A safetensors header whose dtype string changes (BF16 -> F16, same bytes) is another valid
    file: merging it is right, not a silent change; an output that differs from what
    ``safe_open`` reads from the mutated file is one."""
    target = _hf_target(hf_folder)
    pristine = harness._pristine(target, tmp_path / "p")
    assert target.self_describing
    work = tmp_path / "case"
    shutil.copytree(hf_folder, work / "src")
    _set_header_dtype(work / "src" / "model.safetensors", "model.norm.weight", "F16")
    case = harness.Case(target, "model.safetensors", {"op": "json-value", "path": "$.model.norm.weight.dtype"}, False)
    outcome, notes = harness.judge(case, work, pristine)
    assert outcome == "accepted", notes
    assert harness._tensors_digest(work / "out") != pristine  # the merge did change: as the file says
    assert harness._reads_as_source(work / "out", work / "src")
    assert not harness._reads_as_source(work / "out", hf_folder)  # the pristine file says otherwise
