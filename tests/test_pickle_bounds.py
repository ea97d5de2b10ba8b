"""Issue 26, pickle part: the policy checks arguments, not only callables, and bounds the work.

Every crafted file is made from a real fixture (a verl FSDP2 rank file, a megatron-core DCP
``.metadata``, the committed DeepSpeed files): either a few opcodes put in front of the real
pickle (then ``POP``, so plain pickle would load the real object unnoticed) or an object of the
real state dict replaced and the file saved again with ``torch.save``. Each must be refused with
one typed error line, in every entry point that reads it (inspect, merge, verify,
``from_sharded_pretrained``; the head start's torch-free reader for rank files).
"""

from __future__ import annotations

import enum
import shutil
import struct
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

import hf_merge
from hf_merge.cli.app import main as cli
from hf_merge.errors import CorruptCheckpointError, HfMergeError, PickleLimitError, UnsafeCheckpointError
from hf_merge.readers import rank_records
from hf_merge.readers import safe_pickle as sp
from hf_merge.readers.dcp import load_dcp_metadata
from test_security import _call, _glob, _str  # the opcode writers of the first round's payloads
from helpers import dcp_no_dist

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DATA = Path(__file__).parent / "data" / "deepspeed"
DCP_MD = "torch.distributed.checkpoint.metadata"
RANK1 = "model_world_size_2_rank_1.pt"


# --------------------------------------------------------------------------------------------
# opcodes (protocol 4, no memo: the real pickle after them keeps its memo indices)
# --------------------------------------------------------------------------------------------


def _payload(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"0"  # ... POP: the real pickle follows


PAYLOADS = {
    # a dict key (t, t) of (t', t') ... 64 levels: hashing it visits 2**64 tuples
    "hash_bomb": _payload(b"})" + b"2\x86" * 64 + b"Ns"),
    # a key nested a million tuples deep: hashing it overflows the C stack
    "deep_tuple": _payload(b"})" + b"\x85" * 1_000_000 + b"Ns"),
    # LONG_BINPUT 2**26: C pickle sizes its memo array by the largest index (0.5 GB here)
    "huge_memo": _payload(b"Nr" + struct.pack("<I", 1 << 26)),
    # BUILD plants __setstate__ in an allowed container's __dict__; the next BUILD would call it
    "planted_setstate": _payload(
        _call(_glob("collections", "OrderedDict")) + b"}" + _str("__setstate__") + _str("y") + b"sb"
        + _str("x") + b"b"
    ),
    # BUILD puts `append` in a stand-in's state; APPEND would then call it
    "planted_append": _payload(
        _glob(DCP_MD, "Metadata") + b")\x81}" + _str("append") + _glob("pathlib", "Path") + b"sb" + _str("x") + b"a"
    ),
    # an allowed function as a plain value where a reader expects data (fuzz: a DeepSpeed
    # partition_count became torch._utils._rebuild_tensor_v2 and the reader crashed comparing it)
    "callable_as_data": _payload(b"}" + _str("x") + _glob("pathlib", "Path") + b"s"),
    # APPEND on a stand-in (no callable anywhere): only lists, dicts and sets are filled
    "append_on_stand_in": _payload(_glob(DCP_MD, "Metadata") + b")\x81}b" + _str("x") + b"a"),
}
LIMITS = {"hash_bomb": "hash", "deep_tuple": "deep", "huge_memo": "memo entry"}


def _rewrite_data_pkl(path: Path, edit) -> None:
    """``path`` (a torch.save zip) written again by torch's own zip writer with ``data.pkl`` edited."""
    with zipfile.ZipFile(path) as z:
        records = [(n.split("/", 1)[1], z.read(n)) for n in z.namelist()]
    path.unlink()
    w = torch._C.PyTorchFileWriter(str(path))
    for name, data in records:
        if name in ("version", ".data/version", ".data/serialization_id"):
            continue  # the writer adds these
        data = edit(data) if name == "data.pkl" else data
        w.write_record(name, data, len(data))
    w.write_end_of_file()


# --------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_v1(megatron_root):
    return megatron_root / "qwen2_v1" / "actor"


@pytest.fixture(scope="module")
def merged(qwen2_fp32_ws2, megatron_v1, tmp_path_factory):
    """Pristine merges (the reference ``verify`` compares a crafted source against)."""
    out = {}
    for kind, src in (("fsdp", qwen2_fp32_ws2.actor), ("dcp", megatron_v1)):
        out[kind] = tmp_path_factory.mktemp("pristine") / kind
        assert cli(["--quiet", "merge", str(src), str(out[kind])]) == 0
    return out


def _fsdp_with(payload: bytes, qwen2_fp32_ws2, tmp_path: Path) -> Path:
    src = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, src)
    _rewrite_data_pkl(src / RANK1, lambda data: payload + data)
    return src


