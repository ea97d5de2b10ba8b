"""DeepSpeed universal checkpoints: REAL ``ds_to_universal`` (0.19.8) output of the committed ZeRO fixtures.

``tests/data/deepspeed_universal/make_universal.py`` converted three variants of
``tests/data/deepspeed/`` (stage 1 BF16_Optimizer tied, stage 2 with alignment padding over 3 ranks,
stage 3 tied); the fp32 masters read from ``zero/<name>/fp32.pt`` must equal, bit for bit, the
masters DeepSpeed itself gathered in the training processes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_merge import open_checkpoint
from hf_merge.cli.app import main
from hf_merge.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError
from hf_merge.readers.formats import detect

from helpers import assert_tensors_equal, folder_tensors, model_logits

DATA = Path(__file__).parent / "data"
UNIVERSAL = DATA / "deepspeed_universal"
VARIANTS = sorted(p.name for p in UNIVERSAL.iterdir() if (p / "latest_universal").is_file())
TIED = {"z1_bf16_tied_ws2", "z3_bf16_tied_ws2"}


def reference(name: str) -> Path:
    return DATA / "deepspeed" / name / "reference" / "step2"


def test_the_fixtures_cover_every_stage():
    assert len(VARIANTS) == 3
    stages = set()
    for name in VARIANTS:
        with open_checkpoint(UNIVERSAL / name) as ck:
            stages.add(ck.info.details["zero_stage"])
    assert stages == {1, 2, 3}


@pytest.mark.parametrize("name", VARIANTS)
def test_masters_byte_exact(name):
    root = UNIVERSAL / name
    assert detect(root).chosen.name == "deepspeed"
    want = load_file(reference(name) / "masters.safetensors")
    with open_checkpoint(root) as ck:
        assert ck.info.details["layout"] == "universal" and ck.info.step == 2
        assert ck.info.notes[0] == f"using tag global_step2_universal (from {name}/latest_universal)"
        specs = ck.specs()
        # the tied alias, as the model's state dict has it, reads the embedding's master (ds_to_universal
        # itself writes the 16-bit module copy for it)
        assert set(specs) - set(want) == ({"lm_head.weight"} if name in TIED else set())
        assert all(s.dtype == torch.float32 for s in specs.values())
        got = {k: ck.read(k) for k in want}
        if name in TIED:
            assert torch.equal(ck.read("lm_head.weight"), want["model.embed_tokens.weight"])
    assert_tensors_equal(got, want)


@pytest.mark.parametrize("name,dtype", [("z3_bf16_tied_ws2", "float32"), ("z2_bf16_align_ws3", "bfloat16")])
def test_merge_cli_weights_and_logits(name, dtype, tmp_path, capsys):
    out = tmp_path / "out"
    tag_dir = UNIVERSAL / name / "global_step2_universal"  # the tag folder itself also opens
    rc = main(["merge", "--workers", "1", str(tag_dir), str(out), "--config", str(reference(name) / "config"),
               "--dtype", dtype, "--verify"])
    assert rc == 0, capsys.readouterr().err
    want = load_file(reference(name) / "masters.safetensors")
    assert_tensors_equal(folder_tensors(out), want, dtype=getattr(torch, dtype))
    if dtype == "float32":
        ref = torch.load(reference(name) / "logits.pt", weights_only=True)
        torch.testing.assert_close(model_logits(out, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-5)


def test_bad_universal_folders(tmp_path):
    root = tmp_path / "u"
    shutil.copytree(UNIVERSAL / "z2_bf16_align_ws3", root)
    with pytest.raises(UnsupportedCheckpointError, match="universal"):
        open_checkpoint(root, source_weights="module")
    zero = root / "global_step2_universal" / "zero"
    # a master that executes code on load is refused before anything runs
    (zero / "model.norm.weight" / "fp32.pt").unlink()
    import os

    torch.save({"param": torch.ones(24), "x": os.system}, zero / "model.norm.weight" / "fp32.pt")
    with pytest.raises(UnsafeCheckpointError):
        open_checkpoint(root)
    shutil.rmtree(zero / "model.norm.weight")
    with pytest.raises(CorruptCheckpointError, match="model.norm.weight"):
        open_checkpoint(root)


def test_masters_are_file_runs_and_a_damaged_one_is_refused(tmp_path):
    """Each fp32.pt master is handed out as a run of its file (copied file to file, mapped on load)
    and its zip record is CRC-32-checked: before, the masters came as plain tensors, never checked."""
    import hf_merge
    from hf_merge.readers import record_crc
    from hf_merge.readers.file_runs import run_of

    root = tmp_path / "u"
    shutil.copytree(UNIVERSAL / "z3_bf16_tied_ws2", root)
    config = reference("z3_bf16_tied_ws2") / "config"
    with open_checkpoint(root) as ck:
        runs = list(ck.read_rows("model.layers.0.mlp.down_proj.weight", torch.float32))
        assert runs and all(run_of(piece) is not None for _, piece in runs)
    master = root / "global_step2_universal" / "zero" / "model.layers.0.mlp.down_proj.weight" / "fp32.pt"
    raw = bytearray(master.read_bytes())
    with open(master, "rb") as f:
        from hf_merge.readers.torch_zip import read_records

        record = next(r for r in read_records(f, master.name).values() if r.name.endswith("data/0"))
    raw[record.data_start + 5] ^= 0x10
    master.write_bytes(bytes(raw))
    with pytest.raises(record_crc.SourceCrcError, match="down_proj"):
        hf_merge.merge(str(root), str(tmp_path / "out"), config=str(config), dtype="float32")
    assert not (tmp_path / "out").exists()
    with pytest.raises(record_crc.SourceCrcError, match="down_proj"):
        hf_merge.from_sharded_pretrained(str(root), config=str(config), dtype=torch.float32)
