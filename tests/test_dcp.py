"""The lazy DCP reader against folders written by torch.distributed.checkpoint itself.

Multi-chunk tensors (what TP / FSDP ranks produce) are written in one process by a save planner
that splits chosen tensors into chunks along a dim; the files are DCP's own (FileSystemWriter,
default TORCH_SAVE serialization). Megatron-written folders are covered in test_megatron.py.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from hf_merge.errors import CorruptCheckpointError, SourceNotFoundError, UnsafeCheckpointError, UnsupportedCheckpointError
from hf_merge.readers import dcp_index
from hf_merge.readers.dcp import DcpCheckpoint, is_dcp_dir
from helpers import dcp_no_dist

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class ChunkedPlanner(DefaultSavePlanner):
    """Save planner that stores chosen tensors as several chunks: ``{name: (dim, parts)}``."""

    def __init__(self, splits: dict[str, tuple[int, int]]):
        super().__init__()
        self.splits = splits

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for it in plan.items:
            name = it.index.fqn
            if name not in self.splits or it.type != WriteItemType.TENSOR:
                items.append(it)
                continue
            t = self.state_dict[name]
            dim, parts = self.splits[name]
            step = -(-t.shape[dim] // parts)
            for a in range(0, t.shape[dim], step):
                off = [0] * t.dim()
                off[dim] = a
                size = list(t.shape)
                size[dim] = min(step, t.shape[dim] - a)
                chunk = ChunkStorageMetadata(torch.Size(off), torch.Size(size))
                items.append(
                    WriteItem(
                        index=MetadataIndex(name, torch.Size(off)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(t), size=t.size()),
                    )
                )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        name = write_item.index.fqn
        if name in self.splits and write_item.type == WriteItemType.SHARD:
            t = self.state_dict[name]
            c = write_item.tensor_data.chunk
            for d, (o, s) in enumerate(zip(c.offsets, c.sizes)):
                t = t.narrow(d, o, s)
            return t.contiguous().clone()
        return super().resolve_data(write_item)


def save_dcp(path: Path, state_dict: dict, splits: dict[str, tuple[int, int]] | None = None) -> Path:
    dcp.save(state_dict, storage_writer=FileSystemWriter(str(path)), planner=ChunkedPlanner(splits or {}), **dcp_no_dist())
    return path


def official_load(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load(sd, storage_reader=FileSystemReader(str(path)), **dcp_no_dist())
    return sd


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "stacked.qkv": torch.randn(4, 24, 8, generator=g),  # [L, rows, H] sharded on rows (TP dim 0)
        "stacked.proj": torch.randn(4, 8, 12, generator=g),  # sharded on the last dim (TP dim 1)
        "emb": torch.randn(10, 8, generator=g).to(torch.bfloat16),  # uneven chunks (10 rows / 3)
        "half": torch.randn(3, 5, generator=g).half(),
        "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "transposed": torch.randn(6, 4, generator=g).t(),  # non-contiguous at save time
    }
    state = dict(tensors)
    state["extra_state"] = io.BytesIO(b"not a tensor")
    path = save_dcp(
        tmp_path_factory.mktemp("dcp") / "ckpt",
        state,
        {"stacked.qkv": (1, 2), "stacked.proj": (2, 3), "emb": (0, 3), "ids": (1, 2)},
    )
    return path, tensors


def test_specs_and_full_reads_match_torch_dcp(sample):
    path, tensors = sample
    assert is_dcp_dir(path)
    ck = DcpCheckpoint(path)
    assert set(ck.specs()) == set(tensors)
    assert ck.byte_keys() == ["extra_state"]
    assert len(ck.chunk_boxes("stacked.qkv")) == 2 and len(ck.chunk_boxes("emb")) == 3
    ref = official_load(path, tensors)
    for name, t in tensors.items():
        spec = ck.specs()[name]
        assert spec.shape == tuple(t.shape) and spec.dtype == t.dtype, name
        got = ck.read(name)
        assert got.dtype == t.dtype and torch.equal(got, t) and torch.equal(got, ref[name]), name
    assert ck.info.format == "dcp" and ck.info.world_size == 1
    ck.close()
    ck.close()  # twice is fine


def test_region_reads_cross_chunk_boundaries(sample):
    path, tensors = sample
    ck = DcpCheckpoint(path)
    qkv, proj = tensors["stacked.qkv"], tensors["stacked.proj"]
    for i in range(4):  # one layer of a stacked tensor at a time
        out = torch.empty(1, 24, 8)
        ck.read_region_into("stacked.qkv", (i, 0, 0), out)
        assert torch.equal(out[0], qkv[i])
    out = torch.empty(2, 7, 8)  # rows 10..17 straddle the two row chunks
    ck.read_region_into("stacked.qkv", (1, 10, 0), out)
    assert torch.equal(out, qkv[1:3, 10:17])
    out = torch.empty(1, 8, 9)  # columns 2..11 straddle three column chunks
    ck.read_region_into("stacked.proj", (3, 0, 2), out)
    assert torch.equal(out, proj[3:4, :, 2:11])
    out = torch.empty(2, 3)  # a box of a chunk stored transposed (non-contiguous at save time)
    ck.read_region_into("transposed", (1, 2), out)
    assert torch.equal(out, tensors["transposed"][1:3, 2:5])
    with pytest.raises(ValueError, match="outside"):
        ck.read_region_into("stacked.qkv", (3, 20, 0), torch.empty(2, 8, 8))


def test_read_into_casts_and_fills_strided_buffers(sample):
    path, tensors = sample
    ck = DcpCheckpoint(path)
    buf = torch.zeros(8, 10, dtype=torch.float64)
    out = buf.t()  # [10, 8] non-contiguous view, another dtype
    ck.read_into("emb", out)
    assert torch.equal(out, tensors["emb"].double())
    with pytest.raises(ValueError, match="shape"):
        ck.read_into("emb", torch.empty(8, 10))
    with pytest.raises(KeyError, match="byte entry"):
        ck.read("extra_state")


def test_reads_are_bounded_byte_ranges(tmp_path, monkeypatch):
    big = torch.randn(8, 256, 256)  # 2 MiB, one chunk: one layer is 256 KiB
    path = save_dcp(tmp_path / "big", {"w": big})
    limit = 64 << 10
    ck = DcpCheckpoint(path, max_read_bytes=limit)
    read_bytes = []
    real_preadv = os.preadv

    def counting_preadv(fd, buffers, offset, *a):
        read_bytes.append(sum(memoryview(b).nbytes for b in buffers))
        return real_preadv(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    ck.read("w")  # parse the chunk once
    read_bytes.clear()

    # Same dtype, contiguous buffer: one layer is one read straight into the buffer.
    out = torch.empty(1, 256, 256)
    ck.read_region_into("w", (5, 0, 0), out)
    assert torch.equal(out[0], big[5])
    assert read_bytes == [256 * 256 * 4]  # exactly the layer, nothing else

    # Cast on the way (float32 -> float64): read through buffers no larger than the limit,
    # so Python-side memory stays near the limit whatever the tensor size.
    read_bytes.clear()
    full = torch.empty(8, 256, 256, dtype=torch.float64)
    tracemalloc.start()
    ck.read_into("w", full)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert torch.equal(full, big.double())
    assert sum(read_bytes) == big.numel() * 4 and max(read_bytes) <= limit
    assert peak < 2 * limit + (32 << 10), peak


def test_missing_and_garbage_metadata(tmp_path):
    with pytest.raises(SourceNotFoundError):
        DcpCheckpoint(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CorruptCheckpointError, match="not a readable pickle"):
        DcpCheckpoint(tmp_path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_metadata_pickle_is_allowlisted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system|allowlist"):
        DcpCheckpoint(tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_a_flipped_byte_in_the_metadata_is_called_damaged(tmp_path):
    """``.metadata`` is a plain pickle with no CRC. Before, a flipped byte in a class name read as a
    pickle outside the allowlist with "re-save ... torch.load(weights_only=False)" as the thing to
    do, and one in a chunk offset as "chunk at [0, 0] has no storage entry", with nothing to do. The
    refusal stands (same class, nothing unpickled that the walk did not accept); every message about
    the .metadata now says it is damaged (re-copy it) or not written by torch.distributed.checkpoint,
    as a rank file's flipped data.pkl says it is damaged (its CRC-32)."""
    from hf_merge.errors import HfMergeError, PickleRefusedError

    path = save_dcp(tmp_path / "c", {"a.weight": torch.randn(4, 6), "b.bias": torch.randn(6).bfloat16()},
                    {"a.weight": (0, 2)})
    meta = (path / ".metadata").read_bytes()
    refused = no_storage = 0
    for i in range(len(meta)):
        flipped = bytearray(meta)
        flipped[i] ^= 0x01
        (path / ".metadata").write_bytes(bytes(flipped))
        try:
            DcpCheckpoint(path).close()
        except HfMergeError as e:
            message = str(e).lower()
            assert "weights_only=false" not in message and "re-save" not in message, message
            assert not isinstance(e, UnsafeCheckpointError) or "re-copy" in message, message
            if isinstance(e, PickleRefusedError) or "no storage entry" in message:
                assert "the file is damaged (re-copy it from the training run) or was not written by " \
                       "torch.distributed.checkpoint" in message and ".metadata" in message, message
            refused += isinstance(e, PickleRefusedError)
            no_storage += "no storage entry" in message
    assert refused > 10 and no_storage > 0, (refused, no_storage)
    at = meta.index(b"ChunkStorageMetadata") + 5  # a class name flipped: still the refusal, on one line
    (path / ".metadata").write_bytes(meta[:at] + bytes([meta[at] ^ 1]) + meta[at + 1:])
    with pytest.raises(PickleRefusedError, match=r"ChunkRtorageMetadata, which is outside hf_merge's pickle allowlist; "
                       r"refused, nothing from it was run. The file is damaged \(re-copy it") as info:
        DcpCheckpoint(path)
    assert "\n" not in str(info.value)


