"""FSDP rank files read through the pickle policy with stand-ins (``readers/rank_records.py``)
agree with torch's own DTensors (``safe_pickle.load_rank_file``: ``torch.load(weights_only=True)``)
on REAL FSDP2 / distribute_tensor rank files, and a merge never imports ``torch.distributed.tensor``."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import fresh_merge_imports
from hf_merge.errors import CorruptCheckpointError, UnsafeCheckpointError
from hf_merge.readers import rank_records
from hf_merge.readers.rank_records import LocalDTensor, load_rank_records
from hf_merge.readers.safe_pickle import DTENSOR_FILE, load_rank_file

LAYOUTS = [
    "qwen2_fp32_ws2",  # FSDP2 fully_shard, Shard(0) on a 1-D mesh
    "llama_tied_bf16_ws4",  # tied embeddings, bf16, 4 ranks
    "qwen2_shard1",  # Shard(1) where dim 0 does not divide
    "hsdp_fsdp2_ckpt",  # HSDP: (Replicate(), Shard(0)) on a 2-D mesh
    "uneven_fsdp2_ckpt",  # uneven chunks, empty local shards
    "ws1_fsdp2_ckpt",  # one rank
    "mixed_buffers_ckpt",  # DTensors and plain buffers
    "lora_ckpt",  # PEFT LoRA under FSDP2
]


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """All the bytes of ``t``'s storage as a uint8 tensor (``bytes(storage)`` would build them one
    Python int at a time: 12 CPU-s over these rank files)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
        and torch.equal(_storage_bytes(a), _storage_bytes(b))
    )


@pytest.mark.parametrize("name", LAYOUTS)
def test_stand_ins_give_what_torch_builds(name, checkpoint):
    ck = checkpoint(name)
    dtensors = 0
    for path in ck.rank_files:
        old, new = load_rank_file(path), load_rank_records(path)
        assert list(old) == list(new)
        for key, o in old.items():
            n = new[key]
            if hasattr(o, "_local_tensor"):
                dtensors += 1
                assert isinstance(n, LocalDTensor)
                assert n.shape == tuple(o.shape) and n.dtype == o.dtype
                assert str(n.placements) == str(tuple(o.placements))
                assert n.mesh.tolist() == o.device_mesh.mesh.tolist()
                assert n.mesh_dim_names == o.device_mesh.mesh_dim_names
                assert n.meta_shape == tuple(o._spec.tensor_meta.shape)
                assert _same_view(n._local_tensor, o._local_tensor), key
            else:
                assert isinstance(n, torch.Tensor) and _same_view(n, o), key
    assert dtensors


def test_every_dtensor_pair_has_a_stand_in():
    """A pair of DTENSOR_FILE without a stand-in would make the policy import torch.distributed."""
    subs = rank_records._substitutes()
    for module, name in DTENSOR_FILE.calls | DTENSOR_FILE.classes:
        if module.startswith("torch.distributed") or "_rebuild" in name:
            assert (module, name) in subs, (module, name)


def test_specs_and_reader_agree_with_the_torch_path(hsdp_fsdp2_ckpt, monkeypatch):
    """The reader's layouts are the same whichever way the rank files are read."""
    from hf_merge.readers import fsdp

    def specs_and_placements():
        ckpt = fsdp.open_fsdp(hsdp_fsdp2_ckpt.actor)
        try:
            out = {k: (s.shape, s.dtype) for k, s in ckpt.specs().items()}, ckpt.placements(), ckpt.info.details
            data = {k: ckpt.read(k).clone() for k in ckpt.specs()}
        finally:
            ckpt.close()
        return out, data

    (specs, places, details), data = specs_and_placements()
    assert "(Replicate(), Shard(dim=0))" in places.values() and details["mesh"] == [2, 2]
    for key, tensor in data.items():
        assert tensor.shape == specs[key][0]
    from safetensors.torch import load_file

    ref = load_file(str(hsdp_fsdp2_ckpt.reference / "model.safetensors"))
    for key, tensor in data.items():
        if key in ref:
            assert torch.equal(tensor.view(torch.uint8), ref[key].to(tensor.dtype).contiguous().view(torch.uint8)), key


@pytest.mark.parametrize("grow", [(1, 0), (0, 1)])
def test_view_past_its_storage_is_refused(grow, qwen2_fp32_ws2, monkeypatch):
    """A local tensor whose view (size, or storage offset) runs past its storage record is a typed
    error naming the key, never a read of other bytes."""
    subs = dict(rank_records._substitutes())
    real = subs[("torch._utils", "_rebuild_tensor_v2")]

    def damaged(storage, offset, size, stride, *rest):
        rec = real(storage, offset, size, stride, *rest)
        if rec.size and rec.size[0] > 1:
            return rank_records._TensorRecord(rec.storage, rec.offset + grow[1], (rec.size[0] + grow[0], *rec.size[1:]), rec.stride)
        return rec

    subs[("torch._utils", "_rebuild_tensor_v2")] = damaged
    monkeypatch.setattr(rank_records, "_substitutes", lambda: subs)
    with pytest.raises(CorruptCheckpointError, match="inconsistent tensor metadata.*storage of"):
        load_rank_records(qwen2_fp32_ws2.rank_files[0])


def test_unsafe_global_in_a_rank_file_is_refused_before_anything_runs(qwen2_fp32_ws2, tmp_path):
    import pickle
    import zipfile

    src = tmp_path / "r.pt"
    state = torch.load(qwen2_fp32_ws2.rank_files[0], weights_only=False)
    torch.save(state, src)
    with zipfile.ZipFile(src) as z:
        names = z.namelist()
    assert any(n.endswith("data.pkl") for n in names)

    class Boom:
        def __reduce__(self):
            return (os.system, ("true",))

    state["model.norm.weight"] = Boom()
    torch.save(state, src, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system"):
        load_rank_records(src)


def test_truncated_rank_file_is_a_typed_error(qwen2_fp32_ws2, tmp_path):
    src = tmp_path / "r.pt"
    data = qwen2_fp32_ws2.rank_files[0].read_bytes()
    src.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError):
        load_rank_records(src)


# dense (LoRA imports peft); the 1-D mesh qwen2_fp32_ws2 is checked with the rest of what a plain
# merge leaves unimported, in the same fresh interpreter (test_formats.py)
@pytest.mark.slow  # a fresh interpreter; make test keeps the 1-D mesh case (test_formats.py)
@pytest.mark.parametrize("name", ["hsdp_fsdp2_ckpt"])
def test_merge_does_not_import_torch_distributed_tensor(name, checkpoint, tmp_path):
    mods = ["torch.distributed.tensor", "torch.distributed.checkpoint"]
    result = fresh_merge_imports(["merge", checkpoint(name).actor, tmp_path / "out"], mods)
    assert result == {"code": 0, **dict.fromkeys(mods, False)}
