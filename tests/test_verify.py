"""verify: passes on good merges, fails (exit 1, naming the tensor) on damaged ones."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import run_cli
from safetensors.torch import load_file, save_file

import hf_merge
from hf_merge.verification import verify


@pytest.fixture(scope="module")
def merged(qwen2_fp32_ws2, tmp_path_factory):
    target = tmp_path_factory.mktemp("verify") / "merged"
    hf_merge.merge(qwen2_fp32_ws2.actor, target)
    return target


def _copy(merged, tmp_path):
    dest = tmp_path / "copy"
    shutil.copytree(merged, dest)
    return dest


@pytest.mark.compat
def test_good_merge_passes_against_source_and_reference(merged, qwen2_fp32_ws2):
    proc = run_cli("verify", merged, "--against", qwen2_fp32_ws2.actor)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-exact" in proc.stdout and "file checksums" in proc.stdout
    # against the fp32 reference folder, a bf16 merge is within one bf16 rounding
    report = verify(merged, qwen2_fp32_ws2.reference, atol=0, rtol=2**-8)
    assert report.ok, report.table()


@pytest.mark.compat
def test_lora_merge_verifies_against_source(lora_ckpt, tmp_path):
    target = tmp_path / "m"
    result = hf_merge.merge(lora_ckpt.actor, target, lora="fuse", verify=True)
    assert result.provenance["verification"]["passed"] is True
    assert verify(target, lora_ckpt.actor).ok


@pytest.mark.compat
def test_flipped_byte_fails_naming_the_tensor(merged, qwen2_fp32_ws2, tmp_path):
    bad = _copy(merged, tmp_path)
    path = bad / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.weight"
    raw = tensors[name].view(torch.int16).clone()
    raw.view(-1)[3] ^= 1  # one bit of one element
    tensors[name] = raw.view(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    proc = run_cli("verify", bad, "--against", qwen2_fp32_ws2.actor)
    assert proc.returncode == 1
    assert name in proc.stdout and "not bit-identical" in proc.stdout
    assert "crc32 differs" in proc.stdout


def test_without_a_source_the_recorded_checksums_are_checked(merged, tmp_path):
    """`hf-merge verify TARGET` (no --against): a copied folder passes; one changed byte anywhere in
    a weight file fails naming the file; a folder with no recorded checksums is one error line."""
    good = _copy(merged, tmp_path)
    proc = run_cli("verify", good)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "file checksums" in proc.stdout and "crc32:" in (good / "hf_merge.json").read_text()
    path = good / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit in the middle of the tensor data
    path.write_bytes(bytes(data))
    proc = run_cli("verify", good)
    assert proc.returncode == 1 and "model.safetensors: crc32 differs" in proc.stdout, proc.stdout + proc.stderr
    record = json.loads((good / "hf_merge.json").read_text())
    del record["files"]
    (good / "hf_merge.json").write_text(json.dumps(record))
    proc = run_cli("verify", good)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 2 and len(lines) == 1 and "--against" in lines[0], proc.stderr


def test_every_file_the_merge_wrote_is_checked_but_the_model_card(merged, tmp_path):
    """Before: hf_merge.json recorded the weight files only, so a changed config.json verified as
    "file checksums ok". Now every file the merge wrote is recorded (the card and the record itself
    aside), and the one-line verdict names a changed or missing file. A card edited afterwards, and a
    folder whose older record lists its weight files only, still verify."""
    good = _copy(merged, tmp_path)
    recorded = json.loads((good / "hf_merge.json").read_text())["files"]
    written = [p.relative_to(good).as_posix() for p in good.rglob("*") if p.is_file()]
    assert sorted(recorded) == sorted(set(written) - {"hf_merge.json", "README.md"}) and "config.json" in recorded
    with open(good / "README.md", "a") as f:
        f.write("\nTrained on our data.\n")
    assert run_cli("verify", good).returncode == 0
    config = json.loads((good / "config.json").read_text())
    (good / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    (good / "generation_config.json").unlink()
    proc = run_cli("verify", good)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 1 and len(lines) == 1, proc.stdout + proc.stderr
    assert "config.json changed since the merge" in lines[0] and "generation_config.json missing" in lines[0], lines[0]
    record = json.loads((good / "hf_merge.json").read_text())
    record["files"] = {n: d for n, d in record["files"].items() if n.endswith(".safetensors")}
    (good / "hf_merge.json").write_text(json.dumps(record))  # as written before 2026-12-06
    assert run_cli("verify", good).returncode == 0


def test_the_adapter_subfolder_files_are_recorded_and_checked(lora_ckpt, tmp_path):
    """``--lora both``: lora_adapter/'s config and weights are recorded too (its card is not)."""
    target = tmp_path / "both"
    hf_merge.merge(lora_ckpt.actor, target, lora="both")
    recorded = json.loads((target / "hf_merge.json").read_text())["files"]
    assert {"lora_adapter/adapter_config.json", "lora_adapter/adapter_model.safetensors"} <= set(recorded)
    assert "lora_adapter/README.md" not in recorded and verify(target).ok
    config = target / "lora_adapter" / "adapter_config.json"
    config.write_text(config.read_text().replace('"r": 4', '"r": 8'))
    report = verify(target)
    assert not report.ok and "lora_adapter/adapter_config.json changed since the merge" in report.summary()


