"""The format registry: every reader registers itself once; detection says what it saw."""

from __future__ import annotations

import json

import pytest

import hf_merge
from hf_merge.readers import formats
from hf_merge.errors import SourceNotFoundError, UnsupportedCheckpointError


def test_registry_lists_every_reader_module_with_a_format():
    names = formats.format_names()
    assert {"fsdp", "megatron", "hf"} <= set(names)
    for fmt in formats.registry().values():
        assert fmt.description and callable(fmt.probe) and callable(fmt.open)


def test_cli_backend_choices_come_from_the_registry():
    from hf_merge.cli.app import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command in ("merge", "inspect", "verify"):
        backend = next(a for a in sub.choices[command]._actions if a.dest == "backend")
        assert list(backend.choices) == ["auto", *formats.format_names()]


def test_detect_fsdp_and_provenance_label(qwen2_fp32_ws2, tmp_path):
    det = formats.detect(qwen2_fp32_ws2.root)
    assert det.chosen.name == "fsdp" and det.matched == ("fsdp",) and det.note is None
    with hf_merge.open_checkpoint(qwen2_fp32_ws2.root) as ckpt:
        assert ckpt.info.reader == "fsdp" and ckpt.info.format == "fsdp"


def test_two_matching_formats_are_reported(qwen2_fp32_ws2, tmp_path):
    # an actor folder that also holds a safetensors copy of the model at its top level
    import shutil

    actor = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, actor)
    for f in qwen2_fp32_ws2.reference.iterdir():
        if f.name.endswith(".safetensors") or f.name == "config.json":
            shutil.copy(f, actor / f.name)
    det = formats.detect(actor)
    assert det.chosen.name == "fsdp" and det.matched == ("fsdp", "hf")
    assert "--backend hf" in det.note
    with hf_merge.open_checkpoint(actor) as ckpt:
        assert any("also looks like hf" in n for n in ckpt.info.notes)
    with hf_merge.open_checkpoint(actor, backend="hf") as ckpt:
        assert ckpt.info.reader == "hf"


def test_nothing_matches_says_what_is_there(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "notes").mkdir()
    with pytest.raises(UnsupportedCheckpointError, match=r"holds notes/, weights.bin\); it reads: fsdp"):
        formats.detect(tmp_path)
    with pytest.raises(SourceNotFoundError):
        formats.detect(tmp_path / "missing")
    with pytest.raises(UnsupportedCheckpointError, match="unknown format 'zero'"):
        hf_merge.open_checkpoint(tmp_path, backend="zero")


def test_options_go_only_to_formats_that_declare_them(qwen2_fp32_ws2):
    # is_value_model is a Megatron option: the FSDP reader never sees it
    with hf_merge.open_checkpoint(qwen2_fp32_ws2.root, is_value_model=True) as ckpt:
        assert ckpt.info.reader == "fsdp"


def test_probes_read_no_pickles(qwen2_fp32_ws2, tmp_path, monkeypatch):
    import pickle

    import torch

    def refuse(*a, **k):
        raise AssertionError("a probe unpickled something")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    for fmt in formats.registry().values():
        fmt.probe(qwen2_fp32_ws2.root)
        fmt.probe(tmp_path)
    json.dumps(formats.format_names())


