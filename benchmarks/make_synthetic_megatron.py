#!/usr/bin/env python
"""Write a synthetic Megatron-Core ``torch_dist`` checkpoint in verl's v2 layout.

    python benchmarks/make_synthetic_megatron.py OUT_DIR --layers 2 [--tp 4]
    python benchmarks/make_synthetic_megatron.py --check OUT_DIR MERGED_HF_DIR   # spot-check a merge

OUT_DIR is the role folder (what verl writes as ``global_step_N/actor``)::

    OUT_DIR/ckpt_contents.json          verl's v2 manifest (schema_version 2)
    OUT_DIR/transformer_config.json
    OUT_DIR/model/dist_ckpt/            .metadata, __<rank>_<i>.distcp, common.pt, metadata.json
    OUT_DIR/model/huggingface/          config.json, generation_config.json, tiny tokenizer
    OUT_DIR/synthetic.json              what was written (not part of a real checkpoint)

The model is the same Qwen2-7B-shaped bf16 model as ``make_synthetic_checkpoint.py`` (vocab
152064, hidden 3584, 28 heads / 4 KV heads, head_dim 128, FFN 18944, q/k/v biases, untied
output layer) with ``--layers`` decoder layers, under Megatron-Core's GPTModel names as its
``sharded_state_dict`` spells them for ``torch_dist`` (Transformer Engine layer-norm spelling,
layers stacked on a leading axis)::

    embedding.word_embeddings.weight                              [V, H]
    decoder.layers.self_attention.linear_qkv.layer_norm_weight    [L, H]
    decoder.layers.self_attention.linear_qkv.weight               [L, (nq + 2 nkv) hd, H]  per query group: q.., k, v
    decoder.layers.self_attention.linear_qkv.bias                 [L, (nq + 2 nkv) hd]
    decoder.layers.self_attention.linear_proj.weight              [L, H, nq hd]
    decoder.layers.mlp.linear_fc1.layer_norm_weight               [L, H]
    decoder.layers.mlp.linear_fc1.weight                          [L, 2F, H]               [gate; up]
    decoder.layers.mlp.linear_fc2.weight                          [L, H, F]
    decoder.final_layernorm.weight                                [H]
    output_layer.weight                                           [V, H]
    decoder.layers.<module>._extra_state/shard_<l>_<L>            bytes (ignored by readers)

Sharding is what Megatron-Core writes for TP=``--tp``, PP=1, DP=1: one chunk per layer and TP
rank. Column-parallel tensors (qkv, fc1, embedding, output layer) are split on their output
rows: TP rank ``t`` owns query groups ``[t*nkv/tp, (t+1)*nkv/tp)`` of qkv, and its fc1 shard
``[gate_t; up_t]`` is stored as two chunks (rows ``t*F/tp`` of the gate half and ``F + t*F/tp``
of the up half: Megatron's ``apply_swiglu_sharded_factory``); row-parallel ones (linear_proj,
fc2) on their input columns; layer norms are replicated and written by TP rank 0.

It is written by ``--tp`` gloo processes with ``torch.distributed.checkpoint.save`` (not through
Megatron-Core, which would build the model, far too slow at 7B widths on CPU): each process
creates only its own chunks (random bf16 from a seed derived from the key and chunk offsets) and
wraps each tensor's chunks in a ``ShardedTensor`` built from local shards, as Megatron-Core's
``torch_dist`` strategy does; the file writer uses two threads per rank, as Megatron's default
does (``__<rank>_0.distcp``, ``__<rank>_1.distcp``). ``common.pt`` and ``metadata.json`` are
what ``dist_checkpointing.save`` writes beside them.

``--check`` compares a merged Hugging Face folder with the source: it loads the fused source
tensors with torch's own DCP reader (``torch.distributed.checkpoint.load``, no process group),
splits qkv and gate/up with the per-query-group rule written out here independently of
hf_merge, and compares bytes for a few layers (first and last by default) plus every global
tensor.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import make_synthetic_checkpoint as fsdp  # noqa: E402  (config, tokenizer, widths)

QKV = "decoder.layers.self_attention.linear_qkv.weight"
QKV_BIAS = "decoder.layers.self_attention.linear_qkv.bias"
PROJ = "decoder.layers.self_attention.linear_proj.weight"
LN1 = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
LN2 = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
FC2 = "decoder.layers.mlp.linear_fc2.weight"
EMB = "embedding.word_embeddings.weight"
FINAL_LN = "decoder.final_layernorm.weight"
OUT_LAYER = "output_layer.weight"
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


@dataclass(frozen=True)
class Dims:
    layers: int
    hidden: int = fsdp.HIDDEN
    ffn: int = fsdp.INTERMEDIATE
    heads: int = fsdp.HEADS
    kv_heads: int = fsdp.KV_HEADS
    head_dim: int = fsdp.HEAD_DIM
    vocab: int = fsdp.VOCAB

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


def global_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Megatron key -> global shape, in GPTModel.sharded_state_dict order."""
    L, H = d.layers, d.hidden
    return {
        EMB: (d.vocab, H),
        LN1: (L, H),
        QKV: (L, d.qkv_rows, H),
        QKV_BIAS: (L, d.qkv_rows),
        PROJ: (L, H, d.heads * d.head_dim),
        LN2: (L, H),
        FC1: (L, 2 * d.ffn, H),
        FC2: (L, H, d.ffn),
        FINAL_LN: (H,),
        OUT_LAYER: (d.vocab, H),
    }