def test_a_flipped_byte_in_a_chunks_pickle_is_called_damaged(tmp_path):
    """Each chunk of a .distcp is a torch.save archive whose data.pkl says where the tensor is.
    Its CRC-32 is checked as a rank file's is: a flipped byte in a global's name reads as a damaged
    file (re-copy it), not as a pickle outside the allowlist with "re-save ... weights_only=False"."""
    path = save_dcp(tmp_path / "c", {"a.weight": torch.randn(4, 6)})
    distcp = next(path.glob("*.distcp"))
    raw = distcp.read_bytes()
    at = raw.index(b"_rebuild_tensor_v2") + 3
    distcp.write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:])
    dcp_index._CHUNK_PICKLES.clear()
    with DcpCheckpoint(path) as ck, pytest.raises(CorruptCheckpointError, match=r"data\.pkl.*fails its CRC-32.*re-copy") as info:
        ck.read("a.weight")
    assert "weights_only" not in str(info.value) and "\n" not in str(info.value)


def test_truncated_or_missing_data_files(sample, tmp_path):
    import shutil

    src, _ = sample
    trunc = tmp_path / "trunc"
    shutil.copytree(src, trunc)
    data = trunc / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="truncated .*; re-copy it from the training run"):
        DcpCheckpoint(trunc)
    data.unlink()  # before, neither said what to do
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp listed in .metadata is missing; copy it from the training run"):
        DcpCheckpoint(trunc)


