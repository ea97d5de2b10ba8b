"""Issue 13: crafted checkpoints (made from the real fixtures) never run code, never give silently
wrong weights, never clobber a target.

Every code-execution payload would create a file (``pwned``) if any part of it ran; each test
checks the file is absent. Entry points are called in-process (``hf_merge.cli.app.main``).
"""

from __future__ import annotations

import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch

import hf_merge
from hf_merge.cli.app import main as cli
from hf_merge.errors import CorruptCheckpointError, UnsafeCheckpointError
from hf_merge.readers import safe_pickle as sp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DCP_MD = "torch.distributed.checkpoint.metadata"
DCP_FS = "torch.distributed.checkpoint.filesystem"


# --------------------------------------------------------------------------------------------
# pickle payloads, written opcode by opcode (protocol 4)
# --------------------------------------------------------------------------------------------


def _str(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b if len(b) < 256 else b"X" + struct.pack("<I", len(b)) + b


def _glob(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL: the dotted-name resolver of protocol 4


def _call(func: bytes, *args: bytes) -> bytes:
    return func + b"(" + b"".join(args) + b"tR"  # MARK args TUPLE REDUCE


def _payloads(pwned: Path) -> dict[str, bytes]:
    cmd = _str(f"touch {pwned}")
    getattr_ = _glob("builtins", "getattr")
    return {
        # protocol 4 walks "os.system" from a module that imports os
        "dotted_global": b"\x80\x04" + _call(_glob("torch.distributed.checkpoint.filesystem", "os.system"), cmd) + b".",
        # an allowed class's attributes lead to its module's globals:
        # getattr(_StorageInfo.__init__.__globals__["os"], "system")(cmd)
        "class_gadget_chain": b"\x80\x04" + _call(_call(getattr_, _call(
            _glob("_operator", "getitem"),
            _call(getattr_, _call(getattr_, _glob(DCP_FS, "_StorageInfo"), _str("__init__")), _str("__globals__")),
            _str("os"),
        ), _str("system")), cmd) + b".",
        "class_gadget_dotted": b"\x80\x04" + _call(_glob(DCP_MD, "Metadata.__init__.__globals__"), _str("os")) + b".",
        # calling a class that is allowed only to be created empty and filled (its __init__ would run)
        "reduce_on_allowed_class": b"\x80\x04" + _call(_glob(DCP_MD, "Metadata"), _str("x")) + b".",
        # BUILD on a class object would set class attributes for the whole process
        "build_on_class": b"\x80\x04" + _glob(DCP_MD, "Metadata") + b"N}" + _str("__repr__") + _str("x") + b"s\x86b.",
        "inst_opcode": b"\x80\x02(" + b"c" + b"os\nsystem\n" + cmd + b"o.",
    }


class _Evil:
    def __init__(self, pwned: Path):
        self.pwned = pwned

    def __reduce__(self):
        return (os.system, (f"touch {self.pwned}",))


def _prepend(payload: bytes, valid: bytes) -> bytes:
    """``payload`` (a whole pickle) then POP, then the valid pickle: one stream that loads as ``valid``."""
    assert payload.endswith(b".")
    return payload[:-1] + b"0" + valid


@pytest.fixture
def sentinel_init(monkeypatch, tmp_path):
    """Make Metadata.__init__ and DeviceMesh.__init__ create ``pwned`` if they are ever called."""
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.device_mesh import DeviceMesh

    pwned = tmp_path / "pwned"

    def init(self, *a, **k):
        pwned.write_text("ran")

    monkeypatch.setattr(Metadata, "__init__", init)
    monkeypatch.setattr(DeviceMesh, "__init__", init)
    return pwned


@pytest.mark.parametrize("kind", list(_payloads(Path("x"))))
def test_policy_refuses_every_payload_kind(kind, sentinel_init):
    data = _payloads(sentinel_init)[kind]
    with pytest.raises(UnsafeCheckpointError) as e:
        sp.load_pickle(data, sp.DCP_METADATA, "crafted.metadata")
    with pytest.raises(UnsafeCheckpointError):
        sp.scan_pickle(data, sp.DCP_METADATA, "crafted.metadata")
    assert "crafted.metadata" in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400
    assert not sentinel_init.exists()


def _fast_path_payloads() -> dict[str, bytes]:
    """What C pickle could do to the stand-ins of the fast path that the pure machine never meets."""
    md = _glob(DCP_MD, "Metadata")
    return {
        "setitem_on_class": b"\x80\x04" + md + _str("k") + _str("v") + b"s.",
        "appends_on_class": b"\x80\x04" + md + b"(" + _str("v") + b"e.",
        "additems_on_class": b"\x80\x04" + md + b"(" + _str("v") + b"\x90.",
        "build_dict_on_class": b"\x80\x04" + md + b"}" + _str("__repr__") + _str("x") + b"sb.",
        "newobj_on_a_call_only_pair": b"\x80\x04" + _glob("pathlib", "Path") + b")\x81.",
        "reduce_on_a_call_result": b"\x80\x04" + _call(_call(_glob("builtins", "set"))) + b".",
        "build_on_a_call_result": b"\x80\x04" + _call(_glob("torch", "Size"), b")") + b"}b.",
        "inst_with_arguments": b"\x80\x02(" + _str("x") + b"ibuiltins\nset\n.",
        "ext_registered_code": b"\x80\x02\x82\xf0)R.",
    }


@pytest.mark.parametrize("kind", list(_fast_path_payloads()))
def test_fast_path_refuses_what_the_policy_refuses(kind, sentinel_init):
    """The C-pickle fast path of load_pickle (opcode walk, C scan over stand-ins, then C load)
    refuses every use the policy forbids; the pure machine then gives the typed error."""
    import copyreg

    from torch.distributed.checkpoint.metadata import Metadata

    data = _fast_path_payloads()[kind]
    allow = sp.DCP_METADATA | sp.torch_names()
    before = dict(vars(Metadata))
    copyreg.add_extension("builtins", "set", 240)
    try:
        with pytest.raises(Exception):
            sp._fast_load(data, allow)
        with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError)):
            sp.load_pickle(data, sp.DCP_METADATA, "crafted.metadata")
    finally:
        copyreg.remove_extension("builtins", "set", 240)
    assert dict(vars(Metadata)) == before and not sentinel_init.exists()


