"""The CLI's head start (``hf_merge.write.head_start``): a forked child writes the first output file
while the merge imports torch, and the merge takes that file only when it is byte for byte the
one it planned. With or without it the output folder is the same; whatever the child does, the
merge's own checks decide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_merge.options import MergeOptions
from hf_merge.write import head_start
from hf_merge.readers import rank_records
from hf_merge.readers.safe_pickle import DTENSOR_FILE, torch_names

from helpers import error_line, processes, run_cli

pytestmark = pytest.mark.skipif(
    not (hasattr(os, "fork") and getattr(os, "O_TMPFILE", 0) and getattr(os, "O_DIRECT", 0)), reason="Linux only"
)
ROOT = Path(__file__).resolve().parents[1]


def without_conversion_table(monkeypatch) -> None:
    """``transformers.conversion_mapping`` out of ``sys.modules`` for the test, the module and the
    package's attribute put back after it: a sharded merge builds the model's meta skeleton, which
    imports the module again, and that second copy must not outlive the test (``import
    transformers.conversion_mapping`` would give it, where hf-merge reads ``sys.modules``)."""
    original = sys.modules.get("transformers.conversion_mapping")
    monkeypatch.delitem(sys.modules, "transformers.conversion_mapping", raising=False)
    package = sys.modules.get("transformers")
    if original is not None and package is not None:
        monkeypatch.setattr(package, "conversion_mapping", original, raising=False)


@pytest.fixture
def adoptions(monkeypatch):
    """What ``HeadStart.adopt`` answered, per call, in this process."""
    answers: list[bool] = []
    real = head_start.HeadStart.adopt
    # as in a fresh CLI process: transformers' conversion table read from its source, not asked
    # (an earlier test may have imported it; the child then declines, not knowing the Hub layout)
    without_conversion_table(monkeypatch)

    def recording(self, *args, **kwargs):
        answers.append(real(self, *args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(head_start.HeadStart, "adopt", recording)
    return answers


def _folder(path: Path) -> dict[str, bytes]:
    """Every file of a merged folder; the provenance without its creation time."""
    out = {}
    for p in sorted(path.iterdir()):
        data = p.read_bytes()
        if p.name == "hf_merge.json":
            record = json.loads(data)
            record.pop("created", None)
            data = json.dumps(record, sort_keys=True).encode()
        out[p.name] = data
    return out


def _merge_both_ways(source: Path, tmp_path: Path, *flags: str) -> tuple[dict, dict]:
    with_head = tmp_path / "with"
    without = tmp_path / "without"
    proc = run_cli("merge", source, with_head, *flags)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("merge", source, without, *flags, env={head_start.ENV: "0"}, in_process=True)
    assert proc.returncode == 0, proc.stderr
    return _folder(with_head), _folder(without)


@pytest.mark.parametrize("flags", [("--dtype", "auto"), ("--dtype", "float32", "--max-shard-size", "300KB")],
                         ids=["one file", "sharded"])
def test_the_childs_file_is_taken_and_the_folder_is_the_same(qwen2_fp32_ws2, tmp_path, adoptions, flags):
    got, expected = _merge_both_ways(qwen2_fp32_ws2.actor, tmp_path, *flags)
    assert adoptions == [True]
    assert got == expected
    if "--max-shard-size" in flags:
        assert "model.safetensors.index.json" in got and sum(n.endswith(".safetensors") for n in got) >= 2


@pytest.mark.parametrize("kind", ["crc32", "sha256"])
def test_the_recorded_checksum_is_the_written_files(kind, qwen2_fp32_ws2, tmp_path, adoptions):
    import hashlib
    import zlib

    out = tmp_path / "out"
    assert run_cli("merge", qwen2_fp32_ws2.actor, out, "--dtype", "auto", "--checksum", kind).returncode == 0
    assert adoptions == [True]
    recorded = json.loads((out / "hf_merge.json").read_text())["files"]
    data = (out / "model.safetensors").read_bytes()
    want = f"crc32:{zlib.crc32(data):08x}" if kind == "crc32" else hashlib.sha256(data).hexdigest()
    assert recorded["model.safetensors"] == want


@pytest.mark.parametrize("case", ["cast", "tied", "lora", "switched off"])
def test_no_head_start_where_the_merge_is_not_a_plain_copy(case, checkpoint, tmp_path, adoptions):
    name, flags, env = {
        "cast": ("qwen2_fp32_ws2", (), None),  # config.json says bfloat16: a cast
        "tied": ("llama_tied_bf16_ws4", (), None),
        "lora": ("lora_ckpt", ("--lora", "fuse"), None),
        "switched off": ("qwen2_fp32_ws2", ("--dtype", "auto"), {head_start.ENV: "0"}),
    }[case]
    out = tmp_path / "out"
    proc = run_cli("merge", checkpoint(name).actor, out, *flags, env=env, in_process=True)
    assert proc.returncode == 0, proc.stderr
    assert adoptions == ([] if case == "switched off" else [False])
    assert (out / "model.safetensors").is_file()


def test_no_child_is_forked_for_other_formats(tmp_path, monkeypatch):
    """A Hugging Face folder (or any source of a format the child does not read) forks nothing."""
    import shutil

    forks: list[object] = []
    real = head_start.begin
    monkeypatch.setattr(head_start, "begin", lambda request: forks.append(request) or real(request))
    reference = ROOT / "tests" / "data" / "colossalai" / "ddp_safetensors_ws2" / "reference"
    data = tmp_path / "hf"
    data.mkdir()
    shutil.copy(reference / "config" / "config.json", data / "config.json")
    shutil.copy(reference / "weights.safetensors", data / "model.safetensors")
    proc = run_cli("merge", data, tmp_path / "out", "--dtype", "auto", in_process=True)
    assert proc.returncode == 0, proc.stderr
    assert forks == []
    with_rank_files = run_cli("merge", tmp_path / "missing", tmp_path / "out2", in_process=True)
    assert with_rank_files.returncode != 0 and forks == []


def test_the_fork_follows_the_reader_backend_names(qwen2_fp32_ws2, tmp_path, monkeypatch):
    """``--backend`` decides the reader: fsdp's alias forks as ``auto`` does on rank files, another
    format's name forks nothing (the merge then reads the folder as that format, or says why not)."""
    forks: list[object] = []
    real = head_start.begin
    monkeypatch.setattr(head_start, "begin", lambda request: forks.append(request) or real(request))
    proc = run_cli("merge", qwen2_fp32_ws2.actor, tmp_path / "a", "--dtype", "auto", "--backend", "verl-fsdp", in_process=True)
    assert proc.returncode == 0, proc.stderr
    assert len(forks) == 1
    run_cli("merge", qwen2_fp32_ws2.actor, tmp_path / "b", "--dtype", "auto", "--backend", "megatron", in_process=True)
    assert len(forks) == 1