def test_missing_tensor_and_wrong_dtype_fail(merged, qwen2_fp32_ws2, tmp_path):
    bad = _copy(merged, tmp_path)
    path = bad / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.norm.weight"]
    tensors["model.layers.0.input_layernorm.weight"] = tensors["model.layers.0.input_layernorm.weight"].float()
    save_file(tensors, path, metadata={"format": "pt"})
    (bad / "hf_merge.json").write_text(json.dumps({**json.loads((bad / "hf_merge.json").read_text()), "files": {}}))
    proc = run_cli("verify", bad, "--against", qwen2_fp32_ws2.actor)
    assert proc.returncode == 1
    assert "missing tensor model.norm.weight" in proc.stdout
    assert "model.layers.0.input_layernorm.weight: dtype torch.float32 != torch.bfloat16" in proc.stdout
    proc = run_cli("verify", bad, "--against", merged)  # against an HF folder: names every difference too
    assert proc.returncode == 1 and "missing tensor model.norm.weight" in proc.stdout


@pytest.mark.compat
def test_logits_check_runs_a_forward_pass(merged, qwen2_fp32_ws2):
    report = verify(merged, qwen2_fp32_ws2.reference, atol=1e-2, logits=True, logits_atol=0.1)
    names = {c.name: c for c in report.checks}
    assert names["logits finite"].ok and names["logits vs reference"].ok, report.table()


def test_swapped_arguments_say_which_goes_where(merged, qwen2_fp32_ws2):
    """`hf-merge verify CHECKPOINT --against MERGED` (the two swapped). Before: "no *.safetensors
    files in CHECKPOINT; pass a Hugging Face model folder". Now one line says what each is."""
    proc = run_cli("verify", qwen2_fp32_ws2.actor, "--against", merged)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"{qwen2_fp32_ws2.actor} is a fsdp checkpoint, not a merged folder" in lines[0], lines[0]
    assert "hf-merge verify MERGED --against CHECKPOINT" in lines[0], lines[0]


@pytest.mark.parametrize("flip_row", [None, 0, -1])
def test_large_tensors_are_compared_band_by_band(merged, qwen2_fp32_ws2, tmp_path, monkeypatch, flip_row):
    """Above BAND_BYTES both sides stream their rows (memory flat with the model): the same verdicts,
    a bit flipped in the first or the last row of a tensor included."""
    import hf_merge.verification as verification

    monkeypatch.setattr(verification, "BAND_BYTES", 256)  # every 2-D weight of the tiny model, in bands of a few rows
    bands = []
    real = verification._aligned
    monkeypatch.setattr(verification, "_aligned", lambda *a: (bands.append(1), (yield from real(*a)))[1])
    target = merged
    name = "model.layers.1.mlp.down_proj.weight"
    if flip_row is not None:
        target = _copy(merged, tmp_path)
        tensors = load_file(target / "model.safetensors")
        raw = tensors[name].view(torch.int16).clone()
        raw[flip_row, 0] ^= 1
        tensors[name] = raw.view(torch.bfloat16)
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    report = verify(target, qwen2_fp32_ws2.actor)
    assert len(bands) > 10
    assert report.ok == (flip_row is None), report.table()
    if flip_row is not None:
        assert any(m.startswith(f"{name}: not bit-identical") for m in report.mismatches), report.mismatches
        # against the unflipped folder, same dtype, with tolerances: one ulp of bf16 is within 2**-6, not within 0
        within = verify(target, merged, atol=0, rtol=2**-6)  # fails on the recorded file checksum only
        assert within.mismatches == ["model.safetensors: crc32 differs from the one recorded at merge time"], within.mismatches
        strict = verify(target, merged, atol=0, rtol=0)
        assert any(m.startswith(f"{name}: max abs diff") for m in strict.mismatches), strict.mismatches
    if flip_row is None:  # with tolerances: bf16 against the fp32 reference, within one rounding
        tolerant = verify(target, qwen2_fp32_ws2.reference, atol=0, rtol=2**-8)
        assert tolerant.ok, tolerant.table()


def test_the_source_is_read_as_the_merge_read_it(tmp_path):
    """A ``--source-weights module`` DeepSpeed merge. Before: hf_merge.json did not record the choice
    and verify had no --source-weights, so ``verify --against`` compared with the fp32 masters:
    ``failed: dtypes``. Now the record holds the reader options and verify reads the source with
    them; --source-weights given to verify wins."""
    from pathlib import Path

    source = Path(__file__).parent / "data" / "deepspeed" / "z2_bf16_align_ws3"
    config = ("--config", source / "reference" / "step2" / "config")
    target = tmp_path / "m"
    proc = run_cli("merge", source, target, *config, "--source-weights", "module", "--dtype", "auto", "-q")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((target / "hf_merge.json").read_text())["source"]["options"] == {"source_weights": "module"}
    proc = run_cli("verify", target, "--against", source, *config)
    assert proc.returncode == 0 and "bit-exact" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("verify", target, "--against", source, *config, "--source-weights", "master")
    assert proc.returncode == 1 and "dtypes" in proc.stderr, proc.stdout + proc.stderr