def test_fast_path_loads_real_metadata_as_the_pure_machine_does(megatron_root):
    import io

    files = sorted(megatron_root.glob("*/actor/**/.metadata"))
    assert files
    for path in files:
        data = path.read_bytes()
        pure = sp._run(sp._PolicyUnpickler(io.BytesIO(data), sp.DCP_METADATA | sp.torch_names(), "x", resolve=True), "x")
        assert repr(sp._fast_load(data, sp.DCP_METADATA | sp.torch_names())) == repr(pure)
    # plain data of every protocol, whatever its opcodes, loads as pickle does (bytes from protocol 3:
    # before, pickle writes them as a call of _codecs.encode); a cut pickle is refused
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        blob = [b"y" * 70000] if proto >= 3 else []
        for obj in ({"a": [1, 2.5, "x" * 300, *blob, None, True, 2**70, -(2**40)]}, list(range(300)), "\u00e9" * 9):
            assert sp.load_pickle(pickle.dumps(obj, protocol=proto), sp.Allowlist(), "x") == obj
    with pytest.raises(CorruptCheckpointError):
        sp.load_pickle(pickle.dumps(list(range(300)), protocol=0)[:-1], sp.Allowlist(), "x")  # cut: no STOP


def test_plain_pickle_would_have_run_the_payloads(tmp_path):
    """The payloads are live: the standard unpickler runs the dotted one and the gadget chain."""
    import torch.distributed.checkpoint  # noqa: F401

    for kind in ("dotted_global", "class_gadget_chain"):
        pwned = tmp_path / kind
        pickle.loads(_payloads(pwned)[kind])
        assert pwned.exists(), kind


# --------------------------------------------------------------------------------------------
# the same through every entry point, on real checkpoints
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_v1(megatron_root):
    return megatron_root / "qwen2_v1" / "actor"


@pytest.fixture(scope="module")
def megatron_merged(megatron_v1, tmp_path_factory):
    out = tmp_path_factory.mktemp("sec") / "merged"
    assert cli(["merge", str(megatron_v1), str(out)]) == 0
    return out


@pytest.fixture
def tampered_metadata(megatron_v1, tmp_path):
    src = tmp_path / "actor"
    shutil.copytree(megatron_v1, src)
    md = src / "dist_ckpt" / ".metadata"
    pwned = tmp_path / "pwned"
    payload = b"\x80\x02" + _call(b"cos\nsystem\n", _str(f"touch {pwned}")) + b"."  # no memo: the valid part's memo indices stay right
    md.write_bytes(_prepend(payload, md.read_bytes()))
    return src, pwned


def test_prepended_payload_loads_as_valid_metadata_with_plain_pickle(tampered_metadata):
    """Without the policy the tampered file would load (and run the payload) unnoticed."""
    src, pwned = tampered_metadata
    import torch.distributed.checkpoint  # noqa: F401

    md = pickle.loads((src / "dist_ckpt" / ".metadata").read_bytes())
    assert pwned.exists() and hasattr(md, "state_dict_metadata")


@pytest.mark.parametrize("entry", ["inspect", "merge", "verify", "from_sharded_pretrained"])
def test_prepended_metadata_payload_refused_everywhere(entry, tampered_metadata, megatron_merged, tmp_path, capsys):
    src, pwned = tampered_metadata
    target = tmp_path / "out"
    if entry == "from_sharded_pretrained":
        with pytest.raises(UnsafeCheckpointError, match=r"\.metadata"):
            hf_merge.from_sharded_pretrained(src)
    else:
        args = {
            "inspect": ["inspect", str(src)],
            "merge": ["merge", str(src), str(target)],
            "verify": ["verify", str(megatron_merged), "--against", str(src)],
        }[entry]
        assert cli(args) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and ".metadata" in err[0], err
        assert "posix.system" in err[0] or "os.system" in err[0] or "calls" in err[0] or "asks for" in err[0], err
    assert not pwned.exists()
    assert not target.exists()