def test_a_child_that_copied_other_bytes_is_not_kept(qwen2_fp32_ws2, tmp_path, adoptions, monkeypatch):
    """The child's name and header match, so its file is linked; its recipe, told once it has
    written, is not the merge's: the merge drops the file and writes it itself."""
    real, finished = head_start._write, []

    def swapped(*args, **kwargs):  # the child says it copied two tensors' ranges in the other order
        digest, ranges = real(*args, **kwargs)
        ranges[0], ranges[1] = ranges[1], ranges[0]
        return digest, ranges

    monkeypatch.setattr(head_start, "_write", swapped)
    finish = head_start.HeadStart.finish
    monkeypatch.setattr(head_start.HeadStart, "finish", lambda self: finished.append(finish(self)) or finished[-1])
    got, expected = _merge_both_ways(qwen2_fp32_ws2.actor, tmp_path, "--dtype", "auto")
    assert adoptions == [True] and finished == [(False, None)]
    assert got == expected


def test_a_child_that_fails_after_its_file_was_taken_is_written_again(qwen2_fp32_ws2, tmp_path, adoptions, bars, monkeypatch):
    taken_r, taken_w = os.pipe()  # the merge writes a byte here once it has taken the child's file
    recording = head_start.HeadStart.adopt

    def adopt_then_tell(self, *args, **kwargs):
        taken = recording(self, *args, **kwargs)
        if taken:
            os.write(taken_w, b"t")
        return taken

    def half_written_then_killed(planned, fd, checksum, progress):
        buffered = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)  # fd itself is O_DIRECT
        os.pwrite(buffered, b"\0" * 4096, 0)
        progress(4096)
        os.read(taken_r, 1)  # the child dies only after its file was taken (forked: it has the pipe)
        os.kill(os.getpid(), 9)

    monkeypatch.setattr(head_start.HeadStart, "adopt", adopt_then_tell)
    monkeypatch.setattr(head_start, "_write", half_written_then_killed)
    with_head, without = tmp_path / "with", tmp_path / "without"
    proc = run_cli("merge", qwen2_fp32_ws2.actor, with_head, "--dtype", "auto")
    assert proc.returncode == 0, proc.stderr
    assert adoptions == [True]
    assert "head-start writer failed" in proc.stderr
    weights = _weight_bytes(with_head)
    assert [(b["total"], b["done"]) for b in bars] == [(weights, weights)]  # the rewrite's bytes not counted twice
    assert run_cli("merge", qwen2_fp32_ws2.actor, without, "--dtype", "auto", env={head_start.ENV: "0"},
                   in_process=True).returncode == 0
    assert _folder(with_head) == _folder(without)
    os.close(taken_r)
    os.close(taken_w)


def _children() -> list[int]:
    me = str(os.getpid())
    return [pid for pid, fields in processes() if fields[1] == me]


def test_a_merge_that_fails_stops_the_child_and_leaves_nothing(qwen2_fp32_ws2, tmp_path):
    import shutil

    source = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, source)
    rank1 = source / "model_world_size_2_rank_1.pt"
    rank1.write_bytes(rank1.read_bytes()[:-4096])  # truncated: the merge refuses it
    before = set(_children())
    proc = run_cli("merge", source, tmp_path / "out", "--dtype", "auto")
    assert proc.returncode != 0 and "truncated" in error_line(proc), proc.stderr
    assert not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path)) == ["actor"]
    assert set(_children()) <= before


def test_the_child_imports_no_torch(qwen2_fp32_ws2, tmp_path):
    """What the child runs, in a fresh interpreter: plan and write without torch."""
    code = f"""
import hashlib, json, os, sys
from hf_merge.options import MergeOptions
from hf_merge.write import head_start as hs
request = hs.Request({str(qwen2_fp32_ws2.actor)!r}, {str(tmp_path / "out")!r}, MergeOptions(dtype="auto"))
planned = hs._plan(request)
fd = os.open({str(tmp_path)!r}, os.O_TMPFILE | os.O_RDWR, 0o644)
digest, _ranges = hs._write(planned, fd, "sha256", lambda n: None)
data = os.pread(fd, os.fstat(fd).st_size, 0)
print(json.dumps({{"torch": "torch" in sys.modules, "digest": digest, "data": hashlib.sha256(data).hexdigest()}}))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["torch"] is False
    assert result["digest"] == result["data"]
    out = tmp_path / "merged"
    assert run_cli("merge", qwen2_fp32_ws2.actor, out, "--dtype", "auto", env={head_start.ENV: "0"},
                   in_process=True).returncode == 0
    import hashlib

    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == result["digest"]


def test_the_childs_pickle_policy_is_a_subset_of_the_one_policy():
    allow, names, subs = rank_records.named_policy()
    assert allow.calls <= DTENSOR_FILE.calls and allow.classes <= DTENSOR_FILE.classes
    assert names.names <= torch_names().names
    for pair in allow.pairs() | names.pairs():  # nothing the child allows is looked up in a module
        assert pair in subs or pair[0] in ("builtins", "collections"), pair


def test_the_dcp_childs_pickle_policies_are_the_readers_with_no_torch_module_looked_up():
    """The DCP child reads ``.metadata`` and the chunk pickles under the reader's own allowlists, with
    a subset of torch's names, every torch pair bound to a stand-in (nothing imports torch)."""
    from hf_merge.readers import dcp_index
    from hf_merge.readers.safe_pickle import DCP_METADATA

    for allow, (names, subs) in [(DCP_METADATA, dcp_index._named_metadata_policy()),
                                 (dcp_index._CHUNK_PICKLE, dcp_index._chunk_policy(True))]:
        assert names.names <= torch_names().names
        for pair in allow.pairs() | names.pairs():
            assert pair in subs or not pair[0].startswith("torch"), pair


