#!/usr/bin/env python
"""Throughput of a merge on 1, 2, 4 ... processes (torchrun on one machine) against the copy floor.

    python benchmarks/bench_distributed.py CKPT WORKDIR [--procs 1,2,4] [--repeat 3] [--max-shard-size 1GB]

CKPT is a verl FSDP checkpoint (``benchmarks/make_synthetic_checkpoint.py`` makes one). Per
repetition, in turn: the copy floor (``cat`` of the rank files into one file in WORKDIR, then
fsync), and for each process count a merge into WORKDIR (1 process: ``python -m hf_merge merge``;
N > 1: ``torchrun --nproc-per-node N -m hf_merge merge``), wall time including an fsync of every
output file. The page cache is warmed once by reading the rank files. Prints a markdown table of
medians (and every run), with GB/s of checkpoint bytes; ``--json`` saves the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rank_files(ckpt: Path) -> list[Path]:
    files = sorted(ckpt.glob("model_world_size_*_rank_*.pt"))
    if not files:
        sys.exit(f"{ckpt}: no model_world_size_*_rank_*.pt files")
    return files


def fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def timed(cmd: list[str], out: Path, env: dict[str, str]) -> float:
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    if out.is_dir():
        fsync_tree(out)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-shard-size", default="1GB")
    ap.add_argument("--extra", default="", help="more hf-merge merge arguments, e.g. '--no-checksums'")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    files = rank_files(args.ckpt)
    size = sum(p.stat().st_size for p in files)
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONWARNINGS="ignore")
    for p in files:  # warm cache for every run alike
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
    procs = [int(n) for n in args.procs.split(",")]
    runs: dict[str, list[float]] = {"copy": []}
    for n in procs:
        runs[f"hf-merge, {n} process{'es' if n > 1 else ''}"] = []
    load = os.getloadavg()[0]
    for _ in range(args.repeat):
        copy_out = args.workdir / "copy"
        cat = f"mkdir -p {copy_out} && cat {' '.join(map(str, files))} > {copy_out / 'all.bin'}"
        runs["copy"].append(timed(["sh", "-c", cat], copy_out, env))
        shutil.rmtree(copy_out, ignore_errors=True)
        for n in procs:
            out = args.workdir / f"merged-{n}"
            tail = ["merge", str(args.ckpt), str(out), "--max-shard-size", args.max_shard_size, *args.extra.split()]
            if n == 1:
                cmd = [sys.executable, "-m", "hf_merge", *tail]
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--monitor-interval",
                       "0.1", "-m", "hf_merge", *tail]
            runs[f"hf-merge, {n} process{'es' if n > 1 else ''}"].append(timed(cmd, out, env))
            shutil.rmtree(out, ignore_errors=True)
    floor = statistics.median(runs["copy"])
    print(f"checkpoint {args.ckpt} ({size / 1e9:.2f} GB, {len(files)} rank files); load average before: {load:.1f}; "
          f"medians of {args.repeat}")
    print("| run | wall s (median) | GB/s | ratio to copy | runs s |")
    print("|---|---:|---:|---:|---|")
    for name, walls in runs.items():
        med = statistics.median(walls)
        print(f"| {name} | {med:.1f} | {size / 1e9 / med:.2f} | {med / floor:.2f}x | {', '.join(f'{w:.1f}' for w in walls)} |")
    if args.json:
        args.json.write_text(json.dumps({"bytes": size, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
