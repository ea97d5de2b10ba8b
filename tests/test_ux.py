"""What a new user stumbles on (issue 16): dtype in config.json and in every report, adapter and
HSDP verification, verl's spellings (`hf merge --backend ...`, `test`, `--target_dir .../huggingface`),
argument parsing, plain progress in logs, missing tokenizer, failed push, inspect's table.

CLI checks run in-process (``hf_merge.cli.app.main``): the process boundary is not what they test.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import folder_tensors, read_json
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_hub import TOKEN, hub, inproc  # noqa: F401 - the Hub stand-in fixtures

import hf_merge
from hf_merge.cli import app
from hf_merge.transformers_compat import has_weight_conversions


@pytest.fixture(autouse=True)
def _restore_logging():
    """app.main points the hf_merge logger at this test's captured stderr: undo it afterwards."""
    log = logging.getLogger("hf_merge")
    saved = log.handlers[:], log.level, log.propagate
    yield
    log.handlers[:], log.level, log.propagate = saved


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = app.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def usage_error(capsys, *args) -> str:
    """argparse's exit 2 with the subcommand's usage; returns stderr."""
    with pytest.raises(SystemExit) as info:
        app.main([str(a) for a in args])
    assert info.value.code == 2
    return capsys.readouterr().err


def file_dtypes(folder: Path) -> set[str]:
    dtypes = set()
    for path in Path(folder).glob("*.safetensors"):
        header_len = int.from_bytes(path.read_bytes()[:8], "little")
        header = json.loads(path.read_bytes()[8 : 8 + header_len])
        dtypes |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return dtypes


@pytest.fixture
def actor_copy(qwen2_fp32_ws2, tmp_path):
    return Path(shutil.copytree(qwen2_fp32_ws2.actor, tmp_path / "actor"))


# --- 1, 12: config.json names the dtype written; fp32 and downcasts are announced -------------


def test_dtype_auto_writes_float32_config_and_loads_float32(qwen2_fp32_ws2, tmp_path, capsys):
    target = tmp_path / "auto"
    rc, _, err = cli(capsys, "merge", qwen2_fp32_ws2.actor, target, "--dtype", "auto")
    assert rc == 0, err
    assert file_dtypes(target) == {"F32"}
    assert read_json(target / "config.json")["dtype"] == "float32"  # the source config says bfloat16
    assert read_json(target / "hf_merge.json")["dtype"] == "float32"
    assert "dtype float32); float32 is exact, --dtype bfloat16 writes half the size" in err
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)  # no dtype given: the config's
    assert model.dtype == torch.float32
    assert "`float32` (exact; merge with `--dtype bfloat16`" in (target / "README.md").read_text()


def test_default_downcast_is_announced_and_float32_config_stays_exact(actor_copy, tmp_path, capsys):
    rc, _, err = cli(capsys, "merge", actor_copy, tmp_path / "bf16")
    assert rc == 0
    assert "holds float32 weights and its config.json says bfloat16: writing bfloat16 (one rounding per weight)" in err
    assert "dtype bfloat16)" in err and file_dtypes(tmp_path / "bf16") == {"BF16"}
    # verl 0.9.1 writes "dtype": "float32" for fp32 training: exact by default, and said so
    cfg_path = actor_copy / "huggingface" / "config.json"
    cfg = read_json(cfg_path)
    cfg_path.write_text(json.dumps({**cfg, "dtype": "float32"}))
    rc, _, err = cli(capsys, "merge", actor_copy, tmp_path / "fp32")
    assert rc == 0 and file_dtypes(tmp_path / "fp32") == {"F32"}
    assert "dtype float32); float32 is exact, --dtype bfloat16 writes half the size" in err
    assert "one rounding per weight); --dtype auto" not in err