@pytest.mark.parametrize("name", ["qwen2_fp32_ws2", "hsdp_fsdp2_ckpt", "uneven_fsdp2_ckpt", "mixed_buffers_ckpt"])
def test_the_torch_free_index_agrees_with_the_torch_reader(name, checkpoint):
    import torch

    from hf_merge.readers.fsdp import FsdpCheckpoint

    ck = checkpoint(name)
    reader = FsdpCheckpoint(ck.actor)
    try:
        for path in sorted(ck.actor.glob("model_world_size_*_rank_*.pt")):
            index = rank_records.index_rank_file(path)
            loaded = rank_records.load_rank_records(path)
            assert list(index) == list(loaded)
            with open(path, "rb") as f:
                for key, value in loaded.items():
                    local = getattr(value, "_local_tensor", value)
                    got = index[key]
                    assert str(got.dtype) == str(value.dtype) and got.shape == tuple(value.shape), key
                    assert got.local_shape == tuple(local.shape), key
                    assert (got.placements is None) == isinstance(value, torch.Tensor), key
                    if got.span is not None and local.numel():
                        f.seek(got.span[0])
                        raw = f.read(got.span[1])
                        assert raw == local.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), key
    finally:
        reader.close()


@pytest.mark.parametrize("change", ["hub layout", "cast", "tied"])
def test_the_child_declines_what_is_not_a_plain_copy(change, qwen2_fp32_ws2, tmp_path, monkeypatch):
    import shutil

    without_conversion_table(monkeypatch)  # as in a fresh CLI
    reason = {"hub layout": "Hub layout", "cast": "a cast", "tied": "tied"}[change]

    source = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, source)
    config_path = source / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    dtype = "auto"
    if change == "hub layout":  # a composite model: save_pretrained may rename its sub-models' tensors
        config["text_config"] = {"model_type": "qwen2"}
    elif change == "cast":
        dtype = None  # config.json's bfloat16, the shards are float32
    elif change == "tied":
        config["tie_word_embeddings"] = True
    config_path.write_text(json.dumps(config))
    request = head_start.Request(str(source), str(tmp_path / "out"), MergeOptions(dtype=dtype))
    with pytest.raises(head_start._Skip, match=reason):
        head_start._plan(request)
    if change == "hub layout":
        del config["text_config"]
        config_path.write_text(json.dumps(config))
        planned = head_start._plan(request)  # the same folder as a dense model: planned
        assert planned.file.name == "model.safetensors"


FSDP_CELLS = sorted(d for d in (ROOT / "tests" / "data" / "torch_versions").glob("torch-*/*") if d.name != "dcp" and d.is_dir())


@pytest.mark.parametrize("cell", FSDP_CELLS, ids=lambda d: f"{d.parent.name}/{d.name}")
def test_the_child_lays_out_every_tensor_as_the_reader_does(cell, tmp_path):
    """Rank files written by each torch release (FSDP1, FSDP2 with Shard(0) or Shard(1), HSDP): the
    child's torch-free index has the reader's layouts, and its recipe, when it has one, is the
    merge's own recipe for the same file; without one (bytes that are not one run: Shard(1)) it
    declines."""
    from hf_merge.readers.fsdp import FsdpCheckpoint
    from hf_merge.readers.fsdp_files import RankIndex
    from hf_merge.write.engine import byte_recipe
    from hf_merge.write.plan import plan_shards

    reader = FsdpCheckpoint(cell)
    index = RankIndex(cell, reader.world_size)
    try:
        assert list(index.layouts) == list(reader._layouts)
        for name, lay in reader._layouts.items():
            got = index.layouts[name]
            assert (got.pieces, got.placements, got.replicas) == (lay.pieces, lay.placements, lay.replicas), name
            assert (got.spec.shape, str(got.spec.dtype)) == (lay.spec.shape, str(lay.spec.dtype)), name
        first = plan_shards(index.specs()).files[0]
        ours = byte_recipe(index, first)
        assert ours == byte_recipe(reader, plan_shards(reader.specs()).files[0])
    finally:
        reader.close()
        index.close()
    try:
        planned = head_start._plan(head_start.Request(str(cell), str(tmp_path / "out"), MergeOptions(dtype="auto")))
    except head_start._Skip:  # also for its config (a tie, the Hub layout)
        planned = None
    if ours is None:  # declined from the layout alone, before anything is written
        assert planned is None
    else:
        assert planned is None or byte_recipe(planned.index, planned.file) == ours


@pytest.fixture
def bars(monkeypatch):
    """The progress bars a merge opens, as ``{"desc", "total", "done"}`` dicts."""
    import contextlib

    from hf_merge import progress

    opened = []

    @contextlib.contextmanager
    def counting_bar(iterable=None, *, total=None, desc, **kwargs):
        bar = {"total": total, "desc": desc, "done": 0}
        opened.append(bar)

        class Bar:
            def update(self, n):
                bar["done"] += n

        yield Bar()

    monkeypatch.setattr(progress, "progress_bar", counting_bar)
    return opened


def _weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size - (8 + int.from_bytes(p.read_bytes()[:8], "little")) for p in folder.glob("*.safetensors"))


def test_one_progress_bar_counts_every_byte_of_every_file(qwen2_fp32_ws2, tmp_path, adoptions, bars):
    """The child's bytes and the merge's own files go to the same bar, each byte once."""
    out = tmp_path / "out"
    proc = run_cli("merge", qwen2_fp32_ws2.actor, out, "--dtype", "auto", "--max-shard-size", "300KB")
    assert proc.returncode == 0, proc.stderr
    assert adoptions == [True]
    weights = _weight_bytes(out)
    assert [(b["desc"], b["total"], b["done"]) for b in bars] == [("Merging", weights, weights)]