def test_rank_file_reduce_on_allowed_class_refused(qwen2_fp32_ws2, sentinel_init, tmp_path, capsys):
    """torch's own weights_only unpickler would call an allowlisted class (DeviceMesh(...));
    the package policy refuses it before torch.load sees the file."""
    from torch.distributed.device_mesh import DeviceMesh

    class Gadget:
        def __reduce__(self):
            return (DeviceMesh, ("cpu", [0]))

    src = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, src)
    rank1 = src / "model_world_size_2_rank_1.pt"
    state = torch.load(rank1, weights_only=False)
    state["model.norm.weight"] = Gadget()
    torch.save(state, rank1)
    for args in (["inspect", str(src)], ["merge", str(src), str(tmp_path / "out")]):
        assert cli(args) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model_world_size_2_rank_1.pt" in err[0] and "DeviceMesh" in err[0], err
    assert not sentinel_init.exists() and not (tmp_path / "out").exists()


def test_legacy_model_pt_payload_refused(tmp_path):
    from hf_merge.readers.megatron_legacy import load_rank_file as _load_rank_file

    path = tmp_path / "model.pt"
    pwned = tmp_path / "pwned"
    torch.save({"model": {"w": torch.ones(2)}, "x": _Evil(pwned)}, path)
    with pytest.raises(UnsafeCheckpointError, match="model.pt.*system"):
        _load_rank_file(path)
    assert not pwned.exists()


def test_real_files_load_under_the_policy(qwen2_fp32_ws2, megatron_root):
    """The allowlists are not too narrow: real FSDP2 rank files, legacy model.pt and .metadata load."""
    from torch.distributed.tensor import DTensor

    state = sp.load_rank_file(qwen2_fp32_ws2.rank_files[1])
    assert state and all(isinstance(v, (DTensor, torch.Tensor)) for v in state.values())
    legacy = next((megatron_root / "qwen2_legacy_tied" / "actor" / "model").glob("mp_rank_*/model.pt"))
    from hf_merge.readers.megatron_legacy import LEGACY_RANK_FILE

    assert isinstance(sp.torch_load(legacy, LEGACY_RANK_FILE), (list, dict))
    md = sp.load_pickle((megatron_root / "qwen2_v1" / "actor" / "dist_ckpt" / ".metadata").read_bytes(), sp.DCP_METADATA, "m")
    assert type(md).__name__ == "Metadata" and md.state_dict_metadata


def test_torch_names_are_reference_only():
    """A dtype may be referenced but not called; a storage class may not be called either."""
    data = b"\x80\x04" + _call(_glob("torch", "FloatStorage"), _str("x")) + b"."
    with pytest.raises(UnsafeCheckpointError, match="calls torch.FloatStorage"):
        sp.scan_pickle(data, sp.TENSOR_FILE, "f")
    with pytest.raises(CorruptCheckpointError):
        sp.load_pickle(b"\x80\x04\x8c", sp.TENSOR_FILE, "f")


# --------------------------------------------------------------------------------------------
# 2. silent wrong weights
# --------------------------------------------------------------------------------------------


def _local_header(raw: bytes, suffix: bytes, nth: int = 0) -> int:
    """Byte offset of the ``nth`` zip local header whose name ends with ``suffix``."""
    pos, seen = 0, 0
    while (pos := raw.find(b"PK\x03\x04", pos)) >= 0:
        nlen = struct.unpack_from("<H", raw, pos + 26)[0]
        if raw[pos + 30 : pos + 30 + nlen].endswith(suffix):
            if seen == nth:
                return pos
            seen += 1
        pos += 4
    raise AssertionError(f"no local header for {suffix!r}")


def _shift_local_data(path: Path, suffix: bytes) -> None:
    """Grow a record's local extra field by 64 bytes: torch's reader would take its data from 64
    bytes further on (alignment preserved), everything else unchanged."""
    raw = bytearray(path.read_bytes())
    at = _local_header(raw, suffix)
    struct.pack_into("<H", raw, at + 28, struct.unpack_from("<H", raw, at + 28)[0] + 64)
    path.write_bytes(bytes(raw))


def _merge_fails(src: Path, tmp_path: Path, capsys, *needles: str) -> str:
    target = tmp_path / "out"
    assert cli(["merge", str(src), str(target)]) != 0
    stderr = capsys.readouterr().err
    err = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and "Traceback" not in stderr, stderr
    assert all(n in err[0] for n in needles), err
    assert not target.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    return err[0]


@pytest.fixture
def megatron_copy(megatron_v1, tmp_path):
    src = tmp_path / "actor"
    shutil.copytree(megatron_v1, src)
    return src


def _torch_dcp_metadata(dist):
    """The ``.metadata`` as torch's own objects (hf_merge reads it into stand-ins), to damage and re-pickle."""
    import torch.distributed.checkpoint  # noqa: F401

    return sp.load_pickle((dist / ".metadata").read_bytes(), sp.DCP_METADATA, ".metadata")


def test_overlapping_dcp_chunks_that_add_up_are_refused_before_reading(megatron_copy, tmp_path, capsys):
    dist = megatron_copy / "dist_ckpt"
    md = _torch_dcp_metadata(dist)
    key, entry = next((k, e) for k, e in md.state_dict_metadata.items() if len(getattr(e, "chunks", ())) >= 2)
    moved = entry.chunks[1]
    old_index = next(i for i in md.storage_data if i.fqn == key and tuple(i.offset) == tuple(moved.offsets))
    new_offsets = torch.Size(entry.chunks[0].offsets)  # same size, same place as chunk 0: overlap + hole
    assert tuple(moved.sizes) == tuple(entry.chunks[0].sizes)
    md.storage_data[type(old_index)(key, new_offsets, old_index.index)] = md.storage_data.pop(old_index)
    entry.chunks[1] = type(moved)(offsets=new_offsets, sizes=moved.sizes)
    (dist / ".metadata").write_bytes(pickle.dumps(md))
    _merge_fails(megatron_copy, tmp_path, capsys, ".metadata is damaged", "overlap", key)


