"""``hf-merge push`` / :func:`hf_merge.publish.hub.push` against a loopback stand-in of the Hub.

Nothing here can reach the real Hub: the CLI runs in subprocesses whose environment points
huggingface_hub at the stand-in before it is imported; in-process tests patch huggingface_hub's
endpoint and install an HTTP client that refuses any host but 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from hf_merge.errors import HubError
from hf_merge.publish.hub import push

try:
    from .hub_server import HubStandIn
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    from hub_server import HubStandIn

TOKEN = "hf_StandInSecretToken0123456789abcdef"
BASE = "hf-internal-testing/tiny-random-LlamaForCausalLM"  # a valid Hub id; never downloaded

# Runs `hf-merge push ...` through the real entry point when it exists, else through a tiny shim
# doing what hf_merge.cli.app does (one `error: ...` line, exit code from the error class).
CLI = r"""
import sys
try:
    from hf_merge.cli.app import main
except ImportError:
    main = None
if main is not None:
    sys.exit(main(["push", *sys.argv[1:]]))
import argparse
from hf_merge.cli import push as cmd
from hf_merge.errors import HfMergeError
parser = argparse.ArgumentParser(prog="hf-merge")
cmd.add_parser(parser.add_subparsers())
args = parser.parse_args(["push", *sys.argv[1:]])
try:
    sys.exit(cmd.run(args))
