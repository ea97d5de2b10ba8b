#!/usr/bin/env python
"""Write a generic PyTorch DCP checkpoint holding the same model as a synthetic verl FSDP one.

    python benchmarks/make_synthetic_dcp.py FSDP_CKPT OUT_DIR [--world-size N]

FSDP_CKPT is a folder written by ``make_synthetic_checkpoint.py``. Its tensors (HF names, the
checkpoint's dtype) are saved by ``torch.distributed.checkpoint.save`` in one process (no process
group), and its ``huggingface/`` files are copied beside ``.metadata``, so
``from_sharded_pretrained(OUT_DIR)`` and ``hf-merge merge OUT_DIR ...`` find the config. This is a
benchmark helper: it holds the whole model in memory while saving (about 3 GB for 2 layers).
``--world-size N`` saves from N gloo ranks instead, each tensor a ``Shard(0)`` DTensor on a 1-D mesh
(``distribute_tensor``): N ``.distcp`` files, a chunk per tensor per rank, as FSDP2 training saves
(every rank holds the whole model while saving: for tiny widths, e.g. ``make_tiny_many_tensors.py``).
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
    p.add_argument("--world-size", type=int, default=1)
    a = p.parse_args(argv)
    if a.world_size > 1:
        return _save_distributed(a.fsdp_ckpt, a.out, a.world_size)

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


def _rank(rank: int, fsdp_ckpt: Path, out: Path, world_size: int, port: int) -> None:
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hf_merge.checkpoint import open_checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    with open_checkpoint(fsdp_ckpt) as ck:
        state = {name: distribute_tensor(ck.read(name), mesh, [Shard(0)]) for name in ck.specs()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out)))
    dist.destroy_process_group()


def _save_distributed(fsdp_ckpt: Path, out: Path, world_size: int) -> int:
    import socket

    import torch.multiprocessing as tmp

    from hf_merge.checkpoint import open_checkpoint

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(_rank, args=(fsdp_ckpt, out, world_size, port), nprocs=world_size, join=True)
    with open_checkpoint(fsdp_ckpt) as ck:
        hf_dir, n = ck.info.hf_dir, len(ck.specs())
    for f in Path(hf_dir).iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    print(f"wrote {out}: {n} tensors from {world_size} ranks", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