def test_distcp_local_header_that_disagrees_is_refused(megatron_copy, tmp_path, capsys):
    from hf_merge.readers.dcp import DcpCheckpoint

    ck = DcpCheckpoint(megatron_copy / "dist_ckpt")
    chunk = ck._chunks["embedding.word_embeddings.weight"][0]
    ck.close()
    data_file = megatron_copy / "dist_ckpt" / chunk.file
    raw = bytearray(data_file.read_bytes())
    at = chunk.start + _local_header(raw[chunk.start : chunk.start + chunk.length], b"/data/0")
    struct.pack_into("<H", raw, at + 28, struct.unpack_from("<H", raw, at + 28)[0] + 64)
    data_file.write_bytes(bytes(raw))
    _merge_fails(megatron_copy, tmp_path, capsys, chunk.file, "data descriptor")


@pytest.fixture
def fsdp_copy(qwen2_fp32_ws2, tmp_path):
    src = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, src)
    return src


def test_rank_file_local_header_that_disagrees_is_refused(fsdp_copy, tmp_path, capsys):
    rank1 = fsdp_copy / "model_world_size_2_rank_1.pt"
    _shift_local_data(rank1, b"/data/3")
    _merge_fails(fsdp_copy, tmp_path, capsys, rank1.name, "data/3")


def test_rank_file_local_name_that_disagrees_is_refused(fsdp_copy, tmp_path, capsys):
    rank0 = fsdp_copy / "model_world_size_2_rank_0.pt"
    raw = bytearray(rank0.read_bytes())
    at = _local_header(raw, b"/data/1")
    raw[at + 30 + struct.unpack_from("<H", raw, at + 26)[0] - 1] = ord("7")  # ".../data/1" -> ".../data/7"
    rank0.write_bytes(bytes(raw))
    _merge_fails(fsdp_copy, tmp_path, capsys, rank0.name, "disagrees with the central directory")