def _ask_for_code(path: Path, key: str, marker: Path) -> None:
    """Put under ``key`` of the ``torch.save`` file ``path`` an object whose unpickling would run
    ``touch marker``."""
    import torch

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    state = torch.load(path, weights_only=False)
    state[key] = Boom()
    torch.save(state, path)


def _merge_refuses_code(source: Path, tmp_path: Path, marker: Path, *flags: str) -> None:
    """``hf-merge merge source`` (head start on) ends with the one pickle policy's error line: the
    command never ran, no target, no child left."""
    before = set(_children())
    line = error_line(run_cli("merge", source, tmp_path / "out", *flags))
    assert "system" in line and "allowlist" in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert set(_children()) <= before


def test_a_rank_file_that_asks_for_code_is_one_line_and_nothing_runs(qwen2_fp32_ws2, tmp_path, adoptions):
    """The child refuses it under its subset of the policy; the merge refuses it with the one
    policy's error line; no target, no child left, the command never ran."""
    import shutil

    source = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, source)
    marker = tmp_path / "ran"
    rank1 = source / "model_world_size_2_rank_1.pt"
    _ask_for_code(rank1, "model.norm.weight", marker)
    from hf_merge.errors import UnsafeCheckpointError

    with pytest.raises(UnsafeCheckpointError, match="system"):  # the child's own reading
        rank_records.index_rank_file(rank1)
    _merge_refuses_code(source, tmp_path, marker, "--dtype", "auto")
    assert adoptions == []  # refused while the merge opened the source, before any weight was planned


# ---- DCP folders (generic DCP, accelerate): the same child, their torch-free index ---------------


def _dcp_case(dcp_root: Path, case: str) -> tuple[Path, tuple]:
    source = dcp_root / case / ("dump" if case == "torchtitan" else "ckpt")
    return source, ("--config", dcp_root / case / "config", "--dtype", "auto")


@pytest.fixture
def finishes(monkeypatch):
    """What ``HeadStart.finish`` answered (kept the child's file or not), per call, in this process."""
    answers: list[bool] = []
    real = head_start.HeadStart.finish

    def recording(self):
        kept = real(self)
        answers.append(kept[0])
        return kept

    monkeypatch.setattr(head_start.HeadStart, "finish", recording)
    return answers


@pytest.fixture
def forks(monkeypatch):
    """The format of every head start ``begin`` started (forked a child for), per call, in this process."""
    started_for: list[str] = []
    real = head_start.begin

    def begin(request):
        started = real(request)
        if started is not None:
            started_for.append(request.format)
        return started

    monkeypatch.setattr(head_start, "begin", begin)
    return started_for


@pytest.mark.parametrize("case", ["accelerate", "dcp_nested", "torchtitan"])
def test_a_dcp_folders_first_file_is_the_childs_and_the_folder_is_the_same(case, dcp_root, tmp_path, adoptions, finishes, forks):
    """The child's file is linked and kept (its byte recipe is the merge's: for torchtitan's q/k,
    each head's source rows and their un-permuted order), and the folder is the merge's own."""
    source, flags = _dcp_case(dcp_root, case)
    got, expected = _merge_both_ways(source, tmp_path, *flags)
    assert (forks, adoptions, finishes) == ([{"dcp_nested": "dcp"}.get(case, case)], [True], [True])
    assert got == expected


@pytest.mark.parametrize("case", ["qwen2_v1", "llama_v2_singleton"])
def test_a_megatron_folders_first_file_is_the_childs_and_the_folder_is_the_same(case, megatron_root, tmp_path, adoptions,
                                                                               finishes, forks):
    """Megatron-Core torch_dist (TP>1: the row-parallel weights are each rank's columns side by
    side, copied as ColumnGathers): the child's file is linked and kept, the folder the merge's own."""
    got, expected = _merge_both_ways(megatron_root / case / "actor", tmp_path, "--dtype", "auto")
    assert (forks, adoptions, finishes) == (["megatron"], [True], [True])
    assert got == expected


def test_a_model_save_pretrained_may_rename_is_served_once_a_merge_stored_its_hub_layout(megatron_moe_root, hub_root,
                                                                                         tmp_path, adoptions, finishes, forks,
                                                                                         monkeypatch):
    """Qwen3-MoE: transformers 5 fuses its experts in memory, so the child cannot tell the Hub layout
    without transformers and declines the first merge. That merge stores the layout in the plan
    cache; a Megatron folder's is the source's own names (stored as a passthrough), so the next
    merge's child serves it, and the folder is the merge's own. A verl FSDP folder of the same model
    holds the fused in-memory names: its stored plan renames them, and the child still declines."""
    monkeypatch.setenv("HF_MERGE_CACHE", str(tmp_path / "cache"))
    source = megatron_moe_root / "qwen3_moe" / "actor"
    first = run_cli("merge", source, tmp_path / "first", "--dtype", "auto")
    assert first.returncode == 0, first.stderr
    assert (forks, adoptions) == (["megatron"], [False])
    got, expected = _merge_both_ways(source, tmp_path, "--dtype", "auto")
    assert (forks[1:], adoptions[1:], finishes) == (["megatron"], [True], [True])
    assert got == expected
    fsdp = hub_root / "qwen3_moe"
    for out in ("fsdp1", "fsdp2"):
        proc = run_cli("merge", fsdp, tmp_path / out, "--dtype", "auto")
        assert proc.returncode == 0, proc.stderr
    assert (forks[2:], adoptions[2:]) == (["fsdp", "fsdp"], [False, False])
    assert any((tmp_path / "cache").rglob("*.json"))


@pytest.mark.parametrize("case", ["mistral_critic_v2", "qwen2_legacy_tied", "qwen2_mbridge_v2", "qwen3_tied_v2"])
def test_megatron_folders_the_child_does_not_serve_are_the_merges_own(case, megatron_root, tmp_path, adoptions):
    """A critic, the legacy per-rank files, an mbridge folder, a tied model: the merge writes every
    file (no file is taken from the child), and the folder is what it writes without one."""
    role = "critic" if "critic" in case else "actor"
    got, expected = _merge_both_ways(megatron_root / case / role, tmp_path, "--dtype", "auto")
    assert True not in adoptions
    assert got == expected