def test_float16_overflow_is_warned_once_per_tensor(qwen2_fp32_ws2, tmp_path, capsys):
    """Before: ``--dtype float16`` of weights beyond +-65504 wrote inf without a word (as
    ``save_pretrained`` of a ``.half()`` model does); only ``verify`` said ``finite FAIL``."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen2_fp32_ws2.reference, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(1e6)  # an HF folder saved by transformers, one weight out of float16's range
    model.save_pretrained(tmp_path / "big")
    rc, _, err = cli(capsys, "merge", tmp_path / "big", tmp_path / "fp16", "--dtype", "float16")
    assert rc == 0, err
    warned = [line for line in err.splitlines() if "beyond float16's range" in line]
    assert warned == ["warning: model.norm.weight has values beyond float16's range (+-65504), written as inf; merge "
                      "with --dtype bfloat16 or float32 to keep them"], err
    assert torch.isinf(load_file(tmp_path / "fp16" / "model.safetensors")["model.norm.weight"]).any()
    rc, _, err = cli(capsys, "merge", tmp_path / "big", tmp_path / "bf16", "--dtype", "bfloat16")
    assert rc == 0 and "float16's range" not in err


def test_written_dtype_is_the_majority_of_floating_elements():
    from hf_merge.hf_files import written_dtype
    from hf_merge.spec import TensorSpec

    specs = {
        "w": TensorSpec("w", (64, 64), torch.bfloat16),
        "norm": TensorSpec("norm", (64,), torch.float32),
        "packed": TensorSpec("packed", (10_000,), torch.uint8),
    }
    dtype, counts = written_dtype(specs)
    assert dtype == torch.bfloat16 and counts == {torch.bfloat16: 4096, torch.float32: 64}
    assert written_dtype(specs, skip=lambda s: s.name == "w")[0] == torch.float32
    assert written_dtype({"p": specs["packed"]}) == (None, {})


def test_missing_base_model_name_says_how_to_set_it(actor_copy, tmp_path, capsys):
    cfg_path = actor_copy / "huggingface" / "config.json"
    cfg = read_json(cfg_path)
    del cfg["_name_or_path"]
    cfg_path.write_text(json.dumps(cfg))
    rc, _, err = cli(capsys, "merge", actor_copy, tmp_path / "m")
    assert rc == 0 and "pass --base-model-name ORG/NAME" in err
    assert "merge with `--base-model-name ORG/NAME`" in (tmp_path / "m" / "README.md").read_text()


# --- 2, 3: adapters are verified and reported with their own dtype ---------------------------


@pytest.fixture(scope="module")
def lora_both(lora_ckpt, tmp_path_factory):
    target = tmp_path_factory.mktemp("both") / "merged"
    result = hf_merge.merge(lora_ckpt.actor, target, lora="both", verify=True)
    return target, result


def test_adapter_merge_verifies_and_reports_its_dtype(lora_ckpt, tmp_path, capsys):
    target = tmp_path / "adapter"
    rc, _, err = cli(capsys, "merge", lora_ckpt.actor, target, "--lora", "adapter", "--verify")
    assert rc == 0, err
    prov = read_json(target / "hf_merge.json")
    assert prov["verification"]["passed"] is True and prov["dtype"] == "float32"
    assert prov["lora"]["adapter_dtype"] == "float32" and file_dtypes(target) == {"F32"}
    assert "wrote the LoRA adapter" in err and "dtype float32" in err and "bfloat16" not in err.split("wrote")[-1]
    assert "`float32`" in (target / "README.md").read_text()
    # the adapter equals PEFT's own save_pretrained, and verify checks it against the source
    want = load_file(lora_ckpt.reference_adapter / "adapter_model.safetensors")
    got = load_file(target / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)
    rc, out, _ = cli(capsys, "verify", target, "--against", lora_ckpt.actor)
    assert rc == 0, out
    assert re.search(r"^adapter_config.json +ok", out, re.M) and "bit-exact" in out


def test_verify_adapter_detects_a_changed_lora_b_and_config(lora_ckpt, tmp_path, capsys):
    target = tmp_path / "adapter"
    hf_merge.merge(lora_ckpt.actor, target, lora="adapter")
    path = target / "adapter_model.safetensors"
    tensors = load_file(path)
    name = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = read_json(target / "adapter_config.json")
    (target / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 99}))
    rc, out, err = cli(capsys, "verify", target, "--against", lora_ckpt.actor)
    assert rc == 1
    assert f"{name}: not bit-identical" in out
    assert "adapter_config.json: lora_alpha is 99, the checkpoint gives 8" in out


def test_both_merge_verifies_the_adapter_folder_too(lora_both, lora_ckpt, tmp_path, capsys):
    target, result = lora_both
    assert result.provenance["verification"]["passed"]
    assert result.adapter["dtype"] == "float32" and result.adapter["tensors"] == 2 * 7 * 2
    from hf_merge.cli.merge import summary_line

    line = summary_line(result)
    assert f"and its LoRA adapter {target / 'lora_adapter'} (28 tensors, " in line and "kB" in line and "0.00 GB" not in line
    bad = Path(shutil.copytree(target, tmp_path / "bad"))
    path = bad / "lora_adapter" / "adapter_model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = -tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})
    rc, out, _ = cli(capsys, "verify", bad, "--against", lora_ckpt.actor)
    assert rc == 1
    assert "values" in out and f"adapter: {name}: not bit-identical" in out
    # the adapter's files are recorded too: only the changed one fails its checksum
    assert "lora_adapter/adapter_model.safetensors: crc32 differs" in out and re.search(r"^file checksums +FAIL +1 changed", out, re.M)


def test_quantized_summary_names_the_mode_and_int8_forward_is_quiet(qwen2_fp32_ws2, tmp_path, capsys, caplog):
    pytest.importorskip("bitsandbytes")
    rc, _, err = cli(capsys, "merge", qwen2_fp32_ws2.actor, tmp_path / "q", "--quantize", "int8")
    assert rc == 0, err
    assert "int8 (bitsandbytes), other tensors bfloat16)" in err
    assert "`int8` weights (bitsandbytes), other tensors `bfloat16`" in (tmp_path / "q" / "README.md").read_text()
    # a forward pass of the int8 model in float32: bitsandbytes' cast notice, once per layer and
    # pass (12 int8 linears here), reaches the user at most once
    with caplog.at_level(logging.WARNING, logger="bitsandbytes"):
        rc, out, err = cli(capsys, "verify", tmp_path / "q", "--against", qwen2_fp32_ws2.actor, "--logits")
    assert rc == 0, out + err
    assert re.search(r"^logits finite +ok", out, re.M)
    casts = [r for r in caplog.records if r.getMessage().startswith("MatMul8bitLt")] + [
        ln for ln in err.splitlines() if "MatMul8bitLt" in ln]
    assert len(casts) <= 1


def test_kernel_download_notice_is_dropped(caplog):
    """bitsandbytes' own logger and message (logged at import on AVX512-BF16 CPUs without `kernels`)."""
    from hf_merge._quiet import quiet_bitsandbytes

    quiet_bitsandbytes()
    with caplog.at_level(logging.WARNING, logger="bitsandbytes"):
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
            "`pip install kernels` and the kernels >= 0.11.1", "No module named 'kernels'")
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