def _dcp_with(payload: bytes, megatron_v1: Path, tmp_path: Path) -> Path:
    src = tmp_path / "actor"
    shutil.copytree(megatron_v1, src)
    md = src / "dist_ckpt" / ".metadata"
    md.write_bytes(payload + md.read_bytes())
    return src


def _entry(entry: str, src: Path, reference: Path, tmp_path: Path, capsys, extra: list[str] = ()) -> str:
    """The error of one entry point on ``src``: one ``error:`` line (or the exception's text);
    ``extra``: CLI options (``--config DIR`` is given to ``from_sharded_pretrained`` too)."""
    target = tmp_path / "out"
    if entry == "from_sharded_pretrained":
        config = {"config": extra[1]} if extra[:1] == ["--config"] else {}
        with pytest.raises(HfMergeError) as e:
            hf_merge.from_sharded_pretrained(src, **config)
        return str(e.value)
    args = {
        "inspect": ["inspect", str(src), *extra],
        "merge": ["merge", str(src), str(target), *extra],
        "merge-head-start": ["merge", str(src), str(target), "--dtype", "auto", *extra],  # the child reads rank files too
        "verify": ["verify", str(reference), "--against", str(src), *extra],
    }[entry]
    assert cli(args) != 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err and "unexpected" not in err, err
    assert not target.exists()
    return lines[0]


ENTRIES = ["inspect", "merge", "verify", "from_sharded_pretrained"]


# --------------------------------------------------------------------------------------------
# 1. limits and planted attributes: .metadata and rank files, every entry point
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(PAYLOADS))
def test_metadata_payloads_are_refused_by_the_policy(kind, megatron_v1, tmp_path):
    src = _dcp_with(PAYLOADS[kind], megatron_v1, tmp_path)
    expected = PickleLimitError if kind in LIMITS else UnsafeCheckpointError
    with pytest.raises(expected) as e:
        load_dcp_metadata(src / "dist_ckpt")
    message = str(e.value)
    assert ".metadata" in message and "\n" not in message and len(message) < 400 + len(str(src))
    needles = {"planted_setstate": "attribute '__setstate__'", "planted_append": "into a container as data",
               "callable_as_data": "into a container as data", "append_on_stand_in": "not a container"}
    assert (LIMITS.get(kind) or needles[kind]) in message, message


@pytest.mark.parametrize("kind", list(LIMITS))
def test_rank_file_payloads_are_refused_by_both_readers(kind, qwen2_fp32_ws2, tmp_path):
    """The merge's reader and the head start's torch-free one (``index_rank_file``) refuse the same."""
    src = _fsdp_with(PAYLOADS[kind], qwen2_fp32_ws2, tmp_path)
    for read in (rank_records.load_rank_records, rank_records.index_rank_file, sp.load_rank_file):
        with pytest.raises(PickleLimitError, match=rf"{RANK1}: the pickle .*{LIMITS[kind]}"):
            read(src / RANK1)


@pytest.mark.parametrize("entry", [*ENTRIES, "merge-head-start"])
@pytest.mark.parametrize("kind", list(LIMITS))
def test_limits_through_every_entry_point(kind, entry, qwen2_fp32_ws2, megatron_v1, merged, tmp_path, capsys):
    for fmt, make in (("fsdp", lambda p: _fsdp_with(p, qwen2_fp32_ws2, tmp_path / "f")),
                      ("dcp", lambda p: _dcp_with(p, megatron_v1, tmp_path / "d"))):
        src = make(PAYLOADS[kind])
        line = _entry(entry, src, merged[fmt], tmp_path, capsys)
        assert LIMITS[kind] in line and ("refused" in line), line


@pytest.mark.parametrize("entry", ENTRIES)
def test_planted_attributes_through_every_entry_point(entry, megatron_v1, merged, tmp_path, capsys):
    for kind in ("planted_setstate", "planted_append", "append_on_stand_in"):
        src = _dcp_with(PAYLOADS[kind], megatron_v1, tmp_path / kind)
        line = _entry(entry, src, merged["dcp"], tmp_path, capsys)
        assert ".metadata" in line and "allowlist" in line, line


