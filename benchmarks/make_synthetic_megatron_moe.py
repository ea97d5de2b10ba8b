#!/usr/bin/env python
"""Write a Qwen3-30B-A3B-shaped Megatron-Core MoE ``torch_dist`` checkpoint (verl v2 layout).

    python benchmarks/make_synthetic_megatron_moe.py OUT_DIR --layers 2 [--experts 128]
    python benchmarks/make_synthetic_megatron_moe.py --check OUT_DIR MERGED_HF_DIR

Real Qwen3-30B-A3B widths (hidden 2048, 32 query / 4 KV heads of 128, q/k RMSNorm, 128 experts
of width 768, vocab 151936, untied output layer), bf16, ``--layers`` decoder layers, under the
keys megatron-core 0.16 writes for expert parallelism 2 (checked on real saves, see
``examples/make_megatron_moe_checkpoint.py``): ``decoder.layers.mlp.router.weight [L, E, H]``,
``decoder.layers.mlp.experts.experts.linear_fc1.weight [L, E, 2F, H]`` stored as one gate chunk and
one up chunk per layer and expert, ``…linear_fc2.weight [L, E, H, F]`` one chunk per layer and
expert; EP rank ``r`` owns experts ``[r E/2, (r+1) E/2)``. It is written by 2 gloo processes with
``torch.distributed.checkpoint.save`` as :mod:`make_synthetic_megatron` does (building the model
through megatron-core at these widths is far too slow on CPU).

``--check`` reads the first and last layer's experts with torch's own DCP reader and compares
them byte for byte with the merged per-expert tensors.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import make_synthetic_megatron as dense  # noqa: E402  (chunk values, DCP metadata files, port)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MOE_FFN, VOCAB, TOPK = 2048, 32, 4, 128, 768, 151936, 8
EP = 2
P = "decoder.layers."
FC1, FC2, ROUTER = P + "mlp.experts.experts.linear_fc1.weight", P + "mlp.experts.experts.linear_fc2.weight", P + "mlp.router.weight"


def shapes(layers: int, experts: int) -> dict[str, tuple[int, ...]]:
    L, H, E, F = layers, HIDDEN, experts, MOE_FFN
    return {
        dense.EMB: (VOCAB, H),
        dense.LN1: (L, H),
        dense.QKV: (L, (HEADS + 2 * KV_HEADS) * HEAD_DIM, H),
        P + "self_attention.q_layernorm.weight": (L, HEAD_DIM),
        P + "self_attention.k_layernorm.weight": (L, HEAD_DIM),
        dense.PROJ: (L, H, HEADS * HEAD_DIM),
        dense.LN2: (L, H),
        ROUTER: (L, E, H),
        FC1: (L, E, 2 * F, H),
        FC2: (L, E, H, F),
        dense.FINAL_LN: (H,),
        dense.OUT_LAYER: (VOCAB, H),
    }


def boxes(key: str, shape: tuple[int, ...]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``[(owner rank, offsets, sizes)]``: experts by EP rank, the rest one chunk per layer."""
    if key in (FC1, FC2):
        L, E = shape[:2]
        out = []
        for layer in range(L):
            for e in range(E):
                owner = e // (E // EP)
                if key == FC1:  # apply_swiglu_sharded_factory: gate and up halves are separate chunks
                    out.append((owner, (layer, e, 0, 0), (1, 1, MOE_FFN, shape[3])))
                    out.append((owner, (layer, e, MOE_FFN, 0), (1, 1, MOE_FFN, shape[3])))
                else:
                    out.append((owner, (layer, e, 0, 0), (1, 1, *shape[2:])))
        return out
    if len(shape) >= 2 and key.startswith(P):
        return [(layer % EP, (layer,) + (0,) * (len(shape) - 1), (1, *shape[1:])) for layer in range(shape[0])]
    return [(0 if key != dense.OUT_LAYER else 1, (0,) * len(shape), shape)]


