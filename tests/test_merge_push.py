"""`hf-merge merge ... --hf_upload_path REPO --private` (verl's spelling) against the Hub stand-in.

In this process (the ``inproc`` fixture points huggingface_hub at the stand-in): the process
boundary is not what is tested; `test_hub.py` runs `hf-merge push` as a subprocess. A merge
without push runs in a fresh interpreter (what it imports first is what is tested) and must send
the stand-in nothing.
"""

from __future__ import annotations

import pytest
from helpers import run_cli
from huggingface_hub import ModelCard
from test_hub import TOKEN, hub, inproc  # noqa: F401 - the Hub stand-in fixtures


def test_merge_then_push_with_card(inproc, lora_ckpt, tmp_path):  # noqa: F811
    target = tmp_path / "merged"
    proc = run_cli("merge", "--backend", "fsdp", "--local_dir", lora_ckpt.actor, "--target_dir", target,
                   "--hf_upload_path", "tester/grpo-lora", "--private")
    assert proc.returncode == 0, proc.stderr
    assert TOKEN not in proc.stdout + proc.stderr
    repo = inproc.repos["tester/grpo-lora"]
    assert repo.private is True
    local = {p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()}
    assert set(repo.files) == local
    assert {"model.safetensors", "lora_adapter/adapter_model.safetensors", "lora_adapter/adapter_config.json",
            "README.md", "lora_adapter/README.md", "hf_merge.json"} <= local
    card = ModelCard(repo.files["README.md"].decode())
    assert "lora" in card.data.tags and "hf-merge" in card.data.tags
    assert card.data.library_name == "transformers"
    adapter_card = ModelCard(repo.files["lora_adapter/README.md"].decode())
    assert adapter_card.data.library_name == "peft"
    assert "pushed to" in proc.stderr


@pytest.mark.parametrize("fixture, extra", [("lora_ckpt", []), ("qwen2_fp32_ws2", ["--quantize", "nf4"])])
def test_merge_without_push_sends_no_request(hub, checkpoint, tmp_path, fixture, extra):  # noqa: F811
    """bitsandbytes (imported by peft for the adapter config, or for --quantize) asked the Hub
    (GET /api/organizations/kernels-community/overview) for an optional CPU kernel at import."""
    proc = run_cli("merge", checkpoint(fixture).actor, tmp_path / "out", *extra, env=hub.env(str(tmp_path / "home")))
    assert proc.returncode == 0, proc.stderr
    assert hub.requests == []
    assert "kernels-community" not in proc.stderr
