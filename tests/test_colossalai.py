"""ColossalAI 0.5: booster.save_model(shard=True) folders written by REAL ColossalAI on CPU (gloo).

ColossalAI pins torch <= 2.5.1 and transformers 4.51.3, so it cannot run in the test venv: the
fixtures under tests/data/colossalai/ were written once by ``make_fixtures.py`` there (versions and
command in ``VERSIONS``). Each variant folder holds, beside the checkpoint, what the training process
itself held: ``reference/weights.safetensors`` (the unsharded state dict), ``reference/logits.pt``
and ``reference/config/``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import detections_differing_from_every_probe, incomplete_newest_step

from hf_merge import open_checkpoint
from hf_merge.cli.app import main
from hf_merge.errors import CorruptCheckpointError, IncompleteStepError, SourceNotFoundError, UnsafeCheckpointError
from hf_merge.readers.formats import detect

from helpers import assert_tensors_equal, folder_tensors, model_logits

DATA = Path(__file__).parent / "data" / "colossalai"
VARIANTS = sorted(p.name for p in DATA.iterdir() if (p / "reference" / "variant.json").is_file())
BOOSTER = [v for v in VARIANTS if not v.startswith("dist")]
PLAIN = [v for v in BOOSTER if "lora" not in v]
DIST = "dist_tp2_ws2"


def variant(name: str) -> dict:
    return json.loads((reference(name) / "variant.json").read_text())


def reference(name: str) -> Path:
    return DATA / name / "reference"


def weights(name: str) -> dict[str, torch.Tensor]:
    return load_file(reference(name) / "weights.safetensors")


def logits(name: str) -> dict[str, torch.Tensor]:
    return torch.load(reference(name) / "logits.pt", weights_only=True)


def test_fixtures_are_real_colossalai_layouts():
    """What the real library wrote: no -of-N, total_size in MB as a float, .bin shards, stage files."""
    for name in BOOSTER:
        versions = variant(name)["versions"]
        assert versions["colossalai"].startswith("0.5.") and versions["torch"].startswith("2.5.1")
    seen = {}
    for name in BOOSTER:
        folder = DATA / name
        index = next(folder.glob("*.index.json"))
        data = json.loads(index.read_text())
        assert isinstance(data["metadata"]["total_size"], float)
        files = set(data["weight_map"].values())
        assert len(files) > 1 and not any("-of-" in f for f in files)
        seen[name] = sorted(files)
    assert "pytorch_model-00001.bin" in seen["ddp_bin_tied_ws2"]
    assert "model-00001.safetensors" in seen["ddp_safetensors_ws2"]
    assert {f[: len("model-stage-00002")] for f in seen["hybrid_pp2_ws2"]} == {"model-stage-00001", "model-stage-00002"}
    assert {f[: len("pytorch_model-stage-00002")] for f in seen["hybrid_tp2_pp2_ws4"]} == {
        "pytorch_model-stage-00001", "pytorch_model-stage-00002"}


@pytest.mark.parametrize("name", BOOSTER)
def test_detected_and_byte_exact(name):
    want = weights(name)
    assert detect(DATA / name).chosen.name == "colossalai"
    with open_checkpoint(DATA / name) as ck:
        assert ck.info.reader == "colossalai" and ck.info.details["layout"] == "booster"
        assert ck.info.hf_dir == DATA / name  # booster writes config.json beside the shards
        specs = ck.specs()
        extra = set(specs) - set(want)
        assert extra == ({"lm_head.weight"} if variant(name)["tied"] else set()), extra
        got = {k: ck.read(k) for k in want}
        for k in extra:
            assert torch.equal(ck.read(k), ck.read("model.embed_tokens.weight"))
    assert_tensors_equal(got, want)


@pytest.mark.parametrize("name", VARIANTS)
def test_tensors_are_file_runs(name):
    """A shard's tensors (.bin or safetensors; a distributed save's row slices) come as runs of
    their files, so a merge copies file bytes and a load maps them; their values are read()'s."""
    from hf_merge.readers.file_runs import FileRun, values

    config = {"config": reference(name) / "config"} if name == DIST else {}
    with open_checkpoint(DATA / name, **config) as ck:
        runs = 0
        for key, spec in ck.specs().items():
            rows = ck.read_rows(key, spec.dtype)
            if rows is None:  # a distributed box cut along another dim (a row-parallel TP slice)
                assert name == DIST and len(spec.shape) > 1
                continue
            pieces = list(rows)
            runs += sum(isinstance(p, FileRun) for _, p in pieces)
            assert [first for first, _ in pieces] == sorted(first for first, _ in pieces)
            assert torch.equal(torch.cat([values(p) for _, p in pieces]), ck.read(key)), key
        assert runs >= len(ck.specs()) // 2


