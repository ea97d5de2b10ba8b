#!/usr/bin/env python
"""Many tensors, few bytes, for scaling work: the synthetic checkpoints at tiny widths.

    python benchmarks/make_tiny_many_tensors.py megatron-moe OUT --layers 16 --experts 128
    python benchmarks/make_tiny_many_tensors.py fsdp OUT --layers 720 [--world-size 2]

``megatron-moe``: :mod:`make_synthetic_megatron_moe` at hidden 64, 4/2 heads of 16, expert width
32, vocab 512: ``layers x experts x 3`` expert tensors (and as many DCP chunks, gate and up apart).
``fsdp``: :mod:`make_synthetic_checkpoint`'s verl FSDP Qwen2 at hidden 64, intermediate 128,
4/2 heads, vocab 512: 12 tensors per layer.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# patched at import, so that the writers' spawned processes (which re-import this file) see it too
import make_synthetic_checkpoint as fsdp  # noqa: E402
import make_synthetic_megatron_moe as moe  # noqa: E402

moe.HIDDEN, moe.HEADS, moe.KV_HEADS, moe.HEAD_DIM, moe.MOE_FFN, moe.VOCAB = 64, 4, 2, 16, 32, 512
fsdp.DENSE_SHAPES["tiny"] = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 512}


def main(argv: list[str]) -> int:
    kind, rest = argv[0], argv[1:]
    if kind == "megatron-moe":
        return moe.main(rest)
    if kind == "fsdp":
        return fsdp.main(rest + ["--shape", "tiny"])
    raise SystemExit(f"unknown kind {kind!r}: megatron-moe or fsdp")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
