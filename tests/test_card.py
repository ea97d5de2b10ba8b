"""Model cards from the provenance record: YAML that huggingface_hub parses, and the body."""

from __future__ import annotations

import copy

import pytest
import yaml
from huggingface_hub import ModelCard, RepoCard

from hf_merge.publish.card import SECTION_BEGIN, SECTION_END, render_adapter_card, render_model_card

SHA = "0" * 64
INFO = {
    "hf_merge_version": "0.1.0",
    "created": "2026-01-01T00:00:00+00:00",
    "source": {
        "format": "fsdp",
        "framework": "verl",
        "path": "/home/alice/secret-project/ckpts/global_step_100/actor",
        "world_size": 8,
        "step": 100,
        "mesh": [2, 4],
        "mesh_dim_names": ["ddp", "fsdp"],
        "fsdp_version": 2,
    },
    "dtype": "bfloat16",
    "base_model": "Qwen/Qwen2.5-0.5B",
    "architecture": "Qwen2ForCausalLM",
    "lora": None,
    "quantization": None,
    "verification": {"passed": True, "summary": "290 tensors bit-exact | logits match"},
    "files": {"config.json": SHA, "model.safetensors": SHA, "tokenizer.json": SHA},
}


def info(**changes):
    out = copy.deepcopy(INFO)
    out.update(changes)
    return out


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_model_card_yaml_carries_the_fields(tmp_path):
    text = render_model_card(INFO, repo_id="me/qwen-grpo")
    path = tmp_path / "README.md"
    path.write_text(text)
    data = ModelCard.load(path).data
    assert data.library_name == "transformers"
    assert data.base_model == "Qwen/Qwen2.5-0.5B"
    assert data.get("base_model_relation") == "finetune"
    assert data.pipeline_tag == "text-generation"
    assert data.tags == ["hf-merge", "verl", "fsdp"]
    assert RepoCard.load(path).data.to_dict() == front_matter(text)


def test_model_card_body_table_and_snippet():
    text = render_model_card(INFO, repo_id="me/qwen-grpo")
    body = ModelCard(text).text
    assert body.count(SECTION_BEGIN) == 1 and body.count(SECTION_END) == 1
    assert "# qwen-grpo" in body
    assert "| Source format | `fsdp` (verl) |" in body
    assert "| Source checkpoint | `global_step_100/actor` (step 100) |" in body
    assert "| World size / mesh | 8 / `ddp=2 × fsdp=4` |" in body
    assert "| Verification | passed: 290 tensors bit-exact \\| logits match |" in body  # pipe escaped
    assert "| `model.safetensors` | `sha256:" + SHA + "` |" in body  # a bare digest is a sha256, shown as one
    assert 'AutoModelForCausalLM.from_pretrained("me/qwen-grpo")' in body
    assert 'AutoTokenizer.from_pretrained("me/qwen-grpo")' in body  # tokenizer.json was written
    assert "alice" not in text and "secret-project" not in text  # only the last two path parts


def test_lora_and_quantization_tags_and_relation():
    fused = info(
        lora={"mode": "both", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "use_rslora": True},
        quantization={"method": "bitsandbytes", "mode": "nf4"},
    )
    text = render_model_card(fused)
    meta = front_matter(text)
    assert meta["tags"] == ["hf-merge", "verl", "fsdp", "lora", "bitsandbytes", "nf4", "4-bit"]
    assert meta["base_model_relation"] == "finetune"  # trained weights, even when quantized
    assert "r=8; lora_alpha=16; rsLoRA; modules: `q_proj`, `v_proj`" in text
    assert 'subfolder="lora_adapter"' in text
    assert "path/or/repo-id" in text  # no repo id given: a placeholder, not a local path

    requantized = info(source={"format": "hf", "path": "/m"}, quantization={"method": "bitsandbytes", "mode": "int8"})
    meta = front_matter(render_model_card(requantized))
    assert meta["base_model_relation"] == "quantized"
    assert meta["tags"] == ["hf-merge", "bitsandbytes", "8-bit"]