@pytest.mark.parametrize("name", PLAIN)
def test_merge_cli_weights_and_logits(name, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["merge", "--workers", "1", str(DATA / name), str(out), "--dtype", "float32", "--verify"])
    assert rc == 0, capsys.readouterr().err
    assert_tensors_equal(folder_tensors(out), weights(name))  # the tied alias written once
    ref = logits(name)
    torch.testing.assert_close(model_logits(out, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-5)
    provenance = json.loads((out / "hf_merge.json").read_text())
    assert provenance["verification"]["passed"] and provenance["source"]["format"] == "colossalai"


def test_merge_bf16(tmp_path, capsys):
    name = "ddp_bin_tied_ws2"
    out = tmp_path / "bf16"
    assert main(["merge", "--workers", "1", str(DATA / name), str(out), "--dtype", "bfloat16"]) == 0, capsys.readouterr().err
    assert_tensors_equal(folder_tensors(out), weights(name), dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def test_quantized_int8_is_bitsandbytes_own(tmp_path, capsys):
    import bitsandbytes.functional as F

    name = "ddp_safetensors_ws2"
    out = tmp_path / "int8"
    assert main(["merge", "--workers", "1", str(DATA / name), str(out), "--quantize", "int8"]) == 0, capsys.readouterr().err
    got = folder_tensors(out)
    want = weights(name)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["load_in_8bit"] is True
    w = "model.layers.1.mlp.down_proj.weight"
    cb, scb, _ = F.int8_vectorwise_quant(want[w].to(torch.float16))
    assert torch.equal(got[w], cb) and torch.equal(got[w.replace(".weight", ".SCB")], scb)


def test_lora_fused_adapter_and_from_sharded_pretrained(tmp_path, capsys):
    """booster.enable_lora: base weights under their plain names beside lora_A/B.default; fused with
    --lora-alpha, the adapter equals PEFT's own save (booster.save_lora_as_pretrained)."""
    from transformers import AutoModelForCausalLM

    import hf_merge  # noqa: F401 - installs from_sharded_pretrained

    name = "ddp_lora_ws2"
    with open_checkpoint(DATA / name) as ck:
        assert any(".lora_A.default." in k for k in ck.specs()) and "model.layers.0.self_attn.q_proj.weight" in ck.specs()
    out = tmp_path / "lora"
    rc = main(["merge", "--workers", "1", str(DATA / name), str(out), "--dtype", "float32", "--lora-alpha", "8", "--verify"])
    err = capsys.readouterr().err
    assert rc == 0, err
    ref = logits(name)
    torch.testing.assert_close(model_logits(out, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-5)
    peft_own = load_file(reference(name) / "adapter" / "adapter_model.safetensors")
    assert_tensors_equal(load_file(out / "lora_adapter" / "adapter_model.safetensors"), peft_own)
    model = AutoModelForCausalLM.from_sharded_pretrained(DATA / name, dtype="float32", lora_alpha=8)
    with torch.no_grad():
        got = model(ref["input_ids"]).logits.float()
    torch.testing.assert_close(got, ref["logits"], rtol=0, atol=1e-5)


def test_verify_against_source(tmp_path, capsys):
    name = "ddp_bin_tied_ws2"
    out = tmp_path / "v"
    assert main(["merge", "--workers", "1", str(DATA / name), str(out), "--dtype", "float32"]) == 0
    assert main(["verify", str(out), "--against", str(DATA / name)]) == 0, capsys.readouterr().err


# ---- bad input -------------------------------------------------------------------------------


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(DATA / name, dst, ignore=shutil.ignore_patterns("reference"))
    return dst


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_bin_shard_refused_nothing_run(tmp_path, capsys):
    ckpt = _copy("ddp_bin_tied_ws2", tmp_path)
    marker = tmp_path / "ran"
    payload = _Payload()
    payload.marker = marker
    torch.save({"model.norm.weight": payload}, ckpt / "pytorch_model-00001.bin")
    with pytest.raises(UnsafeCheckpointError, match="pytorch_model-00001.bin"):
        open_checkpoint(ckpt)
    assert main(["merge", "--workers", "1", str(ckpt), str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert len([ln for ln in err.splitlines() if ln.startswith("error: ")]) == 1 and "Traceback" not in err
    assert not marker.exists()


def test_truncated_and_missing_shards(tmp_path):
    ckpt = _copy("ddp_bin_tied_ws2", tmp_path)
    f = ckpt / "pytorch_model-00002.bin"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="pytorch_model-00002.bin"):
        open_checkpoint(ckpt)
    f.unlink()
    with pytest.raises(CorruptCheckpointError, match="pytorch_model-00002.bin.*missing"):
        open_checkpoint(ckpt)


def test_index_errors(tmp_path):
    ckpt = _copy("ddp_safetensors_ws2", tmp_path)
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = next(iter(data["weight_map"]))
    data["weight_map"][name] = "../../etc/model-00001.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CorruptCheckpointError, match="not a ColossalAI weight file"):
        open_checkpoint(ckpt)
    index.write_text("{not json")
    assert detect(ckpt).chosen.name != "colossalai"  # probe: undecodable index, not this format
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        open_checkpoint(ckpt, backend="colossalai")
    data["weight_map"][name] = "model-00009.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CorruptCheckpointError, match="model-00009.safetensors.*missing"):
        open_checkpoint(ckpt)
    index.unlink()
    with pytest.raises(SourceNotFoundError, match="model.safetensors.index.json"):
        open_checkpoint(ckpt, backend="colossalai")


def test_colossal_llama_save_folders(tmp_path):
    """Colossal-LLaMA / ColossalChat save to save_dir/epoch-E_step-S/modeling/ (optimizer/ beside)."""
    for run in ("epoch-0_step-5", "epoch-1_step-10"):
        shutil.copytree(DATA / "ddp_safetensors_ws2", tmp_path / run / "modeling", ignore=shutil.ignore_patterns("reference"))
        (tmp_path / run / "optimizer").mkdir()
        (tmp_path / run / "running_states.json").write_text('{"epoch": 0, "step": 5}')
    assert detect(tmp_path / "epoch-0_step-5").chosen.name == "colossalai"
    assert detections_differing_from_every_probe(tmp_path) == []  # the save root, each save, each modeling/
    with open_checkpoint(tmp_path / "epoch-0_step-5") as ck:
        assert ck.info.path == tmp_path / "epoch-0_step-5" / "modeling"
        assert "reading epoch-0_step-5/modeling/" in ck.info.notes[0]
    with open_checkpoint(tmp_path) as ck:
        assert ck.info.path == tmp_path / "epoch-1_step-10" / "modeling"
        assert "the newest of 2 ColossalAI saves" in ck.info.notes[0]
        assert_tensors_equal({k: ck.read(k) for k in ck.specs()}, weights("ddp_safetensors_ws2"))
    # a newer save cut short (its modeling/ has only config.json): named with the complete save to
    # pass, never replaced by it
    (tmp_path / "epoch-2_step-15" / "modeling").mkdir(parents=True)
    shutil.copy(tmp_path / "epoch-1_step-10" / "modeling" / "config.json", tmp_path / "epoch-2_step-15" / "modeling")
    assert detect(tmp_path).chosen.name == "colossalai"
    with pytest.raises(IncompleteStepError, match=re.escape(
            incomplete_newest_step(tmp_path / "epoch-2_step-15", tmp_path / "epoch-1_step-10"))):
        open_checkpoint(tmp_path)
    with open_checkpoint(tmp_path / "epoch-1_step-10") as ck:
        assert ck.info.path == tmp_path / "epoch-1_step-10" / "modeling"


# ---- per-rank DistributedCheckpointIO (pull request #6181's tree; see VERSIONS) ----------------


def test_distributed_layout_byte_exact_and_logits(tmp_path, capsys):
    """tp=2, gather_dtensor=False: each tensor assembled from the two ranks' boxes."""
    assert variant(DIST)["versions"]["colossalai"].startswith("pull request #6181")
    metas = sorted(p.name for p in (DATA / DIST).glob("pytorch_model-meta-dist-*.json"))
    assert metas == ["pytorch_model-meta-dist-00000.json", "pytorch_model-meta-dist-00001.json"]
    q = json.loads((DATA / DIST / metas[1]).read_text())["metadata"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["offsets"][0] > 0 and q["lengths"][0] < q["global_shape"][0]  # a real tensor-parallel slice
    assert detect(DATA / DIST).chosen.name == "colossalai"
    with open_checkpoint(DATA / DIST, config=reference(DIST) / "config") as ck:
        assert ck.info.details == {"layout": "distributed", "ranks": 2, "files": ck.info.details["files"]}
        want = weights(DIST)
        assert set(ck.specs()) == set(want)
        assert_tensors_equal({k: ck.read(k) for k in want}, want)
    out = tmp_path / "out"
    rc = main(["merge", "--workers", "1", str(DATA / DIST), str(out), "--config", str(reference(DIST) / "config"),
               "--dtype", "float32", "--verify"])
    assert rc == 0, capsys.readouterr().err
    assert_tensors_equal(folder_tensors(out), weights(DIST))
    ref = logits(DIST)
    torch.testing.assert_close(model_logits(out, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-5)


def test_distributed_layout_errors(tmp_path):
    ckpt = _copy(DIST, tmp_path)
    meta = ckpt / "pytorch_model-meta-dist-00001.json"
    data = json.loads(meta.read_text())
    entry = data["metadata"]["model.layers.0.self_attn.q_proj.weight"]
    own = entry["file"]
    entry["file"] = "../pytorch_model-dist-00001.bin"
    meta.write_text(json.dumps(data))
    with pytest.raises(CorruptCheckpointError, match="not a ColossalAI weight file"):
        open_checkpoint(ckpt)
    entry["file"] = "/etc/passwd"
    meta.write_text(json.dumps(data))
    with pytest.raises(CorruptCheckpointError, match="not a ColossalAI weight file"):
        open_checkpoint(ckpt)
    # the path the rank wrote to (unsharded saves record it): only its name counts, inside the folder
    entry["file"] = f"/elsewhere/{DIST}/{own}"
    meta.write_text(json.dumps(data))
    with open_checkpoint(ckpt) as ck:
        assert torch.equal(ck.read("model.layers.0.self_attn.q_proj.weight"), weights(DIST)["model.layers.0.self_attn.q_proj.weight"])
    entry["file"] = own
    entry["offsets"][0] -= entry["lengths"][0] // 2  # half over rank 0's box
    meta.write_text(json.dumps(data))
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        open_checkpoint(ckpt)
    meta.unlink()
    with pytest.raises(CorruptCheckpointError, match="do not cover"):
        open_checkpoint(ckpt)
