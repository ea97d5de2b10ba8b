"""The shard planner on specs alone (no tensor data), and the safetensors bytes it lays out."""

from __future__ import annotations

import json
import struct

import torch

from hf_merge.write.plan import plan_shards
from hf_merge.spec import TensorSpec


def _specs():
    return [
        TensorSpec("embed", (100, 8), torch.bfloat16),
        TensorSpec("norm", (8,), torch.float32),
        TensorSpec("mask", (3,), torch.bool),
        TensorSpec("big", (1000,), torch.float32),
        TensorSpec("empty", (0, 4), torch.float32),
    ]


def test_single_file_has_no_index():
    plan = plan_shards(_specs())
    assert [f.name for f in plan.files] == ["model.safetensors"] and plan.index is None


def test_sharded_plan_names_sizes_and_index():
    plan = plan_shards(_specs(), max_shard_size=2000)
    names = [f.name for f in plan.files]
    assert names == [f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)]
    assert plan.index["metadata"]["total_size"] == sum(s.nbytes for s in _specs())  # bytes, not elements
    assert set(plan.index["weight_map"]) == {s.name for s in _specs()}
    for f in plan.files:
        assert f.data_size <= 2000 or len(f.specs) == 1


def test_header_is_valid_safetensors_and_offsets_aligned():
    for f in plan_shards(_specs(), max_shard_size=2000).files:
        (n,) = struct.unpack("<Q", f.header[:8])
        assert n % 8 == 0 and len(f.header) == 8 + n
        header = json.loads(f.header[8:])
        assert header["__metadata__"]["format"] == "pt"
        end = 0
        for spec in f.specs:
            begin, stop = header[spec.name]["data_offsets"]
            assert begin == end and stop - begin == spec.nbytes  # contiguous, no gaps
            assert (f.data_start + begin) % spec.dtype.itemsize == 0  # viewable in place
            end = stop
        assert end == f.data_size


def test_written_file_round_trips_through_safetensors(tmp_path):
    from safetensors.torch import load_file

    from hf_merge.checkpoint import LazyCheckpoint
    from hf_merge.write.shards import write_shards

    values = {s.name: (torch.arange(s.numel) % 7).to(s.dtype).reshape(s.shape) for s in _specs()}

    class InMemory(LazyCheckpoint):
        def specs(self):
            return {s.name: s for s in _specs()}

        def read_into(self, name, out):
            out.copy_(values[name])

    plan = plan_shards(_specs(), max_shard_size=2000)
    write_shards(InMemory(), plan, tmp_path)
    loaded = {}
    for f in plan.files:
        loaded.update(load_file(tmp_path / f.name))
    assert set(loaded) == set(values)
    for k, v in values.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