# --- 4: verl drop-in ------------------------------------------------------------------------


def test_hf_extension_spelling_implies_merge_and_flags_say_they_change_nothing(qwen2_fp32_ws2, tmp_path, capsys):
    # `hf merge --backend fsdp ...` runs `hf-merge --backend fsdp ...`
    rc, _, err = cli(
        capsys, "--backend", "fsdp", "--local_dir", qwen2_fp32_ws2.actor, "--target_dir", tmp_path / "m",
        "--tie-word-embedding", "--trust-remote-code", "--is-value-model", "--use_cpu_initialization",
    )
    assert rc == 0, err
    notes = [ln for ln in err.splitlines() if "changes nothing" in ln]
    assert len(notes) == 4, err
    assert all(len(ln) < 200 for ln in notes)
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_merge_into_verls_actor_huggingface_keeps_its_files(actor_copy, qwen2_fp32_ws2, capsys):
    hf = actor_copy / "huggingface"
    (hf / "chat_template.jinja").write_text("{{ messages }}")
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    rc, _, err = cli(capsys, "merge", "--backend", "fsdp", "--local_dir", actor_copy, "--target_dir", hf)
    assert rc == 0, err
    assert "holds config/tokenizer files only: merging into it" in err
    for name, data in before.items():
        if name != "config.json":
            assert (hf / name).read_bytes() == data, name
    assert read_json(hf / "config.json")["architectures"] == ["Qwen2ForCausalLM"]
    ref = folder_tensors(qwen2_fp32_ws2.reference)
    got = folder_tensors(hf)
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k].to(torch.bfloat16)) for k in ref)
    # now it holds weights: a second merge is refused as for any model folder
    rc, _, err = cli(capsys, "merge", actor_copy, hf)
    assert rc == 2 and "pass --overwrite" in err


