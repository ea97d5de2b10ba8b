"""LoRA: real PEFT models sharded by real FSDP2, fused and as adapters."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import assert_tensors_equal, error_line, folder_tensors, model_logits, reference_logits, run_cli

import hf_merge
from hf_merge.transformers_compat import dtype_kwargs


def _peft_logits(base_dir, adapter_dir, input_ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, **dtype_kwargs(torch.float32))
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


@pytest.mark.compat
@pytest.mark.parametrize("fixture", ["lora_ckpt", "lora_rslora_ckpt", "lora_modules_to_save_ckpt"])
def test_fused_and_adapter_match_peft(fixture, request, tmp_path):
    ckpt = request.getfixturevalue(fixture)
    target = tmp_path / "merged"
    extra = ["--use-rslora"] if ckpt.options["lora"].get("use_rslora") else []
    proc = run_cli("merge", ckpt.actor, target, "--dtype", "float32", *extra)
    assert proc.returncode == 0, proc.stderr
    input_ids, want = reference_logits(ckpt)
    # fused: logits of the PEFT model, weights of PEFT's merge_and_unload
    assert (model_logits(target, input_ids) - want).abs().max() <= 1e-5
    assert_tensors_equal(folder_tensors(target), folder_tensors(ckpt.reference))
    # adapter: loads onto the base weights with PEFT and gives the PEFT model's logits
    adapter = target / "lora_adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    lora = ckpt.options["lora"]
    assert cfg["peft_type"] == "LORA" and cfg["r"] == lora["r"] and cfg["lora_alpha"] == lora["lora_alpha"]
    assert cfg["target_modules"] == sorted(lora["target_modules"])
    assert cfg["use_rslora"] == bool(lora.get("use_rslora")) and cfg["use_dora"] is False
    assert cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["modules_to_save"] or None) == (lora.get("modules_to_save") or None)
    assert (_peft_logits(ckpt.reference_base, adapter, input_ids) - want).abs().max() <= 1e-5
    # the adapter holds exactly PEFT's own saved tensors
    assert_tensors_equal(folder_tensors(adapter), folder_tensors(ckpt.reference_adapter))


@pytest.mark.compat
def test_adapter_mode_writes_adapter_folder_only(lora_ckpt, tmp_path):
    target = tmp_path / "adapter"
    proc = run_cli("merge", lora_ckpt.actor, target, "--lora", "adapter")
    assert proc.returncode == 0, proc.stderr
    assert (target / "adapter_config.json").is_file() and (target / "adapter_model.safetensors").is_file()
    assert not (target / "model.safetensors").exists() and not (target / "config.json").exists()
    # the adapter keeps the training dtype (fp32) unless --dtype says otherwise
    assert all(t.dtype == torch.float32 for t in folder_tensors(target).values())


def test_fuse_mode_has_no_adapter(lora_ckpt, tmp_path):
    target = tmp_path / "fused"
    hf_merge.merge(lora_ckpt.actor, target, lora="fuse")
    assert not (target / "lora_adapter").exists()
    assert all(".lora_" not in k and "base_layer" not in k for k in folder_tensors(target))


def test_missing_alpha_is_refused_then_flag_works(lora_ckpt, tmp_path):
    actor = tmp_path / "actor"
    shutil.copytree(lora_ckpt.actor, actor)
    (actor / "lora_train_meta.json").unlink()
    line = error_line(run_cli("merge", actor, tmp_path / "out"))
    assert "--lora-alpha" in line
    assert not (tmp_path / "out").exists()
    proc = run_cli("merge", actor, tmp_path / "out", "--lora-alpha", str(lora_ckpt.options["lora"]["lora_alpha"]), "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert_tensors_equal(folder_tensors(tmp_path / "out"), folder_tensors(lora_ckpt.reference))


@pytest.mark.compat
def test_lora_only_needs_base_model(lora_only_ckpt, tmp_path):
    line = error_line(run_cli("merge", lora_only_ckpt.actor, tmp_path / "out"))
    assert "--base-model" in line
    proc = run_cli("merge", lora_only_ckpt.actor, tmp_path / "out", "--base-model", lora_only_ckpt.base_model, "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    input_ids, want = reference_logits(lora_only_ckpt)
    assert (model_logits(tmp_path / "out", input_ids) - want).abs().max() <= 1e-5
    # the adapter alone needs no base
    proc = run_cli("merge", lora_only_ckpt.actor, tmp_path / "adapter", "--lora", "adapter")
    assert proc.returncode == 0, proc.stderr


def test_inspect_reports_adapter(lora_ckpt):
    proc = run_cli("inspect", lora_ckpt.actor, "--json")
    assert proc.returncode == 0, proc.stderr
    lora = json.loads(proc.stdout)["lora"]
    assert lora["r"] == lora_ckpt.options["lora"]["r"]
    assert lora["lora_alpha"] == lora_ckpt.options["lora"]["lora_alpha"]
    assert lora["alpha_source"] == "lora_train_meta.json"
    assert lora["target_modules"] == sorted(lora_ckpt.options["lora"]["target_modules"])
    assert lora["adapter_bytes"] > 0


def test_adapter_flag_on_plain_checkpoint_is_refused(qwen2_fp32_ws2, tmp_path):
    assert "no LoRA weights" in error_line(run_cli("merge", qwen2_fp32_ws2.actor, tmp_path / "o", "--lora", "adapter"))


def _notes(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("note: ")]


def test_lora_options_that_change_nothing_say_so(lora_ckpt, qwen2_fp32_ws2, tmp_path):
    """--base-model on a checkpoint holding its base weights, and --lora-alpha / --use-rslora on one
    without LoRA weights, were taken without a word (the output as without them)."""
    proc = run_cli("merge", lora_ckpt.actor, tmp_path / "bm", "--lora", "fuse", "--base-model", lora_ckpt.reference_base)
    assert proc.returncode == 0, proc.stderr
    assert any(n.startswith("note: --base-model changes nothing here: the checkpoint holds the base weights itself")
               for n in _notes(proc)), proc.stderr
    proc = run_cli("merge", qwen2_fp32_ws2.actor, tmp_path / "plain", "--lora-alpha", "8", "--use-rslora")
    assert proc.returncode == 0, proc.stderr
    assert "note: --lora-alpha and --use-rslora change nothing here: the checkpoint has no LoRA weights" in proc.stderr
    # a checkpoint without config.json takes the --base-model folder's: that is not "nothing"
    bare = shutil.copytree(qwen2_fp32_ws2.actor, tmp_path / "bare", ignore=shutil.ignore_patterns("huggingface"))
    proc = run_cli("merge", bare, tmp_path / "cfg", "--base-model", qwen2_fp32_ws2.reference)
    assert proc.returncode == 0 and "config.json and tokenizer from the base model" in proc.stderr, proc.stderr
    assert "changes nothing" not in proc.stderr, proc.stderr


def test_quantize_with_adapter_only_output_is_refused(lora_ckpt, tmp_path):
    """--lora adapter --quantize nf4 wrote a float32 adapter (hf_merge.json: quantization null): refused,
    as --gguf with --quantize is, before anything is read."""
    pytest.importorskip("bitsandbytes")
    line = error_line(run_cli("merge", lora_ckpt.actor, tmp_path / "q", "--lora", "adapter", "--quantize", "nf4"))
    assert "--quantize does not apply to --lora adapter" in line and "--lora both" in line
    assert not (tmp_path / "q").exists()


def test_lora_note_says_rslora_was_assumed_off(lora_rslora_ckpt, tmp_path):
    """verl records no use_rslora: merged without --use-rslora, an rsLoRA run came out misscaled with no
    hint; the LoRA note says rsLoRA was not recorded and is assumed off."""
    proc = run_cli("merge", lora_rslora_ckpt.actor, tmp_path / "off", "--lora", "fuse")
    assert proc.returncode == 0, proc.stderr
    (note,) = [n for n in _notes(proc) if n.startswith("note: LoRA: r=")]
    assert "rsLoRA not recorded, assumed off (pass --use-rslora if training used it)" in note
    proc = run_cli("merge", lora_rslora_ckpt.actor, tmp_path / "on", "--lora", "fuse", "--use-rslora")
    assert proc.returncode == 0, proc.stderr
    (note,) = [n for n in _notes(proc) if n.startswith("note: LoRA: r=")]
    assert "rsLoRA, " in note and "not recorded" not in note


def test_lora_alpha_flag_says_it_overrides_the_recorded_alpha(lora_ckpt, tmp_path):
    """--lora-alpha 32 against lora_train_meta.json's 8: the note said only "(from --lora-alpha)"."""
    recorded = lora_ckpt.options["lora"]["lora_alpha"]
    proc = run_cli("merge", lora_ckpt.actor, tmp_path / "a", "--lora", "fuse", "--lora-alpha", str(4 * recorded))
    assert proc.returncode == 0, proc.stderr
    assert f"(from --lora-alpha, overriding the recorded {recorded} in lora_train_meta.json)" in proc.stderr
    proc = run_cli("merge", lora_ckpt.actor, tmp_path / "b", "--lora", "fuse", "--lora-alpha", str(recorded))
    assert proc.returncode == 0 and "overriding" not in proc.stderr, proc.stderr


def test_loading_lora_only_without_base_suggests_what_works(lora_only_ckpt):
    """from_sharded_pretrained of a save_lora_only checkpoint without a base suggested lora="adapter",
    which fails the same way: loading needs the base weights in every mode."""
    from transformers import AutoModelForCausalLM

    from hf_merge.errors import LoraError

    for lora in ({}, {"lora": "adapter"}):
        with pytest.raises(LoraError) as e:
            AutoModelForCausalLM.from_sharded_pretrained(lora_only_ckpt.actor, dtype="float32", **lora)
        assert "base_model=DIR" in str(e.value) and "lora=" not in str(e.value), str(e.value)