def test_compressed_record_is_refused(fsdp_copy, tmp_path, capsys):
    """A deflated record (torch never writes one) is refused, never inflated."""
    import zipfile

    rank1 = fsdp_copy / "model_world_size_2_rank_1.pt"
    with zipfile.ZipFile(rank1) as z:
        items = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(rank1, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in items:
            z.writestr(name, data)
    _merge_fails(fsdp_copy, tmp_path, capsys, rank1.name, "compressed")


def test_verify_against_source_checks_record_crcs(fsdp_copy, tmp_path, capsys):
    """A flipped tensor byte keeps every structure valid: the merge refuses it (the record's CRC-32,
    checked as it reads); with --no-source-crc it copies it faithfully (exit 0), and
    ``verify --against`` finds it through the zip directory's CRC-32."""
    rank1 = fsdp_copy / "model_world_size_2_rank_1.pt"
    raw = bytearray(rank1.read_bytes())
    at = _local_header(raw, b"/data/0")
    data_start = at + 30 + struct.unpack_from("<H", raw, at + 26)[0] + struct.unpack_from("<H", raw, at + 28)[0]
    raw[data_start + 1] ^= 0x40
    rank1.write_bytes(bytes(raw))
    target = tmp_path / "out"
    _merge_fails(fsdp_copy, tmp_path, capsys, rank1.name, "data/0", "CRC-32")
    assert cli(["merge", str(fsdp_copy), str(target), "--dtype", "auto", "--no-source-crc"]) == 0
    capsys.readouterr()
    assert cli(["verify", str(target), "--against", str(fsdp_copy)]) == 1
    out = capsys.readouterr()
    assert "source CRC-32" in out.out and "FAIL" in out.out and f"{rank1.name}: record" in out.out, out.out
    rank1.write_bytes(bytes(raw[:data_start + 1]) + bytes([raw[data_start + 1] ^ 0x40]) + bytes(raw[data_start + 2:]))
    assert cli(["verify", str(target), "--against", str(fsdp_copy)]) == 1  # restored source: values now differ


# --------------------------------------------------------------------------------------------
# 3. side files come only from inside the checkpoint
# --------------------------------------------------------------------------------------------


def test_symlinked_huggingface_folder_leaving_the_checkpoint_is_refused(fsdp_copy, tmp_path, capsys):
    outside = tmp_path / "home" / ".docker"
    shutil.copytree(fsdp_copy / "huggingface", outside)
    (outside / "key.pem").write_text("-----BEGIN PRIVATE KEY-----")
    shutil.rmtree(fsdp_copy / "huggingface")
    (fsdp_copy / "huggingface").symlink_to(outside)
    _merge_fails(fsdp_copy, tmp_path, capsys, "huggingface is a symlink", "outside the checkpoint", "--config")


def test_symlinked_side_file_is_skipped_and_said(fsdp_copy, tmp_path, capsys):
    secret = tmp_path / "key.pem"
    secret.write_text("-----BEGIN PRIVATE KEY-----")
    (fsdp_copy / "huggingface" / "key.pem").symlink_to(secret)
    target = tmp_path / "out"
    assert cli(["merge", str(fsdp_copy), str(target)]) == 0
    assert "key.pem is a symlink" in capsys.readouterr().err
    assert not (target / "key.pem").exists() and (target / "config.json").is_file()


def test_symlinked_megatron_huggingface_folder_is_refused(megatron_copy, tmp_path, capsys):
    outside = tmp_path / "elsewhere"
    shutil.move(megatron_copy / "huggingface", outside)
    (megatron_copy / "huggingface").symlink_to(outside)
    _merge_fails(megatron_copy, tmp_path, capsys, "huggingface is a symlink", "outside the checkpoint")


# --------------------------------------------------------------------------------------------
# 4. one run per target, nothing clobbered, symlinked targets, no leftovers
# --------------------------------------------------------------------------------------------


def _leftovers(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.hf-merge-"))


def test_second_run_on_a_locked_target_is_refused(fsdp_copy, tmp_path, capsys):
    from hf_merge.write.atomic import target_lock

    target = tmp_path / "out"
    with target_lock(target):
        assert cli(["merge", str(fsdp_copy), str(target)]) != 0
        err = capsys.readouterr().err
        assert f"error: another hf-merge run (pid {os.getpid()}) is writing {target}" in err, err
        assert not target.exists() and _leftovers(target) == [".out.hf-merge-lock"]  # the holder's
    assert _leftovers(target) == []  # the holder removed its lock file on exit
    assert cli(["merge", str(fsdp_copy), str(target)]) == 0 and _leftovers(target) == []


def test_target_is_locked_while_the_first_run_still_reads(fsdp_copy, tmp_path, monkeypatch, run_cli):
    """The lock is taken before the source is read: a second merge into the same target fails at
    once with one line while the first is still opening its source, and the first one finishes."""
    import threading

    from hf_merge import merging

    reading, release = threading.Event(), threading.Event()
    real_open = merging.open_checkpoint

    def slow_open(*args, **kwargs):
        ckpt = real_open(*args, **kwargs)
        reading.set()
        assert release.wait(300)
        return ckpt

    monkeypatch.setattr(merging, "open_checkpoint", slow_open)
    target = tmp_path / "out"
    first: list = []
    thread = threading.Thread(target=lambda: first.append(merging.merge(fsdp_copy, target)))
    thread.start()
    try:
        assert reading.wait(300)
        assert not target.exists()  # still reading: nothing written yet
        rc, _, err = run_cli("merge", fsdp_copy, target)
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert rc != 0 and lines == [f"error: another hf-merge run (pid {os.getpid()}) is writing {target}; "
                                     "wait for it to finish or choose another target"], err
    finally:
        release.set()
        thread.join(300)
    assert first and first[0].num_tensors > 0 and (target / "config.json").is_file()
    assert _leftovers(target) == []


def test_final_rename_never_replaces_a_target_that_appeared(tmp_path):
    from hf_merge.errors import TargetExistsError
    from hf_merge.write.atomic import atomic_folder

    target = tmp_path / "out"
    with pytest.raises(TargetExistsError, match="appeared while merging"):
        with atomic_folder(target) as tmp:
            (tmp / "model.safetensors").write_text("ours")
            target.mkdir()
            (target / "theirs.txt").write_text("theirs")  # another process, not hf-merge, wrote it
    assert sorted(p.name for p in target.iterdir()) == ["theirs.txt"] and _leftovers(target) == []
    with atomic_folder(target, overwrite=True) as tmp:  # --overwrite replaces it
        (tmp / "model.safetensors").write_text("ours")
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"] and _leftovers(target) == []


def test_parent_folders_created_for_a_failed_target_are_removed(tmp_path):
    from hf_merge.write.atomic import atomic_folder

    target = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError):
        with atomic_folder(target) as tmp:
            (tmp / "x").write_text("x")
            raise RuntimeError("writer failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_symlinked_targets(fsdp_copy, tmp_path, capsys):
    real = tmp_path / "disk" / "merged"
    real.mkdir(parents=True)
    link = tmp_path / "merged"
    link.symlink_to(real)
    assert cli(["merge", str(fsdp_copy), str(link)]) == 0  # a link to a folder means that folder
    assert link.is_symlink() and (real / "model.safetensors").is_file()
    assert cli(["merge", str(fsdp_copy), str(link), "--overwrite"]) == 0
    assert link.is_symlink() and (real / "model.safetensors").is_file()
    assert _leftovers(link) == [] and _leftovers(real) == []
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    capsys.readouterr()
    assert cli(["merge", str(fsdp_copy), str(dangling)]) != 0
    assert "dangling symlink" in capsys.readouterr().err
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists() and _leftovers(dangling) == []


# --------------------------------------------------------------------------------------------
# 5. bounded work for what names and metadata claim; 6. typed one-line errors for bad input
# --------------------------------------------------------------------------------------------


def _cli_error(args: list[str], capsys) -> str:
    assert cli(args) != 0
    stderr = capsys.readouterr().err
    err = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and "Traceback" not in stderr and not err[0].startswith("error: unexpected "), stderr
    assert len(err[0]) < 600, err[0]
    return err[0]


class _WorkBudget:
    """Counts the Python lines this thread runs (``sys.settrace``) and stops the work with
    :class:`_OverBudget` past ``lines``: a bound on work that no machine load can move."""

    def __init__(self, lines: int):
        self.lines, self.used, self.exceeded = lines, 0, False

    def _trace(self, frame, event, arg):
        if event == "line":
            self.used += 1
            if self.used > self.lines:
                self.exceeded = True
                raise _OverBudget
        return self._trace

    def __enter__(self):
        import sys

        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc):
        import sys

        sys.settrace(None)


class _OverBudget(Exception):
    pass


def test_huge_world_size_in_a_file_name_is_cheap_and_short(fsdp_copy, capsys):
    (fsdp_copy / "model_world_size_2_rank_1.pt").unlink()
    (fsdp_copy / "fsdp_config.json").unlink()
    (fsdp_copy / "model_world_size_2_rank_0.pt").rename(fsdp_copy / "model_world_size_1000000000_rank_0.pt")
    # the name claims 10**9 ranks: the answer must cost one directory listing, not a walk over them
    with _WorkBudget(lines=5_000_000) as budget:  # ~170,000 when nothing was imported before
        line = _cli_error(["inspect", str(fsdp_copy)], capsys)
    assert not budget.exceeded, f"inspect ran more than {budget.lines} Python lines"
    assert "1 of 1000000000 present" in line and "model_world_size_1000000000_rank_1.pt" in line, line


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("huggingface/config.json", b"[1, 2]", "not an object"),
        ("huggingface/config.json", b'{"architectures": "Qwen2ForCausalLM", "model_type": "qwen2"}', "architectures"),
        ("huggingface/config.json", b"\xff\xfe{}", "not readable JSON"),
        ("fsdp_config.json", b'{"world_size": Infinity}', "not a positive integer"),
        ("fsdp_config.json", b'{"world_size": "2"}', "not a positive integer"),
    ],
)
def test_bad_side_files_are_typed_errors(fsdp_copy, tmp_path, capsys, name, content, needle):
    (fsdp_copy / name).write_bytes(content)
    line = _cli_error(["merge", str(fsdp_copy), str(tmp_path / "out")], capsys)
    assert needle in line and Path(name).name in line, line
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path / "out") == []