def test_local_dir_with_one_positional_takes_it_as_the_target(qwen2_fp32_ws2, tmp_path, capsys):
    """`hf-merge merge --local_dir X ./merged`: before, "both SOURCE and --local_dir given; pass one"
    (./merged was read as SOURCE). The one positional is the target, as `X --target_dir Y` makes it the source."""
    rc, _, err = cli(capsys, "merge", "--local_dir", qwen2_fp32_ws2.actor, tmp_path / "m")
    assert rc == 0 and (tmp_path / "m" / "model.safetensors").is_file(), err
    rc, _, err = cli(capsys, "merge", qwen2_fp32_ws2.root, tmp_path / "x", "--local_dir", qwen2_fp32_ws2.actor)
    assert rc == 2 and "both SOURCE and --local_dir given; pass one" in err


def test_options_that_change_nothing_here_say_so(qwen2_fp32_ws2, tmp_path, capsys):
    """--dist-writers without torchrun and --max-shard-size with --gguf were taken without a word
    (and given as their defaults, node and 5GB, they still were)."""
    for writers in ("rank", "node"):
        rc, _, err = cli(capsys, "merge", qwen2_fp32_ws2.actor, tmp_path / writers, "--dist-writers", writers)
        assert rc == 0 and f"note: --dist-writers {writers} changes nothing without torchrun" in err, err
    pytest.importorskip("gguf")
    for size in ("100kB", "5GB"):
        rc, _, err = cli(capsys, "merge", qwen2_fp32_ws2.actor, tmp_path / size, "--gguf", "f16", "--gguf-pre-tokenizer",
                         "gpt-2", "--max-shard-size", size)
        assert rc == 0 and "note: --max-shard-size changes nothing with --gguf" in err, err
    rc, _, err = cli(capsys, "merge", qwen2_fp32_ws2.actor, tmp_path / "w", "--gguf", "f16", "--gguf-pre-tokenizer",
                     "gpt-2", "--workers", "2")
    assert rc == 0 and "note: --workers changes nothing with --gguf" in err, err
    rc, _, err = cli(capsys, "merge", qwen2_fp32_ws2.actor, tmp_path / "p", "--private", "--gguf-pre-tokenizer", "gpt-2")
    assert rc == 0 and "note: --private changes nothing without --push-to-hub" in err, err
    assert "note: --gguf-pre-tokenizer changes nothing without --gguf" in err, err
    rc, _, err = cli(capsys, "merge", qwen2_fp32_ws2.actor, tmp_path / "c")
    assert rc == 0 and "changes nothing" not in err, err


