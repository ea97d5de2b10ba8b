#!/usr/bin/env python
"""Write a synthetic verl FSDP checkpoint made of real DTensors.

    python benchmarks/make_synthetic_checkpoint.py OUT_DIR --layers 2 [--world-size 4] [--lora]
        [--shape qwen2_7b|qwen2.5_1.5b]

The model is Qwen2-7B shaped (hidden 3584, intermediate 18944, 28 heads / 4 KV heads,
vocab 152064, q/k/v biases, untied lm_head) with only ``--layers`` decoder layers, in bf16:
about 2.18 GB of embeddings + lm_head plus 0.47 GB per layer (2 layers ~3.1 GB, 8 layers
~5.9 GB).

``--shape qwen2.5_1.5b``: Qwen2.5-1.5B widths instead (hidden 1536, intermediate 8960, 12 heads /
2 KV heads, vocab 151936, q/k/v biases; untied here so that every tensor is a plain copy): 0.93 GB
of embeddings + lm_head plus 0.093 GB per layer, so a realistic depth stays small
(``--layers 28``: 3.55 GB, 339 tensors, most of them a few MB or less).

Like verl's FSDP2 checkpoint manager, ``world_size`` gloo processes (CPU) each save their own
``model_world_size_{N}_rank_{r}.pt``: a ``torch.save`` of a state dict whose values are
DTensors on a 1-D ``("fsdp",)`` mesh, placement ``Shard(0)``, chunked with ``torch.chunk``
semantics. Each process creates only its own local shards (random bf16 values from a seed
derived from the tensor name and rank), so no process ever holds the full model. The folder
also gets ``fsdp_config.json`` and ``huggingface/`` (config.json, generation_config.json and a
tiny tokenizer, since verl's merger always saves a tokenizer).

``--lora``: the same model wrapped by PEFT (``get_peft_model``) with LoRA r=16 on every linear
layer of the decoder (q, k, v, o, gate, up, down), as verl saves it (``save_lora_only`` off):
names ``base_model.model.<hf name>``, each wrapped linear ``m`` as ``m.base_layer.weight`` (+
``.bias`` for q/k/v), ``m.lora_A.default.weight`` ``[r, in]`` and ``m.lora_B.default.weight``
``[out, r]`` (non-zero, as after training), every tensor a ``Shard(0)`` DTensor like the rest.
The base weights get exactly the values of the plain checkpoint (same seeds, by HF name), so a
merge that ignores LoRA reproduces the plain checkpoint's merge bit for bit. Beside the rank
files, ``lora_train_meta.json`` records ``{"r": 16, "lora_alpha": 32, "task_type": "CAUSAL_LM"}``
as verl does.

``--moe qwen3_30b_a3b``: a Qwen3-30B-A3B-shaped model instead (hidden 2048, 32 q heads / 4 KV
heads, head_dim 128, q/k norms, 128 experts, moe_intermediate_size 768, router ``mlp.gate``,
vocab 151936, untied lm_head), experts in transformers 5's in-memory layout
(``mlp.experts.gate_up_proj [E, 2F, H]``, ``mlp.experts.down_proj [E, H, F]``) as verl's FSDP
rank files hold them: 1.25 GB of embeddings + lm_head plus 1.25 GB per layer (3 layers ~4.98 GB).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
import zlib
from pathlib import Path

import torch

HIDDEN = 3584
INTERMEDIATE = 18944
HEADS = 28
KV_HEADS = 4
VOCAB = 152064
HEAD_DIM = HIDDEN // HEADS
# --shape: the widths of a dense Qwen2 model (only the layer count comes from --layers)
DENSE_SHAPES = {
    "qwen2_7b": {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "heads": HEADS, "kv_heads": KV_HEADS, "vocab": VOCAB},
    "qwen2.5_1.5b": {"hidden": 1536, "intermediate": 8960, "heads": 12, "kv_heads": 2, "vocab": 151936},
}
DEFAULT_SHAPE = "qwen2_7b"
LORA_R = 16
LORA_ALPHA = 32
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."

# --moe qwen3_30b_a3b: the real widths of Qwen/Qwen3-30B-A3B (only the layer count differs)
MOE_SHAPES = {
    "qwen3_30b_a3b": {"hidden": 2048, "intermediate": 6144, "moe_intermediate": 768, "heads": 32,
                      "kv_heads": 4, "head_dim": 128, "experts": 128, "experts_per_tok": 8, "vocab": 151936},
}


def moe_hf_config(layers: int, moe: str) -> dict:
    m = MOE_SHAPES[moe]
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": m["head_dim"],
        "hidden_act": "silu",
        "hidden_size": m["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": m["intermediate"],
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": m["moe_intermediate"],
        "norm_topk_prob": True,
        "num_attention_heads": m["heads"],
        "num_experts": m["experts"],
        "num_experts_per_tok": m["experts_per_tok"],
        "num_hidden_layers": layers,
        "num_key_value_heads": m["kv_heads"],
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": m["vocab"],
    }


def moe_param_shapes(layers: int, moe: str) -> dict[str, tuple[int, ...]]:
    """In-memory names and shapes of transformers 5's Qwen3MoeForCausalLM, in state_dict order."""
    m = MOE_SHAPES[moe]
    h, hd, e, f = m["hidden"], m["head_dim"], m["experts"], m["moe_intermediate"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m["vocab"], h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (m["heads"] * hd, h),
            p + "self_attn.k_proj.weight": (m["kv_heads"] * hd, h),
            p + "self_attn.v_proj.weight": (m["kv_heads"] * hd, h),
            p + "self_attn.o_proj.weight": (h, m["heads"] * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.experts.gate_up_proj": (e, 2 * f, h),
            p + "mlp.experts.down_proj": (e, h, f),
            p + "mlp.gate.weight": (e, h),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (m["vocab"], h)
    return shapes


def hf_config(layers: int, moe: str | None = None, shape: str = DEFAULT_SHAPE) -> dict:
    if moe:
        return moe_hf_config(layers, moe)
    w = DENSE_SHAPES[shape]
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": w["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": w["intermediate"],
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": w["heads"],
        "num_hidden_layers": layers,
        "num_key_value_heads": w["kv_heads"],
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": w["vocab"],
    }


def param_shapes(layers: int, lora_r: int = 0, moe: str | None = None,
                 shape: str = DEFAULT_SHAPE) -> dict[str, tuple[int, ...]]:
    """HF parameter names and global shapes, in Qwen2ForCausalLM's state_dict order.

    ``lora_r > 0``: the names and shapes of the PEFT-wrapped model (see the module docstring),
    in PEFT's state_dict order. ``moe``: the MoE model of that shape (MOE_SHAPES) instead.
    ``shape``: the dense widths (DENSE_SHAPES)."""
    if moe:
        if lora_r:
            raise ValueError("--moe and --lora cannot be combined")
        return moe_param_shapes(layers, moe)
    if lora_r:
        return peft_shapes(param_shapes(layers, shape=shape), lora_r)
    w = DENSE_SHAPES[shape]
    HIDDEN, INTERMEDIATE, VOCAB = w["hidden"], w["intermediate"], w["vocab"]  # noqa: N806
    kv = w["kv_heads"] * (HIDDEN // w["heads"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.q_proj.bias": (HIDDEN,),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        })
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def peft_shapes(hf_shapes: dict[str, tuple[int, ...]], r: int) -> dict[str, tuple[int, ...]]:
    """PEFT names for ``hf_shapes`` with LoRA of rank ``r`` on every LORA_TARGETS linear."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in hf_shapes.items():
        module, param = name.rsplit(".", 1)
        if module.rsplit(".", 1)[-1] not in LORA_TARGETS:
            out[PEFT_PREFIX + name] = shape
            continue
        out[f"{PEFT_PREFIX}{module}.base_layer.{param}"] = shape
        if param == "weight":  # the bias (q/k/v) comes right after its weight in hf_shapes
            out_features, in_features = shape
            out[f"{PEFT_PREFIX}{module}.lora_A.default.weight"] = (r, in_features)
            out[f"{PEFT_PREFIX}{module}.lora_B.default.weight"] = (out_features, r)
    # PEFT's order: base_layer.weight, base_layer.bias, lora_A, lora_B
    order = []
    for name in out:
        if ".lora_" not in name:
            order.append(name)
            if name.endswith(".base_layer.bias") or (
                name.endswith(".base_layer.weight") and name[: -len(".weight")] + ".bias" not in out
            ):
                module = name.rsplit(".base_layer.", 1)[0]
                order += [f"{module}.lora_A.default.weight", f"{module}.lora_B.default.weight"]
    return {name: out[name] for name in order}


def hf_name(name: str) -> str:
    """The plain HF name of a (possibly PEFT-wrapped) base tensor name."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def expected_bytes(layers: int, dtype: torch.dtype = torch.bfloat16, lora_r: int = 0,
                   moe: str | None = None, shape: str = DEFAULT_SHAPE) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    for dims in param_shapes(layers, lora_r, moe, shape).values():
        n = 1
        for d in dims:
            n *= d
        total += n * item
    return total


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def local_shard(name: str, shape: tuple[int, ...], rank: int, world: int) -> torch.Tensor:
    """This rank's Shard(0) piece, torch.chunk semantics (ceil-sized chunks, last short/empty).

    Seeded by the plain HF name, so a PEFT base weight equals the plain model's weight."""
    n = shape[0]
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    stop = min(start + chunk, n)
    local_shape = (stop - start, *shape[1:])
    gen = torch.Generator().manual_seed(zlib.crc32(f"{hf_name(name)}#{rank}".encode()))
    if name.endswith("norm.weight"):
        # RMSNorm weights sit around 1.0
        t = torch.randn(local_shape, generator=gen, dtype=torch.float32).mul_(0.05).add_(1.0)
        return t.to(torch.bfloat16)
    return torch.randn(local_shape, generator=gen, dtype=torch.bfloat16).mul_(0.02)


def _worker(rank: int, world: int, port: int, out: str, layers: int, lora_r: int = 0,
            moe: str | None = None, shape: str = DEFAULT_SHAPE) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        sd = {}
        for name, dims in param_shapes(layers, lora_r, moe, shape).items():
            local = local_shard(name, dims, rank, world)
            sd[name] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size(dims), stride=contiguous_stride(dims)
            )
        path = Path(out) / f"model_world_size_{world}_rank_{rank}.pt"
        tmp = path.with_suffix(".pt.tmp")
        torch.save(sd, tmp)
        os.replace(tmp, path)
        del sd
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tokenizer(hf_dir: Path) -> None:
    """A tiny word-level tokenizer: real verl checkpoints always carry one, and verl's merger
    calls AutoTokenizer.from_pretrained on huggingface/ unconditionally."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<unk>": 1}
    for w in "the a of to and in is it that for on with as was at by hello world".split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "model_max_length": 131072,
    }, indent=2) + "\n")


def make_checkpoint(out: Path, layers: int, world: int = 4, lora_r: int = 0, moe: str | None = None,
                    shape: str = DEFAULT_SHAPE) -> dict:
    """Write the checkpoint into ``out`` (replaced atomically). Returns a summary dict.

    ``lora_r > 0``: the PEFT-wrapped model with LoRA of that rank (see the module docstring)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "huggingface").mkdir(parents=True)
    t0 = time.perf_counter()
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, _free_port(), str(tmp), layers, lora_r, moe, shape), nprocs=world, join=True)
    (tmp / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
    hf = tmp / "huggingface"
    (hf / "config.json").write_text(json.dumps(hf_config(layers, moe, shape), indent=2) + "\n")
    eos = hf_config(layers, moe)["eos_token_id"]
    (hf / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": eos, "max_new_tokens": 2048}, indent=2) + "\n")
    write_tokenizer(hf)
    if lora_r:
        (tmp / "lora_train_meta.json").write_text(json.dumps(
            {"r": lora_r, "lora_alpha": LORA_ALPHA, "task_type": "CAUSAL_LM"}, indent=2) + "\n")
    elapsed = time.perf_counter() - t0
    rank_bytes = sum((tmp / f"model_world_size_{world}_rank_{r}.pt").stat().st_size for r in range(world))
    summary = {
        "layers": layers,
        "world_size": world,
        "param_bytes": expected_bytes(layers, lora_r=lora_r, moe=moe, shape=shape),
        "rank_file_bytes": rank_bytes,
        "create_seconds": round(elapsed, 2),
    }
    if moe:
        summary["moe"] = moe
    else:
        summary["shape"] = shape
    if lora_r:
        summary.update(lora_r=lora_r, lora_alpha=LORA_ALPHA, lora_targets=list(LORA_TARGETS),
                       base_param_bytes=expected_bytes(layers, shape=shape))
    (tmp / "synthetic.json").write_text(json.dumps(summary, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="checkpoint folder to write (replaced if it exists)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (2 ~3.1 GB, 8 ~5.9 GB)")
    ap.add_argument("--world-size", type=int, default=4, help="number of FSDP ranks / gloo processes")
    ap.add_argument("--lora", action="store_true",
                    help=f"PEFT-wrapped model, LoRA r={LORA_R} alpha={LORA_ALPHA} on q,k,v,o,gate,up,down")
    ap.add_argument("--moe", choices=sorted(MOE_SHAPES), default=None,
                    help="an MoE model of that shape (fused experts, transformers 5 in-memory layout) "
                         "instead of Qwen2-7B; qwen3_30b_a3b: 3 layers ~4.98 GB")
    ap.add_argument("--shape", choices=sorted(DENSE_SHAPES), default=DEFAULT_SHAPE,
                    help="dense widths (default qwen2_7b); qwen2.5_1.5b: 28 layers ~3.55 GB, 339 tensors")
    args = ap.parse_args(argv)
    if args.moe and args.lora:
        ap.error("--moe and --lora cannot be combined")
    if args.moe and args.shape != DEFAULT_SHAPE:
        ap.error("--moe and --shape cannot be combined")
    lora_r = LORA_R if args.lora else 0
    shape = f"{args.moe}-shaped" if args.moe else f"{args.shape}-shaped"
    nbytes = expected_bytes(args.layers, lora_r=lora_r, moe=args.moe, shape=args.shape)
    print(f"writing {args.layers}-layer {shape} {'LoRA (PEFT) ' if lora_r else ''}checkpoint "
          f"({nbytes / 1e9:.2f} GB bf16) with {args.world_size} ranks to {args.out}", file=sys.stderr)
    summary = make_checkpoint(args.out, args.layers, args.world_size, lora_r, args.moe, args.shape)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
