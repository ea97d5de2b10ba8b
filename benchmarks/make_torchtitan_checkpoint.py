#!/usr/bin/env python
"""Write a big torchtitan Llama 3 checkpoint with torchtitan's own model and ``CheckpointManager`` (CPU, 2 gloo ranks).

    python benchmarks/make_torchtitan_checkpoint.py OUT [--layers 17]

torchtitan 0.3's ``Llama3Model`` (dim 2048, 32 heads, 8 KV heads, FFN 8192, vocab 128256, untied:
Llama-3.2-1B's widths) with ``--layers`` decoder layers is built on the meta device, sharded per
layer with FSDP2 ``fully_shard`` on 2 ranks, given storage (``to_empty``) and seeded random weights,
then saved as a final step by ``CheckpointManager`` with ``last_save_model_only=True`` and
``export_dtype="bfloat16"``: ``OUT/dump/checkpoint/step-1/{.metadata, __0_0.distcp, __1_0.distcp}``
in torchtitan's names (``layers.{i}.attention.qkv_linear.wq.weight`` ... rotary-permuted q/k rows
as torchtitan trains them), model weights only. ``OUT/config/config.json`` is the matching
Hugging Face ``LlamaConfig`` (bf16); pass it as ``--config`` to ``hf-merge merge`` and
``from_sharded_pretrained``. 17 layers: 1.55 B parameters, 3.12 GB. The weights are random, not
trained: a benchmark input, not a model.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WIDTHS = dict(dim=2048, n_heads=32, n_kv_heads=8, hidden=8192, vocab=128256, theta=500000.0, max_seq=4096)


def _worker(rank: int, out: str, port: int, layers: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sys.path.insert(0, str(REPO / "examples"))
    from make_dcp_checkpoints import _torchtitan_stand_ins  # noqa: E402  (triton kernels torchtitan imports)

    _torchtitan_stand_ins()
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    w = WIDTHS
    cfg = Llama3Model.Config(
        dim=w["dim"], vocab_size=w["vocab"], enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=w["vocab"], embedding_dim=w["dim"]),
        norm=RMSNorm.Config(normalized_shape=w["dim"], eps=1e-5),
        lm_head=Linear.Config(in_features=w["dim"], out_features=w["vocab"]),
        layers=_build_llama3_layers(n_layers=layers, dim=w["dim"], n_heads=w["n_heads"], n_kv_heads=w["n_kv_heads"],
                                    hidden_dim=w["hidden"], fuse_qkv=True, attn_backend="flex",
                                    rope=ComplexRoPE.Config(dim=w["dim"] // w["n_heads"], max_seq_len=w["max_seq"],
                                                            theta=w["theta"])),
    )
    with torch.device("meta"):
        model = cfg.build()
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.copy_(torch.randn(local.shape, generator=gen) * 0.02 + (1.0 if p.dim() == 1 else 0.0))
    manager = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, last_save_model_only=True,
                                 export_dtype="bfloat16", keep_latest_k=0),
        dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None,
        base_folder=str(Path(out) / "dump"),
    )
    manager.save(curr_step=1, last_step=True)
    manager.maybe_wait_for_saving()
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


def hf_config(layers: int) -> dict:
    w = WIDTHS
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": w["vocab"],
            "hidden_size": w["dim"], "intermediate_size": w["hidden"], "num_hidden_layers": layers,
            "num_attention_heads": w["n_heads"], "num_key_value_heads": w["n_kv_heads"], "head_dim": w["dim"] // w["n_heads"],
            "max_position_embeddings": w["max_seq"], "rope_theta": w["theta"], "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "bfloat16"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=17, help="decoder layers (17: 3.12 GB bf16)")
    a = ap.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(str(a.out), port, a.layers), nprocs=2, join=True)
    (a.out / "config").mkdir(parents=True, exist_ok=True)
    (a.out / "config" / "config.json").write_text(json.dumps(hf_config(a.layers), indent=2))
    files = sorted((a.out / "dump").rglob("*.distcp"))
    print(json.dumps({"layers": a.layers, "bytes": sum(p.stat().st_size for p in files),
                      "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