def test_bad_latest_step_file_falls_back_to_the_highest_step(qwen2_fp32_ws2, tmp_path, capsys):
    root = tmp_path / "ckpts"
    shutil.copytree(qwen2_fp32_ws2.root, root, ignore=shutil.ignore_patterns("reference"))
    for content in (b"\xff\xfe1", "\u00b2".encode(), b"999999999999999999999999"):
        (root / "latest_checkpointed_iteration.txt").write_bytes(content)
        assert cli(["inspect", str(root)]) == 0
        assert "the highest of" in capsys.readouterr().out
    # a step number with no folder (steps copied without the newest): an error naming both, not the highest read
    (root / "latest_checkpointed_iteration.txt").write_text("7\n")
    line = _cli_error(["merge", str(root), str(tmp_path / "out")], capsys)
    assert (f"{root / 'latest_checkpointed_iteration.txt'} names step 7, which is not here; the newest complete step "
            f"is global_step_1: pass {root / 'global_step_1'} to merge it") in line, line
    assert not (tmp_path / "out").exists()


def test_an_empty_newest_step_names_the_previous_complete_step(qwen2_fp32_ws2, tmp_path, capsys):
    """A run killed while saving leaves an empty newest ``global_step_N`` (and the latest file not
    yet moved to it, or gone). Before: "not a checkpoint hf-merge recognises". Now one line says
    which step is empty and which to pass; the older step is not merged in its place. The empty
    step folder given itself says the same (it said "not a checkpoint hf-merge recognises")."""
    root = tmp_path / "ckpts"
    shutil.copytree(qwen2_fp32_ws2.root, root, ignore=shutil.ignore_patterns("reference"))
    (root / "global_step_2" / "actor" / "huggingface").mkdir(parents=True)  # verl makes the folders first
    for latest in (None, "7\n"):
        (root / "latest_checkpointed_iteration.txt").unlink(missing_ok=True)
        if latest is not None:
            (root / "latest_checkpointed_iteration.txt").write_text(latest)
        line = _cli_error(["merge", str(root), str(tmp_path / "out")], capsys)
        assert f"{root / 'global_step_2'} is empty or incomplete" in line, line
        assert f"the newest complete step is global_step_1: pass {root / 'global_step_1'}" in line, line
        assert ("latest_checkpointed_iteration.txt names step 7, which is not here" in line) == (latest is not None), line
        assert not (tmp_path / "out").exists()
    for given in (root / "global_step_2", root / "global_step_2" / "actor"):  # the empty step itself
        line = _cli_error(["merge", str(given), str(tmp_path / "out")], capsys)
        assert f"{given} is not a checkpoint (holds " in line, line
        assert f"global_step_2 looks empty or incomplete (a run stopped while saving it?); the newest step before it " \
               f"that is a checkpoint is global_step_1: pass {root / 'global_step_1'} to merge it" in line, line
    (root / "latest_checkpointed_iteration.txt").write_text("1\n")  # the save of step 2 never finished: step 1
    assert cli(["inspect", str(root)]) == 0
    assert "using global_step_1 (from latest_checkpointed_iteration.txt)" in capsys.readouterr().out