def test_declared_literals_equal_the_registry_and_import_no_reader():
    import subprocess
    import sys

    fields = ("name", "description", "priority", "aliases", "cli", "hf_folder", "marks")
    declared = [tuple(getattr(d, k) for k in fields) for d in formats.declared()]
    assert declared == [tuple(getattr(f, k) for k in fields) for f in formats.registry().values()]
    code = "import sys, hf_merge.readers.formats as f; f.format_names(); f.declared(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_one_name_per_format_and_the_old_spellings_are_aliases(qwen2_fp32_ws2, tmp_path):
    """The format's name is what --backend takes and what CheckpointInfo.format, hf_merge.json and
    inspect say; the names earlier releases wrote are accepted on input. The safetensors header
    keeps the label it had, so weight files stay byte-identical."""
    from safetensors import safe_open

    from hf_merge.cli.app import build_parser

    every = [n for d in formats.declared() for n in (d.name, *d.aliases)]
    assert len(every) == len(set(every))
    assert formats.canonical("verl-fsdp") == "fsdp" and formats.canonical("accelerate-fsdp") == "accelerate"
    assert formats.canonical("torchtitan-dcp") == "torchtitan" and formats.canonical("auto") == "auto"
    with hf_merge.open_checkpoint(qwen2_fp32_ws2.root, backend="verl-fsdp") as ckpt:
        assert ckpt.info.reader == ckpt.info.format == "fsdp"
    args = build_parser().parse_args(["merge", str(qwen2_fp32_ws2.root), str(tmp_path / "o"), "--backend", "verl-fsdp"])
    assert args.backend == "fsdp"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["merge", "a", "b", "--backend", "zero"])
    hf_merge.merge(qwen2_fp32_ws2.root, tmp_path / "merged")
    assert json.loads((tmp_path / "merged" / "hf_merge.json").read_text())["source"]["format"] == "fsdp"
    shard = next((tmp_path / "merged").glob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:  # the header's metadata is save_pretrained's: provenance is in hf_merge.json
        assert f.metadata() == {"format": "pt"}


def test_formats_declare_their_cli_options():
    """DeepSpeed's --tag / --source-weights come from its FORMAT declaration, in merge and inspect."""
    from hf_merge.cli._formats import source_options
    from hf_merge.cli.app import build_parser

    declared = {o.flag: (d.name, o) for d in formats.declared() for o in d.cli}
    assert {"--tag", "--source-weights"} <= set(declared)
    for flag, (name, option) in declared.items():
        assert option.dest in formats.registry()[name].options
    parser = build_parser()
    for command in ("merge", "inspect"):
        argv = [command, "src"] + (["dst"] if command == "merge" else []) + ["--tag", "t1", "--source-weights", "module"]
        args = parser.parse_args(argv)
        assert source_options(args) == {"tag": "t1", "source_weights": "module"}
    with pytest.raises(ValueError, match="set no option"):
        formats.SourceFormat("x", "x", probe=bool, open=print, cli=(formats.CliOption("--y", "y", "y"),))


def test_is_value_model_note_follows_the_format_options(qwen2_fp32_ws2, tmp_path, caplog):
    """--is-value-model is an option of the formats that declare it (Megatron); elsewhere merge says it changes nothing."""
    import logging

    with caplog.at_level(logging.INFO, logger="hf_merge"):
        hf_merge.merge(qwen2_fp32_ws2.root, tmp_path / "m", is_value_model=True,
                       source_options={"tag": "global_step2", "source_weights": "module"})
    # before: "FSDP critics are saved ..." whatever the format, and DeepSpeed's options ignored without a word
    assert "--is-value-model changes nothing here: fsdp checkpoints hold a critic's tensors under their Hugging " \
           "Face names already" in caplog.text
    assert "--tag changes nothing here: the fsdp reader takes no such option (deepspeed does)" in caplog.text
    assert "--source-weights changes nothing here: the fsdp reader takes no such option (deepspeed does)" in caplog.text


def test_marks_hide_no_format_in_any_fixture_folder(qwen2_fp32_ws2, tmp_path):
    """detect() probes only the formats whose marks are in the folder; in every folder of every
    checkpoint under tests/data (ColossalAI, DeepSpeed, universal, every torch release's FSDP /
    HSDP / DCP cells) and of a verl FSDP checkpoints root, it matches what asking every probe does."""
    from pathlib import Path

    from helpers import detections_differing_from_every_probe

    assert detections_differing_from_every_probe(Path(__file__).parent / "data") == []
    assert detections_differing_from_every_probe(qwen2_fp32_ws2.root) == []


def test_a_plain_fsdp_merge_imports_only_what_it_uses(qwen2_fp32_ws2, tmp_path):
    """A dense verl FSDP merge (no --verify, no --push-to-hub, no LoRA) of the checkpoint root, in a
    fresh interpreter with an empty plan cache, imports no other format's reader or name table, no
    LoRA transform, no verification and no Hub upload module; nor torch.distributed's tensor /
    checkpoint packages (the rank files are read through stand-ins, test_rank_records.py); nor
    transformers: for an untied dense model the Hub-layout decision ("as stored") is made from
    transformers' declarations read from its source (conversion_keys.py), then stored in the plan
    cache. Detection is part of the merge: a plain verl FSDP folder's detection imports the FSDP
    reader only, as the other formats' marks (file names) are not there. One fresh interpreter
    checks all of it; the bytes equal those of the same merge in this process, where transformers
    is imported and asked."""
    from helpers import assert_tensors_equal, folder_tensors, fresh_merge_imports, read_json, run_cli

    mods = [d.module for d in formats.declared() if d.name != "fsdp"] + [
        "hf_merge.transforms.name_table", "hf_merge.transforms.lora", "hf_merge.verification", "hf_merge.publish.hub",
        "torch.distributed.tensor", "torch.distributed.checkpoint", "transformers",
    ]
    cache = tmp_path / "cache"
    argv = ["merge", qwen2_fp32_ws2.root, tmp_path / "out"]
    result = fresh_merge_imports(argv, mods, hub_layout=True, env={"HF_MERGE_CACHE": str(cache)})
    assert result == {"code": 0, **dict.fromkeys(mods, False)}
    assert read_json(tmp_path / "out" / "hf_merge.json")["source"]["format"] == "fsdp"
    assert list((cache / "hub_layout").glob("*.json"))  # the passthrough plan, stored
    assert run_cli("merge", qwen2_fp32_ws2.root, tmp_path / "asked").returncode == 0  # HF_MERGE_CACHE=off here
    assert_tensors_equal(folder_tensors(tmp_path / "out"), folder_tensors(tmp_path / "asked"))


@pytest.mark.parametrize("backend", ["megatron", "deepspeed", "accelerate", "colossalai", "torchtitan", "dcp", "hf"])
def test_a_wrong_backend_names_the_format_the_folder_has(backend, qwen2_fp32_ws2, tmp_path, capsys):
    """A verl FSDP checkpoint opened with another ``--backend``. Before, each reader said only what
    it missed, some of it wrong for the user: `dcp`/`torchtitan`/`accelerate` asked for --config
    (the config was there; the format was not), `colossalai` said it "holds ColossalAI shard files
    ()", `hf` said "no *.safetensors files" with nothing to do. Now the line also names the
    format detected and the flag that reads it."""
    from hf_merge.cli.app import main

    code = main(["merge", str(qwen2_fp32_ws2.root), str(tmp_path / "o"), "--backend", backend])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"{qwen2_fp32_ws2.root} is in the fsdp format, not {backend}: pass --backend fsdp or leave --backend out ({backend}: " in lines[0]
    assert "()" not in lines[0] and not (tmp_path / "o").exists()


def _wrong_backend_sources(dcp_root, megatron_root):
    tt, meg = dcp_root / "torchtitan", megatron_root / "qwen2_v1" / "actor"
    return {
        "torchtitan": (tt / "dump" / "checkpoint" / "step-1", ["--config", str(tt / "config")]),
        "megatron": (meg / "dist_ckpt", ["--config", str(meg / "huggingface")]),
        "dcp": (dcp_root / "dcp_plain" / "ckpt", []),
    }


@pytest.mark.parametrize("found, backend", [("torchtitan", "dcp"), ("megatron", "dcp"), ("dcp", "accelerate"), ("dcp", "torchtitan")])
def test_a_wrong_backend_on_a_dcp_folder_is_refused_in_one_short_line(found, backend, dcp_root, megatron_root, tmp_path, capsys):
    """Before, `--backend dcp` on a torchtitan step folder or a Megatron dist_ckpt wrote that
    framework's names (`layers.0.attention.qkv_linear.wk.weight`, `decoder.layers.mlp.linear_fc1.weight`),
    which from_pretrained left unloaded (random weights); `--backend accelerate` on a plain DCP folder
    stripped the state dict's own `model.` (`embed_tokens.weight`); `--backend torchtitan` on it listed
    12 names and was cut at 600 characters. Now each is one short line naming the format and the flag."""
    from hf_merge.cli.app import main

    source, extra = _wrong_backend_sources(dcp_root, megatron_root)[found]
    code = main(["merge", str(source), str(tmp_path / "o"), "--backend", backend, *extra])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"{source} is in the {found} format, not {backend}: pass --backend {found} or leave --backend out" in lines[0]
    assert "message cut" not in lines[0] and len(lines[0]) < 420 + len(str(source)), lines[0]
    assert not (tmp_path / "o").exists()
    if backend == "torchtitan":  # a few names, the rest counted, and what the table expected
        assert "and 17 more" in lines[0] and "torchtitan names look like layers.0." in lines[0], lines[0]


def test_a_generic_backend_still_reads_a_folder_the_specific_one_cannot(dcp_root, tmp_path, capsys):
    """A plain DCP folder saved as ``step-5`` is a torchtitan step to detection, and the torchtitan
    reader refuses its names: ``--backend dcp`` reads it, as it reads the folder under its own name."""
    import shutil

    from helpers import assert_tensors_equal, folder_tensors
    from hf_merge.cli.app import main

    step = shutil.copytree(dcp_root / "dcp_plain" / "ckpt", tmp_path / "run" / "step-5")
    assert formats.detect(step).chosen.name == "torchtitan"
    # auto: the torchtitan reader's refusal names the other format that matched (before: it did not)
    assert main(["merge", str(step), str(tmp_path / "auto")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: ") and "\n" not in line and line.endswith(
        "(this folder also looks like dcp: pass --backend dcp if it is not a torchtitan checkpoint)"), line
    assert not (tmp_path / "auto").exists()
    assert main(["merge", str(step), str(tmp_path / "o"), "--backend", "dcp"]) == 0, capsys.readouterr().err
    assert main(["merge", str(dcp_root / "dcp_plain" / "ckpt"), str(tmp_path / "plain")]) == 0
    assert_tensors_equal(folder_tensors(tmp_path / "o"), folder_tensors(tmp_path / "plain"))


def test_a_hugging_face_folders_tensors_are_runs_of_its_files(tmp_path):
    """Each tensor of a safetensors folder, in its own dtype, is one run of its file (placed by
    the header: a merge copies it file to file, a load maps it), whatever its dtype and offset;
    values, ``read_into`` and a cast's row runs are what ``safetensors`` reads."""
    import torch
    from safetensors.torch import load_file, save_file

    from hf_merge.readers.file_runs import FileRun, values
    from hf_merge.readers.hf_dir import open_hf_dir

    tensors = {"a.weight": torch.randn(3, 5).to(torch.bfloat16), "b.bias": torch.randn(7),
               "c.weight": torch.randn(4, 3).to(torch.float16), "d.index": torch.arange(5), "e.x": torch.randn(2, 2)}
    save_file(dict(list(tensors.items())[:3]), tmp_path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(dict(list(tensors.items())[3:]), tmp_path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {k: f"model-0000{1 + (i >= 3)}-of-00002.safetensors" for i, k in enumerate(tensors)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text("{}")
    want = {**load_file(tmp_path / "model-00001-of-00002.safetensors"), **load_file(tmp_path / "model-00002-of-00002.safetensors")}
    ckpt = open_hf_dir(tmp_path)
    try:
        for name, spec in ckpt.specs().items():
            (first, run), = ckpt.read_rows(name, spec.dtype)
            assert first == 0 and isinstance(run, FileRun) and torch.equal(values(run), want[name]), name
            out = torch.empty(spec.shape, dtype=spec.dtype)
            ckpt.read_into(name, out)
            assert torch.equal(out, want[name]), name
            if spec.dtype.is_floating_point:
                cast = [values(p).clone() for _, p in ckpt.read_rows(name, torch.float64)]
                assert torch.equal(torch.cat(cast), want[name].double()), name
    finally:
        ckpt.close()