def test_verl_test_subcommand(qwen2_fp32_ws2, tmp_path, capsys):
    ref = qwen2_fp32_ws2.reference
    rc, out, err = cli(capsys, "test", "--backend", "fsdp", "--local_dir", qwen2_fp32_ws2.actor, "--test_hf_dir", ref)
    assert rc == 0, out + err
    assert "values" in out and "max abs diff 0" in out
    bad = Path(shutil.copytree(ref, tmp_path / "ref"))
    tensors = load_file(bad / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    rc, out, err = cli(capsys, "test", "--backend", "fsdp", "--local_dir", qwen2_fp32_ws2.actor, "--test_hf_dir", bad)
    assert rc == 1 and "model.norm.weight: max abs diff" in out and "does not match" in err
    # a mistyped folder: one line saying which and what to pass (before: "error: X is not a folder")
    for args, needle in (
        (("--local_dir", qwen2_fp32_ws2.actor, "--test_hf_dir", tmp_path / "nope"), "pass the reference Hugging Face folder"),
        (("--local_dir", tmp_path / "nope", "--test_hf_dir", ref), "pass the checkpoint's actor/ or global_step_N folder"),
    ):
        rc, out, err = cli(capsys, "test", "--backend", "fsdp", *args)
        assert rc == 2 and err.count("error: ") == 1 and f"{tmp_path / 'nope'} does not exist; {needle}" in err, err


def test_help_texts(capsys):
    parser = app.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        assert p.description, name
        for action in p._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    with pytest.raises(SystemExit):
        app.main(["merge", "--help"])
    out = capsys.readouterr().out
    assert "--use_cpu_initialization" in out and "bf16" in out
    # `hf-merge --help` names every source family the README does (it said verl FSDP / Megatron only)
    for family in ("verl FSDP", "Megatron", "DeepSpeed", "accelerate", "torchtitan", "PyTorch DCP", "ColossalAI", "GGUF"):
        assert family in parser.description, family


def test_readme_merge_table_and_merge_help_name_the_same_options(capsys):
    """The README says its `merge` option table is all of them, as `hf-merge merge --help` says.
    Before: `-q` (in the table, "anywhere") was missing from `merge --help`."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme.split("`hf-merge merge [SOURCE] [TARGET]` options", 1)[1].split("\n\n", 2)[1]
    in_readme = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", "\n".join(ln.split(" | ")[0] for ln in table.splitlines())))
    with pytest.raises(SystemExit):
        app.main(["merge", "--help"])
    help_text = capsys.readouterr().out
    parser = next(a for a in app.build_parser()._actions if a.dest == "command").choices["merge"]
    in_help = {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}
    assert in_readme - {"--hf_model_path", "--hf_upload_path"} <= in_help, in_readme - in_help
    assert all(o in help_text for o in in_readme), [o for o in in_readme if o not in help_text]
    firsts = {a.option_strings[0] for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"}
    assert firsts <= in_readme, firsts - in_readme


# --- 5: arguments ---------------------------------------------------------------------------


def test_sizes_and_dtype_aliases_are_parsed_before_anything_is_read(qwen2_fp32_ws2, tmp_path, capsys):
    err = usage_error(capsys, "merge", tmp_path / "does-not-exist", tmp_path / "o", "--max-shard-size", "2X")
    assert "usage: hf-merge merge" in err and "cannot read the size '2X'" in err and "Traceback" not in err
    err = usage_error(capsys, "merge", tmp_path / "x", tmp_path / "o", "--dtype", "bfloat")
    assert "unknown dtype 'bfloat' (did you mean bfloat16?)" in err
    for flag, value in (("--workers", "0"), ("--workers", "-2"), ("--workers", "two")):
        err = usage_error(capsys, "merge", tmp_path / "x", tmp_path / "o", flag, value)
        assert f"{value!r} is not a whole number of at least 1" in err and "Traceback" not in err, err
    target = tmp_path / "m"
    rc, _, err = cli(capsys, "merge", qwen2_fp32_ws2.actor, target, "--max-shard-size", "150kB", "--dtype", "fp32")
    assert rc == 0, err
    index = read_json(target / "model.safetensors.index.json")
    assert len(set(index["weight_map"].values())) > 1 and file_dtypes(target) == {"F32"}
    from hf_merge.write.plan import parse_size

    assert [parse_size(s) for s in ("2G", "2GB", "2gb", "1.5GB", "4GiB", "500M", "123")] == [
        2 * 10**9, 2 * 10**9, 2 * 10**9, 1_500_000_000, 4 * 2**30, 500 * 10**6, 123]


def test_misspelled_flag_gets_a_suggestion_and_the_subcommand_usage(tmp_path, capsys):
    err = usage_error(capsys, "merge", tmp_path / "a", tmp_path / "b", "--max-shard-sise", "2G")
    assert "usage: hf-merge merge" in err
    assert "unrecognized argument --max-shard-sise (did you mean --max-shard-size?)" in err
    err = usage_error(capsys, "verify", tmp_path / "a", "--againts", tmp_path / "b")
    assert "usage: hf-merge verify" in err and "did you mean --against?" in err


# --- 6: progress in logs ----------------------------------------------------------------------


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(qwen2_fp32_ws2, tmp_path, capsys, monkeypatch):
    from hf_merge import progress

    monkeypatch.setattr(progress, "PLAIN_INTERVAL", 0.0)  # a line per update
    rc, _, err = cli(capsys, "merge", qwen2_fp32_ws2.actor, tmp_path / "m", "--max-shard-size", "150kB", "--workers", "1")
    assert rc == 0 and "\r" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("note: Merging: ")]
    assert lines and lines[-1].startswith("note: Merging: 100% (") and "B of " in lines[-1]


def test_plain_progress_is_periodic():
    from hf_merge.progress import PlainProgress

    now = [0.0]
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    log = logging.getLogger("hf_merge.progress")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        bar = PlainProgress(total=3_000_000, desc="Merging", interval=30, clock=lambda: now[0])
        for t in (1, 10, 31, 40, 62):
            now[0] = t
            bar.update(500_000)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    assert records == ["Merging: 50% (1.5 MB of 3 MB)", "Merging: 83% (2.5 MB of 3 MB)"]


# --- 7, 8: missing tokenizer, failed push ------------------------------------------------------


def test_missing_tokenizer_warns_and_generation_config_is_derived(actor_copy, tmp_path, capsys):
    hf = actor_copy / "huggingface"
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json"):
        (hf / name).unlink(missing_ok=True)
    rc, _, err = cli(capsys, "merge", actor_copy, tmp_path / "m")
    assert rc == 0
    warning = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warning) == 2 and "has no tokenizer, so" in warning[1] and "pass --config DIR" in warning[1], warning
    assert "no generation_config.json: wrote the one save_pretrained derives" in warning[0], warning
    record = read_json(tmp_path / "m" / "hf_merge.json")
    assert record["missing_files"] == ["tokenizer"] and record["derived_files"] == ["generation_config.json"]
    assert "Not included | no tokenizer" in (tmp_path / "m" / "README.md").read_text()
    assert (tmp_path / "m" / "generation_config.json").is_file()


@pytest.mark.compat
def test_missing_generation_config_is_save_pretrained_s(actor_copy, tmp_path, capsys):
    """No generation_config.json beside the checkpoint: the output gets the one ``save_pretrained``
    of the trained model writes (derived from config.json: its eos/bos tokens), as verl's merger
    does, and one warning says it has no sampling settings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    (actor_copy / "huggingface" / "generation_config.json").unlink()
    rc, _, err = cli(capsys, "merge", actor_copy, tmp_path / "m")
    assert rc == 0
    (warning,) = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert "no sampling settings" in warning and "pass --config DIR" in warning, warning
    config = AutoConfig.from_pretrained(actor_copy / "huggingface")
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "reference")
    derived = read_json(tmp_path / "m" / "generation_config.json")
    assert derived == read_json(tmp_path / "reference" / "generation_config.json")
    assert derived["eos_token_id"] == config.eos_token_id