def test_malformed_megatron_manifest_is_a_typed_error(megatron_root, tmp_path, capsys):
    src = tmp_path / "actor"
    shutil.copytree(megatron_root / "llama_v2_singleton" / "actor", src)
    manifest = src / "ckpt_contents.json"
    for bad in ('{"contents": []}', '{"contents": 1.5}', '{"contents": {"model": {"path": 3}}}', '{"contents": {"model": "x"}}'):
        manifest.write_text(bad)
        line = _cli_error(["inspect", str(src)], capsys)
        assert "ckpt_contents.json" in line and "manifest" in line, line


def _rewrite_safetensors_header(path: Path, edit) -> None:
    import json

    raw = path.read_bytes()
    n = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    path.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n :])


def test_bad_hf_folders_are_typed_errors(fsdp_copy, tmp_path, capsys):
    merged = tmp_path / "merged"
    assert cli(["merge", str(fsdp_copy), str(merged)]) == 0
    ref = tmp_path / "ref"
    shutil.copytree(merged, ref)
    (ref / "model.safetensors.index.json").write_text('{"weight_map": ["model.safetensors"]}')
    capsys.readouterr()
    line = _cli_error(["verify", str(merged), "--against", str(ref)], capsys)
    assert "model.safetensors.index.json is not a valid index" in line, line
    (ref / "model.safetensors.index.json").unlink()

    def to_u16(header):
        t = header["model.norm.weight"]
        t["shape"] = [t["shape"][0] * {"F32": 2, "BF16": 1, "F16": 1}[t["dtype"]]]  # same bytes
        t["dtype"] = "U16"  # a dtype safetensors knows and torch 2.13 has no safetensors mapping for here

    _rewrite_safetensors_header(ref / "model.safetensors", to_u16)
    line = _cli_error(["verify", str(merged), "--against", str(ref)], capsys)
    assert "model.norm.weight has dtype U16" in line, line


def test_lora_meta_with_wrong_types_or_nan(lora_ckpt, tmp_path, capsys):
    src = tmp_path / "actor"
    shutil.copytree(lora_ckpt.actor, src)
    for meta in ('{"r": 4, "lora_alpha": NaN}', '{"r": "four", "lora_alpha": 8}', "[8]", '{"lora_alpha": 8, "task_type": 3}'):
        (src / "lora_train_meta.json").write_text(meta)
        line = _cli_error(["merge", str(src), str(tmp_path / "out")], capsys)
        assert "lora_train_meta.json" in line, line


def test_disk_full_in_a_writer_process_reaches_the_user(fsdp_copy, tmp_path, capsys, monkeypatch):
    import errno

    from hf_merge.write import shards

    def full(ckpt, plan, folder, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / plan.name))

    monkeypatch.setattr(shards, "write_file", full)  # inherited by the forked writers
    line = _cli_error(["merge", str(fsdp_copy), str(tmp_path / "out"), "--workers", "2", "--max-shard-size", "100KB"], capsys)
    assert "no space left on the device" in line and "model-0000" in line, line
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path / "out") == []


def test_model_card_is_world_readable_and_endpoint_token_never_echoed(fsdp_copy, tmp_path):
    import stat

    from hf_merge.errors import HubError
    from hf_merge.publish.hub import _hub_errors

    target = tmp_path / "out"
    assert cli(["merge", str(fsdp_copy), str(target)]) == 0
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir() if p.is_file()}
    assert modes["README.md"] == modes["config.json"] == 0o666 & ~_umask(), modes
    with pytest.raises(HubError) as e:
        with _hub_errors("org/model", None, "https://user:hf_SECRETTOKEN123@hub.internal"):
            raise ConnectionError("refused")
    assert "hf_SECRETTOKEN123" not in str(e.value) and "hub.internal" in str(e.value)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_verify_checks_crcs_of_dcp_chunks(megatron_merged, megatron_v1, capsys):
    assert cli(["verify", str(megatron_merged), "--against", str(megatron_v1)]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("source CRC-32"))
    assert " ok " in row and "archives" in row, row


def test_fuzz_findings_are_typed_errors(megatron_copy, capsys):
    """Found by the 10-minute fuzz run: a metadata object missing a field, a non-list architectures."""
    import json

    dist = megatron_copy / "dist_ckpt"
    pristine = (dist / ".metadata").read_bytes()
    md = _torch_dcp_metadata(dist)
    chunk = next(e for e in md.state_dict_metadata.values() if hasattr(e, "chunks")).chunks[0]
    object.__delattr__(chunk, "offsets")
    (dist / ".metadata").write_bytes(pickle.dumps(md))
    assert "malformed DCP metadata" in _cli_error(["inspect", str(megatron_copy)], capsys)
    (dist / ".metadata").write_bytes(pristine)
    cfg = megatron_copy / "huggingface" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "architectures": 1.5}))
    assert '"architectures" must be a list' in _cli_error(["inspect", str(megatron_copy)], capsys)