def _nested_relative_path(data: bytes, depth: int) -> bytes:
    """The real .metadata with the value of its first ``relative_path`` field replaced by a list
    nested ``depth`` deep (the memo entry that follows now names the list)."""
    import pickletools

    ops = list(pickletools.genops(data))
    frames = [(pos, pos + 9) for op, _, pos in ops if op.name == "FRAME"]
    if frames:  # frames are optional; their lengths would no longer fit
        kept, last = [], 0
        for start, end in frames:
            kept.append(data[last:start])
            last = end
        return _nested_relative_path(b"".join(kept) + data[last:], depth)
    for i, (op, arg, pos) in enumerate(ops):
        if arg == "relative_path":
            j = i + 1
            while ops[j][0].name in ("BINPUT", "MEMOIZE", "LONG_BINPUT"):
                j += 1
            op2, _, start = ops[j]
            assert "UNICODE" in op2.name, op2.name
            end = ops[j + 1][2]
            return data[:start] + b"(" * depth + b"l" * depth + data[end:]
    raise AssertionError("no relative_path in the metadata")


@pytest.mark.parametrize("entry", ENTRIES)
def test_deeply_nested_relative_path_is_a_typed_error(entry, megatron_v1, merged, tmp_path, capsys):
    src = tmp_path / "actor"
    shutil.copytree(megatron_v1, src)
    md = src / "dist_ckpt" / ".metadata"
    md.write_bytes(_nested_relative_path(md.read_bytes(), 5000))
    line = _entry(entry, src, merged["dcp"], tmp_path, capsys)
    assert "deep" in line and ".metadata" in line, line
    md.write_bytes(_nested_relative_path((megatron_v1 / "dist_ckpt" / ".metadata").read_bytes(), 3))
    line = _entry(entry, src, merged["dcp"], tmp_path, capsys)  # shallow: the reader says what it is
    assert "relative_path" in line, line


# --------------------------------------------------------------------------------------------
# 2. arguments: _rebuild_from_type_v2(torch.Tensor, ...) and stride-0 views in DeepSpeed files
# --------------------------------------------------------------------------------------------