def test_a_tied_dcp_folder_is_written_by_the_merge(dcp_root, tmp_path, adoptions, monkeypatch):
    """A tied model (dcp_plain) is declined by the child."""
    forks: list[object] = []
    real = head_start.begin
    monkeypatch.setattr(head_start, "begin", lambda request: forks.append(request.format) or real(request))
    proc = run_cli("merge", dcp_root / "dcp_plain" / "ckpt", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert (forks, adoptions) == (["dcp"], [False])


@pytest.mark.parametrize("case", ["accelerate", "torchtitan", "megatron", "deepspeed", "deepspeed universal", "colossalai"])
def test_the_dcp_child_imports_no_torch_and_writes_the_merges_file(case, request, tmp_path):
    """The CLI's choice of a head start and the child's plan and file, in a fresh interpreter:
    no torch (torchtitan's name table and q/k un-permutation included); the file is byte for byte
    the merge's own."""
    if case == "megatron":
        source, flags = request.getfixturevalue("megatron_root") / "qwen2_v1" / "actor", ("--dtype", "auto")
    elif case == "deepspeed":
        source, flags = DEEPSPEED / "z3_fp32_ws3", _deepspeed_flags("z3_fp32_ws3")
    elif case == "deepspeed universal":
        source, flags = UNIVERSAL / "z2_bf16_align_ws3", _deepspeed_flags("z2_bf16_align_ws3")
    elif case == "colossalai":
        source, flags = COLOSSALAI / "hybrid_tp2_pp2_ws4", ("--dtype", "auto")
    else:
        source, flags = _dcp_case(request.getfixturevalue("dcp_root"), case)
    config = str(flags[1]) if flags[0] == "--config" else None
    form = case.split()[0]
    code = f"""
import hashlib, json, os, sys
from hf_merge.options import MergeOptions
from hf_merge.write import head_start as hs
from hf_merge.cli.merge import _head_start_format
assert _head_start_format({str(source)!r}, "auto") == {form!r}  # the CLI's choice, made without torch too
request = hs.Request({str(source)!r}, {str(tmp_path / "out")!r}, MergeOptions(dtype="auto", config={config!r}), {form!r})
planned = hs._plan(request)
fd = os.open({str(tmp_path)!r}, os.O_TMPFILE | os.O_RDWR, 0o644)
digest, _ranges = hs._write(planned, fd, "sha256", lambda n: None)
print(json.dumps({{"torch": "torch" in sys.modules, "digest": digest}}))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["torch"] is False
    out = tmp_path / "merged"
    assert run_cli("merge", source, out, *flags, env={head_start.ENV: "0"}, in_process=True).returncode == 0
    import hashlib

    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == result["digest"]


def _recipe(ckpt, name: str, dtype) -> list | None:
    """The file bytes ``ckpt.read_rows`` hands the writer for ``name`` (``byte_recipe``'s question):
    adjacent runs joined (``engine.join_range``), rows side by side in several runs as
    ``("columns", first row, [(inode, offset, bytes) of each run])``; None when there are no row
    runs or some are not file bytes."""
    from hf_merge.readers.file_runs import ColumnGather
    from hf_merge.write.engine import file_bytes, join_range

    rows = ckpt.read_rows(name, dtype)
    if rows is None:
        return None
    ranges: list = []
    for first, run in rows:
        if isinstance(run, ColumnGather):
            ranges.append(("columns", first, [(os.fstat(r.fd).st_ino, r.offset, r.nbytes) for r in run.runs]))
            continue
        located = file_bytes(run)
        if located is None:
            return None
        st = os.fstat(located.fd)
        join_range(ranges, (st.st_dev, st.st_ino), located.offset, located.nbytes)
    return ranges


DCP_CELLS = sorted((ROOT / "tests" / "data" / "torch_versions").glob("torch-*/dcp"))


@pytest.mark.parametrize("case", ["dcp_plain/ckpt", "dcp_nested/ckpt", "accelerate/ckpt/pytorch_model_fsdp_0",
                                  "torchtitan/dump/checkpoint/step-1", *map(str, DCP_CELLS)])
def test_the_torch_free_dcp_index_agrees_with_the_torch_reader(case, dcp_root):
    """Every tensor of every DCP fixture, those written by each torch release from 2.4 on included:
    the same shape and dtype, and the same file bytes, row band by row band, as the DCP reader
    hands the writer (``byte_recipe``'s question)."""
    from hf_merge.readers.dcp import DcpCheckpoint
    from hf_merge.readers.dcp_index import DcpIndex

    index = DcpIndex(dcp_root / case)
    served = 0
    with DcpCheckpoint(dcp_root / case) as reader:
        specs = reader.specs()
        assert {n: (s.shape, str(s.dtype)) for n, s in index.specs().items()} == {n: (s.shape, str(s.dtype)) for n, s in specs.items()}
        for name, spec in specs.items():
            if spec.shape and spec.shape[0]:  # the index refuses no tensor the reader has runs of
                mine = _recipe(index, name, index.specs()[name].dtype)
                assert mine == _recipe(reader, name, spec.dtype), name
                served += mine is not None
                # rows of it (a layer's slice, a permuted head's rows): the same file bytes too
                _same_file_rows(index, reader, name, spec.shape)
    index.close()
    assert served >= len(specs) // 2


def _file_bytes_of(rows) -> list | None:
    """``file_rows``' answer as (row, [(inode, offset, bytes) of each run side by side])."""
    from hf_merge.readers.file_runs import ColumnGather

    if rows is None:
        return None
    return [(r, [(os.fstat(x.fd).st_ino, x.offset, x.nbytes) for x in (p.runs if isinstance(p, ColumnGather) else (p,))])
            for r, p in rows]


def _same_file_rows(index, reader, name: str, shape: tuple[int, ...]) -> int:
    """The torch-free index and the DCP reader give the same file bytes for rows of ``name`` (a
    layer's slice of a stacked tensor, a band of it); the number of bands whose columns several
    chunks hold."""
    index_of = (0,) * (len(shape) - 2) if len(shape) > 2 else ()
    rows = shape[len(index_of)]
    columns = 0
    for first, n in ((0, rows), (rows // 3, max(1, rows // 2))):
        a, b = _file_bytes_of(index.file_rows(name, index_of, first, n)), _file_bytes_of(reader.file_rows(name, index_of, first, n))
        assert a == b, name
        columns += sum(len(parts) > 1 for _, parts in a or ())
    return columns


def test_the_torch_free_index_agrees_with_the_reader_on_megatron_folders(megatron_root):
    """Megatron-Core torch_dist folders (layers stacked, TP chunks): the same file bytes for every
    layer slice, a TP>1 row-parallel weight's rows as the same chunk runs side by side."""
    from hf_merge.readers.dcp import DcpCheckpoint
    from hf_merge.readers.dcp_index import DcpIndex

    folders = sorted(p.parent for p in megatron_root.glob("*/actor/**/.metadata"))
    assert folders
    columns = 0
    for folder in folders:
        index = DcpIndex(folder)
        with DcpCheckpoint(folder) as reader:
            for name, spec in reader.specs().items():
                if not name.startswith("optimizer") and len(spec.shape) >= 2 and spec.shape[0]:
                    columns += _same_file_rows(index, reader, name, spec.shape)
        index.close()
    assert columns, "no Megatron fixture has a weight cut along its columns: the test proves nothing"


@pytest.mark.parametrize("damage", ["truncated chunk file", "metadata that asks for code"])
def test_a_damaged_dcp_folder_is_one_line_with_the_child_running(damage, dcp_root, tmp_path, adoptions, monkeypatch):
    """The accelerate fixture, damaged, merged with the head start on: the one reader's error line,
    no target, no child left behind, and nothing from the pickle ran."""
    import pickle
    import shutil

    forks: list[str] = []
    real = head_start.begin
    monkeypatch.setattr(head_start, "begin", lambda request: forks.append(request.format) or real(request))

    source = tmp_path / "ckpt"
    shutil.copytree(dcp_root / "accelerate" / "ckpt", source)
    model = source / "pytorch_model_fsdp_0"
    marker = tmp_path / "ran"
    if damage == "truncated chunk file":
        data = sorted(model.glob("*.distcp"))[-1]
        data.write_bytes(data.read_bytes()[:-4096])
    else:
        class Boom:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        (model / ".metadata").write_bytes(pickle.dumps(Boom()))
    before = set(_children())
    proc = run_cli("merge", source, tmp_path / "out", "--config", dcp_root / "accelerate" / "config", "--dtype", "auto")
    line = error_line(proc)
    assert proc.returncode != 0
    assert ("truncated" in line) if damage == "truncated chunk file" else ("system" in line and "allowlist" in line), line
    assert forks == ["accelerate"] and adoptions == [] and not marker.exists() and not (tmp_path / "out").exists()
    assert set(_children()) <= before


@pytest.mark.parametrize("case", ["torchtitan", "megatron"])
def test_a_config_no_name_table_maps_is_one_line_with_the_child_running(case, request, tmp_path, adoptions, forks):
    """A config.json whose model_type no name table maps (the child opens the name table too): the
    child is forked, the merge fails with the reader's one error line, no target, no child left."""
    import shutil

    if case == "megatron":
        source, config = request.getfixturevalue("megatron_root") / "qwen2_v1" / "actor", None
        config = tmp_path / "config"
        shutil.copytree(source / "huggingface", config)
    else:
        dcp_root = request.getfixturevalue("dcp_root")
        source, config = dcp_root / "torchtitan" / "dump", tmp_path / "config"
        shutil.copytree(dcp_root / "torchtitan" / "config", config)
    data = json.loads((config / "config.json").read_text())
    data["model_type"] = "gpt2"
    (config / "config.json").write_text(json.dumps(data))
    before = set(_children())
    proc = run_cli("merge", source, tmp_path / "out", "--config", config)
    line = error_line(proc)
    assert "name table" in line and "gpt2" in line, line
    assert forks == [case] and adoptions == []
    assert not (tmp_path / "out").exists() and set(_children()) <= before


# ---- DeepSpeed ZeRO folders: the reader's own layout (ZeroLayout) over pickles read without torch -----

DEEPSPEED = ROOT / "tests" / "data" / "deepspeed"
DEEPSPEED_CASES = sorted(p.name for p in DEEPSPEED.iterdir() if (p / "variant.json").is_file())


def _deepspeed_flags(name: str) -> tuple:
    return ("--config", DEEPSPEED / name / "reference" / "step2" / "config", "--dtype", "auto")


@pytest.mark.parametrize("name", ["z3_fp32_ws3", "z1_fp32_ws1"])
def test_a_deepspeed_folders_first_file_is_the_childs_and_the_folder_is_the_same(name, tmp_path, adoptions, finishes, forks):
    """ZeRO-3 over 3 ranks (rows cut between ranks copied as their pieces side by side) and ZeRO-1
    on one rank, fp32 masters written as they are: the child's file is linked and kept, the folder
    is the merge's own."""
    got, expected = _merge_both_ways(DEEPSPEED / name, tmp_path, *_deepspeed_flags(name))
    assert (forks, adoptions, finishes) == (["deepspeed"], [True], [True])
    assert got == expected


@pytest.mark.parametrize("name, flags", [("z3_bf16_tied_ws2", ()), ("z3_fp32_ws3", ("--dtype", "bfloat16"))],
                         ids=["tied", "cast"])
def test_deepspeed_merges_the_child_declines_are_the_merges_own(name, flags, tmp_path, adoptions, forks):
    """A tied model, and fp32 masters written as bfloat16: the child is forked and declines, the
    merge writes every file, and the folder is what it writes without the child."""
    got, expected = _merge_both_ways(DEEPSPEED / name, tmp_path, *_deepspeed_flags(name), *flags)
    assert (forks, adoptions) == (["deepspeed"], [False])
    assert got == expected


UNIVERSAL = ROOT / "tests" / "data" / "deepspeed_universal"


def test_a_universal_deepspeed_folders_first_file_is_the_childs(tmp_path, adoptions, finishes, forks):
    """ds_to_universal output (one fp32.pt per parameter, laid out by the reader's own
    ``universal_layout``): the child's file is linked and kept, the folder is the merge's own."""
    config = DEEPSPEED / "z2_bf16_align_ws3" / "reference" / "step2" / "config"
    got, expected = _merge_both_ways(UNIVERSAL / "z2_bf16_align_ws3", tmp_path, "--config", config, "--dtype", "auto")
    assert (forks, adoptions, finishes) == (["deepspeed"], [True], [True])
    assert got == expected


@pytest.mark.parametrize("name", sorted(p.name for p in UNIVERSAL.iterdir() if p.is_dir()))
def test_the_torch_free_universal_index_agrees_with_the_torch_reader(name):
    """Every tensor of every universal fixture: the same names in the same order, shapes, dtypes
    and file bytes (one run of its fp32.pt per master; a tied alias its source's)."""
    from hf_merge.readers.deepspeed import open_deepspeed
    from hf_merge.readers.deepspeed_files import UniversalIndex, resolve_deepspeed_dir
    from hf_merge.write.engine import file_bytes

    def run_of(ckpt, spec):
        rows = ckpt.read_rows(spec.name, spec.dtype)
        if rows is None:
            return None
        (first, run), = rows
        located = file_bytes(run)
        return None if located is None else (first, os.fstat(located.fd).st_ino, located.offset, located.nbytes)

    reader = open_deepspeed(UNIVERSAL / name)
    index = UniversalIndex(resolve_deepspeed_dir(UNIVERSAL / name))
    try:
        specs, indexed = reader.specs(), index.specs()
        assert list(indexed) == list(specs)
        for key, spec in specs.items():
            assert (indexed[key].shape, str(indexed[key].dtype)) == (spec.shape, str(spec.dtype)), key
            want = run_of(reader, spec)
            assert want is not None and run_of(index, indexed[key]) == want, key
    finally:
        reader.close()
        index.close()


@pytest.mark.parametrize("name", DEEPSPEED_CASES)
def test_the_torch_free_deepspeed_index_agrees_with_the_torch_reader(name):
    """Every tensor of every DeepSpeed fixture (ZeRO 1/2/3, BF16_Optimizer, alignment padding, an
    HF Trainer folder, LoRA): the same names in the same order, shapes and dtypes, and the same file
    bytes as the reader hands the writer, rows cut between partitions as the same pieces."""
    from hf_merge.readers.deepspeed import open_deepspeed
    from hf_merge.readers.deepspeed_files import DeepSpeedIndex, resolve_deepspeed_dir

    source = next(DEEPSPEED.joinpath(name).rglob("latest")).parent
    reader = open_deepspeed(source)
    index = DeepSpeedIndex(resolve_deepspeed_dir(source))
    try:
        specs, indexed = reader.specs(), index.specs()
        assert list(indexed) == list(specs)
        cut_rows = 0
        for name_, spec in specs.items():
            assert (indexed[name_].shape, str(indexed[name_].dtype)) == (spec.shape, str(spec.dtype)), name_
            want = _recipe(reader, name_, spec.dtype)  # the reader's rows of a master are file bytes
            assert want is not None and _recipe(index, name_, indexed[name_].dtype) == want, name_
            cut_rows += sum(1 for entry in want if entry[0] == "columns")
        if name.startswith("z3") or name in ("z2_bf16_align_ws3", "z1_bf16_tied_ws2"):
            assert cut_rows, "no row of this fixture is cut between partitions: the cut-row case is not tested"
    finally:
        reader.close()
        index.close()


def test_the_deepspeed_childs_pickle_policy_is_the_readers_with_no_torch_module_looked_up():
    from hf_merge.readers import deepspeed_files
    from hf_merge.readers.deepspeed import DEEPSPEED_FILE

    allow, names, subs = deepspeed_files._named_policy()
    assert allow.calls <= DEEPSPEED_FILE.calls and allow.classes <= DEEPSPEED_FILE.classes
    assert names.names <= torch_names().names | DEEPSPEED_FILE.names
    for pair in allow.pairs() | names.pairs():
        assert pair in subs or pair[0] in ("builtins", "collections"), pair


def test_a_deepspeed_file_that_asks_for_code_is_one_line_with_the_child_running(tmp_path, adoptions, forks):
    """A model_states file whose pickle calls os.system: the child refuses it under its subset of
    the policy, the merge with the one policy's error line; no target, no child left, nothing ran."""
    import shutil

    source = tmp_path / "run"
    shutil.copytree(DEEPSPEED / "z3_fp32_ws3", source, ignore=shutil.ignore_patterns("reference"))
    marker = tmp_path / "ran"
    _ask_for_code(source / "global_step2" / "zero_pp_rank_1_mp_rank_00_model_states.pt", "boom", marker)
    from hf_merge.errors import UnsafeCheckpointError
    from hf_merge.readers.deepspeed_files import DeepSpeedIndex, resolve_deepspeed_dir

    with pytest.raises(UnsafeCheckpointError, match="system"):  # the child's own reading
        DeepSpeedIndex(resolve_deepspeed_dir(source))
    _merge_refuses_code(source, tmp_path, marker, *_deepspeed_flags("z3_fp32_ws3"))
    assert forks == ["deepspeed"] and adoptions == []


def test_a_flipped_byte_in_a_row_cut_between_partitions_is_one_line_with_the_child_running(tmp_path, adoptions, forks):
    """A byte of a ZeRO-3 row that two ranks' partitions share (copied as its pieces side by side),
    flipped: the child's and the merge's CRC-32 checks refuse it; one line naming the file, no target."""
    import shutil

    from hf_merge.readers.deepspeed import open_deepspeed
    from hf_merge.readers.file_runs import ColumnGather

    source = tmp_path / "run"
    shutil.copytree(DEEPSPEED / "z3_fp32_ws3", source, ignore=shutil.ignore_patterns("reference"))
    with open_deepspeed(source) as reader:
        cut = next(run for spec in reader.specs().values() for _first, run in reader.read_rows(spec.name, spec.dtype) or ()
                   if isinstance(run, ColumnGather))
        piece = cut.runs[-1]
        path = next(p for p in (source / "global_step2").iterdir() if p.stat().st_ino == os.fstat(piece.fd).st_ino)
        at = piece.offset + piece.nbytes // 2
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    proc = run_cli("merge", source, tmp_path / "out", *_deepspeed_flags("z3_fp32_ws3"))
    line = error_line(proc)
    assert proc.returncode != 0 and path.name in line and "CRC" in line, line
    assert forks == ["deepspeed"] and adoptions == [True] and not (tmp_path / "out").exists()


def test_a_truncated_deepspeed_file_is_one_line_with_the_child_running(tmp_path, adoptions, forks):
    """A ZeRO-3 optim_states file cut in half, merged with the head start on: the child is forked,
    the merge fails with the reader's one error line naming the file, no target, no child left."""
    import shutil

    source = tmp_path / "run"
    shutil.copytree(DEEPSPEED / "z3_fp32_ws3", source, ignore=shutil.ignore_patterns("reference"))
    optim = source / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    before = set(_children())
    proc = run_cli("merge", source, tmp_path / "out", *_deepspeed_flags("z3_fp32_ws3"))
    line = error_line(proc)
    assert proc.returncode != 0 and optim.name in line, line
    assert forks == ["deepspeed"] and adoptions == []
    assert not (tmp_path / "out").exists() and set(_children()) <= before


# ---- ColossalAI booster folders of .bin shards: the reader's index, the shards' pickles read without torch ----

COLOSSALAI = ROOT / "tests" / "data" / "colossalai"
COLOSSALAI_BIN = ["ddp_bin_tied_ws2", "hybrid_tp2_pp2_ws4"]


def test_a_colossalai_folders_first_file_is_the_childs_and_the_folder_is_the_same(tmp_path, adoptions, finishes, forks):
    """Real ColossalAI 0.5 hybrid TP2 x PP2 save (.bin stage shards): the child's file is linked
    and kept, the folder is the merge's own."""
    got, expected = _merge_both_ways(COLOSSALAI / "hybrid_tp2_pp2_ws4", tmp_path, "--dtype", "auto")
    assert (forks, adoptions, finishes) == (["colossalai"], [True], [True])
    assert got == expected


@pytest.mark.parametrize("name", ["ddp_bin_tied_ws2", "ddp_safetensors_ws2", "dist_tp2_ws2"])
def test_colossalai_merges_the_child_does_not_serve_are_the_merges_own(name, tmp_path, adoptions, forks):
    """A tied model, safetensors shards and a per-rank distributed save: the child is forked and
    declines, the merge writes every file, and the folder is what it writes without the child."""
    config = ("--config", COLOSSALAI / name / "reference" / "config") if name.startswith("dist") else ()
    got, expected = _merge_both_ways(COLOSSALAI / name, tmp_path, *config, "--dtype", "auto")
    assert (forks, adoptions) == (["colossalai"], [False])
    assert got == expected


@pytest.mark.parametrize("name", COLOSSALAI_BIN)
def test_the_torch_free_colossalai_index_agrees_with_the_torch_reader(name):
    """Every tensor of every .bin booster fixture: the same names in the same order, shapes, dtypes
    and file bytes as the reader hands the writer."""
    from hf_merge.readers.colossalai import open_colossalai
    from hf_merge.readers.colossalai_files import open_index

    index, config = open_index(COLOSSALAI / name, None)
    assert config == COLOSSALAI / name
    with open_colossalai(COLOSSALAI / name) as reader:
        specs, indexed = reader.specs(), index.specs()
        assert list(indexed) == list(specs)
        for key, spec in specs.items():
            assert (indexed[key].shape, str(indexed[key].dtype)) == (spec.shape, str(spec.dtype)), key
            want = _recipe(reader, key, spec.dtype)
            assert want is not None and _recipe(index, key, indexed[key].dtype) == want, key
    index.close()


def test_the_colossalai_childs_pickle_policy_is_the_readers_with_no_torch_module_looked_up():
    from hf_merge.readers import colossalai_files
    from hf_merge.readers.safe_pickle import TENSOR_FILE

    allow, names, subs = colossalai_files._named_tensor_policy()
    assert allow.calls <= TENSOR_FILE.calls and allow.classes <= TENSOR_FILE.classes
    assert ("torch._utils", "_rebuild_tensor_v2") in allow.calls
    assert names.names <= torch_names().names
    for pair in allow.pairs() | names.pairs():
        assert pair in subs or pair[0] in ("builtins", "collections"), pair


def test_a_colossalai_shard_that_asks_for_code_is_one_line_with_the_child_running(tmp_path, adoptions, forks):
    """A stage shard whose pickle calls os.system: the child refuses it under its subset of the
    policy, the merge with the one policy's error line; no target, no child left, nothing ran."""
    import shutil

    source = tmp_path / "run"
    shutil.copytree(COLOSSALAI / "hybrid_tp2_pp2_ws4", source, ignore=shutil.ignore_patterns("reference"))
    marker = tmp_path / "ran"
    _ask_for_code(source / "pytorch_model-stage-00002-shard-00001.bin", "model.layers.1.self_attn.q_proj.weight", marker)
    from hf_merge.errors import UnsafeCheckpointError
    from hf_merge.readers.colossalai_files import open_index

    with pytest.raises(UnsafeCheckpointError, match="system"):  # the child's own reading
        open_index(source, None)
    _merge_refuses_code(source, tmp_path, marker, "--dtype", "auto")
    assert forks == ["colossalai"] and adoptions == []


def test_a_truncated_colossalai_shard_is_one_line_with_the_child_running(tmp_path, adoptions, forks):
    """A stage shard cut in half, merged with the head start on: the child is forked, the merge
    fails with the reader's one error line naming the file, no target, no child left."""
    import shutil

    source = tmp_path / "run"
    shutil.copytree(COLOSSALAI / "hybrid_tp2_pp2_ws4", source, ignore=shutil.ignore_patterns("reference"))
    shard = source / "pytorch_model-stage-00002-shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = set(_children())
    proc = run_cli("merge", source, tmp_path / "out", "--dtype", "auto")
    line = error_line(proc)
    assert proc.returncode != 0 and shard.name in line, line
    assert forks == ["colossalai"] and adoptions == []
    assert not (tmp_path / "out").exists() and set(_children()) <= before
