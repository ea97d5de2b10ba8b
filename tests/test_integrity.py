"""Input integrity (issue 26): no file contents or secrets in messages, no symlink out of the
checkpoint, exact tiling of DeepSpeed partitions and paddings, and the CRC-32 of every zip record
a merge reads. Every case starts from a real fixture (verl FSDP rank files, DeepSpeed 0.19 files,
a megatron-core ``torch_dist`` folder) changed in one place, and goes through ``inspect``,
``merge``, ``verify`` and ``from_sharded_pretrained`` where each applies."""

from __future__ import annotations

import enum
import json
import os
import shutil
import struct
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_merge
from hf_merge.cli.app import main as cli
from hf_merge.errors import CorruptCheckpointError, UnsafeCheckpointError
from hf_merge.readers import file_runs
from hf_merge.readers import record_crc
from hf_merge.readers.torch_zip import read_records

DEEPSPEED = Path(__file__).parent / "data" / "deepspeed"
SECRET = "HF_TOKEN=hf_SeCrEtToKeN0123456789abcdef"


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_error(code: int, err: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def _merge_refused(capsys, source: Path, tmp_path: Path, *needles: str, flags: tuple[str, ...] = ()) -> str:
    target = tmp_path / "out"
    code, out, err = _run(capsys, "merge", source, target, *flags)
    line = _one_error(code, err, *needles)
    assert not target.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    return line + out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("reference"))
    return dst


def _ds_config(name: str) -> list[str]:
    return ["--config", str(DEEPSPEED / name / "reference" / "step2" / "config")]


# --------------------------------------------------------------------------------------------
# 1. no file contents in messages; no symlink out of the checkpoint
# --------------------------------------------------------------------------------------------


@pytest.fixture
def secret(tmp_path) -> Path:
    """A file outside every checkpoint holding a token, as /proc/self/environ would."""
    path = tmp_path / "elsewhere" / "environ"
    path.parent.mkdir()
    path.write_text(SECRET + "\0HOME=/root\0")
    return path


def _no_secret(*texts: str) -> None:
    for text in texts:
        assert "SeCrEt" not in text and "HF_TOKEN" not in text, text


def test_deepspeed_latest_symlink_to_a_secret_is_refused_and_never_printed(tmp_path, secret, capsys):
    """Before: ``latest -> /proc/self/environ`` printed its first 256 bytes in a note and in --json."""
    ckpt = _copy(DEEPSPEED / "z1_fp32_ws1", tmp_path / "run")
    (ckpt / "latest").unlink()
    (ckpt / "latest").symlink_to(secret)
    for args in (("inspect", ckpt), ("inspect", ckpt, "--json")):
        code, out, err = _run(capsys, *args)
        _one_error(code, err, "latest", "symlink", "outside the checkpoint")
        _no_secret(out, err)
    line = _merge_refused(capsys, ckpt, tmp_path, "latest", "symlink", flags=tuple(_ds_config("z1_fp32_ws1")))
    _no_secret(line)
    with pytest.raises(UnsafeCheckpointError, match="latest"):
        hf_merge.open_checkpoint(ckpt)


def test_a_latest_file_that_names_no_tag_is_not_echoed(tmp_path, capsys):
    """A regular ``latest`` inside the checkpoint with other content: an error naming the complete
    tag to pass (never the highest tag merged in its place), without repeating what the file holds."""
    ckpt = _copy(DEEPSPEED / "z1_fp32_ws1", tmp_path / "run")
    (ckpt / "latest").write_text(SECRET)
    for args in (("inspect", ckpt), ("inspect", ckpt, "--json")):
        code, out, err = _run(capsys, *args)
        _one_error(code, err, "latest names no tag folder here", f"pass {ckpt / 'global_step2'}")
        _no_secret(out, err)


def test_paths_are_redacted_in_notes_and_json(tmp_path, capsys):
    """A token in a path (a folder named after it) is redacted in every line and in --json."""
    ckpt = _copy(DEEPSPEED / "z1_fp32_ws1", tmp_path / "hf_SeCrEtToKeNabcdefghijklmnopqrstuvw" / "run")
    code, out, err = _run(capsys, "inspect", ckpt, "--json")
    assert code == 0, err
    assert "SeCrEt" not in out + err and "hf_***" in out
    assert json.loads(out)["path"].endswith("run")


def test_folder_names_that_start_like_a_token_are_shown(tmp_path, capsys):
    """Before: ``hf_checkpoints/run`` was printed as ``hf_***/run`` (any ``hf_`` and 8 letters, any
    case, was taken for a token; ``HF_ENDPOINT`` too). A token is ``hf_`` and 34 letters."""
    from hf_merge.errors import redact_credentials

    ckpt = _copy(DEEPSPEED / "z1_fp32_ws1", tmp_path / "hf_checkpoints" / "run")
    code, out, err = _run(capsys, "inspect", ckpt, "--json")
    assert code == 0, err
    assert json.loads(out)["path"] == str(ckpt)
    assert redact_credentials("check HF_ENDPOINT") == "check HF_ENDPOINT"


@pytest.fixture
def fsdp_copy(qwen2_fp32_ws2, tmp_path) -> Path:
    return _copy(qwen2_fp32_ws2.actor, tmp_path / "actor")


@pytest.fixture
def other_checkpoint(qwen2_fp32_ws2, tmp_path) -> Path:
    """Another local checkpoint (same layout), outside the one being merged."""
    return _copy(qwen2_fp32_ws2.actor, tmp_path / "private" / "actor")


def test_a_rank_file_symlinked_to_another_checkpoint_is_refused_everywhere(fsdp_copy, other_checkpoint, tmp_path, capsys):
    """Before: symlinked rank files were followed, so another local checkpoint's tensors could be
    merged and pushed."""
    name = "model_world_size_2_rank_1.pt"
    (fsdp_copy / name).unlink()
    (fsdp_copy / name).symlink_to(other_checkpoint / name)
    code, _, err = _run(capsys, "inspect", fsdp_copy)
    _one_error(code, err, name, "outside the checkpoint")
    _merge_refused(capsys, fsdp_copy, tmp_path, name, "symlink")
    with pytest.raises(UnsafeCheckpointError, match=name):
        AutoModelForCausalLM.from_sharded_pretrained(fsdp_copy, dtype="float32")
    good = tmp_path / "good"
    assert cli(["merge", str(other_checkpoint), str(good)]) == 0
    capsys.readouterr()
    code, _, err = _run(capsys, "verify", good, "--against", fsdp_copy)
    _one_error(code, err, name, "outside the checkpoint")


