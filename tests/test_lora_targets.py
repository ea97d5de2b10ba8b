"""adapter_config.json ``target_modules`` that PEFT loads, for a vision-language model.

A tiny Qwen2.5-VL with verl's default all-linear LoRA (text, vision blocks and merger) and one with
LoRA on the vision merger's ``mlp.0`` / ``mlp.2`` only, written as REAL FSDP2 checkpoints (the
``hub_root`` session fixture), merged with ``--lora adapter`` and ``--lora both``, then loaded
with ``PeftModel.from_pretrained`` onto ``from_pretrained`` of the merged base model (the Hub
layout, ``model.*`` / ``visual.*``, which transformers 5 loads as ``model.language_model.*`` /
``model.visual.*``): it must load and give PEFT's own model's logits on an image + text input.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_tensors_equal, folder_tensors, read_json

import hf_merge
import make_hub_checkpoints as mh
from hf_merge.describe import describe
from hf_merge.transformers_compat import dtype_kwargs

VLM_LORA = ["qwen2_5_vl_lora", "qwen2_5_vl_merger_lora"]


def image_inputs() -> dict[str, torch.Tensor]:
    """Text around one 56x56 image: a 4x4 grid of 14-pixel patches (2 frames deep), merged 2x2
    into 4 image tokens (id 5) between vision start (3) and end (4)."""
    ids = torch.tensor([[9, 10, 3, 5, 5, 5, 5, 4, 11, 12, 13]])
    pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(7))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                image_grid_thw=torch.tensor([[1, 4, 4]]))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**image_inputs()).logits.float()


@pytest.fixture(scope="module")
def base_dir(hub_root, tmp_path_factory) -> Path:
    """The base model the adapters go onto, in the Hub layout: hf-merge's merge of the plain
    ``qwen2_5_vl`` checkpoint (the LoRA variants' base weights: same config, same seed)."""
    target = tmp_path_factory.mktemp("base") / "qwen2_5_vl"
    hf_merge.merge(hub_root / "qwen2_5_vl", target)
    return target


@pytest.fixture(scope="module")
def peft_reference():
    """name -> (PEFT's own model the checkpoint was written from, its logits)."""
    out = {}
    for name in VLM_LORA:
        model = mh.build_model(name)  # seeded: the same weights the fixture's ranks trained
        out[name] = model, logits(model)
    return out


def load_adapter(base_dir: Path, adapter_dir: Path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(base_dir, **dtype_kwargs(torch.float32))
    return PeftModel.from_pretrained(base, adapter_dir)


@pytest.mark.parametrize("mode", ["adapter", "both"])
@pytest.mark.parametrize("name", VLM_LORA)
def test_vlm_adapter_loads_with_peft(hub_root, base_dir, peft_reference, tmp_path, name, mode):
    peft_model, want = peft_reference[name]
    src, target = hub_root / name, tmp_path / "out"
    hf_merge.merge(src, target, lora=mode)
    adapter_dir = target if mode == "adapter" else target / "lora_adapter"
    got_cfg = read_json(adapter_dir / "adapter_config.json")
    peft_cfg = read_json(src / "reference" / "adapter" / "adapter_config.json")  # PEFT's save_pretrained
    if name == "qwen2_5_vl_lora":  # all-linear: PEFT's own shortest suffixes (the merger case: PEFT keeps the list given)
        assert sorted(got_cfg["target_modules"]) == sorted(peft_cfg["target_modules"])
        assert {"mlp.0", "2", "attn.proj"} <= set(got_cfg["target_modules"])
    assert_tensors_equal(folder_tensors(adapter_dir), folder_tensors(src / "reference" / "adapter"))
    loaded = load_adapter(base_dir, adapter_dir)  # raised "Target module ... is not supported" before
    # exactly the modules PEFT wrapped, under the same names
    assert sorted(loaded.base_model.targeted_module_names) == sorted(peft_model.base_model.targeted_module_names)
    torch.testing.assert_close(logits(loaded), want, rtol=0, atol=1e-6)
    # the image matters: without the adapter the logits differ
    assert (logits(loaded.unload()) - want).abs().max() > 1e-3
    if mode == "both":  # the fused model computes the same
        from transformers import AutoModelForImageTextToText

        fused = AutoModelForImageTextToText.from_pretrained(target, **dtype_kwargs(torch.float32))
        torch.testing.assert_close(logits(fused), want, rtol=0, atol=1e-5)


def test_without_the_model_a_bare_index_is_not_trusted(hub_root):
    """``inspect`` (and ``--lora fuse``) name the targets from the checkpoint alone, without building
    the model: modules without weights (the merger's ``mlp.1`` GELU, activations of another
    ``nn.Sequential``) are unknown there, so ``mlp.2``, not ``2``; ``0`` alone is also a block, a layer."""
    lora = describe(hub_root / "qwen2_5_vl_merger_lora")["lora"]
    assert lora["target_modules"] == ["mlp.0", "mlp.2"]