except HfMergeError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
"""


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A real two-layer Llama saved by transformers (random weights, no download) + hf_merge.json."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny") / "merged"
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    files = {p.name: _sha256(p) for p in sorted(folder.iterdir())}
    provenance = {
        "hf_merge_version": "0.1.0",
        "source": {"format": "verl-fsdp", "framework": "verl", "path": "/ckpt/global_step_7/actor",
                   "world_size": 2, "step": 7, "mesh": [2], "mesh_dim_names": ["fsdp"]},
        "dtype": "float32",
        "base_model": BASE,
        "architecture": "LlamaForCausalLM",
        "lora": None,
        "quantization": None,
        "verification": {"passed": True, "summary": "all tensors equal"},
        "files": files,
    }
    (folder / "hf_merge.json").write_text(json.dumps(provenance, indent=2))
    return folder


@pytest.fixture
def model_dir(tiny_model, tmp_path) -> Path:
    """A fresh copy per test (push writes README.md into it)."""
    return Path(shutil.copytree(tiny_model, tmp_path / "merged"))


@pytest.fixture
def hub():
    with HubStandIn(token=TOKEN) as stand_in:
        yield stand_in


@pytest.fixture
def inproc(hub, monkeypatch, tmp_path):
    """Point this process's huggingface_hub at the stand-in; refuse any other host."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    def loopback_only(request):
        if request.url.host != "127.0.0.1":
            raise RuntimeError(f"test tried to reach {request.url.host}")

    def factory():
        client = _http.default_client_factory()
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "request": [*hooks["request"], loopback_only]}
        return client

    assert isinstance(_http.get_session(), httpx2.Client)
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    # downloads (a model card transformers' push_to_hub reads first) resolve through this template
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "home" / "agent_harnesses.json"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "home" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "home" / "stored_tokens"))
    for var in ("HF_OIDC_RESOURCE", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    _http.set_client_factory(factory)
    try:
        yield hub
    finally:
        _http.set_client_factory(_http.default_client_factory)


def run_cli(
    hub: HubStandIn, tmp_path: Path, *args: str, disable_xet: bool = True, **env_extra: str
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(hub.env(str(tmp_path / "hf_home"), disable_xet=disable_xet, **env_extra))
    return subprocess.run([sys.executable, "-c", CLI, *args], env=env, capture_output=True, text=True, timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------------------------
# the CLI, in subprocesses
# ---------------------------------------------------------------------------------------------
def test_cli_push_uploads_every_file_private_with_card(hub, model_dir, tmp_path):
    # huggingface_hub's default path (hf_xet installed: the pipelined upload_folder), as users run it.
    proc = run_cli(hub, tmp_path, str(model_dir), "tester/tiny-llama", "--private", disable_xet=False, HF_TOKEN=TOKEN)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"{hub.endpoint}/tester/tiny-llama"

    repo = hub.repos["tester/tiny-llama"]
    assert repo.private is True
    local = folder_files(model_dir)
    assert {"config.json", "model.safetensors", "generation_config.json", "hf_merge.json", "README.md"} <= set(local)
    assert repo.files == local  # every file, byte for byte, README.md included
    assert len(hub.commits) == 1 and hub.commits[0].create_pr is False and hub.commits[0].revision == "main"
    assert hub.commits[0].message == "Upload model from verl-fsdp step 7 merged with hf-merge"

    card = ModelCard(repo.files["README.md"].decode())
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert card.data.base_model == BASE and card.data.get("base_model_relation") == "finetune"
    assert {"hf-merge", "verl", "fsdp"} <= set(card.data.tags)
    assert 'AutoModelForCausalLM.from_pretrained("tester/tiny-llama")' in card.text
    assert hub.yaml_validated  # the client sent the card to the Hub's YAML validation

    assert TOKEN not in proc.stdout + proc.stderr
    assert set(hub.auth_headers) == {f"Bearer {TOKEN}"}
    assert hub.unexpected == []


def test_cli_failed_upload_gives_one_line_error_and_rerun_completes(hub, model_dir, tmp_path):
    # Legacy single-commit path (HF_HUB_DISABLE_XET=1): the pipelined one retries a failed commit
    # with backoff, which would make this test slow. (HTTP 500 and 404 are mapped in process below.)
    hub.fail(401, path_contains="/commit/")
    proc = run_cli(hub, tmp_path, str(model_dir), "tester/tiny-llama", HF_TOKEN=TOKEN)
    assert_one_line_error(proc, "not logged in or no write access", "hf auth login", "HF_TOKEN")
    assert TOKEN not in proc.stdout + proc.stderr
    assert hub.commits == [] and hub.repos["tester/tiny-llama"].files == {}

    proc = run_cli(hub, tmp_path, str(model_dir), "tester/tiny-llama", "--token", TOKEN)  # no HF_TOKEN now
    assert proc.returncode == 0, proc.stderr
    assert TOKEN not in proc.stdout + proc.stderr
    assert hub.repos["tester/tiny-llama"].files == folder_files(model_dir)
    assert len(hub.commits) == 1 and hub.unexpected == []
    assert set(hub.auth_headers) == {f"Bearer {TOKEN}"}


def test_cli_push_of_a_resharded_model_deletes_the_old_weights(hub, model_dir, tmp_path):
    # The default (pipelined) upload: the deletions ride its first commit.
    from transformers import LlamaForCausalLM

    assert run_cli(hub, tmp_path, str(model_dir), "tester/tiny", disable_xet=False, HF_TOKEN=TOKEN).returncode == 0
    resharded = tmp_path / "resharded"  # no hf_merge.json: pushed without a card
    LlamaForCausalLM.from_pretrained(model_dir).save_pretrained(resharded, max_shard_size="20KB")
    assert len([p for p in resharded.iterdir() if p.suffix == ".safetensors"]) > 1
    proc = run_cli(hub, tmp_path, str(resharded), "tester/tiny", disable_xet=False, HF_TOKEN=TOKEN)
    assert proc.returncode == 0, proc.stderr
    repo = hub.repos["tester/tiny"]
    assert repo.files == {**folder_files(resharded), "README.md": (model_dir / "README.md").read_bytes()}
    assert len(hub.commits) == 2 and sorted(hub.commits[1].deleted) == ["hf_merge.json", "model.safetensors"]
    assert "tester/tiny: deleted 2 file(s) of an earlier upload" in proc.stderr
    assert hub.unexpected == []


# ---------------------------------------------------------------------------------------------
# the library, in process
# ---------------------------------------------------------------------------------------------
def test_push_to_new_branch_with_message(inproc, model_dir):
    hub = inproc
    url = push(model_dir, "tester/tiny", private=False, revision="step-7", commit_message="step 7")
    assert url == f"{hub.endpoint}/tester/tiny/tree/step-7"
    repo = hub.repos["tester/tiny"]
    assert repo.private is False
    assert repo.files == {} and repo.branches["step-7"] == folder_files(model_dir)
    assert [(c.revision, c.message) for c in hub.commits] == [("step-7", "step 7")]
    assert hub.unexpected == []


def test_create_pr_on_existing_repo_sends_only_changed_files(inproc, model_dir):
    hub = inproc
    config = (model_dir / "config.json").read_bytes()
    hub.add_repo("tester/tiny", files={"config.json": config, "old.txt": b"kept"})
    url = push(model_dir, "tester/tiny", create_pr=True)
    assert url == f"{hub.endpoint}/tester/tiny/discussions/1"
    (commit,) = hub.commits
    assert commit.create_pr is True
    assert "config.json" not in commit.files  # unchanged on the Hub: not sent again
    assert set(commit.files) == set(folder_files(model_dir)) - {"config.json"}
    repo = hub.repos["tester/tiny"]
    assert repo.files == {"config.json": config, "old.txt": b"kept"}  # main untouched
    assert repo.branches["refs/pr/1"] == {**folder_files(model_dir), "old.txt": b"kept"}


def test_rerun_with_nothing_changed_makes_no_commit(inproc, model_dir):
    hub = inproc
    first = push(model_dir, "tester/tiny")
    readme = (model_dir / "README.md").read_text()
    assert push(model_dir, "tester/tiny") == first
    assert len(hub.commits) == 1
    assert (model_dir / "README.md").read_text() == readme  # the card is stable across runs


def test_private_push_to_existing_public_repo_is_refused(inproc, model_dir):
    hub = inproc
    hub.add_repo("tester/public", private=False)
    with pytest.raises(HubError, match=r"already exists and is public.*nothing was uploaded"):
        push(model_dir, "tester/public", private=True)
    assert hub.commits == [] and hub.repos["tester/public"].files == {}


def test_server_error_then_rerun(inproc, model_dir):
    hub = inproc
    hub.fail(500, path_contains="/commit/")
    with pytest.raises(HubError, match=r"^the Hub at http://127\.0\.0\.1:\d+ answered HTTP 500: .*re-running") as info:
        push(model_dir, "tester/tiny")
    assert "\n" not in str(info.value) and info.value.__cause__ is not None
    assert hub.commits == []
    push(model_dir, "tester/tiny")
    assert hub.repos["tester/tiny"].files == folder_files(model_dir)


def test_not_found_and_no_auth_errors(inproc, model_dir, monkeypatch):
    hub = inproc
    hub.fail(404, path_contains="/preupload/")
    with pytest.raises(HubError, match=r"^repository tester/tiny not found on http://127\.0\.0\.1") as info:
        push(model_dir, "tester/tiny")
    assert info.value.__cause__ is not None  # the huggingface_hub error stays chained
    assert "\n" not in str(info.value)

    hub.fail(404, path_contains="/commit/", error_code="RevisionNotFound")
    with pytest.raises(HubError, match=r"^revision 'main' not found in tester/tiny"):
        push(model_dir, "tester/tiny")

    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(HubError, match=r"^not logged in or no write access .*`hf auth login` or set HF_TOKEN$") as info:
        push(model_dir, "tester/other")
    assert "hf_wrong" not in str(info.value)
    assert hub.commits == []


def test_unreachable_hub_names_the_endpoint(inproc, model_dir, monkeypatch):
    from huggingface_hub import constants

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    with pytest.raises(HubError, match=rf"^cannot reach the Hub at {dead} \(ConnectError\)") as info:
        push(model_dir, "tester/tiny")
    assert info.value.__cause__ is not None


def test_existing_readme_is_extended_not_overwritten(inproc, model_dir):
    hub = inproc
    (model_dir / "README.md").write_text("---\nlicense: mit\ntags: [mine]\n---\n\n# Mine\n\nKeep me.\n")
    push(model_dir, "tester/tiny")
    card = ModelCard(hub.repos["tester/tiny"].files["README.md"].decode())
    assert card.data.license == "mit" and card.data.tags[0] == "mine" and "hf-merge" in card.data.tags
    assert "Keep me." in card.text and "hf-merge provenance" in card.text


def test_adapter_folder_gets_a_peft_card(inproc, tmp_path):
    hub = inproc
    folder = tmp_path / "adapter"
    folder.mkdir()
    adapter_config = {"peft_type": "LORA", "base_model_name_or_path": BASE, "r": 4}
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    (folder / "hf_merge.json").write_text(json.dumps({
        "source": {"format": "verl-fsdp", "framework": "verl"}, "architecture": "LlamaForCausalLM",
        "lora": {"mode": "adapter", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_rslora": False},
    }))
    push(folder, "tester/lora")
    card = ModelCard(hub.repos["tester/lora"].files["README.md"].decode())
    assert card.data.library_name == "peft" and card.data.base_model == BASE
    assert card.data.get("base_model_relation") == "adapter"
    assert 'PeftModel.from_pretrained(base, "tester/lora")' in card.text


def test_folder_without_provenance_is_pushed_without_a_card(inproc, model_dir):
    (model_dir / "hf_merge.json").unlink()
    push(model_dir, "tester/plain")
    assert "README.md" not in inproc.repos["tester/plain"].files
    assert not (model_dir / "README.md").exists()


# ---------------------------------------------------------------------------------------------
# checks made before any network call (the inproc guard would catch a stray request)
# ---------------------------------------------------------------------------------------------
def test_not_a_model_folder(inproc, tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(HubError, match=r"no config\.json \(model\) and no adapter_config\.json"):
        push(tmp_path / "x", "tester/x")
    with pytest.raises(HubError, match=r"is not a folder"):
        push(tmp_path / "missing", "tester/x")
    assert inproc.requests == []


def test_incomplete_folders(inproc, model_dir):
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00002.safetensors")
    index = {"metadata": {"total_size": 1}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                            "b": "model-00002-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HubError, match=r"lists 1 missing shard\(s\) \(model-00002-of-00002\.safetensors\)"):
        push(model_dir, "tester/x")

    index["weight_map"]["b"] = "../outside.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HubError, match=r"outside the folder"):
        push(model_dir, "tester/x")

    (model_dir / "model.safetensors.index.json").unlink()
    (model_dir / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(HubError, match=r"but no weights: expected model\.safetensors or"):
        push(model_dir, "tester/x")
    assert inproc.requests == []


def test_provenance_lists_a_missing_file(inproc, model_dir):
    (model_dir / "generation_config.json").unlink()
    missing = r"hf_merge\.json lists 1 file\(s\) that are not there \(generation_config\.json\)"
    with pytest.raises(HubError, match=missing):
        push(model_dir, "tester/x")
    assert inproc.requests == []


@pytest.mark.parametrize(
    "repo_id, kwargs, pattern",
    [
        ("a/b/c", {}, r"invalid repo id 'a/b/c'"),
        ("bad--name", {}, r"invalid repo id"),
        ("tester/x", {"create_pr": True, "revision": "dev"}, r"--create-pr .* --revision 'dev'"),
    ],
)
def test_bad_arguments(inproc, model_dir, repo_id, kwargs, pattern):
    with pytest.raises(HubError, match=pattern):
        push(model_dir, repo_id, **kwargs)
    assert inproc.requests == []


@pytest.mark.parametrize("header", ["- a list\n- not a mapping", "key: [unclosed"])
def test_unreadable_existing_readme_fails_before_the_network(inproc, model_dir, header):
    (model_dir / "README.md").write_text(f"---\n{header}\n---\n\n# Mine\n")
    with pytest.raises(HubError, match=r"README\.md has a YAML header that cannot be read"):
        push(model_dir, "tester/x")
    assert inproc.requests == []
    assert (model_dir / "README.md").read_text() == f"---\n{header}\n---\n\n# Mine\n"  # untouched


def test_push_reuses_the_merge_digests(model_dir):
    """Uploads take the sha256 recorded in hf_merge.json instead of hashing each file again."""
    import time

    from huggingface_hub import CommitOperationAdd

    from hf_merge.publish.hub import _read_provenance, reuse_digests

    folder = model_dir
    info = _read_provenance(folder)
    weights = [name for name, digest in info["files"].items() if digest]
    assert weights
    edited = folder / weights[0]
    with reuse_digests(folder, info):
        ops = {name: CommitOperationAdd(path_in_repo=name, path_or_fileobj=folder / name) for name in weights}
    for name, op in ops.items():
        assert op.upload_info.is_hashed, name  # taken from hf_merge.json, nothing read
        assert op.upload_info.sha256 == hashlib.sha256((folder / name).read_bytes()).digest()
    # a file changed after the merge is hashed again, and nothing stays patched outside the context
    edited.write_bytes(edited.read_bytes()[:-1] + b"\0")
    os.utime(edited, ns=(time.time_ns() + 10**9,) * 2)
    with reuse_digests(folder, info):
        op = CommitOperationAdd(path_in_repo=weights[0], path_or_fileobj=edited)
    assert not op.upload_info.is_hashed
    assert op.upload_info.sha256 == hashlib.sha256(edited.read_bytes()).digest()
    assert not CommitOperationAdd(path_in_repo=weights[0], path_or_fileobj=folder / weights[-1]).upload_info.is_hashed