@pytest.mark.parametrize("what", ["fsdp_config.json", "huggingface/tokenizer_config.json"])
def test_side_files_symlinked_out_of_the_checkpoint(what, fsdp_copy, tmp_path, secret, capsys):
    """fsdp_config.json is read: refused. A tokenizer file is not read, only copied: the copy skips
    the link (and says so), the merge goes on, nothing of the target is copied."""
    (fsdp_copy / what).unlink()
    (fsdp_copy / what).symlink_to(secret)
    target = tmp_path / "out"
    code, out, err = _run(capsys, "merge", fsdp_copy, target)
    if what == "fsdp_config.json":
        _one_error(code, err, "fsdp_config.json", "outside the checkpoint")
    else:
        assert code == 0, err
        assert not (target / "tokenizer_config.json").exists()
        with pytest.raises(UnsafeCheckpointError, match="tokenizer_config.json"):
            hf_merge.load_tokenizer(fsdp_copy)  # load_tokenizer reads it: refused
    _no_secret(out, err)


def test_symlinks_inside_the_checkpoint_are_followed(fsdp_copy, qwen2_fp32_ws2, tmp_path, capsys):
    """A rank file that is a link to a file inside the checkpoint, and a checkpoint folder named
    through a link, read as before."""
    name = "model_world_size_2_rank_0.pt"
    (fsdp_copy / "blobs").mkdir()
    (fsdp_copy / name).rename(fsdp_copy / "blobs" / name)
    (fsdp_copy / name).symlink_to(Path("blobs") / name)
    link = tmp_path / "linked"
    link.symlink_to(fsdp_copy)
    assert cli(["merge", str(link), str(tmp_path / "out"), "--dtype", "auto"]) == 0
    capsys.readouterr()
    assert cli(["verify", str(tmp_path / "out"), "--against", str(link)]) == 0


def test_a_deepspeed_latest_linked_inside_is_followed(tmp_path, capsys):
    ckpt = _copy(DEEPSPEED / "z1_fp32_ws1", tmp_path / "run")
    (ckpt / "tags").mkdir()
    (ckpt / "latest").rename(ckpt / "tags" / "latest")
    (ckpt / "latest").symlink_to(ckpt / "tags" / "latest")
    with hf_merge.open_checkpoint(ckpt) as ck:
        assert any("from run/latest" in n for n in ck.info.notes), ck.info.notes


def test_a_distcp_file_symlinked_out_is_refused(megatron_root, tmp_path, capsys):
    src = _copy(megatron_root / "qwen2_v1" / "actor", tmp_path / "actor")
    dist = src / "dist_ckpt"
    data = sorted(dist.glob("*.distcp"))[0]
    outside = tmp_path / "other.distcp"
    shutil.move(data, outside)
    data.symlink_to(outside)
    code, _, err = _run(capsys, "inspect", src)
    _one_error(code, err, data.name, "outside the checkpoint")
    _merge_refused(capsys, src, tmp_path, data.name, "symlink")


# --------------------------------------------------------------------------------------------
# 2. exact tiling: DeepSpeed alignment paddings and partitions
# --------------------------------------------------------------------------------------------


def _fake_deepspeed() -> None:
    """Importable stand-ins for the DeepSpeed classes an optim_states pickle names, so a test can
    load a real file with torch.load, change one field and save it under the same class names."""
    if getattr(sys.modules.get("deepspeed"), "_hf_merge_test_stand_in", False):
        return

    def module(name: str) -> types.ModuleType:
        sys.modules.setdefault(name, types.ModuleType(name))
        return sys.modules[name]

    module("deepspeed")._hf_merge_test_stand_in = True
    for name in ("deepspeed.runtime", "deepspeed.runtime.zero", "deepspeed.runtime.fp16", "deepspeed.utils"):
        module(name)

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3

    class LossScaler:
        pass

    class DynamicLossScaler:
        pass

    class fragment_address:  # noqa: N801 - DeepSpeed's name
        pass

    for mod, cls in (("deepspeed.runtime.zero.config", ZeroStageEnum), ("deepspeed.runtime.fp16.loss_scaler", LossScaler),
                     ("deepspeed.runtime.fp16.loss_scaler", DynamicLossScaler), ("deepspeed.utils.tensor_fragment", fragment_address)):
        cls.__module__, cls.__qualname__ = mod, cls.__name__
        setattr(module(mod), cls.__name__, cls)


@pytest.fixture
def deepspeed_stand_ins(monkeypatch):
    saved = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    _fake_deepspeed()
    yield
    for k in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def _edit_optim_files(tag: Path, edit) -> None:
    for path in sorted(tag.glob("*optim_states.pt")):
        state = torch.load(path, weights_only=False)  # the test's own copy of a committed fixture
        edit(state["optimizer_state_dict"])
        torch.save(state, path)


PADDINGS = {
    # group 1 of z2_bf16_align_ws3 pads parameters 1, 2, 6, 7 by 4 to an 8-element boundary
    "shifted": lambda p: p.__setitem__(slice(0, 2), [4, 0]),  # same total, parameter 1 moves by 4
    "negative": lambda p: p.__setitem__(slice(1, 3), [-4, 12]),  # same total, parameters overlap
    "short": lambda p: p.__setitem__(1, 0),  # parameters end before the partitions do
}