def chunk_boxes(key: str, d: Dims, tp: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``[(owner rank, offsets, sizes)]`` of every stored chunk of ``key`` (TP=tp, PP=1)."""
    shape = global_shapes(d)[key]
    L, H = d.layers, d.hidden
    out = []
    if key in (EMB, OUT_LAYER):  # vocab-parallel rows
        rows = -(-shape[0] // tp)
        for t in range(tp):
            lo, hi = min(t * rows, shape[0]), min((t + 1) * rows, shape[0])
            out.append((t, (lo, 0), (hi - lo, H)))
        return out
    if key == FINAL_LN:
        return [(0, (0,), shape)]
    for layer in range(L):
        if key in (LN1, LN2):
            out.append((0, (layer, 0), (1, H)))
        elif key in (QKV, QKV_BIAS):
            rows = d.qkv_rows // tp
            for t in range(tp):
                out.append((t, (layer, t * rows, *([0] * (len(shape) - 2))), (1, rows, *shape[2:])))
        elif key == FC1:
            rows = d.ffn // tp
            for t in range(tp):
                out.append((t, (layer, t * rows, 0), (1, rows, H)))
                out.append((t, (layer, d.ffn + t * rows, 0), (1, rows, H)))
        elif key in (PROJ, FC2):
            cols = shape[2] // tp
            for t in range(tp):
                out.append((t, (layer, 0, t * cols), (1, H, cols)))
        else:
            raise KeyError(key)
    return out


def chunk_values(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """Deterministic bf16 contents of one chunk (norms around 1, the rest ~N(0, 0.02))."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{key}@{tuple(offsets)}".encode()))
    if "layer_norm" in key or "layernorm" in key:
        return torch.randn(sizes, generator=gen, dtype=torch.float32).mul_(0.05).add_(1.0).to(torch.bfloat16)
    return torch.randn(sizes, generator=gen, dtype=torch.bfloat16).mul_(0.02)


def expected_bytes(d: Dims) -> int:
    n = 0
    for shape in global_shapes(d).values():
        k = 1
        for s in shape:
            k *= s
        n += k
    return 2 * n


def _worker(rank: int, world: int, port: int, dist_dir: str, dims: dict) -> None:
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    warnings.filterwarnings("ignore")  # ShardedTensor deprecation notices, once per key
    torch.set_num_threads(1)
    d = Dims(**dims)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        sd: dict[str, object] = {}
        for key, shape in global_shapes(d).items():
            boxes = chunk_boxes(key, d, world)
            meta = [ShardMetadata(list(off), list(size), f"rank:{owner}/cpu") for owner, off, size in boxes]
            local = [Shard(chunk_values(key, off, size), meta[i]) for i, (owner, off, size) in enumerate(boxes)
                     if owner == rank]
            props = TensorProperties(dtype=torch.bfloat16, layout=torch.strided, requires_grad=False,
                                     memory_format=torch.contiguous_format, pin_memory=False)
            # As Megatron-Core's torch_dist strategy: global metadata known on every rank, no
            # collective per tensor.
            sd[key] = ShardedTensor._init_from_local_shards_and_global_metadata(
                local, ShardedTensorMetadata(meta, torch.Size(shape), props))
        for module in EXTRA_STATE_MODULES:  # TE / local-spec _extra_state: opaque bytes, one per layer
            for layer in range(d.layers):
                if layer % world == rank:
                    buf = io.BytesIO()
                    torch.save(None, buf)
                    buf.seek(0)
                    sd[f"decoder.layers.{module}._extra_state/shard_{layer}_{d.layers}"] = buf
        writer = dcp.FileSystemWriter(dist_dir, thread_count=2, single_file_per_rank=True, sync_files=False)
        dcp.save(sd, storage_writer=writer)
        del sd
        dist.barrier()
    finally:
        dist.destroy_process_group()


def transformer_config(d: Dims, tp: int) -> dict:
    return {
        "num_layers": d.layers, "hidden_size": d.hidden, "ffn_hidden_size": d.ffn,
        "num_attention_heads": d.heads, "num_query_groups": d.kv_heads, "kv_channels": d.head_dim,
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1,
        "add_qkv_bias": True, "qk_layernorm": False, "gated_linear_unit": True, "normalization": "RMSNorm",
        "params_dtype": "torch.bfloat16",
    }