@pytest.fixture
def deepspeed_classes(monkeypatch):
    """Plain classes under DeepSpeed's names, so that a real optimizer file can be loaded with
    plain pickle, edited and saved again (DeepSpeed itself is not installed)."""

    def module(name: str) -> types.ModuleType:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            n = ".".join(parts[:i])
            if n not in sys.modules:
                monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
        return sys.modules[name]

    class ZeroStageEnum(int, enum.Enum):
        disabled, optimizer_states, gradients, weights = 0, 1, 2, 3

    ZeroStageEnum.__module__, ZeroStageEnum.__qualname__ = "deepspeed.runtime.zero.config", "ZeroStageEnum"
    module(ZeroStageEnum.__module__).ZeroStageEnum = ZeroStageEnum
    for mod, name in (("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
                      ("deepspeed.utils.tensor_fragment", "fragment_address")):
        setattr(module(mod), name, type(name, (), {"__module__": mod}))


class _Uninitialised:
    """Pickles as ``_rebuild_from_type_v2(torch.Tensor, torch.Tensor, (n,), {})``: ``torch.Tensor(n)``,
    uninitialised memory, as torch's own rebuild would run it."""

    def __init__(self, n: int):
        self.n = n

    def __reduce__(self):
        from torch._tensor import _rebuild_from_type_v2

        return (_rebuild_from_type_v2, (torch.Tensor, torch.Tensor, (self.n,), {}))


def _deepspeed_with(make, tmp_path: Path) -> Path:
    """z1_fp32_ws1 with its first flat fp32 partition replaced by ``make(partition)``."""
    src = tmp_path / "ds"
    shutil.copytree(DATA / "z1_fp32_ws1", src, ignore=shutil.ignore_patterns("reference"))
    path = src / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = torch.load(path, weights_only=False)
    groups = state["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    groups[0] = make(groups[0])
    torch.save(state, path)
    return src


DEEPSPEED_CASES = {
    "uninitialised": (lambda t: _Uninitialised(t.numel()), "_rebuild_from_type_v2"),
    "stride_0": (lambda t: torch.zeros(1, dtype=t.dtype).expand(t.shape), "more than once"),
}


@pytest.mark.parametrize("case", list(DEEPSPEED_CASES))
def test_deepspeed_partition_outside_its_schema_is_refused(case, deepspeed_classes, tmp_path):
    from hf_merge.readers.deepspeed import load_deepspeed_file

    make, needle = DEEPSPEED_CASES[case]
    src = _deepspeed_with(make, tmp_path)
    with pytest.raises(UnsafeCheckpointError, match=needle):
        load_deepspeed_file(src / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", list(DEEPSPEED_CASES))
def test_deepspeed_partition_refused_through_every_entry_point(case, entry, deepspeed_classes, tmp_path, capsys):
    make, needle = DEEPSPEED_CASES[case]
    src = _deepspeed_with(make, tmp_path)
    config = ["--config", str(DATA / "z1_fp32_ws1" / "reference" / "step2" / "config")]
    reference = tmp_path / "pristine"
    assert cli(["--quiet", "merge", str(DATA / "z1_fp32_ws1"), str(reference), *config]) == 0
    line = _entry(entry, src, reference, tmp_path, capsys, config)
    assert needle in line and "optim_states.pt" in line, line


def test_torch_would_have_built_uninitialised_memory(deepspeed_classes, tmp_path):
    """The crafted partition is live: torch's own weights_only loader builds it without complaint."""
    src = _deepspeed_with(lambda t: _Uninitialised(t.numel()), tmp_path)
    state = torch.load(src / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    part = state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    assert type(part) is torch.Tensor and part.numel() == 14064


# --------------------------------------------------------------------------------------------
# 3. stride-0 views in a rank file
# --------------------------------------------------------------------------------------------


@pytest.fixture
def broadcast_rank_file(qwen2_fp32_ws2, tmp_path):
    """A real rank file whose up_proj shard is one stored element broadcast to the shard's shape."""
    import torch.distributed.tensor  # noqa: F401 - DTensor classes for torch.load

    src = tmp_path / "actor"
    shutil.copytree(qwen2_fp32_ws2.actor, src)
    state = torch.load(src / RANK1, weights_only=False)
    dt = state["model.layers.0.mlp.up_proj.weight"]
    dt._local_tensor = torch.ones(1, dtype=dt._local_tensor.dtype).expand(dt._local_tensor.shape)
    torch.save(state, src / RANK1)
    return src


def test_broadcast_view_in_a_rank_file_is_refused(broadcast_rank_file):
    for read in (rank_records.load_rank_records, rank_records.index_rank_file, sp.load_rank_file):
        with pytest.raises(UnsafeCheckpointError, match=rf"{RANK1}: .*reads elements more than once"):
            read(broadcast_rank_file / RANK1)


@pytest.mark.parametrize("entry", ENTRIES)
def test_broadcast_view_refused_through_every_entry_point(entry, broadcast_rank_file, merged, tmp_path, capsys):
    line = _entry(entry, broadcast_rank_file, merged["fsdp"], tmp_path, capsys)
    assert "more than once" in line and RANK1 in line, line


def test_views_that_are_dense_or_size_one_broadcasts_still_load(tmp_path):
    """What torch.save writes for ordinary tensors passes: transposed, sliced, size-1 dims of stride 0."""
    path = tmp_path / "ok.pt"
    base = torch.arange(24.0).reshape(4, 6)
    torch.save({"t": base.t(), "slice": base[1:3, 2:], "one": torch.ones(1, 6)[:, None].expand(1, 1, 6)}, path)
    state = sp.torch_load(path, sp.TENSOR_FILE)
    assert torch.equal(state["t"], base.t()) and torch.equal(state["slice"], base[1:3, 2:])


# --------------------------------------------------------------------------------------------
# 4. the C fast path and the pure walker decide the same, on every opcode-level mutation
# --------------------------------------------------------------------------------------------


def _mutations(data: bytes, every: int = 1):
    """Each opcode replaced by a few others, each argument set to 0, 0xFF.. and +1 (bounded)."""
    import pickletools

    replacements = b"R\x81b.02a)se\x85\x86\x94\x93N"
    for n, (op, arg, pos) in enumerate(pickletools.genops(data)):
        if n % every:
            continue
        for r in replacements:
            if r != data[pos]:
                yield data[:pos] + bytes([r]) + data[pos + 1 :]
        width = {"BINPUT": 1, "BINGET": 1, "LONG_BINPUT": 4, "LONG_BINGET": 4, "BININT1": 1, "BININT2": 2, "BININT": 4}.get(op.name)
        if width:
            for value in (b"\x00" * width, b"\xff" * width, ((int.from_bytes(data[pos + 1 : pos + 1 + width], "little") + 1) % (1 << 8 * width)).to_bytes(width, "little")):
                yield data[: pos + 1] + value + data[pos + 1 + width :]


def _decision(fn):
    try:
        return ("ok", repr(fn()))
    except (UnsafeCheckpointError, CorruptCheckpointError) as e:
        return ("refused", type(e).__name__)
    except Exception as e:  # noqa: BLE001 - the fast path's own refusals
        return ("refused", type(e).__name__)


@pytest.fixture(scope="module")
def small_metadata(tmp_path_factory) -> bytes:
    """A small real ``.metadata``: torch.distributed.checkpoint's own writer, two tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    path = tmp_path_factory.mktemp("dcp-small")
    dcp.save({"w": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, storage_writer=FileSystemWriter(str(path)), **dcp_no_dist())
    return (path / ".metadata").read_bytes()


def test_fast_path_and_pure_walker_decide_the_same_on_metadata_mutations(small_metadata):
    import io

    data = small_metadata
    allow = sp.DCP_METADATA | sp.torch_names()
    subs = None  # real classes: both paths build the same objects
    seen = {"ok": 0, "refused": 0}
    for mutated in _mutations(data, every=2):
        fast = _decision(lambda: sp._fast_load(mutated, allow, subs))
        pure = _decision(lambda: (sp._walk(mutated, allow, "x", persistent=False),
                                  sp._run(sp._PolicyUnpickler(io.BytesIO(mutated), allow, "x", resolve=True), "x"))[1])
        assert fast[0] == pure[0] and (fast[0] == "refused" or fast == pure), (fast, pure)
        seen[fast[0]] += 1
    assert seen["ok"] > 10 and seen["refused"] > 100, seen


def test_a_frame_longer_than_the_rest_of_the_pickle_is_corrupt(small_metadata):
    """C pickle refuses a FRAME that claims more bytes than follow it (truncated); Python's pure
    unpickler reads the short frame and goes on. The walk both machines start with refuses it, so
    the fast path and the pure machine decide the same (torch 2.6's FSDP2 rank file met this in the
    mutation test below: POP over a LONG_BINPUT whose memo index began with 0x95, FRAME)."""
    import io
    import pickletools

    pos = next(p for op, _, p in pickletools.genops(small_metadata) if op.name == "FRAME")
    data = small_metadata[: pos + 1] + (len(small_metadata) - pos).to_bytes(8, "little") + small_metadata[pos + 9 :]
    allow = sp.DCP_METADATA | sp.torch_names()
    fast = _decision(lambda: sp._fast_load(data, allow, None))
    pure = _decision(lambda: sp._run(sp._PolicyUnpickler(io.BytesIO(data), allow, "x", resolve=True), "x"))
    assert fast[0] == "refused" and pure[0] == "ok", (fast, pure)  # what the walk has to decide for both
    with pytest.raises(CorruptCheckpointError, match="crafted.metadata"):
        sp.load_pickle(data, sp.DCP_METADATA, "crafted.metadata")
    with pytest.raises(CorruptCheckpointError, match="crafted.metadata"):
        sp.scan_pickle(data, sp.DCP_METADATA, "crafted.metadata")


@pytest.mark.slow  # thousands of mutated pickles, each scanned twice
def test_c_scan_and_pure_scan_decide_the_same_on_rank_file_mutations(qwen2_fp32_ws2):
    import io

    with zipfile.ZipFile(qwen2_fp32_ws2.rank_files[0]) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    allow = sp.DTENSOR_FILE | sp.torch_names()

    def pid(p):
        return sp._Filled(("torch", "FloatStorage"), False)

    seen = {"ok": 0, "refused": 0}
    for mutated in _mutations(data, every=15):
        fast = _decision(lambda: sp._fast_scan(mutated, allow, pid))
        pure = _decision(lambda: sp.scan_pickle(mutated, sp.DTENSOR_FILE, "x", persistent_load=lambda p: sp._Made(("torch", "FloatStorage"), False)))
        assert fast[0] == pure[0], (fast, pure)
        seen[fast[0]] += 1
    assert seen["ok"] > 10 and seen["refused"] > 100, seen


def test_schemas_cover_every_allowed_call():
    """Every pair a pickle may call has an argument schema (or is a plain-data call on purpose)."""
    from hf_merge.readers import pickle_schemas
    from hf_merge.readers.deepspeed import DEEPSPEED_FILE
    from hf_merge.readers.megatron_legacy import LEGACY_RANK_FILE

    plain = {("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
             ("deepspeed.utils.tensor_fragment", "fragment_address")}
    for allow in (sp.TENSOR_FILE, sp.DTENSOR_FILE, sp.DCP_METADATA, DEEPSPEED_FILE, LEGACY_RANK_FILE):
        assert allow.calls - set(pickle_schemas.CALLS) <= plain, allow.calls - set(pickle_schemas.CALLS)
