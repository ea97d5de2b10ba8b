#!/usr/bin/env python
"""Write a Qwen2-7B-shaped ColossalAI booster checkpoint (hybrid plugin, pipeline stages) for benchmarks.

    python benchmarks/make_synthetic_colossalai.py OUT_DIR --layers 2 [--stages 2] [--shard-mb 1024]

ColossalAI's library pins torch <= 2.5.1, so it cannot write a 3 GB checkpoint in the benchmark
venv. This script writes the layout that ``booster.save_model(model, OUT_DIR, shard=True)`` of
the ``HybridParallelPlugin`` writes with pipeline parallelism, as the committed fixture
``tests/data/colossalai/hybrid_tp2_pp2_ws4`` (written by real ColossalAI 0.5.0) shows it:

    OUT_DIR/pytorch_model-stage-0000S-shard-0000K.bin   torch.save of {HF name: full tensor}, per stage,
                                                        each shard at most --shard-mb MB
    OUT_DIR/pytorch_model.bin.index.json                {"metadata": {"total_size": MB as a float},
                                                         "weight_map": {name: file}}
    OUT_DIR/config.json, generation_config.json        (the booster saves no tokenizer)

The tensors are the same Qwen2-7B widths as ``make_synthetic_checkpoint.py`` (bf16, untied output
layer), random values; stage 1 holds the embedding and the first layers, the last stage the last
layers, the final norm and the output layer. Tensor parallelism leaves no trace in this layout
(the booster gathers every tensor before it saves).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_synthetic_checkpoint import hf_config, param_shapes  # noqa: E402


def stage_of(name: str, layers: int, stages: int) -> int:
    """The pipeline stage (0-based) that holds ``name``: layers split evenly, the embedding first,
    the final norm and output layer last."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) * stages // layers
    return 0 if name.startswith("model.embed_tokens.") else stages - 1


def make_checkpoint(out: Path, layers: int, stages: int = 2, shard_mb: int = 1024, seed: int = 0) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    shapes = param_shapes(layers)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for stage in range(stages):
        names = [n for n in shapes if stage_of(n, layers, stages) == stage]
        shard: dict[str, torch.Tensor] = {}
        size, index = 0, 1

        def flush() -> None:
            nonlocal shard, size, index
            if shard:
                file = f"pytorch_model-stage-{stage + 1:05d}-shard-{index:05d}.bin"
                torch.save(shard, out / file)
                weight_map.update(dict.fromkeys(shard, file))
                shard, size, index = {}, 0, index + 1

        for name in names:
            t = torch.empty(shapes[name], dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
            if shard and size + t.nbytes > shard_mb << 20:
                flush()
            shard[name] = t
            size += t.nbytes
            total += t.nbytes
        flush()
    index_json = {"metadata": {"total_size": total / (1 << 20)}, "weight_map": weight_map}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config(layers), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 151643, "eos_token_id": 151643}) + "\n")
    return {"layers": layers, "stages": stages, "tensors": len(shapes), "bytes": total,
            "files": sorted(set(weight_map.values()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--shard-mb", type=int, default=1024, help="ColossalAI's size_per_shard (default 1024)")
    ns = p.parse_args(argv)
    if ns.stages < 1 or ns.stages > ns.layers:
        p.error("--stages must be between 1 and --layers")
    print(json.dumps(make_checkpoint(ns.out, ns.layers, ns.stages, ns.shard_mb)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