def manifest(tp: int) -> dict:
    """verl's ckpt_contents.json (schema 2) for a model-only save through dist_checkpointing."""
    return {
        "schema_version": 2, "framework": "megatron", "role": "actor", "arch": "Qwen2ForCausalLM",
        "global_step": 1, "world_size": tp,
        "backend": {"has_bridge": False, "use_dist_checkpointing": True, "peft": False},
        "save_contents": ["model"],
        "contents": {
            "model": {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint", "backend": "dist_checkpointing"},
            "hf_config": {"path": "model/huggingface", "format": "huggingface"},
            "transformer_config": {"path": "transformer_config.json", "format": "json"},
        },
        "directories": {}, "saved_any_dist_ckpt": True,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(out: Path, layers: int, tp: int = 4, *, with_manifest: bool = True, dims: Dims | None = None) -> dict:
    """Write the role folder ``out`` (replaced atomically). Returns a summary dict."""
    import torch.multiprocessing as mp

    d = dims or Dims(layers)
    if d.kv_heads % tp or d.ffn % tp or (d.heads * d.head_dim) % tp:
        raise SystemExit(f"--tp {tp} must divide kv_heads={d.kv_heads}, ffn={d.ffn} and heads*head_dim")
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    dist_dir = tmp / "model" / "dist_ckpt"
    hf = tmp / "model" / "huggingface"
    dist_dir.mkdir(parents=True)
    hf.mkdir(parents=True)
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(tp, _free_port(), str(dist_dir), asdict(d)), nprocs=tp, join=True)
    content_metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    torch.save({"content_metadata": content_metadata}, dist_dir / "common.pt")
    (dist_dir / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
         "common_backend": "torch", "common_backend_version": 1}))
    cfg = fsdp.hf_config(d.layers)
    cfg.update(hidden_size=d.hidden, intermediate_size=d.ffn, num_attention_heads=d.heads,
               num_key_value_heads=d.kv_heads, vocab_size=d.vocab)
    if d.head_dim != d.hidden // d.heads:
        cfg["head_dim"] = d.head_dim
    (hf / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (hf / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": 151643, "max_new_tokens": 2048}, indent=2) + "\n")
    fsdp.write_tokenizer(hf)
    (tmp / "transformer_config.json").write_text(json.dumps(transformer_config(d, tp), indent=2) + "\n")
    if with_manifest:
        (tmp / "ckpt_contents.json").write_text(json.dumps(manifest(tp), indent=2, sort_keys=True) + "\n")
    elapsed = time.perf_counter() - t0
    data_files = sorted(dist_dir.glob("*.distcp"))
    summary = {
        "layers": d.layers,
        "world_size": tp,
        "tp": tp,
        "param_bytes": expected_bytes(d),
        "rank_file_bytes": sum(p.stat().st_size for p in data_files),
        "data_files": len(data_files),
        "metadata_bytes": (dist_dir / ".metadata").stat().st_size,
        "create_seconds": round(elapsed, 2),
    }
    if dims is not None:
        summary["dims"] = asdict(d)
    (tmp / "synthetic.json").write_text(json.dumps(summary, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return summary


# --------------------------------------------------------------------------------------------
# Spot check of a merged output
# --------------------------------------------------------------------------------------------

def _load_source(dist_dir: Path, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole global tensor ``key`` through torch's own DCP reader (no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    t = torch.empty(shape, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({key: t}, storage_reader=dcp.FileSystemReader(str(dist_dir)), no_dist=True)
    return t


def _split_qkv(fused: torch.Tensor, d: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query group g: heads/kv_heads query heads, one key head, one value head (hd rows each)."""
    per, hd = d.heads // d.kv_heads, d.head_dim
    groups = fused.reshape(d.kv_heads, (per + 2) * hd, *fused.shape[1:])
    q = groups[:, : per * hd].reshape(d.heads * hd, *fused.shape[1:])
    k = groups[:, per * hd : (per + 1) * hd].reshape(d.kv_heads * hd, *fused.shape[1:])
    v = groups[:, (per + 1) * hd :].reshape(d.kv_heads * hd, *fused.shape[1:])
    return q, k, v


def check_merged(ckpt: Path, merged: Path, layers: list[int] | None = None) -> tuple[bool, str]:
    """Compare ``merged`` (HF safetensors folder) with the Megatron source, bytes, for ``layers``
    (default: first and last) and every global tensor. Returns ``(ok, message)``."""
    from safetensors import safe_open

    info = json.loads((Path(ckpt) / "synthetic.json").read_text())
    d = Dims(**info["dims"]) if "dims" in info else Dims(info["layers"])
    dist_dir = Path(ckpt) / "model" / "dist_ckpt"
    index = Path(merged) / "model.safetensors.index.json"
    if index.is_file():
        wmap = {k: Path(merged) / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    else:
        wmap = {}
        for f in sorted(Path(merged).glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                wmap.update({k: f for k in h.keys()})
    expected_names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(d.layers):
        p = f"model.layers.{i}."
        expected_names |= {p + n for n in (
            "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
            "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}
    if set(wmap) != expected_names:
        return False, (f"tensor names: missing {sorted(expected_names - set(wmap))[:4]}, "
                       f"unexpected {sorted(set(wmap) - expected_names)[:4]}")
    handles: dict[Path, object] = {}

    def merged_tensor(name: str) -> torch.Tensor:
        f = wmap[name]
        if f not in handles:
            handles[f] = safe_open(f, "pt")
        return handles[f].get_tensor(name)

    layers = sorted(set(layers if layers is not None else [0, d.layers - 1]))
    shapes = global_shapes(d)
    compared = 0
    nbytes = 0

    def same(name: str, ref: torch.Tensor) -> str | None:
        nonlocal compared, nbytes
        got = merged_tensor(name)
        if got.dtype != ref.dtype or tuple(got.shape) != tuple(ref.shape):
            return f"{name}: {got.dtype}{list(got.shape)}, expected {ref.dtype}{list(ref.shape)}"
        if not torch.equal(got.reshape(-1).view(torch.int16), ref.reshape(-1).view(torch.int16)):
            return f"{name}: values differ from the source"
        compared += 1
        nbytes += got.numel() * got.element_size()
        return None

    for key, hf in ((EMB, "model.embed_tokens.weight"), (OUT_LAYER, "lm_head.weight"), (FINAL_LN, "model.norm.weight")):
        if err := same(hf, _load_source(dist_dir, key, shapes[key])):
            return False, err
    for key in (QKV, QKV_BIAS, PROJ, LN1, LN2, FC1, FC2):
        src = _load_source(dist_dir, key, shapes[key])
        for i in layers:
            p = f"model.layers.{i}."
            s = src[i]
            if key in (QKV, QKV_BIAS):
                kind = "weight" if key == QKV else "bias"
                refs = dict(zip(("q_proj", "k_proj", "v_proj"), _split_qkv(s, d)))
                checks = [(f"{p}self_attn.{m}.{kind}", r) for m, r in refs.items()]
            elif key == FC1:
                checks = [(f"{p}mlp.gate_proj.weight", s[: d.ffn]), (f"{p}mlp.up_proj.weight", s[d.ffn :])]
            else:
                hf = {PROJ: "self_attn.o_proj.weight", LN1: "input_layernorm.weight",
                      LN2: "post_attention_layernorm.weight", FC2: "mlp.down_proj.weight"}[key]
                checks = [(p + hf, s)]
            for name, ref in checks:
                if err := same(name, ref.contiguous()):
                    return False, err
        del src
    return True, (f"{len(wmap)} HF-named tensors with the right shapes; {compared} compared byte for byte "
                  f"with torch DCP's load of the fused source (layers {layers} + globals, {nbytes / 1e9:.2f} GB)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="role folder to write (replaced if it exists); with --check: the checkpoint")
    ap.add_argument("merged", type=Path, nargs="?", help="with --check: the merged HF folder")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (2 ~3.1 GB, 8 ~5.9 GB)")
    ap.add_argument("--tp", type=int, default=4, help="tensor-parallel size = gloo processes (divides 4)")
    ap.add_argument("--no-manifest", action="store_true", help="do not write ckpt_contents.json")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (for testing this script)")
    ap.add_argument("--check", action="store_true", help="spot-check MERGED against the checkpoint OUT")
    ap.add_argument("--check-layers", default=None, help="with --check: comma-separated layers (default first,last)")
    args = ap.parse_args(argv)
    if args.check:
        if args.merged is None:
            ap.error("--check needs OUT and MERGED")
        layers = [int(x) for x in args.check_layers.split(",")] if args.check_layers else None
        ok, msg = check_merged(args.out, args.merged, layers)
        print(("OK: " if ok else "MISMATCH: ") + msg)
        return 0 if ok else 1
    dims = Dims(args.layers, hidden=64, ffn=96, heads=8, kv_heads=4, head_dim=8, vocab=200) if args.tiny else None
    d = dims or Dims(args.layers)
    print(f"writing {args.layers}-layer Qwen2-7B-shaped Megatron torch_dist checkpoint "
          f"({expected_bytes(d) / 1e9:.2f} GB bf16) with TP={args.tp} to {args.out}", file=sys.stderr)
    summary = make_checkpoint(args.out, args.layers, args.tp, with_manifest=not args.no_manifest, dims=dims)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