def test_second_fuzz_run_findings_are_typed_errors(megatron_root, tmp_path, capsys):
    """Found by the second 10-minute run: Megatron config sizes of the wrong type (legacy layout)."""
    import json

    src = tmp_path / "actor"
    shutil.copytree(megatron_root / "qwen2_legacy_tied" / "actor", src)
    cfg = src / "huggingface" / "config.json"
    base = json.loads(cfg.read_text())
    for bad in ({}, [2], "x" * 50):
        cfg.write_text(json.dumps({**base, "num_key_value_heads": bad}))
        assert "num_key_value_heads is" in _cli_error(["inspect", str(src)], capsys)


def test_legacy_megatron_config_sizes_must_be_positive(megatron_root, tmp_path, capsys):
    """Found by the 7-minute run (seed 2029): a legacy Megatron config.json whose head or layer
    counts are zero, or whose num_hidden_layers is null, reached an AssertionError (QKV split) and
    ``int(None)``; each is now a one-line MissingConfigError naming the field."""
    import json

    src = tmp_path / "actor"
    shutil.copytree(megatron_root / "qwen2_legacy_tied" / "actor", src)
    cfg = src / "huggingface" / "config.json"
    base = json.loads(cfg.read_text())
    for key, value, needle in (
        ("num_attention_heads", 0, "num_attention_heads is '0', not a positive integer"),
        ("hidden_size", 0, "hidden_size is '0'"),
        ("head_dim", 0, "head_dim is '0'"),
        ("num_key_value_heads", 0, "num_key_value_heads is '0'"),
        ("num_hidden_layers", None, "num_hidden_layers"),
        ("hidden_size", None, "no positive integer hidden_size"),
    ):
        cfg.write_text(json.dumps({**base, key: value}))
        assert needle in _merge_fails(src, tmp_path, capsys), (key, value)
    cfg.write_text(json.dumps({k: v for k, v in base.items() if k not in ("head_dim", "num_attention_heads")}))
    assert "no positive integer num_attention_heads" in _merge_fails(src, tmp_path, capsys)


@pytest.mark.parametrize("damage", ["strided", "offset", "dtype"])
def test_rank_file_shard_that_reads_other_bytes_is_refused(qwen2_fp32_ws2, tmp_path, damage):
    # A damaged data.pkl can keep every shape right while its stride, storage offset or storage type
    # make the view read other bytes: torch.save of a DTensor shard is always dense at offset 0 and
    # in the dtype rank 0 declares, so anything else is refused instead of merged silently.
    import torch.distributed.tensor  # noqa: F401 - DTensor classes for torch.load

    actor = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, actor)
    path = actor / "model_world_size_2_rank_1.pt"
    state = torch.load(path, weights_only=False)
    name = "model.layers.0.mlp.up_proj.weight"
    dt = state[name]
    local = dt._local_tensor
    if damage == "strided":
        bigger = torch.zeros((local.shape[0], local.shape[1] * 2), dtype=local.dtype)
        bad = bigger[:, ::2]
    elif damage == "offset":
        bad = torch.zeros(local.numel() + 3, dtype=local.dtype)[3:].view(local.shape)
    else:
        bad = local.to(torch.float16)
    dt._local_tensor = bad
    torch.save(state, path)
    with pytest.raises(CorruptCheckpointError, match=r"model_world_size_2_rank_1\.pt"):
        hf_merge.open_checkpoint(actor)


def test_rank_file_storage_that_torch_cannot_use_is_a_typed_error(qwen2_fp32_ws2, monkeypatch):
    # fuzzing found a data.pkl whose storage record torch loads but then refuses to point at
    # ("invalid python storage"): that must be the rank file's typed error, not an unexpected one
    from hf_merge.readers import file_runs

    def refuse(self, tensor):
        raise RuntimeError("Attempted to access the data pointer on an invalid python storage.")

    monkeypatch.setattr(file_runs.MappedFile, "storage_span", refuse)
    with pytest.raises(CorruptCheckpointError, match=r"model_world_size_2_rank_0\.pt: inconsistent tensor metadata"):
        hf_merge.open_checkpoint(qwen2_fp32_ws2.actor)


def test_fuzz_run_5_findings_are_typed_errors(fsdp_copy, capsys):
    """Found by the fuzz run of seed 2030 (torchtitan source): a config.json whose model_type is
    not a string reached transformers' conversion table lookup (``unhashable type: 'dict'``)."""
    import json

    cfg = fsdp_copy / "huggingface" / "config.json"
    base = json.loads(cfg.read_text())
    for bad in ({"a": {"b": {}}}, [], 5):
        cfg.write_text(json.dumps({**base, "model_type": bad}))
        assert '"model_type" must be a string' in _cli_error(["inspect", str(fsdp_copy)], capsys)


def test_tensor_in_two_safetensors_files_is_refused(fsdp_copy, tmp_path, capsys):
    """An HF folder (here a real merge) where a second file holds a tensor of the first with other
    values: which one is meant is unknown, so it is refused instead of the later file winning."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    assert cli(["--quiet", "merge", str(fsdp_copy), str(hf)]) == 0
    with safe_open(str(hf / "model.safetensors"), "pt") as h:
        name = "model.norm.weight"
        save_file({name: h.get_tensor(name) + 1}, str(hf / "zz-extra.safetensors"))
    assert "is in two files" in _cli_error(["merge", str(hf), str(tmp_path / "out")], capsys)