def test_corrupt_chunk_bytes_are_reported(tmp_path):
    path = save_dcp(tmp_path / "c", {"w": torch.randn(4, 4)})
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[:4] = b"XXXX"  # break the embedded archive's first local header
    data.write_bytes(bytes(raw))
    ck = DcpCheckpoint(path)
    with pytest.raises((CorruptCheckpointError, UnsupportedCheckpointError)):
        ck.read("w")


def test_row_chunks_are_runs_copied_from_the_file(sample):
    """Chunks that split dim 0 only are zero-copy runs located in their .distcp file (the writer
    copies them with copy_file_range); chunks cut along another dimension, or stored transposed,
    are read by box. Every run set equals the tensor, in its own dtype and cast."""
    from hf_merge.readers import file_runs

    path, tensors = sample
    ck = DcpCheckpoint(path)
    backed = {}
    for name, t in tensors.items():
        if not t.dim():
            assert ck.read_rows(name, t.dtype) is None
            continue
        pieces = list(ck.read_rows(name, t.dtype))
        located = [file_runs.run_of(piece) for _, piece in pieces]
        runs = [(first, file_runs.values(piece)) for first, piece in pieces]
        backed[name] = all(located)
        for (first, rows), where in zip(runs, located):
            assert torch.equal(rows, t[first : first + len(rows)]), name
            if where is not None:  # the run's file bytes are its values' bytes
                assert os.pread(where.fd, where.nbytes, where.offset) == rows.reshape(-1).view(torch.uint8).numpy().tobytes(), name
        assert sum(len(rows) for _, rows in runs) == len(t), name
        if t.is_floating_point():
            cast = torch.cat([file_runs.values(p).clone() for _, p in ck.read_rows(name, torch.float64, max_bytes=64)])
            assert torch.equal(cast, t.double()), name
    # emb: three row chunks at unaligned byte offsets; half, ids (cut on dim 1 -> boxes), flag: whole
    assert backed == {"stacked.qkv": False, "stacked.proj": False, "emb": True, "half": True, "ids": False,
                      "flag": True, "transposed": False}
    runs = list(ck.read_rows("emb", torch.bfloat16))
    fds = {run.fd for _, run in runs}
    ck.close()
    for fd in fds:  # closed: never copied through the file again
        with pytest.raises(OSError):
            os.fstat(fd)


def _records_or_error(fd: int, chunk, ends: int):
    from hf_merge.readers.torch_zip import Window, read_records

    try:
        return read_records(Window(fd, chunk.start, chunk.length, ends=ends), "chunk", base=chunk.start)
    except CorruptCheckpointError as e:
        return str(e)