def _worker(rank: int, world: int, port: int, dist_dir: str, layers: int, experts: int) -> None:
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        sd = {}
        props = TensorProperties(dtype=torch.bfloat16, layout=torch.strided, requires_grad=False,
                                 memory_format=torch.contiguous_format, pin_memory=False)
        for key, shape in shapes(layers, experts).items():
            bx = boxes(key, shape)
            meta = [ShardMetadata(list(off), list(size), f"rank:{owner}/cpu") for owner, off, size in bx]
            local = [Shard(dense.chunk_values(key, off, size), meta[i]) for i, (owner, off, size) in enumerate(bx) if owner == rank]
            sd[key] = ShardedTensor._init_from_local_shards_and_global_metadata(local, ShardedTensorMetadata(meta, torch.Size(shape), props))
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(dist_dir, thread_count=2, single_file_per_rank=True, sync_files=False))
        del sd
        dist.barrier()
    finally:
        dist.destroy_process_group()


def hf_config(layers: int, experts: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": 6144, "moe_intermediate_size": MOE_FFN,
        "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_experts": experts, "num_experts_per_tok": TOPK, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "rope_theta": 1e6, "attention_bias": False,
        "tie_word_embeddings": False, "dtype": "bfloat16",
    }


def make_checkpoint(out: Path, layers: int, experts: int) -> dict:
    import torch.multiprocessing as mp

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    dist_dir, hf = out / "model" / "dist_ckpt", out / "model" / "huggingface"
    dist_dir.mkdir(parents=True)
    hf.mkdir(parents=True)
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(EP, dense._free_port(), str(dist_dir), layers, experts), nprocs=EP, join=True)
    torch.save({"content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}}, dist_dir / "common.pt")
    (dist_dir / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}))
    (hf / "config.json").write_text(json.dumps(hf_config(layers, experts), indent=2))
    (out / "transformer_config.json").write_text(json.dumps(
        {"num_layers": layers, "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_query_groups": KV_HEADS,
         "kv_channels": HEAD_DIM, "num_moe_experts": experts, "moe_ffn_hidden_size": MOE_FFN,
         "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": EP}))
    manifest = dense.manifest(EP)
    manifest["arch"] = "Qwen3MoeForCausalLM"
    (out / "ckpt_contents.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    files = sorted(dist_dir.glob("*.distcp"))
    return {"layers": layers, "experts": experts, "rank_file_bytes": sum(p.stat().st_size for p in files),
            "create_seconds": round(time.perf_counter() - t0, 1)}


def check(ckpt: Path, merged: Path) -> tuple[bool, str]:
    from safetensors import safe_open

    cfg = json.loads((ckpt / "model" / "huggingface" / "config.json").read_text())
    L, E = cfg["num_hidden_layers"], cfg["num_experts"]
    dist_dir = ckpt / "model" / "dist_ckpt"
    index_file = merged / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())["weight_map"] if index_file.is_file() else {}
    fc1 = dense._load_source(dist_dir, FC1, (L, E, 2 * MOE_FFN, HIDDEN))
    fc2 = dense._load_source(dist_dir, FC2, (L, E, HIDDEN, MOE_FFN))
    checked = 0
    for layer in sorted({0, L - 1}):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            for name, want in (("gate_proj", fc1[layer, e, :MOE_FFN]), ("up_proj", fc1[layer, e, MOE_FFN:]), ("down_proj", fc2[layer, e])):
                key = p + name + ".weight"
                with safe_open(str(merged / index.get(key, "model.safetensors")), framework="pt") as f:
                    if not torch.equal(f.get_tensor(key), want):
                        return False, f"{key} differs"
                checked += 1
    return True, f"{checked} expert tensors byte-identical"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("merged", type=Path, nargs="?")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    if args.check:
        ok, msg = check(args.out, args.merged)
        print(msg)
        return 0 if ok else 1
    print(json.dumps(make_checkpoint(args.out, args.layers, args.experts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