@pytest.mark.parametrize("case", sorted(PADDINGS))
def test_deepspeed_paddings_must_tile_the_partitions(case, tmp_path, capsys, deepspeed_stand_ins):
    """Before: a shifted or negative padding that still adds up gave exit 0 and shifted tensors;
    only ``offset > held`` was checked."""
    name = "z2_bf16_align_ws3"
    ckpt = _copy(DEEPSPEED / name, tmp_path / "run")
    _edit_optim_files(ckpt / "global_step2", lambda o: PADDINGS[case](o["param_alignment_paddings"][1]))
    code, _, err = _run(capsys, "inspect", ckpt)
    _one_error(code, err, "param group 1")
    _merge_refused(capsys, ckpt, tmp_path, "param group 1", flags=tuple(_ds_config(name)))
    with pytest.raises(CorruptCheckpointError, match="param group 1"):
        AutoModelForCausalLM.from_sharded_pretrained(ckpt, config=_ds_config(name)[1], dtype="float32")


def test_deepspeed_stage3_frozen_fragments_must_be_even(tmp_path):
    """ZeRO 3 gives each rank ceil(numel / world) elements of a frozen parameter; a fragment of
    another size (which still adds up) is refused."""
    name = "z3_bf16_lora_ws2"
    ckpt = _copy(DEEPSPEED / name, tmp_path / "run")
    files = sorted((ckpt / "global_step2").glob("zero_pp_rank_*_model_states.pt"))
    states = [torch.load(f, weights_only=False) for f in files]
    key = next(iter(states[0]["frozen_param_fragments"]))
    a, b = states[0]["frozen_param_fragments"][key], states[1]["frozen_param_fragments"][key]
    states[0]["frozen_param_fragments"][key] = a[:-2].clone()
    states[1]["frozen_param_fragments"][key] = torch.cat([b[:2], b])
    for f, s in zip(files, states):
        torch.save(s, f)
    with pytest.raises(CorruptCheckpointError, match="fragment"):
        hf_merge.open_checkpoint(ckpt)


# --------------------------------------------------------------------------------------------
# 3. the CRC-32 of every record read
# --------------------------------------------------------------------------------------------


def _local_header(raw: bytes, suffix: bytes, start: int = 0) -> int:
    pos = start
    while (pos := raw.find(b"PK\x03\x04", pos)) >= 0:
        nlen = struct.unpack_from("<H", raw, pos + 26)[0]
        if raw[pos + 30 : pos + 30 + nlen].endswith(suffix):
            return pos
        pos += 4
    raise AssertionError(f"no local header for {suffix!r}")


def _flip(path: Path, suffix: bytes, at: int = 1, start: int = 0) -> None:
    """Flip one bit of byte ``at`` of the data of the record named ``...suffix`` (nothing else changes)."""
    raw = bytearray(path.read_bytes())
    h = _local_header(raw, suffix, start)
    data = h + 30 + struct.unpack_from("<H", raw, h + 26)[0] + struct.unpack_from("<H", raw, h + 28)[0]
    raw[data + at] ^= 0x10
    path.write_bytes(bytes(raw))


def _record_of(path: Path, tensor_name: str) -> str:
    """The storage record (``<archive>/data/N``, without the archive folder) holding ``tensor_name``."""
    from hf_merge.readers.rank_records import index_rank_file

    offset, _ = index_rank_file(path)[tensor_name].span
    with open(path, "rb") as f:
        records = read_records(f, path.name)
    return next(r.name.split("/", 1)[1] for r in records.values() if r.data_start == offset)