@pytest.mark.parametrize("damage", [None, b"PK\x03\x04", b"PK\x07\x08", b"PK\x01\x02", b"PK\x05\x06"])
def test_prefetched_chunk_archive_decides_as_small_reads(damage, tmp_path):
    """A chunk's archive is checked from its two ends read up front (``Window(ends=...)``) instead of
    ~27 small reads: every prefetch size, none included, finds the same records, or the same error
    for damage in the head (a local header), at the tensor's end (its data descriptor) or in the
    tail (the central directory and its end record)."""
    path = save_dcp(tmp_path / "c", {"w": torch.randn(64, 80), "b": torch.randn(3)}, {"w": (0, 2)})
    ck = DcpCheckpoint(path)
    chunks = [c for cs in ck._chunks.values() for c in cs]
    ck.close()
    assert len(chunks) == 3
    data = path / chunks[0].file
    if damage is not None:  # the last such signature of the first chunk's archive
        raw = bytearray(data.read_bytes())
        at = raw.rfind(damage, chunks[0].start, chunks[0].start + chunks[0].length)
        assert at >= 0
        raw[at + 3] ^= 0xFF
        data.write_bytes(bytes(raw))
    for chunk in chunks:
        with open(path / chunk.file, "rb") as f:
            results = [_records_or_error(f.fileno(), chunk, ends) for ends in (0, 1, 200, dcp_index._ARCHIVE_ENDS, chunk.length, 3 * chunk.length)]
        assert all(r == results[0] for r in results), results
        if damage is not None and chunk is chunks[0]:
            assert isinstance(results[0], str), results[0]
        else:
            assert isinstance(results[0], dict) and any(n.endswith("data.pkl") for n in results[0])


def test_chunk_overlap_check_agrees_with_pairwise_comparison():
    """The slab-wise overlap check of a tensor's chunk boxes finds a clash exactly when some pair of
    non-empty boxes intersects: per-layer-and-expert grids (MoE), crossing and duplicated boxes."""
    import itertools
    import random

    from hf_merge.readers.dcp_index import Chunk as _Chunk, first_overlap as _first_overlap

    def chunk(off, size):
        return _Chunk(tuple(off), tuple(size), "f", 0, 0)

    def pairwise(chunks):
        boxes = [c for c in chunks if all(s > 0 for s in c.sizes)]
        return any(
            all(ao < co + cs and co < ao + as_ for ao, as_, co, cs in zip(a.offsets, a.sizes, c.offsets, c.sizes))
            for a, c in itertools.combinations(boxes, 2)
        )

    rng = random.Random(0)
    cases = []
    for _ in range(300):
        dims = rng.randint(0, 4)
        shape = [rng.randint(1, 6) for _ in range(dims)]
        cuts = [sorted(set([0, n] + rng.sample(range(1, n + 1), rng.randint(0, n - 1)))) for n in shape]
        grid = [chunk([lo for lo, _ in cell], [hi - lo for lo, hi in cell])
                for cell in itertools.product(*[list(zip(c, c[1:])) for c in cuts])]
        cases.append(grid)
        moved = list(grid)
        i = rng.randrange(len(moved))
        moved[i] = chunk([rng.randint(0, n - s) for n, s in zip(shape, moved[i].sizes)], moved[i].sizes)
        cases.append(moved)  # same sizes, maybe somewhere else: overlaps (or not) like a damaged .metadata
        cases.append(grid + [chunk([0] * dims, [rng.randint(0, n) for n in shape])])  # maybe empty
        bricks = [chunk([r, (r % 2) + 2 * k], [1, 2]) for r in range(4) for k in range(3)]  # rows shifted: crossing spans
        cases.append(bricks + ([chunk([rng.randrange(4), rng.randrange(6)], [1, 1])] if rng.random() < 0.5 else []))
    # MoE [L, E, 2F, H] chunked per layer, expert and gate/up half, with one expert written twice
    moe = [chunk([layer, e, half * 4, 0], [1, 1, 4, 8]) for layer in range(3) for e in range(16) for half in range(2)]
    cases += [moe, moe + [chunk([2, 7, 4, 0], [1, 1, 4, 8])], moe + [chunk([1, 3, 2, 0], [1, 1, 4, 8])]]
    found = 0
    for chunks in cases:
        rng.shuffle(chunks)
        clash = _first_overlap(chunks)
        assert (clash is not None) == pairwise(chunks), chunks
        if clash is not None:
            a, b = clash
            assert a is not b and pairwise([a, b])
            found += 1
    assert 0 < found < len(cases)