def test_generation_config_that_cannot_be_derived_is_reported_missing(actor_copy, tmp_path, capsys, monkeypatch):
    """transformers failing to derive the file (a config it rejects) does not fail a merge whose
    weights are written: the output is complete but for it, and the warning says so."""
    from hf_merge import hf_files

    def rejects(config, folder):
        raise ValueError("a config transformers rejects")

    monkeypatch.setattr(hf_files, "_generation_config_text", rejects)
    (actor_copy / "huggingface" / "generation_config.json").unlink()
    rc, _, err = cli(capsys, "merge", actor_copy, tmp_path / "m")
    assert rc == 0, err
    (warning,) = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert "has no generation_config.json, so the output has none either" in warning, warning
    assert read_json(tmp_path / "m" / "hf_merge.json")["missing_files"] == ["generation_config.json"]
    assert not (tmp_path / "m" / "generation_config.json").exists()


@pytest.mark.skipif(not has_weight_conversions(), reason="a transformers 4.x merge imports transformers for more than this")
def test_derived_generation_config_is_cached_like_the_hub_layout(actor_copy, tmp_path):
    """Deriving the file imports transformers (0.8 s after torch): a second merge of the same model
    takes it, byte for byte, from the plan cache and imports no transformers at all."""
    import subprocess
    import sys

    (actor_copy / "huggingface" / "generation_config.json").unlink()
    script = ("import sys, hf_merge; hf_merge.merge(sys.argv[1], sys.argv[2]); "
              "print(sorted(m for m in sys.modules if m.startswith('transformers'))[:3])")
    env = {**__import__("os").environ, "HF_MERGE_CACHE": str(tmp_path / "cache")}
    imported = []
    for name in ("first", "second"):
        done = subprocess.run([sys.executable, "-c", script, str(actor_copy), str(tmp_path / name)], env=env,
                              capture_output=True, text=True, check=True)
        imported.append(done.stdout.strip().splitlines()[-1])
    assert imported[0] != "[]" and imported[1] == "[]", imported
    assert (tmp_path / "second" / "generation_config.json").read_bytes() == \
        (tmp_path / "first" / "generation_config.json").read_bytes()
    assert list((tmp_path / "cache" / "generation_config").glob("*.json"))


