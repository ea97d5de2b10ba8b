#!/usr/bin/env python
"""Write a generic PyTorch DCP checkpoint holding the same model as a synthetic verl FSDP one.

    python benchmarks/make_synthetic_dcp.py FSDP_CKPT OUT_DIR

FSDP_CKPT is a folder written by ``make_synthetic_checkpoint.py``. Its tensors (HF names, the
checkpoint's dtype) are saved by ``torch.distributed.checkpoint.save`` in one process (no process
group), and its ``huggingface/`` files are copied beside ``.metadata``, so
``from_sharded_pretrained(OUT_DIR)`` and ``hf-merge merge OUT_DIR ...`` find the config. This is a
benchmark helper: it holds the whole model in memory while saving (about 3 GB for 2 layers).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("fsdp_ckpt", type=Path)
    p.add_argument("out", type=Path)
    a = p.parse_args(argv)

    import torch.distributed.checkpoint as dcp

    from hf_merge.checkpoint import open_checkpoint

    if a.out.exists():
        shutil.rmtree(a.out)
    a.out.mkdir(parents=True)
    with open_checkpoint(a.fsdp_ckpt) as ck:
        state = {name: ck.read(name) for name in ck.specs()}
        hf_dir = ck.info.hf_dir
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(a.out), thread_count=4), no_dist=True)
    for f in Path(hf_dir).iterdir():
        if f.is_file():
            shutil.copy2(f, a.out / f.name)
    print(f"wrote {a.out}: {len(state)} tensors, {sum(t.nbytes for t in state.values()) / 1e9:.2f} GB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