def test_a_rank_file_damaged_in_place_with_its_mtime_kept_is_checked_again_in_the_same_process(fsdp_copy, tmp_path):
    """The records found good are remembered per file version for the life of the process. A file
    rewritten in place (same inode) with its modification time set back (``cp -p``, ``rsync -t``)
    kept device, inode and mtime: before, a second merge in the same process took its damaged
    record as checked and wrote it without a word (a fresh process refused it)."""
    hf_merge.merge(str(fsdp_copy), str(tmp_path / "first"), dtype="float32")
    rank1 = fsdp_copy / "model_world_size_2_rank_1.pt"
    before = os.stat(rank1)
    record = _record_of(rank1, "model.embed_tokens.weight")
    _flip(rank1, record.encode())
    os.utime(rank1, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(rank1)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    with pytest.raises(record_crc.SourceCrcError, match=rank1.name):
        hf_merge.merge(str(fsdp_copy), str(tmp_path / "second"), dtype="float32")
    assert not (tmp_path / "second").exists()


def test_a_flipped_byte_in_a_rank_file_stops_the_merge(fsdp_copy, tmp_path, capsys):
    """Before: exit 0 and a different embed_tokens. Now: one error line naming the file and the
    record, no target; ``--no-source-crc`` merges it (and ``verify --against`` reports it)."""
    rank1 = fsdp_copy / "model_world_size_2_rank_1.pt"
    record = _record_of(rank1, "model.embed_tokens.weight")
    _flip(rank1, record.encode())
    line = _merge_refused(capsys, fsdp_copy, tmp_path, rank1.name, record, "CRC-32", "--no-source-crc")
    assert "re-copy" in line
    # the Python API names its own keyword, not the CLI's option (before: "--no-source-crc merges it anyway")
    with pytest.raises(record_crc.SourceCrcError, match=rf"{rank1.name}.*\(source_crc=False merges it anyway\)"):
        AutoModelForCausalLM.from_sharded_pretrained(fsdp_copy, dtype="float32")
    with pytest.raises(record_crc.SourceCrcError, match=r"\(source_crc=False merges it anyway\)"):
        hf_merge.merge(str(fsdp_copy), str(tmp_path / "py"), dtype="float32")
    model = AutoModelForCausalLM.from_sharded_pretrained(fsdp_copy, dtype="float32", source_crc=False)
    assert model.model.embed_tokens.weight.shape[0] > 0
    target = tmp_path / "out"
    assert cli(["merge", str(fsdp_copy), str(target), "--no-source-crc", "--dtype", "auto"]) == 0
    capsys.readouterr()
    code, out, _ = _run(capsys, "verify", target, "--against", fsdp_copy)
    assert code == 1 and "source CRC-32" in out and "FAIL" in out


@pytest.mark.parametrize("flags", [("--max-shard-size", "100KB", "--workers", "2", "--dtype", "auto"),
                                   ("--max-shard-size", "100KB", "--workers", "1")], ids=["forked writers", "cast"])
def test_a_flipped_byte_is_found_by_every_writer(flags, fsdp_copy, tmp_path, capsys):
    """Forked writer processes and a cast (the bytes converted in memory, so checked in full)."""
    rank1 = fsdp_copy / "model_world_size_2_rank_1.pt"
    record = _record_of(rank1, "model.layers.1.mlp.down_proj.weight")
    _flip(rank1, record.encode())
    _merge_refused(capsys, fsdp_copy, tmp_path, rank1.name, record, "CRC-32", flags=flags)


@pytest.mark.parametrize("word", [b"_rebuild", b"Shard", b"model.norm"], ids=["global name", "placement", "key"])
def test_a_flipped_byte_in_a_rank_files_pickle_is_called_damaged(word, fsdp_copy, tmp_path, capsys):
    """data.pkl is a zip record like the others, with its CRC-32 in the directory. Before, it was
    never checked: a flipped byte in a global's name was reported as a pickle outside the allowlist
    ("re-save the checkpoint ... torch.load(weights_only=False)"), and one in a dict key merged into
    a wrong name. Now one line calls the file damaged, with or without ``--no-source-crc`` (the
    pickle says where every tensor is: nothing merged from a damaged one can be right)."""
    rank1 = fsdp_copy / "model_world_size_2_rank_1.pt"
    raw = rank1.read_bytes()
    h = _local_header(raw, b"/data.pkl")
    data = h + 30 + struct.unpack_from("<H", raw, h + 26)[0] + struct.unpack_from("<H", raw, h + 28)[0]
    _flip(rank1, b"/data.pkl", at=raw.index(word, data) - data + 1)
    for flags in ((), ("--no-source-crc",)):
        line = _merge_refused(capsys, fsdp_copy, tmp_path, rank1.name, "data.pkl", "CRC-32", "re-copy", flags=flags)
        assert "allowlist" not in line and "--no-source-crc" not in line
    _one_error(cli(["inspect", str(fsdp_copy)]), capsys.readouterr().err, "data.pkl", "CRC-32")
    with pytest.raises(CorruptCheckpointError, match="data.pkl.*CRC-32"):
        AutoModelForCausalLM.from_sharded_pretrained(fsdp_copy, dtype="float32", source_crc=False)


def test_a_flipped_byte_in_a_shard1_column_piece_is_found(qwen2_shard1, tmp_path, capsys):
    """A Shard(1) piece is read column block by column block; its record is checked once, in full,
    the first time any of it is read."""
    src = _copy(qwen2_shard1.actor, tmp_path / "actor")
    shard1 = [k for k, v in qwen2_shard1.placements.items() if "Shard(dim=1)" in v]
    assert shard1, qwen2_shard1.placements
    rank0 = src / "model_world_size_2_rank_0.pt"
    record = _record_of(rank0, shard1[0])
    _flip(rank0, record.encode(), at=7)
    _merge_refused(capsys, src, tmp_path, rank0.name, record, "CRC-32", flags=("--dtype", "auto"))


def test_a_flipped_byte_in_a_distcp_chunk_stops_the_merge(megatron_root, tmp_path, capsys):
    from hf_merge.readers.dcp import DcpCheckpoint

    src = _copy(megatron_root / "qwen2_v1" / "actor", tmp_path / "actor")
    with DcpCheckpoint(src / "dist_ckpt") as ck:
        chunk = ck._chunks["embedding.word_embeddings.weight"][0]
    _flip(src / "dist_ckpt" / chunk.file, b"/data/0", at=3, start=chunk.start)
    _merge_refused(capsys, src, tmp_path, chunk.file, "embedding.word_embeddings.weight", "CRC-32")
    assert cli(["merge", str(src), str(tmp_path / "out"), "--no-source-crc"]) == 0


def test_damaged_optimizer_state_fails_no_verify_but_a_damaged_model_chunk_does(megatron_root, tmp_path, capsys):
    """Before: one flipped byte in an ``exp_avg_sq`` chunk, which no merge reads, gave a bit-exact
    merge and then ``verify --against``: ``failed: source CRC-32``. Now only the records whose bytes
    the merge uses are checked; a flipped byte in a model chunk still fails."""
    from hf_merge.readers.dcp import DcpCheckpoint

    src = _copy(megatron_root / "qwen2_v1" / "actor", tmp_path / "actor")
    with DcpCheckpoint(src / "dist_ckpt") as ck:
        optim = ck._chunks["optimizer.state.exp_avg_sq.embedding.word_embeddings.weight"][0]
        model = ck._chunks["embedding.word_embeddings.weight"][0]
    _flip(src / "dist_ckpt" / optim.file, b"/data/0", at=3, start=optim.start)
    target = tmp_path / "out"
    assert cli(["merge", str(src), str(target), "--verify"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    code, out, err = _run(capsys, "verify", target, "--against", src)
    row = next(ln for ln in out.splitlines() if ln.startswith("source CRC-32"))
    assert code == 0 and " ok " in row, out + err
    _flip(src / "dist_ckpt" / model.file, b"/data/0", at=3, start=model.start)
    code, out, err = _run(capsys, "verify", target, "--against", src)
    assert code == 1 and "source CRC-32" in err and model.file in out, out + err


def test_a_failed_merge_verify_names_the_target_and_the_command(megatron_root, tmp_path, capsys):
    """Before: ``error: .../.out.hf-merge-tmp-8632 does not match ...; run hf-merge verify for the full
    table``, naming the temporary folder, already gone. Now the target and the command to run."""
    from hf_merge.readers.dcp import DcpCheckpoint

    src = _copy(megatron_root / "qwen2_v1" / "actor", tmp_path / "actor")
    with DcpCheckpoint(src / "dist_ckpt") as ck:
        model = ck._chunks["embedding.word_embeddings.weight"][0]
    _flip(src / "dist_ckpt" / model.file, b"/data/0", at=3, start=model.start)
    target = tmp_path / "out"
    code, _, err = _run(capsys, "merge", src, target, "--no-source-crc", "--verify")
    line = _one_error(code, err, f"{target} does not match", "source CRC-32", f"hf-merge verify {target} --against")
    assert "hf-merge-tmp" not in line and not target.exists(), line


def test_a_flipped_byte_in_a_deepspeed_partition_stops_the_merge(tmp_path, capsys):
    name = "z2_bf16_align_ws3"
    ckpt = _copy(DEEPSPEED / name, tmp_path / "run")
    optim = ckpt / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with hf_merge.open_checkpoint(ckpt) as ck:  # where rank 1's fp32 partition of group 0 lies
        part = ck._files[("group", 1, 0)]
        _, offset, _ = file_runs.source_of(part, ck._mapped).storage_span(part)
    with open(optim, "rb") as f:
        records = read_records(f, optim.name)
    record = next(r for r in records.values() if r.data_start == offset)
    _flip(optim, record.name.split("/", 1)[1].encode(), at=5)
    _merge_refused(capsys, ckpt, tmp_path, optim.name, "CRC-32", flags=tuple(_ds_config(name)))


def test_the_crc32_in_use_is_zips_crc32():
    """The CRC-32 the checks run (ISA-L's where ``isal`` is installed, else zlib's) gives zlib's
    values: from zero and continued from a running value, over bytes, buffers and empty input."""
    import random
    import zlib

    from hf_merge.readers.torch_zip import crc32

    rng = random.Random(28)
    data = rng.randbytes(3 << 20)
    for n in (0, 1, 7, 4095, 65537, 1 << 20, len(data)):
        assert crc32(data[:n]) == zlib.crc32(data[:n])
        assert crc32(memoryview(data)[:n], 0xDEADBEEF) == zlib.crc32(data[:n], 0xDEADBEEF)
    running = 0
    for i in range(0, len(data), 262144):  # as the writer's stream feeds it, piece by piece
        running = crc32(memoryview(data)[i : i + 262144], running)
    assert running == zlib.crc32(data)


def test_each_record_is_checked_once(tmp_path):
    """A DeepSpeed partition holds many parameters: its record is read for the CRC once, however
    many tensors come from it."""
    name = "z2_bf16_align_ws3"
    ckpt = _copy(DEEPSPEED / name, tmp_path / "run")
    before = record_crc.stats()
    with hf_merge.open_checkpoint(ckpt) as ck:
        for key in ck.keys():
            ck.read(key)
        first = record_crc.stats()
        for key in ck.keys():
            ck.read(key)
    again = record_crc.stats()
    checked = first["records"] - before["records"]
    assert 0 < checked <= 2 * 3 + 3  # the ranks' fp32 groups (and the module's buffers), not one per tensor
    assert again == first


@pytest.mark.skipif(not (hasattr(os, "fork") and getattr(os, "O_TMPFILE", 0) and getattr(os, "O_DIRECT", 0)), reason="Linux only")
def test_the_head_start_file_is_not_taken_from_a_damaged_rank_file(fsdp_copy, tmp_path, capsys, monkeypatch):
    """The CLI's head start child writes the first output file from rank-file bytes; the merge
    takes it only after the records it copies pass their CRC-32 (checked while the merge works out
    the child's byte ranges). Before: exit 0, the child's file with the flipped byte taken."""
    from hf_merge.write import head_start

    asked: list[str] = []
    real = head_start.HeadStart.adopt

    def recording(self, name, *args, **kwargs):
        asked.append(name)
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(head_start.HeadStart, "adopt", recording)
    monkeypatch.delitem(sys.modules, "transformers.conversion_mapping", raising=False)  # as a fresh CLI
    rank0 = fsdp_copy / "model_world_size_2_rank_0.pt"
    record = _record_of(rank0, "model.embed_tokens.weight")
    _flip(rank0, record.encode())
    _merge_refused(capsys, fsdp_copy, tmp_path, rank0.name, record, "CRC-32", flags=("--dtype", "auto"))
    assert asked == ["model.safetensors"]  # the child had planned the file: the merge refused it


def test_rank_file_records_are_checked_as_they_stream_through_the_writer(fsdp_copy, tmp_path):
    """The O_DIRECT writer checks each whole rank-file record over the bytes it copies: no record
    is read a second time for its CRC."""
    before = record_crc.stats()
    hf_merge.merge(fsdp_copy, tmp_path / "out", dtype="auto", workers=1)
    after = record_crc.stats()
    checked, streamed = after["records"] - before["records"], after["streamed"] - before["streamed"]
    assert checked > 0 and streamed == checked, (checked, streamed)


def test_distcp_records_stream_through_the_writer_too(megatron_root, tmp_path):
    # a fresh copy: records of the shared fixture may have been checked by an earlier test in this process
    source = shutil.copytree(megatron_root / "qwen2_v1", tmp_path / "qwen2_v1")
    before = record_crc.stats()
    hf_merge.merge(source / "actor", tmp_path / "out", dtype="auto", workers=1)
    after = record_crc.stats()
    assert after["streamed"] > before["streamed"] and after["records"] > before["records"]


@pytest.mark.parametrize("name", ["z2_bf16_align_ws3", "z3_fp32_ws3"])
def test_deepspeed_partitions_are_checked_from_the_pieces_the_writer_copied(name, tmp_path, monkeypatch):
    """A ZeRO partition's parameters pass through the writer in the output's order, not the
    file's: the CRC-32 of each piece is taken in the writer's buffer and the pieces are combined,
    so only the bytes no parameter covers (padding) are read again. Before: every partition was
    read a second time in full (2.5 GB more at Qwen2.5-0.5B's size)."""
    ckpt = _copy(DEEPSPEED / name, tmp_path / "run")
    partitions = sum(p.stat().st_size for p in ckpt.rglob("*optim_states.pt"))
    reread: list[int] = []
    real = record_crc._crc
    monkeypatch.setattr(record_crc, "_crc", lambda fd, start, size, where: reread.append(size) or real(fd, start, size, where))
    before = record_crc.stats()
    hf_merge.merge(ckpt, tmp_path / "out", config=DEEPSPEED / name / "reference" / "step2" / "config",
                   dtype="auto", workers=1)
    checked = record_crc.stats()["bytes"] - before["bytes"]
    assert checked > partitions // 4  # the fp32 partitions' records (files: also Adam's moments) ...
    assert sum(reread) < checked // 20, (sum(reread), checked)  # ... from what the writer copied, not read again


def _reread_log(monkeypatch, log: Path) -> None:
    """Append the size of every byte range the check reads to ``log`` (also from forked writers)."""
    real = record_crc._crc

    def counted(fd, start, size, where):
        fd_log = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd_log, f"{size}\n".encode())
        finally:
            os.close(fd_log)
        return real(fd, start, size, where)

    monkeypatch.setattr(record_crc, "_crc", counted)


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("name", ["z3_fp32_ws3", "z2_bf16_align_ws3", "z1_bf16_tied_ws2"])
def test_a_zero_partition_split_over_output_files_is_read_once(name, workers, tmp_path, monkeypatch):
    """A ZeRO partition whose parameters land in several output files, written by one writer or
    by forked ones: the pieces' CRC-32s of all the files are combined at the end of the merge (also
    the first bytes of a record a file ends in), so only the bytes no file's piece covered are read
    again. Before: each file's writer read what it had not copied itself."""
    ckpt = _copy(DEEPSPEED / name, tmp_path / "run")
    log = tmp_path / "reread.log"
    _reread_log(monkeypatch, log)
    before = record_crc.stats()
    hf_merge.merge(ckpt, tmp_path / "out", config=DEEPSPEED / name / "reference" / "step2" / "config",
                   dtype="float32", workers=workers, max_shard_size=8000)  # the fp32 partitions' bytes
    assert len(list((tmp_path / "out").glob("*.safetensors"))) >= 6
    partitions = sum(p.stat().st_size for p in ckpt.rglob("*optim_states.pt"))
    checked = record_crc.stats()["bytes"] - before["bytes"]
    reread = sum(int(n) for n in log.read_text().split()) if log.exists() else 0
    # what no file's piece covered: small parameters the writer copied from memory (0.2-2 % of the
    # checked bytes here); before: 46-96 % with one writer, more with three (each file's writer read
    # what it had not copied itself)
    assert reread < checked // 20, (reread, checked)
    # the fp32 partitions, combined in this process (also from forked writers); a record a forked
    # writer streamed whole (a ZeRO-3 row cut between ranks is copied from the files too) is checked there
    assert checked > partitions // 5


def _a_piece_in_the_second_file(ckpt: Path, monkeypatch) -> tuple[Path, int]:
    """Merge ``ckpt`` with one writer into small files; the source file and byte offset of a
    partition piece a later output file copied."""
    from hf_merge.write import shards

    current: list[str] = []
    pieces: list[tuple[str, tuple, int, int]] = []
    real_write, real_add = shards.write_file, record_crc.Placed.add

    def write_file(ckpt_, plan, *args, **kwargs):
        current.append(plan.name)
        return real_write(ckpt_, plan, *args, **kwargs)

    def add(self, key, offset, n, crc):
        pieces.append((current[-1], key, offset, n))
        real_add(self, key, offset, n, crc)

    with monkeypatch.context() as m:
        m.setattr(shards, "write_file", write_file)
        m.setattr(record_crc.Placed, "add", add)
        hf_merge.merge(ckpt, ckpt.parent / "probe", config=DEEPSPEED / ckpt.name / "reference" / "step2" / "config",
                       dtype="auto", workers=1, max_shard_size=8000)
    first = sorted(set(current))[0]
    # a piece of a later file (a record one writer streams whole through a file is checked as it passes)
    _file, key, offset, n = next(p for p in pieces if p[0] != first and p[3] >= 8)
    path = next(p for p in ckpt.rglob("*optim_states.pt") if p.stat().st_ino == key[1])
    return path, offset + n // 2


@pytest.mark.parametrize("workers", [1, 3])
def test_a_flipped_byte_in_a_zero3_piece_of_the_second_file_fails_the_merge(workers, tmp_path, monkeypatch):
    """The pieces a (forked) writer of a later file copied are still checked: the merge fails with
    the file's name and leaves neither a target nor a temporary folder."""
    name = "z3_fp32_ws3"
    good = _copy(DEEPSPEED / name, tmp_path / name)
    shutil.copytree(DEEPSPEED / name / "reference", good / "reference")
    path, at = _a_piece_in_the_second_file(good, monkeypatch)
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(record_crc.SourceCrcError, match=path.name):
        hf_merge.merge(good, tmp_path / "out", config=DEEPSPEED / name / "reference" / "step2" / "config",
                       dtype="auto", workers=workers, max_shard_size=8000)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf-merge")]


def test_a_hub_cache_snapshot_is_read_through_its_blob_links(qwen2_fp32_ws2, tmp_path, capsys):
    """A Hugging Face cache snapshot is made of links into its repository's blobs/ folder: read
    (``verify --against`` it, ``--base-model``-style opening); a link elsewhere is refused."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in qwen2_fp32_ws2.reference.iterdir() if p.is_file())):
        shutil.copyfile(f, repo / "blobs" / f"blob{i}")
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    with hf_merge.open_checkpoint(snap) as ck:
        assert ck.info.format == "hf" and "model.embed_tokens.weight" in ck.specs()
    merged = tmp_path / "merged"
    assert cli(["merge", str(qwen2_fp32_ws2.actor), str(merged), "--dtype", "auto"]) == 0
    capsys.readouterr()
    assert cli(["verify", str(merged), "--against", str(snap)]) == 0
    weights = next(p for p in snap.iterdir() if p.name.endswith(".safetensors"))
    weights.unlink()
    weights.symlink_to(tmp_path / "elsewhere.safetensors")
    shutil.copyfile(next(p for p in qwen2_fp32_ws2.reference.iterdir() if p.name.endswith(".safetensors")),
                    tmp_path / "elsewhere.safetensors")
    with pytest.raises(UnsafeCheckpointError, match=weights.name):
        hf_merge.open_checkpoint(snap)


# --------------------------------------------------------------------------------------------
# 4. from_sharded_pretrained checks the records from the bytes it placed in the model
# --------------------------------------------------------------------------------------------


def _saved_record(tmp_path: Path, name: str) -> tuple[Path, "object"]:
    """A real torch.save file holding one 300,000-byte tensor, and that tensor's record."""
    path = tmp_path / name
    torch.save({"w": torch.arange(75_000, dtype=torch.int32).mul_(2654435761 % 2**31)}, path)
    with open(path, "rb") as f:
        records = read_records(f, path.name)
    record_crc.add_archive(path, records)
    return path, max(records.values(), key=lambda r: r.size)


def _finish_placed(path: Path, rec, pieces: list[tuple[int, int]], held: bytearray) -> list[int]:
    """Note ``rec`` as a load's thread does, place ``pieces`` (offsets within the record) from
    ``held`` (the bytes "the model holds"), finish; what the check read from the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        placed = record_crc.Placed()
        with record_crc.deferred(check_at_end=False, pending=placed.pending):
            record_crc.check_record(fd, rec.data_start, rec.size, rec.crc, f"{path.name}: zip record")
        for a, b in pieces:
            placed.place(fd, rec.data_start + a, memoryview(held)[a:b])
        read: list[int] = []
        real = record_crc._crc
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(record_crc, "_crc", lambda *args: (read.append(args[2]), real(*args))[1])
            placed.finish()
        return read
    finally:
        os.close(fd)


def test_a_record_is_checked_from_its_placed_pieces_and_only_the_rest_is_read(tmp_path):
    """Pieces out of order, placed twice, with a gap: the CRC-32 of the placed bytes is combined in
    file order and only the gap is read from the file. A flipped byte where the model holds it, or
    in the file where nothing was placed, raises."""
    # out of order; (0, 100,000) twice (tied weights); nothing placed at 160,000..200,000
    pieces = [(200_000, 300_000), (0, 100_000), (100_000, 150_000), (0, 100_000), (150_000, 160_000)]
    path, rec = _saved_record(tmp_path, "good.pt")
    held = bytearray(path.read_bytes()[rec.data_start : rec.data_start + rec.size])
    before = record_crc.stats()["records"]
    assert _finish_placed(path, rec, pieces, held) == [40_000]
    assert record_crc.stats()["records"] == before + 1

    path, rec = _saved_record(tmp_path, "model_bytes_damaged.pt")
    held = bytearray(path.read_bytes()[rec.data_start : rec.data_start + rec.size])
    held[250_001] ^= 0x10  # the model's copy differs from what the zip directory recorded
    with pytest.raises(record_crc.SourceCrcError, match="model_bytes_damaged.pt"):
        _finish_placed(path, rec, pieces, held)

    path, rec = _saved_record(tmp_path, "gap_damaged.pt")
    held = bytearray(path.read_bytes()[rec.data_start : rec.data_start + rec.size])
    raw = bytearray(path.read_bytes())
    raw[rec.data_start + 170_000] ^= 0x10
    path.write_bytes(bytes(raw))
    record_crc.add_archive(path, {rec.name: rec})  # a new mtime: the same records, known again
    with pytest.raises(record_crc.SourceCrcError, match="gap_damaged.pt"):
        _finish_placed(path, rec, pieces, held)


def test_archives_added_to_one_file_in_any_order_find_every_record(tmp_path):
    """A .distcp file holds one torch.save archive per chunk, added one by one as chunks are read
    (in the output's order, not the file's), some twice: each record is found once, in file order."""
    path = tmp_path / "many.pt"
    torch.save({f"w{i}": torch.full((1000 + i,), i, dtype=torch.int32) for i in range(12)}, path)
    with open(path, "rb") as f:
        records = read_records(f, path.name)
    items = sorted(records.items(), key=lambda kv: kv[1].data_start)
    for part in (items[8:], items[:3], items[5:10], items[3:6]):  # out of order, overlapping
        record_crc.add_archive(path, dict(part))
    fd = os.open(path, os.O_RDONLY)
    try:
        _st, _archive, found = record_crc._touched(fd, 0, path.stat().st_size)
    finally:
        os.close(fd)
    assert [r.data_start for r in found] == [r.data_start for _, r in items]


def test_the_fallback_crc32_combine_is_zlibs():
    import random
    import zlib

    from hf_merge.readers.torch_zip import combine_crc32

    rng = random.Random(28)
    for n in (0, 1, 7, 4096, 300_001):
        a, b = rng.randbytes(1000), rng.randbytes(n)
        assert combine_crc32(zlib.crc32(a), zlib.crc32(b), n) == zlib.crc32(a + b)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="mapping rank files needs Linux")
def test_mapped_weights_are_checked_over_the_models_own_pages(qwen2_vocab2k_ws2, tmp_path):
    """The rank files' pages mapped into the model are CRC-checked there (faulted in once, for the
    forward too), not through a second mapping of every record: before, ``_crc`` read all of them.
    A flipped byte in a mapped tensor's record still raises before a model is returned."""
    src = _copy(qwen2_vocab2k_ws2.actor, tmp_path / "actor")
    read: list[int] = []
    real = record_crc._crc
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(record_crc, "_crc", lambda *args: (read.append(args[2]), real(*args))[1])
        before = record_crc.stats()["bytes"]
        model = AutoModelForCausalLM.from_sharded_pretrained(src, dtype="keep")
        checked = record_crc.stats()["bytes"] - before
    mapped = model.model.embed_tokens.weight.numel() * 4 + model.lm_head.weight.numel() * 4
    assert checked >= mapped and sum(read) <= checked - mapped, (checked, mapped, sum(read))
    del model

    rank1 = src / "model_world_size_2_rank_1.pt"
    record = _record_of(rank1, "model.embed_tokens.weight")
    _flip(rank1, record.encode(), at=4097)
    with pytest.raises(record_crc.SourceCrcError, match=rank1.name):
        AutoModelForCausalLM.from_sharded_pretrained(src, dtype="keep")


def _placements(monkeypatch) -> list[tuple[str, int, int]]:
    """(file name, offset, bytes) of every piece a load places, recorded."""
    seen: list[tuple[str, int, int]] = []
    real = record_crc.Placed.place

    def place(self, fd, offset, data):
        seen.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, offset, len(data)))
        real(self, fd, offset, data)

    monkeypatch.setattr(record_crc.Placed, "place", place)
    return seen


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="mapping rank files needs Linux")
@pytest.mark.parametrize("where", ["placed", "not placed"])
def test_a_flipped_byte_in_a_zero3_partition_stops_the_load(where, tmp_path, monkeypatch):
    """A ZeRO-3 flat partition is one record; the parameters mapped from it are its placed pieces,
    the rest (small parameters read into memory, padding) is read at the end. A flipped byte in
    either part raises before a model is returned."""
    import hf_merge.load.page_mapper

    monkeypatch.setattr(hf_merge.load.page_mapper, "MIN_MAPPED_PAGES", 1)  # the fixture's parameters are KBs
    name = "z3_fp32_ws3"
    config = _ds_config(name)[1]
    good = _copy(DEEPSPEED / name, tmp_path / "good")
    seen = _placements(monkeypatch)
    AutoModelForCausalLM.from_sharded_pretrained(good, config=config, dtype="keep")
    assert seen, "no parameter was mapped from a partition"
    file, offset, n = seen[0]
    path = next(good.rglob(file))
    with open(path, "rb") as f:
        rec = next(r for r in read_records(f, file).values() if r.data_start <= offset < r.data_start + r.size)
    covered = [(o, o + k) for f_, o, k in seen if f_ == file]
    if where == "placed":
        at = offset + n // 2
    else:
        at = next(b for b in range(rec.data_start, rec.data_start + rec.size) if not any(a <= b < e for a, e in covered))
    bad = _copy(DEEPSPEED / name, tmp_path / "bad")
    target = next(bad.rglob(file))
    raw = bytearray(target.read_bytes())
    raw[at] ^= 0x10
    target.write_bytes(bytes(raw))
    with pytest.raises(record_crc.SourceCrcError, match=file):
        AutoModelForCausalLM.from_sharded_pretrained(bad, config=config, dtype="keep")


