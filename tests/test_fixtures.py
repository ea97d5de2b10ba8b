"""The fixture checkpoints are what they claim to be (layouts, placements, reference outputs).

These tests read the rank files with plain torch (no hf_merge code), so they also document the
on-disk format the readers have to handle.
"""

from __future__ import annotations

import json
import math

import make_fsdp_checkpoint as mk  # examples/ is on sys.path (conftest.py)
import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (registers DTensor for weights_only unpickling)
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, Replicate, Shard
from hf_merge.transformers_compat import dtype_kwargs


# What ``import torch.distributed.tensor`` / ``torch.distributed.device_mesh`` register with
# add_safe_globals (DTensor, DeviceMesh, _MeshLayout, _FlatLayout, Shard, ...), snapshotted at
# collection time and re-added before each load: ``with torch.serialization.safe_globals([...])``
# REMOVES its classes on exit, also those torch had registered itself, so code run earlier in the
# session may have dropped them.
_TORCH_SAFE_GLOBALS = list(torch.serialization.get_safe_globals())


def load_rank(path):
    torch.serialization.add_safe_globals(_TORCH_SAFE_GLOBALS)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def load_ranks(ck):
    return [load_rank(p) for p in ck.rank_files]


def reference_state(ck):
    return load_file(str(ck.reference / "model.safetensors"))


def assemble(rank_sds):
    """Rebuild full tensors from the rank dicts (torch.chunk semantics), from placements alone."""
    out = {}
    for key, v0 in rank_sds[0].items():
        if not isinstance(v0, DTensor):
            out[key] = v0
            continue
        full = torch.empty(v0.shape, dtype=v0.dtype)
        mesh = v0.device_mesh.mesh
        for r, sd in enumerate(rank_sds):
            v = sd[key]
            coord = (mesh == r).nonzero()[0].tolist()
            index = [slice(None)] * full.dim()
            skip = False
            for md, p in enumerate(v.placements):
                if isinstance(p, Replicate) and coord[md] != 0:
                    skip = True  # another replica holds the same data
                elif isinstance(p, Shard):
                    n, k = full.shape[p.dim], mesh.shape[md]
                    size = math.ceil(n / k)
                    start = min(n, coord[md] * size)
                    index[p.dim] = slice(start, min(n, start + size))
            if not skip:
                full[tuple(index)] = v.to_local()
        out[key] = full
    return out


PLAIN_FIXTURES = [
    "qwen2_fp32_ws2",
    "llama_tied_bf16_ws4",
    "qwen2_shard1",
    "hsdp_ckpt",
    "uneven_ckpt",
    "shard1_dtensor_ckpt",
    "ws1_ckpt",
    "mixed_buffers_ckpt",
    "hsdp_fsdp2_ckpt",
    "uneven_fsdp2_ckpt",
    "ws1_fsdp2_ckpt",
]