def test_failed_push_says_the_folder_was_written_and_how_to_retry(inproc, qwen2_fp32_ws2, tmp_path, capsys):  # noqa: F811
    inproc.fail(500, path_contains="/commit/")
    target = tmp_path / "m"
    rc, _, err = cli(capsys, "merge", qwen2_fp32_ws2.actor, target, "--push-to-hub", "tester/tiny")
    assert rc == 2 and (target / "model.safetensors").is_file()
    assert f"the merged folder {target} was written; retry the upload with: hf-merge push {target} tester/tiny" in err
    # a merge for the Hub records each file's sha256 (the upload's object id), which push hands to huggingface_hub
    weights = (target / "model.safetensors").read_bytes()
    recorded = json.loads((target / "hf_merge.json").read_text())["files"]
    assert recorded["model.safetensors"] == hashlib.sha256(weights).hexdigest()
    rc, out, err = cli(capsys, "push", target, "tester/tiny")
    assert rc == 0, err
    assert inproc.repos["tester/tiny"].files["model.safetensors"] == (target / "model.safetensors").read_bytes()


# --- 9: verify's hints ---------------------------------------------------------------------------


def test_verify_against_folder_of_another_dtype_says_so_first(qwen2_fp32_ws2, tmp_path, capsys):
    target = tmp_path / "bf16"
    hf_merge.merge(qwen2_fp32_ws2.actor, target)
    rc, out, _ = cli(capsys, "verify", target, "--against", qwen2_fp32_ws2.reference, "--logits", "--logits-atol", "1e-9")
    assert rc == 1
    first = out.splitlines()[0]
    assert first.startswith("note: the dtypes differ: target bfloat16, reference float32") and "--rtol 0.0039" in first
    assert "a larger --logits-atol allows it" in out
    rc, out, _ = cli(capsys, "verify", target, "--against", qwen2_fp32_ws2.reference, "--rtol", "0.0039")
    assert rc == 0, out