@pytest.mark.parametrize("flip", [None, "inside a run", "in the gap"])
def test_runs_of_pieces_from_inside_a_record_are_checked_as_one(flip, tmp_path, monkeypatch):
    """A flat partition (one ``torch.save`` record, 1.5 MB) copied as two parameters, each in
    256 KiB pieces that start inside the record (as the engine copies a ZeRO parameter): the pieces
    of one parameter are one run; at the end only the bytes no run covered are read (the gap
    between the parameters and the record's ends), and a flipped byte anywhere fails the check."""
    path = tmp_path / "partition.pt"
    torch.save({"flat": torch.arange(393216, dtype=torch.float32)}, path)
    with open(path, "rb") as f:
        records = read_records(f, path.name)
    rec = next(r for r in records.values() if r.name.endswith("data/0"))
    params = [(rec.data_start + 4096, 700_000), (rec.data_start + 720_000, 800_000)]  # inside the record, a gap between
    if flip is not None:
        raw = bytearray(path.read_bytes())
        raw[params[1][0] + 300_000 if flip == "inside a run" else rec.data_start + 710_000] ^= 0x01
        path.write_bytes(bytes(raw))
    fd = os.open(path, os.O_RDONLY)
    try:
        record_crc.add_archive(fd, records, path.name)
        read: list[int] = []
        crc_of = record_crc._crc
        monkeypatch.setattr(record_crc, "_crc", lambda fd, start, size, where: read.append(size) or crc_of(fd, start, size, where))
        placed = record_crc.Placed()
        stream = record_crc.Stream()
        with record_crc.deferred(into=placed):
            record_crc.check_record(fd, rec.data_start, rec.size, rec.crc, path.name)
            for start, n in params:
                for at in range(start, start + n, 256 << 10):
                    stream.feed(fd, at, memoryview(os.pread(fd, min(256 << 10, start + n - at), at)))
            stream.end()
        parts = placed._parts[next(iter(placed.pending))]
        assert [(a, n) for a, n, _ in parts] == params  # one piece per run, not one per 256 KiB
        if flip is None:
            placed.finish()
            assert sorted(read) == sorted([4096, 720_000 - 4096 - 700_000, rec.data_start + rec.size - 1_520_000 - rec.data_start])
        else:
            with pytest.raises(record_crc.SourceCrcError, match=path.name):
                placed.finish()
    finally:
        os.close(fd)


