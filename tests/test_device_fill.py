"""The device stager's walk (row runs through a ring of buffers) gives every tensor exactly as
``read`` does, on real checkpoints: FSDP Shard(0) (file-mapped runs, read by ``preadv``),
Shard(1) (no row runs), LoRA fused (computed runs), DCP chunks (``pread`` runs), and casts. On a
CPU machine the same walk runs with plain buffers; with CUDA the loads compare against
``from_pretrained`` of the merged folder."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import hf_merge
from hf_merge.checkpoint import open_checkpoint
from hf_merge.load.device_fill import DeviceStager, stages
from hf_merge.hf_files import load_config
from hf_merge.transforms.views import build_views
from hf_merge.readers.dcp import DcpCheckpoint
from helpers import dcp_no_dist
from hf_merge.transformers_compat import dtype_kwargs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _every_tensor_through(view, stager, dtype=None):
    for name, spec in view.specs().items():
        want = view.read(name, dtype if (dtype and spec.dtype.is_floating_point) else None)
        out = torch.full(spec.shape, float("nan") if want.is_floating_point() else 0, dtype=want.dtype)
        stager.fill(view, name, out)
        assert torch.equal(out, want), name


# 1 KB buffers: every tensor is split over several buffers and the ring wraps many times; the
# 2048-wide rows of the vocab2k embeddings (8 KB in fp32) are each larger than one buffer.
@pytest.mark.parametrize("slot_bytes", [1024, 1 << 20])
@pytest.mark.parametrize("name", ["qwen2_vocab2k_ws2", "qwen2_shard1", "hsdp_ckpt"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_fsdp_tensors_through_the_ring(checkpoint, name, slot_bytes, dtype):
    with open_checkpoint(checkpoint(name).actor) as ck:
        _every_tensor_through(ck, DeviceStager("cpu", slot_bytes=slot_bytes, slots=2), dtype)


def test_lora_fused_runs_through_the_ring(lora_ckpt):
    with open_checkpoint(lora_ckpt.actor) as ck:
        views = build_views(ck, load_config(ck.info.hf_dir), lora="fuse")
        _every_tensor_through(views.model, DeviceStager("cpu", slot_bytes=4096, slots=3), torch.bfloat16)


def test_dcp_chunks_through_the_ring(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"emb": torch.randn(37, 16, generator=g), "w": torch.randn(5, 3, 4, generator=g).bfloat16(),
             "scalar": torch.tensor(1.5), "ids": torch.arange(10)}
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "dcp")), **dcp_no_dist())
    with DcpCheckpoint(tmp_path / "dcp") as ck:
        _every_tensor_through(ck, DeviceStager("cpu", slot_bytes=256, slots=2))
        _every_tensor_through(ck, DeviceStager("cpu", slot_bytes=256, slots=2), torch.float16)


def test_the_records_crc_runs_over_the_staged_bytes(qwen2_vocab2k_ws2, tmp_path, monkeypatch):
    """Where the load checks the zip records, every file run read into a buffer is CRC-checked
    there: finishing reads no mapped record again (before, each was read once more in full), and
    every record the tensors used is checked."""
    import shutil

    from hf_merge.readers import record_crc

    src = shutil.copytree(qwen2_vocab2k_ws2.actor, tmp_path / "actor")  # records not yet checked here
    read: list[int] = []
    real = record_crc._crc
    monkeypatch.setattr(record_crc, "_crc", lambda *args: (read.append(args[2]), real(*args))[1])
    placed = record_crc.Placed()
    before = record_crc.stats()
    with open_checkpoint(src) as ck:
        stager = DeviceStager("cpu", slot_bytes=1 << 16, slots=2)
        staged = 0
        for name, spec in ck.specs().items():
            with record_crc.deferred(check_at_end=False, pending=placed.pending):
                stager.fill(ck, name, torch.empty(spec.shape, dtype=spec.dtype), placed.place)
            staged += spec.nbytes
        placed.finish()
    checked = record_crc.stats()["bytes"] - before["bytes"]
    assert record_crc.stats()["records"] - before["records"] == len(placed.pending) > 0
    assert checked >= staged and sum(read) < staged // 2, (checked, staged, sum(read))


def test_only_cuda_is_staged():
    assert not stages("cpu") and not stages("meta") and stages("cuda:0")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device_map", ["cuda", "auto", "split"])
def test_cuda_load_equals_from_pretrained_of_the_merge(qwen2_fp32_ws2, tmp_path, dtype, device_map):
    from transformers import AutoModelForCausalLM

    merged = tmp_path / "merged"
    hf_merge.merge(qwen2_fp32_ws2.actor, merged, dtype="auto")
    if device_map == "split":  # half the layers on the GPU, the rest on the CPU
        device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": "cpu",
                      "model.rotary_emb": "cpu", "lm_head": "cpu"}
    ours = AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor, dtype=dtype, device_map=device_map)
    ref = AutoModelForCausalLM.from_pretrained(merged, **dtype_kwargs(dtype), device_map=device_map)
    ref_state = ref.state_dict()
    for key, value in ours.state_dict().items():
        assert value.device == ref_state[key].device and torch.equal(value, ref_state[key]), key
    ids = torch.arange(1, 9).unsqueeze(0).to(ours.device)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, ref(input_ids=ids).logits)