# --- 10: inspect ---------------------------------------------------------------------------------


def test_inspect_table_and_json(hsdp_ckpt, capsys):
    rc, out, _ = cli(capsys, "inspect", hsdp_ckpt.actor, "--tensors")
    assert rc == 0
    assert "None" not in out and '["' not in out and "(Shard(dim=0),)" not in out
    assert "device mesh  ddp=2 x fsdp=2" in out and "Replicate(), Shard(dim=0)" in out
    assert "ranks read" in out and "(the others are replicas)" in out
    rc, out, _ = cli(capsys, "inspect", hsdp_ckpt.actor, "--json")
    data = json.loads(out)
    assert data["world_size"] == 4 and data["mesh"] == [2, 2]


# --- 13: HSDP replicas ----------------------------------------------------------------------------


def test_inspect_counts_a_tied_weight_once(capsys):
    """Before: a DeepSpeed tied model showed 27 tensors and 14,280 parameters: lm_head.weight, stored
    again beside the embedding, was counted twice. The merge writes 26 and the model has 11,856."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = Path(__file__).parent / "data" / "deepspeed" / "z1_bf16_tied_ws2"
    config = ckpt / "reference" / "step2" / "config"
    rc, out, err = cli(capsys, "inspect", ckpt, "--config", config, "--json")
    assert rc == 0, err
    report = json.loads(out)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config))
    assert report["parameters"] == model.num_parameters() and report["tied_copies"] == ["lm_head.weight"]
    assert report["tensors_count"] == len(model.state_dict()) - 1  # the tied lm_head.weight written once
    rc, out, _ = cli(capsys, "inspect", ckpt, "--config", config)
    assert f"{model.num_parameters():,} parameters" in out and "lm_head.weight stored again as a tied copy" in out


def test_verify_checks_hsdp_replicas(hsdp_ckpt, tmp_path, capsys):
    target = tmp_path / "m"
    hf_merge.merge(hsdp_ckpt.actor, target)
    rc, out, _ = cli(capsys, "verify", target, "--against", hsdp_ckpt.actor)
    assert rc == 0, out
    assert "replicas" in out and "equal the merged ones" in out
    # rank 2 (replica group 1) diverges in one element of one tensor
    actor = Path(shutil.copytree(hsdp_ckpt.actor, tmp_path / "actor"))
    from hf_merge.readers.safe_pickle import load_rank_file

    path = actor / "model_world_size_4_rank_2.pt"
    state = load_rank_file(path)
    name = "model.layers.0.mlp.up_proj.weight"
    state[name]._local_tensor.view(-1)[0] += 1  # a private (copy-on-write) mapping: the file is unchanged
    torch.save(state, tmp_path / "rank2.pt")
    del state
    (tmp_path / "rank2.pt").replace(path)
    rc, out, _ = cli(capsys, "verify", target, "--against", actor)
    assert rc == 1
    assert f"{name}: rank 2 holds other values than rank 0, its replica" in out
    assert re.search(r"^file checksums +ok", out, re.M) and "bit-exact" in out  # the merged group still matches


# --- 11: packaging -------------------------------------------------------------------------------


def test_pyproject_license_is_an_spdx_string():
    """A TOML-table license makes setuptools >= 77 print a deprecation warning on every install."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert any(r.startswith("setuptools>=77") for r in project["build-system"]["requires"])
