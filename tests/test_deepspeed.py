"""DeepSpeed ZeRO 1/2/3: checkpoints written by REAL DeepSpeed 0.19.8 on CPU (gloo), read without deepspeed.

The fixtures under tests/data/deepspeed/ were written once by ``make_fixtures.py`` there (versions in
``versions.json``); each variant folder holds, beside the checkpoint, what the training processes
themselves saw: the fp32 masters as DeepSpeed gathers them (``safe_get_full_fp32_param``), the 16-bit
module weights (stage 1/2) and the logits of the fp32 model carrying the masters.
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

from hf_merge.readers.file_runs import values
from hf_merge import open_checkpoint
from hf_merge.cli.app import main
from hf_merge.errors import CorruptCheckpointError, IncompleteStepError, SourceNotFoundError, UnsafeCheckpointError, UnsupportedCheckpointError
from hf_merge.readers.formats import detect
from hf_merge.readers.deepspeed import load_deepspeed_file

from helpers import assert_tensors_equal, folder_tensors, model_logits, incomplete_newest_step

DATA = Path(__file__).parent / "data" / "deepspeed"
VARIANTS = sorted(p.name for p in DATA.iterdir() if (p / "variant.json").is_file())
PLAIN = [v for v in VARIANTS if "lora" not in v]
STAGE12 = [v for v in PLAIN if not v.startswith("z3")]


def variant(name: str) -> dict:
    return json.loads((DATA / name / "variant.json").read_text())


def reference(name: str, step: int = 2) -> Path:
    return DATA / name / "reference" / f"step{step}"


def config_args(name: str) -> list[str]:
    """Trainer folders carry their config.json; plain DeepSpeed folders get it from --config."""
    return [] if variant(name).get("trainer") else ["--config", str(reference(name) / "config")]


def test_committed_fixtures_are_the_matrix():
    seen = {(v["stage"], v["dtype"], v["tied"], bool(v.get("lora")), v["world_size"]) for v in map(variant, VARIANTS)}
    assert {s for s, *_ in seen} == {1, 2, 3}
    assert {d for _, d, *_ in seen} == {"bf16", "fp32"}
    assert {t for _, _, t, *_ in seen} == {True, False}
    assert any(lora for *_, lora, _ in seen) and {ws for *_, ws in seen} >= {1, 2, 3}
    assert json.loads((DATA / "versions.json").read_text())["deepspeed"].startswith("0.19.")


@pytest.mark.parametrize("name", VARIANTS)
def test_masters_byte_exact(name):
    """Every trained tensor equals DeepSpeed's own fp32 master, bit for bit (frozen ones: the module's)."""
    want = load_file(reference(name) / "masters.safetensors")
    with open_checkpoint(DATA / name) as ck:
        assert ck.info.reader == "deepspeed" and ck.info.details["zero_stage"] == variant(name)["stage"]
        specs = ck.specs()
        if variant(name).get("lora") and variant(name).get("trainer"):  # exclude_frozen_parameters
            want = {k: v for k, v in want.items() if "lora_" in k}
        prefix = "base_model.model." if variant(name).get("lora") else ""
        extra = set(specs) - set(want)  # the tied alias (shared_params), as the model's state dict has it
        assert extra == ({prefix + "lm_head.weight"} if variant(name)["tied"] else set()), extra
        got = {k: ck.read(k) for k in want}
        for k in extra:
            assert torch.equal(ck.read(k), ck.read(prefix + "model.embed_tokens.weight"))
    assert_tensors_equal(got, want)


@pytest.mark.parametrize("name", STAGE12)
def test_module_weights_byte_exact(name):
    want = load_file(reference(name) / "module.safetensors")
    with open_checkpoint(DATA / name, source_weights="module") as ck:
        assert ck.info.details["source_weights"] == "module"
        got = {k: ck.read(k) for k in want}
        assert set(ck.specs()) >= set(want)
    assert_tensors_equal(got, want)


def test_bf16_optimizer_and_alignment_layouts():
    """The matrix really covers the layouts the reader distinguishes."""
    with open_checkpoint(DATA / "z1_bf16_tied_ws2") as ck:
        assert ck.info.details["optimizer"] == "BF16_Optimizer"
        assert sorted(p.name for p in ck.loc.tag_dir.iterdir())[0].startswith("bf16_zero_pp_rank_0")
    with open_checkpoint(DATA / "z2_bf16_align_ws3") as ck:
        optim = load_deepspeed_file(ck.loc.tag_dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert any(any(g) for g in optim["param_alignment_paddings"])
        # some parameter is split over two ranks' partitions
        assert any(len(lay.pieces) > 1 for lay in ck._layouts.values())
    with open_checkpoint(DATA / "z3_bf16_tied_ws2") as ck:
        # sub_group_size=700: the masters lie in several optimizer sub-groups per rank (DeepSpeed
        # keeps each parameter's slice within one sub-group)
        subs = {p.source[2] for lay in ck._layouts.values() for p in lay.pieces if p.source[0] == "sub"}
        assert len(subs) > 2, subs


@pytest.mark.parametrize("name", ["z1_bf16_tied_ws2", "z2_bf16_align_ws3", "z3_fp32_ws3"])
def test_row_runs_across_partition_boundaries(name):
    """Every tensor streams as runs of rows (the writer's file-to-file path), also those whose rows
    are cut by a rank partition boundary: those rows alone are assembled; values as read()."""
    cut = 0
    with open_checkpoint(DATA / name) as ck:
        for tensor, spec in ck.specs().items():
            row = spec.numel // spec.shape[0] if spec.shape and spec.shape[0] else 0
            cut += any(p.dst_start % row or p.numel % row for p in ck._layouts[tensor].pieces) if row else 0
            for dtype in (spec.dtype, torch.bfloat16):
                runs = ck.read_rows(tensor, dtype, max_bytes=256)
                assert runs is not None, tensor
                out, rows_seen = torch.empty(spec.shape, dtype=dtype), 0
                for first, piece in runs:
                    rows = values(piece)
                    assert first == rows_seen
                    out[first : first + len(rows)] = rows
                    rows_seen += len(rows)
                assert rows_seen == spec.shape[0] and torch.equal(out, ck.read(tensor).to(dtype)), tensor
    assert cut >= 1  # the fixture really has rows cut by a partition boundary


@pytest.mark.parametrize("name,dtype", [("z3_bf16_tied_ws2", "bfloat16"), ("z2_fp32_rr_tied_ws3", "float32"),
                                        ("z1_bf16_tied_ws2", "float32")])
def test_merge_cli_weights_and_logits(name, dtype, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["merge", "--workers", "1", str(DATA / name), str(out), *config_args(name), "--dtype", dtype, "--verify"])
    assert rc == 0, capsys.readouterr().err
    want = load_file(reference(name) / "masters.safetensors")
    assert_tensors_equal(folder_tensors(out), want, dtype=getattr(torch, dtype))
    ref = torch.load(reference(name) / "logits.pt", weights_only=True)
    logits = model_logits(out, ref["input_ids"])
    if dtype == "float32":
        torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)
    else:
        assert (logits - ref["logits"]).abs().max() < 0.1
    provenance = json.loads((out / "hf_merge.json").read_text())
    assert provenance["verification"]["passed"]
    assert "deepspeed" in json.dumps(provenance)


def test_trainer_root_newest_checkpoint_and_tag(tmp_path, capsys):
    root = DATA / "z2_bf16_trainer_ws2"
    assert detect(root).chosen.name == "deepspeed"
    with open_checkpoint(root) as ck:
        assert ck.info.notes[0].startswith("using checkpoint-2 (the newest of 2")
        assert ck.info.hf_dir == root / "checkpoint-2"
    out = tmp_path / "step1"
    assert main(["merge", "--workers", "1", str(root), str(out), "--tag", "global_step1", "--dtype", "float32", "--verify"]) == 0
    assert_tensors_equal(folder_tensors(out), load_file(reference("z2_bf16_trainer_ws2", 1) / "masters.safetensors"))
    assert "using checkpoint-1 (it holds tag global_step1)" in capsys.readouterr().err
    with pytest.raises(SourceNotFoundError, match="global_step9"):
        open_checkpoint(root, tag="global_step9")
    tag_dir = root / "checkpoint-1" / "global_step1"  # a tag folder given directly
    with open_checkpoint(tag_dir) as ck:
        assert ck.info.path == tag_dir and ck.info.details["tag"] == "global_step1"
        assert torch.equal(ck.read("model.norm.weight"), load_file(reference("z2_bf16_trainer_ws2", 1) / "masters.safetensors")["model.norm.weight"])


def test_inspect_tag_and_source_weights(capsys):
    """inspect takes merge's --tag and --source-weights: it describes the tag that merge would read."""
    root = DATA / "z2_bf16_trainer_ws2"
    assert main(["inspect", str(root), "--tag", "global_step1", "--source-weights", "module", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tag"] == "global_step1" and report["step"] == 1 and report["source_weights"] == "module"
    assert report["dtypes"] == {"bfloat16": report["parameters"]}
    assert main(["inspect", str(root)]) == 0
    assert "global_step2" in capsys.readouterr().out


def test_merge_module_weights(tmp_path, capsys):
    out = tmp_path / "module"
    rc = main(["merge", "--workers", "1", str(DATA / "z2_bf16_trainer_ws2"), str(out), "--source-weights", "module", "--dtype", "auto", "--verify"])
    assert rc == 0, capsys.readouterr().err
    assert_tensors_equal(folder_tensors(out), load_file(reference("z2_bf16_trainer_ws2") / "module.safetensors"))
    with pytest.raises(UnsupportedCheckpointError, match="stage 3"):
        open_checkpoint(DATA / "z3_fp32_ws3", source_weights="module")


@pytest.mark.parametrize("how", ["keywords", "source_options"])
def test_from_sharded_pretrained_takes_tag_and_source_weights(how):
    """merge's --tag / --source-weights as from_sharded_pretrained's keyword arguments (or its
    source_options, as merge's), not config overrides the model's __init__ refuses."""
    from transformers import AutoModelForCausalLM

    import hf_merge  # noqa: F401 - installs from_sharded_pretrained

    root = DATA / "z2_bf16_trainer_ws2"
    options = dict(tag="global_step1", source_weights="module")
    given = options if how == "keywords" else {"source_options": options}
    model = AutoModelForCausalLM.from_sharded_pretrained(root, dtype="keep", **given)
    assert_tensors_equal(model.state_dict(), load_file(reference("z2_bf16_trainer_ws2", 1) / "module.safetensors"))


def test_lora_trainer_adapter_and_base_model(tmp_path, capsys):
    """PEFT + exclude_frozen_parameters: only LoRA tensors in the DeepSpeed files; --base-model fuses them."""
    name = "z2_bf16_lora_trainer_ws2"
    base = DATA / name / "reference" / "base"
    out = tmp_path / "lora"
    rc = main(["merge", "--workers", "1", str(DATA / name), str(out), "--base-model", str(base), "--config", str(base), "--dtype", "float32"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "lora_alpha=8 (from adapter_config.json)" in err
    masters = load_file(reference(name) / "masters.safetensors")
    adapter = load_file(out / "lora_adapter" / "adapter_model.safetensors")
    want = {k.replace(".default", ""): v for k, v in masters.items() if "lora_" in k}
    assert_tensors_equal(adapter, want)
    ref = torch.load(reference(name) / "logits.pt", weights_only=True)
    torch.testing.assert_close(model_logits(out, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-4)


def test_lora_trainer_base_model_gives_the_config(tmp_path, capsys):
    """A PEFT checkpoint-N holds no config.json: --base-model's is used (no --config needed), and the
    output is the merge with --config BASE; from_sharded_pretrained(base_model=) loads it alike."""
    from transformers import AutoModelForCausalLM

    import hf_merge  # noqa: F401 - installs from_sharded_pretrained

    name = "z2_bf16_lora_trainer_ws2"
    base = DATA / name / "reference" / "base"
    outs = {}
    for how, extra in (("base", []), ("config", ["--config", str(base)])):
        outs[how] = tmp_path / how
        rc = main(["merge", "--workers", "1", str(DATA / name), str(outs[how]), "--base-model", str(base), *extra])
        assert rc == 0, capsys.readouterr().err
    for rel in ("", "lora_adapter"):
        assert_tensors_equal(folder_tensors(outs["base"] / rel), folder_tensors(outs["config"] / rel))
    assert (outs["base"] / "config.json").read_text() == (outs["config"] / "config.json").read_text()
    model = AutoModelForCausalLM.from_sharded_pretrained(DATA / name, base_model=base, dtype="float32")
    ref = torch.load(reference(name) / "logits.pt", weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(model(ref["input_ids"]).logits.float(), ref["logits"], rtol=0, atol=1e-4)


def test_lora_stage3_frozen_fragments_and_from_sharded_pretrained():
    from transformers import AutoModelForCausalLM

    import hf_merge  # noqa: F401 - installs from_sharded_pretrained

    name = "z3_bf16_lora_ws2"
    model = AutoModelForCausalLM.from_sharded_pretrained(
        DATA / name, config=reference(name) / "config", dtype="float32", lora_alpha=8
    )
    ref = torch.load(reference(name) / "logits.pt", weights_only=True)
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits.float()
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-4)


# ---- bad input -------------------------------------------------------------------------------


def _copy_tag(name: str, tmp_path: Path) -> Path:
    src = DATA / name
    dst = tmp_path / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("reference"))
    return dst


def test_a_missing_or_incomplete_newest_tag_is_named_not_replaced(tmp_path, capsys):
    """`latest` naming a tag that is not here, an empty newer global_stepN (no `latest`), an HF
    Trainer checkpoint-N without its DeepSpeed files: one line names it and the complete step to
    pass, nothing written. Before: a note, and the older step merged in its place."""
    ckpt = _copy_tag("z1_fp32_ws1", tmp_path)
    step2 = ckpt / "global_step2"
    (ckpt / "latest").write_text("global_step7")  # the tag folders copied without the newest
    with pytest.raises(IncompleteStepError, match=re.escape(
            f"{ckpt / 'latest'} names global_step7, which is not here; the newest complete step is global_step2: "
            f"pass {step2} to merge it")):
        open_checkpoint(ckpt)
    (ckpt / "latest").unlink()
    (ckpt / "global_step3").mkdir()  # a save cut short before `latest` was written
    shutil.copy(step2 / "zero_pp_rank_0_mp_rank_00_optim_states.pt", ckpt / "global_step3")
    (ckpt / "stray").mkdir()  # not a step: ignored
    assert detect(ckpt).chosen.name == "deepspeed"
    config = ["--config", str(DATA / "z1_fp32_ws1" / "reference" / "step2" / "config")]
    assert main(["merge", str(ckpt), str(tmp_path / "out"), *config]) != 0
    line = capsys.readouterr().err.strip()
    assert line == f"error: {incomplete_newest_step(ckpt / 'global_step3', step2)}", line
    assert not (tmp_path / "out").exists()
    (ckpt / "latest").write_text("global_step2")  # DeepSpeed's own pointer names the complete one
    with open_checkpoint(ckpt) as ck:
        assert ck.info.details["tag"] == "global_step2"
    for given in ({"source": step2}, {"source": ckpt, "tag": "global_step2"}):  # the complete step, named
        with open_checkpoint(**given) as ck:
            assert ck.info.details["tag"] == "global_step2"

    root = tmp_path / "trainer"
    shutil.copytree(DATA / "z2_bf16_trainer_ws2", root, ignore=shutil.ignore_patterns("reference"))
    (root / "checkpoint-3").mkdir()
    shutil.copy(root / "checkpoint-2" / "config.json", root / "checkpoint-3")
    assert detect(root).chosen.name == "deepspeed"
    with pytest.raises(IncompleteStepError, match=re.escape(
            incomplete_newest_step(root / "checkpoint-3", root / "checkpoint-2"))):
        open_checkpoint(root)
    with open_checkpoint(root / "checkpoint-2") as ck:
        assert ck.info.details["tag"] == "global_step2"


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_pickle_refused_nothing_run(tmp_path, capsys):
    ckpt = _copy_tag("z1_fp32_ws1", tmp_path)
    marker = tmp_path / "ran"
    payload = _Payload()
    payload.marker = marker
    target = ckpt / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 1, "x": payload}}, target)
    with pytest.raises(UnsafeCheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        open_checkpoint(ckpt)
    assert main(["merge", "--workers", "1", str(ckpt), str(tmp_path / "out"), *config_args("z1_fp32_ws1")]) != 0
    err = capsys.readouterr().err
    assert len([ln for ln in err.splitlines() if ln.startswith("error: ")]) == 1 and "Traceback" not in err
    assert not marker.exists()


def test_truncated_and_missing_rank_files(tmp_path):
    ckpt = _copy_tag("z2_fp32_rr_tied_ws3", tmp_path)
    tag = ckpt / "global_step2"
    f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        open_checkpoint(ckpt)
    f.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"rank\(s\) \[1\]"):
        open_checkpoint(ckpt)
    (tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match="saved by 3 ranks"):
        open_checkpoint(ckpt)


@pytest.mark.parametrize("name, lacking", [
    ("z2_bf16_align_ws3", "mp_rank_00_model_states.pt"),
    ("z3_fp32_ws3", "zero_pp_rank_0_mp_rank_00_model_states.pt, zero_pp_rank_1_mp_rank_00_model_states.pt, "
                    "zero_pp_rank_2_mp_rank_00_model_states.pt"),
])
@pytest.mark.parametrize("backend", ["auto", "deepspeed"])
def test_a_step_folder_without_its_model_states_names_them(name, lacking, backend, tmp_path, capsys):
    """Before, a tag folder whose *model_states.pt were gone was no DeepSpeed folder at all: `not a
    checkpoint hf-merge recognises`, or with --backend deepspeed `pass the folder
    engine.save_checkpoint wrote (it holds latest and global_stepN/)`, though it held both."""
    ckpt = _copy_tag(name, tmp_path)
    for f in (ckpt / "global_step2").glob("*model_states.pt"):
        f.unlink()
    with pytest.raises(CorruptCheckpointError, match=f"global_step2 lacks {lacking} "):
        open_checkpoint(ckpt, backend=backend)
    code = main(["merge", str(ckpt), str(tmp_path / "o"), "--backend", backend, *config_args(name)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert f"lacks {lacking} " in lines[0] and "without its model_states is incomplete" in lines[0], lines[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["z3_fp32_ws3", "z2_bf16_align_ws3"])
def test_row_runs_equal_full_reads(name):
    """The writer's fast path (runs of rows, zero-copy per rank piece) gives what read_into gives."""
    with open_checkpoint(DATA / name) as ck:
        fast = 0
        for key, spec in ck.specs().items():
            runs = ck.read_rows(key, torch.bfloat16, max_bytes=256)  # tiny runs: several per piece
            if runs is None:
                continue
            fast += 1
            out, expected_first = torch.empty(spec.shape, dtype=torch.bfloat16), 0
            for first, piece in runs:
                rows = values(piece)
                assert first == expected_first
                out[first : first + len(rows)] = rows
                expected_first = first + len(rows)
            assert expected_first == spec.shape[0] and torch.equal(out, ck.read(key, torch.bfloat16)), key
        assert fast > len(ck.specs()) // 2


@pytest.mark.parametrize("name", ["z3_fp32_ws3", "z1_bf16_tied_ws2"])
def test_a_damaged_parameter_name_is_refused(name, tmp_path):
    # A one-byte change of a parameter name in model_states (found by the fuzz harness: the merge
    # wrote the master weight under the damaged name). Every spelling of the name in the file,
    # whether in the module state dict or in param_shapes, must be refused.
    ckpt = _copy_tag(name, tmp_path)
    target = min(ckpt.rglob("*mp_rank_00_model_states.pt"), key=lambda p: (len(p.name), p.name))  # rank 0's (the names)
    pristine = target.read_bytes()
    needle = b"model.layers.0.post_attention_layernorm.weight"
    hits = [i for i in range(len(pristine)) if pristine.startswith(needle, i)]
    assert len(hits) >= 2  # the module state dict and param_shapes
    for at in hits:
        damaged = bytearray(pristine)
        damaged[at + 2] = ord("^")
        target.write_bytes(bytes(damaged))
        with pytest.raises(CorruptCheckpointError, match="damaged"):
            open_checkpoint(ckpt)