def test_adapter_card():
    adapter = info(lora={"mode": "adapter", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_rslora": False})
    text = render_adapter_card(adapter, repo_id="me/lora")
    meta = front_matter(text)
    assert meta["library_name"] == "peft"
    assert meta["base_model"] == "Qwen/Qwen2.5-0.5B" and meta["base_model_relation"] == "adapter"
    assert "lora" in meta["tags"] and meta["pipeline_tag"] == "text-generation"
    assert 'PeftModel.from_pretrained(base, "me/lora")' in text
    assert 'AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B")' in text


@pytest.mark.parametrize("base", ["/mnt/models/Qwen2.5-7B", "./Qwen", "~/x/y", None, ""])
def test_local_base_model_is_not_published_as_a_hub_id(base):
    text = render_model_card(info(base_model=base))
    meta = front_matter(text)
    assert "base_model" not in meta and "base_model_relation" not in meta
    assert "/mnt/models" not in text


def test_critic_and_unknown_architectures():
    critic = front_matter(render_model_card(info(architecture="Qwen2ForTokenClassification")))
    assert critic["pipeline_tag"] == "token-classification"
    unknown = render_model_card({"architecture": None})  # a nearly empty record still renders
    assert "pipeline_tag" not in front_matter(unknown)
    assert "AutoModel.from_pretrained" in unknown and "Verification | not run" in unknown


EXISTING = """\
---
license: apache-2.0
base_model: someone/else
tags:
- mine
- verl
---

# My model

Trained with love. Do not remove this line.
"""


def test_existing_card_is_extended_never_overwritten():
    text = render_model_card(INFO, repo_id="me/m", existing_card_text=EXISTING)
    card = ModelCard(text)
    assert card.data.license == "apache-2.0"
    assert card.data.base_model == "someone/else"  # kept, not overwritten
    assert "base_model_relation" not in card.data.to_dict()  # ours would describe another base
    assert card.data.tags == ["mine", "verl", "hf-merge", "fsdp"]  # merged, order kept, no duplicates
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert card.text.startswith("\n# My model\n\nTrained with love. Do not remove this line.\n")
    assert card.text.index("Do not remove") < card.text.index(SECTION_BEGIN)

    # Re-rendering refreshes our section in place: idempotent, and the user's text survives.
    again = render_model_card(info(dtype="float16"), repo_id="me/m", existing_card_text=text)
    assert again.count(SECTION_BEGIN) == 1 and "`float16`" in again and "`bfloat16`" not in again
    assert render_model_card(info(dtype="float16"), repo_id="me/m", existing_card_text=again) == again
    assert "Do not remove this line." in again


def test_existing_card_without_front_matter():
    text = render_model_card(INFO, existing_card_text="# Just text\n\nhello\n")
    meta = front_matter(text)
    assert meta["library_name"] == "transformers" and meta["base_model"] == "Qwen/Qwen2.5-0.5B"
    assert meta["base_model_relation"] == "finetune"
    assert "# Just text\n\nhello\n" in text and SECTION_BEGIN in text


def test_tokenizer_line_follows_the_folder_files():
    no_tokenizer = info(files={"model.safetensors": SHA})
    assert "AutoTokenizer" not in render_model_card(no_tokenizer)
    text = render_model_card(no_tokenizer, folder_files=["model.safetensors", "tokenizer_config.json"])
    assert 'AutoTokenizer.from_pretrained("path/or/repo-id")' in text


def test_format_named_after_its_framework_is_said_once():
    for fmt, framework, said in (("colossalai", "colossalai", "a colossalai training"),
                                 ("deepspeed", "DeepSpeed", "a DeepSpeed training"),
                                 ("fsdp", "verl", "a verl fsdp training"),
                                 ("accelerate", "accelerate", "a accelerate training")):
        text = render_model_card(info(source={"format": fmt, "framework": framework}))
        assert said + " checkpoint" in text, text


def test_an_older_format_name_renders_as_the_format_name():
    """hf_merge.json written before the renaming says "verl-fsdp" / "accelerate-fsdp": the card is
    the one the format's name gives."""
    for old, new, framework in (("verl-fsdp", "fsdp", "verl"), ("accelerate-fsdp", "accelerate", "accelerate"),
                                ("torchtitan-dcp", "torchtitan", "torchtitan")):
        assert render_model_card(info(source={"format": old, "framework": framework})) == render_model_card(
            info(source={"format": new, "framework": framework}))
    assert "written from a Hugging Face model folder" in render_model_card(info(source={"format": "hf"}))