def test_verl_layout(qwen2_fp32_ws2):
    ck = qwen2_fp32_ws2
    assert (ck.root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert ck.actor == ck.root / "global_step_1" / "actor"
    assert json.loads((ck.actor / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 2}
    assert [p.name for p in ck.rank_files] == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
    cfg = json.loads((ck.hf_dir / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["_name_or_path"] == "tiny/qwen2-base"
    assert (ck.hf_dir / "generation_config.json").is_file() and (ck.hf_dir / "tokenizer.json").is_file()
    assert not (ck.actor / "lora_train_meta.json").exists()
    sd = load_rank(ck.rank_files[1])
    assert all(isinstance(v, DTensor) for v in sd.values())
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert q.placements == (Shard(0),) and q.device_mesh.mesh_dim_names == ("fsdp",)
    assert q.shape == (64, 64) and q.to_local().shape == (32, 64) and q.dtype == torch.float32
    assert "model.rotary_emb.inv_freq" not in sd  # non-persistent buffer: not in the state dict


@pytest.mark.parametrize("name", PLAIN_FIXTURES)
def test_shards_reassemble_to_reference(name, request):
    ck = request.getfixturevalue(name)
    full = assemble(load_ranks(ck))
    ref = reference_state(ck)
    tied = ck.options["tie_word_embeddings"]
    assert set(ref) == set(full) - ({"lm_head.weight"} if tied else set())
    for k, v in ref.items():
        assert torch.equal(full[k], v), k


def test_tied_weights_saved_under_both_keys(llama_tied_bf16_ws4):
    ck = llama_tied_bf16_ws4
    sd = load_rank(ck.rank_files[3])
    emb, head = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    assert emb.dtype == torch.bfloat16 and emb.device_mesh.mesh.tolist() == [0, 1, 2, 3]
    # one storage, two keys (two DTensor objects after unpickling)
    assert emb.to_local().untyped_storage().data_ptr() == head.to_local().untyped_storage().data_ptr()
    assert "lm_head.weight" not in reference_state(ck)


def test_shard1_from_fsdp2_placement_fn(qwen2_shard1):
    sd = load_rank(qwen2_shard1.rank_files[0])
    emb = sd["model.embed_tokens.weight"]
    assert emb.shape == (129, 64) and emb.placements == (Shard(1),) and emb.to_local().shape == (129, 32)
    assert sd["lm_head.weight"].placements == (Shard(1),)
    assert sd["model.norm.weight"].placements == (Shard(0),)


def test_shard1_dtensor(shard1_dtensor_ckpt):
    sd = load_rank(shard1_dtensor_ckpt.rank_files[1])
    assert sd["model.layers.0.self_attn.o_proj.weight"].placements == (Shard(1),)
    assert sd["model.layers.0.mlp.down_proj.weight"].to_local().shape == (64, 64)
    assert sd["model.layers.0.self_attn.q_proj.weight"].placements == (Shard(0),)


@pytest.mark.parametrize("name", ["hsdp_ckpt", "hsdp_fsdp2_ckpt"])
def test_hsdp_mesh_is_2d(name, request):
    ck = request.getfixturevalue(name)
    sds = load_ranks(ck)
    v = sds[2]["model.embed_tokens.weight"]
    assert v.device_mesh.mesh_dim_names == ("ddp", "fsdp")
    assert v.device_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert v.placements == (Replicate(), Shard(0))
    assert v.to_local().shape == (64, 64)
    # ranks 0 and 2 are replicas of the same shard; 0 and 1 hold different halves
    assert torch.equal(sds[0]["model.embed_tokens.weight"].to_local(), v.to_local())
    assert not torch.equal(sds[1]["model.embed_tokens.weight"].to_local(), v.to_local())


@pytest.mark.parametrize("name", ["uneven_ckpt", "uneven_fsdp2_ckpt"])
def test_uneven_has_short_and_empty_chunks(name, request):
    ck = request.getfixturevalue(name)
    sds = load_ranks(ck)
    kb = "model.layers.0.self_attn.k_proj.bias"
    assert [sd[kb].to_local().shape[0] for sd in sds] == [1, 1, 0, 0]
    emb = "model.embed_tokens.weight"  # vocab 10 over 4 ranks: torch.chunk -> 3, 3, 3, 1
    assert [sd[emb].to_local().shape[0] for sd in sds] == [3, 3, 3, 1]
    norm = "model.norm.weight"  # 6 over 4: 2, 2, 2, 0
    assert [sd[norm].to_local().shape[0] for sd in sds] == [2, 2, 2, 0]
    # the empty local chunk may sit on a padded storage: use the view, not the storage size
    empty = sds[3]["model.layers.0.self_attn.q_proj.weight"].to_local()
    assert empty.numel() == 0


def test_ws1_is_plain_tensors(ws1_ckpt):
    assert ws1_ckpt.rank_files[0].name == "model_world_size_1_rank_0.pt"
    sd = load_rank(ws1_ckpt.rank_files[0])
    assert not any(isinstance(v, DTensor) for v in sd.values())
    assert all(type(v) is torch.Tensor for v in sd.values())


def test_ws1_fsdp2_is_dtensor_on_one_rank(ws1_fsdp2_ckpt):
    sd = load_rank(ws1_fsdp2_ckpt.rank_files[0])
    v = sd["model.embed_tokens.weight"]
    assert isinstance(v, DTensor) and v.device_mesh.mesh.tolist() == [0] and v.to_local().shape == v.shape


def test_mixed_buffers(mixed_buffers_ckpt):
    sds = load_ranks(mixed_buffers_ckpt)
    key = "model.rotary_emb.inv_freq"
    for sd in sds:
        assert type(sd[key]) is torch.Tensor and sd[key].shape == (8,)
        assert isinstance(sd["model.norm.weight"], DTensor)
    assert torch.equal(sds[0][key], sds[1][key])


def test_lora_keys_and_meta(lora_ckpt):
    ck = lora_ckpt
    assert json.loads((ck.actor / "lora_train_meta.json").read_text()) == {
        "r": 4,
        "lora_alpha": 8,
        "task_type": "CAUSAL_LM",
    }
    sd = load_rank(ck.rank_files[0])
    p = "base_model.model.model.layers.0.mlp.gate_proj"
    assert {f"{p}.base_layer.weight", f"{p}.lora_A.default.weight", f"{p}.lora_B.default.weight"} <= set(sd)
    assert sd[f"{p}.lora_A.default.weight"].shape == (4, 64) and sd[f"{p}.lora_B.default.weight"].shape == (128, 4)
    assert "base_model.model.lm_head.weight" in sd
    adapter = json.loads((ck.reference_adapter / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8 and adapter["base_model_name_or_path"] == "tiny/qwen2-base"


@pytest.mark.parametrize(
    "name,scale",
    [("lora_ckpt", 8 / 4), ("lora_rslora_ckpt", 16 / math.sqrt(8)), ("lora_no_meta_ckpt", 16 / 4)],
)
def test_lora_fusion_matches_reference(name, scale, request):
    ck = request.getfixturevalue(name)
    full = assemble(load_ranks(ck))
    merged, base = reference_state(ck), load_file(str(ck.reference_base / "model.safetensors"))
    pre = "base_model.model."
    for k in merged:
        mod = k.rsplit(".", 1)[0]
        a = full.get(f"{pre}{mod}.lora_A.default.weight")
        if a is None or not k.endswith(".weight"):
            assert torch.equal(merged[k], base[k]), k
            continue
        b = full[f"{pre}{mod}.lora_B.default.weight"]
        assert torch.equal(full[f"{pre}{mod}.base_layer.weight"], base[k])
        fused = base[k] + scale * (b @ a)
        assert not torch.allclose(fused, base[k])  # B != 0: fusing matters
        torch.testing.assert_close(fused, merged[k], rtol=1e-5, atol=1e-6)


def test_lora_modules_to_save(lora_modules_to_save_ckpt):
    ck = lora_modules_to_save_ckpt
    full = assemble(load_ranks(ck))
    orig = full["base_model.model.lm_head.original_module.weight"]
    trained = full["base_model.model.lm_head.modules_to_save.default.weight"]
    assert not torch.equal(orig, trained)
    merged = reference_state(ck)
    assert torch.equal(merged["lm_head.weight"], trained)
    assert json.loads((ck.reference_adapter / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]


def test_lora_only(lora_only_ckpt):
    ck = lora_only_ckpt
    sd = load_rank(ck.rank_files[0])
    assert sd and all(".lora_A." in k or ".lora_B." in k for k in sd)
    assert len(sd) == 2 * 7 * 2  # layers x targets x (A, B)
    base = load_file(str(ck.base_model / "model.safetensors"))
    ref_base = load_file(str(ck.reference_base / "model.safetensors"))
    assert set(base) == set(ref_base) and all(torch.equal(base[k], ref_base[k]) for k in base)
    assert (ck.base_model / "config.json").is_file() and (ck.base_model / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "name",
    ["qwen2_fp32_ws2", "llama_tied_bf16_ws4", "uneven_ckpt", "lora_ckpt", "lora_modules_to_save_ckpt"],
)
def test_reference_logits_reproduce(name, request):
    from transformers import AutoModelForCausalLM

    ck = request.getfixturevalue(name)
    data = torch.load(ck.logits, weights_only=True)
    assert data["input_ids"].shape == (2, 8) and data["input_ids"].dtype == torch.long
    assert data["logits"].dtype == torch.float32 and torch.isfinite(data["logits"]).all()
    model = AutoModelForCausalLM.from_pretrained(ck.reference, **dtype_kwargs("auto")).eval()
    assert model.dtype == getattr(torch, ck.options["train_dtype"])
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"]).logits.float()
    tol = 1e-4 if ck.options["lora"] else 1e-6  # merged LoRA vs separate paths: rounding only
    torch.testing.assert_close(logits, data["logits"], rtol=tol, atol=tol)


def test_tokenizer_loads_with_autotokenizer(qwen2_fp32_ws2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_fp32_ws2.hf_dir)
    ids = tok("the water is good").input_ids
    assert ids and max(ids) < 128 and tok.decode(ids) == "the water is good"


def test_run_cli_helper(run_cli):
    rc, out, err = run_cli("--help")
    assert rc == 0, err
    res = run_cli("--help")
    assert res.returncode == 0 and res.stdout == out


def test_generator_cli(tmp_path, capsys):
    """The generator's command line (in this process: its fork server is already warm)."""
    assert mk.main([str(tmp_path / "c"), "--layout", "ws1"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["world_size"] == 1 and info["rank_files"][0].endswith("model_world_size_1_rank_0.pt")
    assert (tmp_path / "c" / "reference" / "logits.pt").is_file()
