#!/usr/bin/env python
"""Many tensors, few bytes: the Megatron-Core MoE checkpoint of ``make_synthetic_megatron_moe``
at tiny widths (hidden 64, 4/2 heads of 16, expert width 32, vocab 512), for scaling work.

    python benchmarks/make_tiny_many_tensors.py OUT --layers 16 --experts 128

``layers x experts x 3`` expert tensors (and as many DCP chunks: gate and up are separate chunks).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_synthetic_megatron_moe as moe  # noqa: E402

moe.HIDDEN, moe.HEADS, moe.KV_HEADS, moe.HEAD_DIM, moe.MOE_FFN, moe.VOCAB = 64, 4, 2, 16, 32, 512

if __name__ == "__main__":
    sys.exit(moe.main())