def test_chunk_archives_added_in_any_order_are_found_by_offset(tmp_path):
    """A .distcp holds one archive per chunk, added as the merge reaches them (not in file order):
    the records of all of them are found by offset, in file order, whichever order they came in,
    and an archive added twice is kept once."""
    import random

    from hf_merge.readers.torch_zip import Record

    path = tmp_path / "chunks.distcp"
    path.write_bytes(b"\0" * 64)
    chunks = [{f"c{i}/{k}": Record(f"c{i}/{k}", i * 1000 + k * 100, 50, k) for k in range(3)} for i in range(200)]
    order = list(range(200))
    random.Random(0).shuffle(order)
    for i in order + order[:10]:
        record_crc.add_archive(path, chunks[i], "chunks.distcp")
    with open(path, "rb") as f:
        _st, archive, records = record_crc._touched(f.fileno(), 0, 200 * 1000)
        assert [r.name for r in records] == [f"c{i}/{k}" for i in range(200) for k in range(3)]
        _st, _archive, records = record_crc._touched(f.fileno(), 57 * 1000 + 120, 200)
        assert [r.name for r in records] == ["c57/1", "c57/2"]
        assert record_crc._record_at(os.fstat(f.fileno()), 99 * 1000 + 249)[1].name == "c99/2"
