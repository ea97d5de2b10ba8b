"""`hf-merge merge ... --hf_upload_path REPO --private` (verl's spelling) against the Hub stand-in.

In this process (the ``inproc`` fixture points huggingface_hub at the stand-in): the process
boundary is not what is tested; `test_hub.py` runs `hf-merge push` as a subprocess. A merge
without push runs in a fresh interpreter (what it imports first is what is tested) and must send
the stand-in nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

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


def _files(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_second_merge_push_replaces_the_first_ones_model(inproc, lora_ckpt, qwen2_fp32_ws2, tmp_path):  # noqa: F811
    # The sweep's case: a merged model + lora_adapter/, then a sharded model of another architecture.
    first, second = tmp_path / "first", tmp_path / "second"
    proc = run_cli("merge", lora_ckpt.actor, first, "--push-to-hub", "tester/stale")
    assert proc.returncode == 0, proc.stderr
    repo = inproc.repos["tester/stale"]
    user = {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", "LICENSE": b"MIT\n",
            "images/loss.png": b"\x89PNG\r\n", "runs/step-1/model.safetensors": b"the user's own copy"}
    repo.files.update(user)  # added on the Hub by the user between the pushes
    proc = run_cli("merge", qwen2_fp32_ws2.actor, second, "--max-shard-size", "100KB", "--push-to-hub", "tester/stale")
    assert proc.returncode == 0, proc.stderr
    local = _files(second)
    assert {"model-00001-of-00002.safetensors", "model.safetensors.index.json"} <= set(local)
    assert repo.files == {**local, **user}  # no model.safetensors, no lora_adapter/ of the first merge
    stale = ["lora_adapter/README.md", "lora_adapter/adapter_config.json", "lora_adapter/adapter_model.safetensors",
             "model.safetensors"]
    assert len(inproc.commits) == 2 and sorted(inproc.commits[1].deleted) == stale  # in the upload's commit
    assert "tester/stale: deleted 4 file(s) of an earlier upload" in proc.stderr
    assert inproc.unexpected == []


@pytest.fixture(scope="module")
def lora_merged(lora_ckpt, tmp_path_factory):  # noqa: F811
    """A merged model with its lora_adapter/ (checksums sha256, as a push wants)."""
    target = tmp_path_factory.mktemp("lora_merged") / "merged"
    proc = run_cli("merge", lora_ckpt.actor, target, "--checksum", "sha256")
    assert proc.returncode == 0, proc.stderr
    return target


def test_adapter_push_onto_a_full_model_repo_replaces_the_model(inproc, lora_merged, tmp_path):  # noqa: F811
    folder = Path(shutil.copytree(lora_merged, tmp_path / "merged"))
    assert run_cli("push", folder, "tester/full-model").returncode == 0
    repo = inproc.repos["tester/full-model"]
    proc = run_cli("push", folder / "lora_adapter", "tester/full-model")
    assert proc.returncode == 0, proc.stderr
    adapter = _files(folder / "lora_adapter")
    kept = {name: _files(folder)[name] for name in ("tokenizer.json", "tokenizer_config.json")}  # an adapter has none
    assert repo.files == {**adapter, **kept}
    assert sorted(inproc.commits[-1].deleted) == [
        "config.json", "generation_config.json", "hf_merge.json", "lora_adapter/README.md",
        "lora_adapter/adapter_config.json", "lora_adapter/adapter_model.safetensors", "model.safetensors"]


def test_no_private_push_onto_a_private_repo_is_refused(inproc, lora_merged, tmp_path):  # noqa: F811
    folder = Path(shutil.copytree(lora_merged, tmp_path / "merged"))
    inproc.add_repo("tester/lora-model", private=True)
    proc = run_cli("push", folder, "tester/lora-model", "--no-private")
    assert proc.returncode != 0
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "tester/lora-model already exists and is private, but a public push (--no-private) was asked" in error
    assert "nothing was uploaded" in error and "hf repos settings tester/lora-model --public" in error
    assert inproc.repos["tester/lora-model"].private is True and inproc.commits == []
    assert run_cli("push", folder, "tester/lora-model").returncode == 0  # without the flag: pushed, still private
    assert inproc.repos["tester/lora-model"].private is True and len(inproc.commits) == 1


@pytest.mark.parametrize("fixture, extra", [("lora_ckpt", []), ("qwen2_fp32_ws2", ["--quantize", "nf4"])])
def test_merge_without_push_sends_no_request(hub, checkpoint, tmp_path, fixture, extra):  # noqa: F811
    """bitsandbytes (imported by peft for the adapter config, or for --quantize) asked the Hub
    (GET /api/organizations/kernels-community/overview) for an optional CPU kernel at import."""
    proc = run_cli("merge", checkpoint(fixture).actor, tmp_path / "out", *extra, env=hub.env(str(tmp_path / "home")))
    assert proc.returncode == 0, proc.stderr
    assert hub.requests == []
    assert "kernels-community" not in proc.stderr
