"""Bad input: one error line naming the problem, non-zero exit, nothing left at the target."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import error_line, no_leftovers, run_cli


@pytest.fixture
def actor_copy(qwen2_fp32_ws2, tmp_path):
    dest = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, dest)
    return dest


def _fails(tmp_path, *args, match: str):
    target = tmp_path / "out"
    proc = run_cli("merge", *args, target)
    line = error_line(proc)
    assert match in line, line
    assert not target.exists() and no_leftovers(target)
    return line


def test_path_missing(tmp_path):
    _fails(tmp_path, tmp_path / "nope", match="does not exist")


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    _fails(tmp_path, tmp_path / "empty", match="is empty")


def test_no_rank_files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("hi")
    _fails(tmp_path, tmp_path / "src", match="is not a checkpoint hf-merge recognises (holds notes.txt); it reads: fsdp")
    _fails(tmp_path, "--backend", "fsdp", tmp_path / "src", match="no model_world_size_*_rank_*.pt files")


def test_missing_rank_file_is_named(actor_copy, tmp_path):
    (actor_copy / "model_world_size_2_rank_1.pt").unlink()
    _fails(tmp_path, actor_copy, match="model_world_size_2_rank_1.pt")


def test_truncated_rank_file_is_named(actor_copy, tmp_path):
    path = actor_copy / "model_world_size_2_rank_1.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    line = _fails(tmp_path, actor_copy, match="model_world_size_2_rank_1.pt")
    assert "truncated" in line


def test_garbage_rank_file_is_named(actor_copy, tmp_path):
    (actor_copy / "model_world_size_2_rank_0.pt").write_bytes(os.urandom(4096))
    _fails(tmp_path, actor_copy, match="model_world_size_2_rank_0.pt")


def test_world_size_disagreeing_with_files(actor_copy, tmp_path):
    (actor_copy / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    _fails(tmp_path, actor_copy, match="world_size 4")


def test_rank_files_of_two_runs(actor_copy, tmp_path):
    (actor_copy / "fsdp_config.json").unlink()
    shutil.copy(actor_copy / "model_world_size_2_rank_0.pt", actor_copy / "model_world_size_4_rank_0.pt")
    _fails(tmp_path, actor_copy, match="several world sizes")


def test_no_hf_config(actor_copy, tmp_path):
    shutil.rmtree(actor_copy / "huggingface")
    _fails(tmp_path, actor_copy, match="--config")


@pytest.mark.parametrize("field, value, says", [
    ("intermediate_size", 96, "model.layers.0.mlp.up_proj.weight is (128, 64), config.json says intermediate_size 96"),
    ("vocab_size", 151936, "model.embed_tokens.weight is (128, 64), config.json says vocab_size 151936"),
    ("hidden_size", 896, "model.embed_tokens.weight is (128, 64), config.json says hidden_size 896"),
    ("num_hidden_layers", 24, "the checkpoint has 2 decoder layers, config.json says num_hidden_layers 24"),
])
def test_a_config_of_another_model_is_refused(field, value, says, actor_copy, tmp_path):
    """--config of another model (here the checkpoint's own config with one size changed). Before:
    exit 0 and a folder that from_pretrained refuses (size mismatch) or loads re-initialised."""
    other = shutil.copytree(actor_copy / "huggingface", tmp_path / "other-model")
    shutil.rmtree(actor_copy / "huggingface")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, field: value}))
    target = tmp_path / "out"
    line = error_line(run_cli("merge", actor_copy, target, "--config", other))
    assert f"the config in {other} does not describe this checkpoint's model: {says}" in line, line
    assert "pass --config with the config of the model that was trained" in line and no_leftovers(target)


def test_existing_target_is_refused_before_reading(qwen2_fp32_ws2, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    line = error_line(run_cli("merge", qwen2_fp32_ws2.actor, target))
    assert "--overwrite" in line
    assert (target / "keep.txt").read_text() == "mine" and len(list(target.iterdir())) == 1


def test_a_target_under_a_file_is_refused_in_words(qwen2_fp32_ws2, tmp_path):
    """Before: `error: File exists (PATH)`, from the lock file's folder being made."""
    (tmp_path / "notes.txt").write_text("mine")
    for target in (tmp_path / "notes.txt" / "merged", tmp_path / "notes.txt" / "a" / "merged"):
        proc = run_cli("merge", qwen2_fp32_ws2.actor, target)
        assert proc.returncode != 0
        line = error_line(proc)
        assert f"{tmp_path / 'notes.txt'} is a file, so the target {target} cannot be made under it; choose another " \
               "target folder" in line, line
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_target_in_a_folder_that_takes_no_files_is_refused_in_words(qwen2_fp32_ws2):
    """Before: `error: No such file or directory (/proc/.merged.hf-merge-lock)`, the lock file's
    raw OSError: /proc exists but creating a file in it fails with ENOENT."""
    line = error_line(run_cli("merge", qwen2_fp32_ws2.actor, "/proc/merged"))
    assert "no file can be created in /proc (No such file or directory); choose another target folder" in line, line


@pytest.mark.parametrize("where", ["source itself", "its parent", "a symlink to it", "the step it reads"])
def test_a_target_holding_the_source_is_refused_even_with_overwrite(where, qwen2_fp32_ws2, tmp_path):
    """Before: `hf-merge merge ckpts ckpts --overwrite` (or a TARGET that is the global_step_N above
    the actor/ given) exited 0 and replaced the training checkpoint by the merged model; without
    --overwrite the refusal suggested passing it. Now one line refuses both, the checkpoint intact,
    from the CLI and from hf_merge.merge."""
    import hf_merge
    from hf_merge.errors import TargetExistsError

    root = shutil.copytree(qwen2_fp32_ws2.root, tmp_path / "ckpts")
    actor = qwen2_fp32_ws2.actor.relative_to(qwen2_fp32_ws2.root)
    source, target = {"source itself": (root, root), "its parent": (root / actor, (root / actor).parent),
                      "a symlink to it": (root, tmp_path / "link"), "the step it reads": (root, root / actor)}[where]
    if where == "a symlink to it":
        target.symlink_to(root)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    for flags in ((), ("--overwrite",)):
        line = error_line(run_cli("merge", source, target, *flags))
        assert "holds the source checkpoint" in line and "--overwrite" not in line, line
    with pytest.raises(TargetExistsError, match="holds the source checkpoint"):
        hf_merge.merge(source, target, overwrite=True)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_a_target_inside_the_source_that_is_no_checkpoint_is_written(qwen2_fp32_ws2, tmp_path):
    """ckpts/merged, merged again with --overwrite, and actor/huggingface (verl's) stay allowed."""
    root = shutil.copytree(qwen2_fp32_ws2.root, tmp_path / "ckpts")
    for _ in range(2):
        assert run_cli("merge", root, root / "merged", "--overwrite").returncode == 0
    actor = root / qwen2_fp32_ws2.actor.relative_to(qwen2_fp32_ws2.root)
    assert run_cli("merge", actor, actor / "huggingface").returncode == 0


def test_shard_shape_inconsistent_with_placement(actor_copy, tmp_path):
    """A rank file whose local shard does not fit its DTensor placement is refused, naming it."""
    path = actor_copy / "model_world_size_2_rank_1.pt"
    state = torch.load(path, weights_only=False)  # our own fixture: trusted, fully read (no mmap)
    name = "model.norm.weight"
    dt = state[name]
    from torch.distributed.tensor import DTensor

    local = dt._local_tensor.clone()[:-1]
    state = {k: (v if k != name else DTensor(local, dt._spec, requires_grad=False)) for k, v in state.items()}
    torch.save(state, path)
    line = _fails(tmp_path, actor_copy, match=name)
    assert "model_world_size_2_rank_1.pt" in line


class _Payload:
    """Pickles as a call to os.system: what an attacker would put in a checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payload_is_refused_and_never_runs(actor_copy, tmp_path):
    marker = tmp_path / "PWNED"
    path = actor_copy / "model_world_size_2_rank_0.pt"
    state = torch.load(path, weights_only=False)
    state["evil"] = _Payload(marker)
    torch.save(state, path)
    line = _fails(tmp_path, actor_copy, match="model_world_size_2_rank_0.pt")
    assert "allowlist" in line and "nothing from it was run" in line
    assert not marker.exists()
    proc = run_cli("inspect", actor_copy)  # inspect refuses too
    assert "allowlist" in error_line(proc)
    assert not marker.exists()


def test_debug_variable_shows_traceback(tmp_path):
    # in this process: the variable is read when the error is reported, not at start-up
    proc = run_cli("merge", tmp_path / "nope", tmp_path / "out", env={"HF_MERGE_DEBUG": "1"}, in_process=True)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_interrupt_removes_temporary(qwen2_fp32_ws2, tmp_path, monkeypatch):
    """An error while writing (here: an interrupt from inside the writer) leaves nothing behind."""
    import hf_merge
    import hf_merge.write.shards as writer

    calls = {"n": 0}
    real = writer.write_file

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(writer, "write_file", flaky)
    target = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        hf_merge.merge(qwen2_fp32_ws2.actor, target, max_shard_size=20_000, workers=1)
    assert not target.exists() and no_leftovers(target)


def test_stale_temporary_from_dead_process_is_removed(qwen2_fp32_ws2, tmp_path):
    target = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.hf-merge-tmp-{dead.pid}"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    proc = run_cli("merge", qwen2_fp32_ws2.actor, target)
    assert proc.returncode == 0, proc.stderr
    assert not stale.exists()


def test_json_failure_is_one_object_on_stdout(qwen2_fp32_ws2, lora_only_ckpt, tmp_path):
    """With --json a failing merge / inspect prints one JSON object on stdout (a script reading it
    learns of the failure); stderr keeps the one `error:` line."""
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    cases = [
        (("merge", qwen2_fp32_ws2.actor, taken, "--json"), "TargetExistsError", "exists and is not empty"),
        (("merge", tmp_path / "nope", tmp_path / "out", "--json"), "SourceNotFoundError", "does not exist"),
        (("merge", lora_only_ckpt.actor, tmp_path / "out", "--json"), "LoraError", "holds only LoRA weights"),
        (("inspect", tmp_path / "nope", "--json"), "SourceNotFoundError", "does not exist"),
    ]
    for argv, kind, says in cases:
        proc = run_cli(*argv)
        line = error_line(proc)
        assert json.loads(proc.stdout) == {"error": line.removeprefix("error: "), "type": kind, "exit_code": proc.returncode}
        assert proc.returncode == 2 and says in line, argv
    assert not (tmp_path / "out").exists() and (taken / "keep.txt").read_text() == "mine"
    proc = run_cli("merge", tmp_path / "nope", tmp_path / "out")  # without --json: nothing on stdout
    assert proc.stdout == "" and error_line(proc)
