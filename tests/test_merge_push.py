"""`hf-merge merge ... --hf_upload_path REPO --private` (verl's spelling) against the Hub stand-in."""

from __future__ import annotations

import os
import subprocess
import sys

from hub_server import HubStandIn
from huggingface_hub import ModelCard

TOKEN = "hf_merge_test_token_do_not_print"


def test_merge_then_push_with_card(lora_ckpt, tmp_path):
    target = tmp_path / "merged"
    with HubStandIn(token=TOKEN) as hub:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
        env.update(hub.env(str(tmp_path / "hf_home"), disable_xet=True, HF_TOKEN=TOKEN))
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        proc = subprocess.run(
            [sys.executable, "-m", "hf_merge.cli.app", "merge", "--backend", "fsdp", "--local_dir", str(lora_ckpt.actor),
             "--target_dir", str(target), "--hf_upload_path", "tester/grpo-lora", "--private"],
            env=env, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert TOKEN not in proc.stdout + proc.stderr
        repo = hub.repos["tester/grpo-lora"]
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
