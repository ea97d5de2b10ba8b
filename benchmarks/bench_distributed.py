#!/usr/bin/env python
"""Throughput of a merge on 1, 2, 4 ... processes (torchrun on one machine) against the copy floor.

    python benchmarks/bench_distributed.py CKPT WORKDIR [--procs 1,2,4] [--repeat 3] [--max-shard-size 1GB]
        [--variants "--workers 1;--workers 2;--no-checksums"]

CKPT is a verl FSDP checkpoint (``benchmarks/make_synthetic_checkpoint.py`` makes one). Per
repetition, in turn: the copy floor (``cat`` of the rank files into one file in WORKDIR, then
fsync), and for each process count a merge into WORKDIR (1 process: ``python -m hf_merge merge``;
N > 1: ``torchrun --nproc-per-node N -m hf_merge merge``), wall time including an fsync of every
output file. The page cache is warmed once by reading the rank files. Prints a markdown table of
medians (and every run), with GB/s of checkpoint bytes, user and system CPU seconds of the run
(children included); ``--json`` saves the runs. ``--variants``: more single-process merges, one
per ``;``-separated set of extra arguments (``--workers 1`` / ``--workers 2``: one or two writer
processes; ``--no-checksums``: without the sha256 thread), each a row of its own.
``--rank-writers``: each N > 1 also with ``--dist-writers rank`` (every rank opens the source and
writes a share), beside the default (on one node: local rank 0 merges alone, the other ranks
return before importing torch; see docs/distributed.md). ``--launcher``: each N > 1 also as
``torchrun --no-python --nproc-per-node N true``, the launcher's own cost (it imports torch)
that any torchrun job pays on top of the work. ``--torchrun-one``: a row for
``torchrun --nproc-per-node 1`` too (and, with ``--launcher``, its ``true``), the reference that pays
the launcher but has no other rank. ``--phases``: every hf-merge run goes through a small shell
wrapper that writes a time stamp before and after each rank's command (torchrun ``--no-python``),
and a second table splits the wall into torchrun's start (command launched -> rank 0 starts),
rank 0's command, and torchrun's end (last rank ends -> torchrun exits). Every command runs in the
repository's folder (``python -m`` puts the working folder first on ``sys.path``).
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
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "0.1"]


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


WRAPPER = """#!/bin/sh
echo "${LOCAL_RANK:-0} start $(date +%s.%N)" >> "$BENCH_PHASES"
"$@"
code=$?
echo "${LOCAL_RANK:-0} end $(date +%s.%N)" >> "$BENCH_PHASES"
exit $code
"""


def timed(cmd: list[str], out: Path, env: dict[str, str], stamps: "Path | None" = None) -> tuple[float, ...]:
    """Wall seconds (the command, then an fsync of its output), its user and system CPU seconds and,
    with ``stamps`` (the wrapper's time stamps), :func:`phases`."""
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    if stamps is not None:
        stamps.unlink(missing_ok=True)
        env = dict(env, BENCH_PHASES=str(stamps))
    before = os.times()
    t0, launched = time.perf_counter(), time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    ended = time.time()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    if out.is_dir():
        fsync_tree(out)
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (wall, after.children_user - before.children_user, after.children_system - before.children_system)
    return cpu + (phases(stamps, launched, ended) if stamps is not None else ())


def phases(stamps: Path, launched: float, ended: float) -> tuple[float, float, float]:
    """From the wrapper's time stamps: command launched -> rank 0 starts, rank 0's command, last rank
    ends -> command exits (seconds)."""
    rows = [line.split() for line in stamps.read_text().splitlines()]
    start = min(float(t) for rank, what, t in rows if rank == "0" and what == "start")
    end = max(float(t) for rank, what, t in rows if rank == "0" and what == "end")
    last = max(float(t) for _, what, t in rows if what == "end")
    return start - launched, end - start, ended - last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-shard-size", default="1GB")
    ap.add_argument("--extra", default="", help="more hf-merge merge arguments, e.g. '--no-checksums'")
    ap.add_argument("--variants", default="", help="';'-separated extra arguments, one single-process row each")
    ap.add_argument("--rank-writers", action="store_true", help="each N > 1 also with --dist-writers rank")
    ap.add_argument("--launcher", action="store_true", help="each N > 1 also as torchrun of `true` (the launcher's cost)")
    ap.add_argument("--torchrun-one", action="store_true", help="torchrun --nproc-per-node 1 as a row too")
    ap.add_argument("--phases", action="store_true", help="time stamps around each rank's command: a table of phases")
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
    commands: dict[str, tuple[list[str], Path]] = {}
    wrapper, stamps = args.workdir / "phases.sh", args.workdir / "phases.log"
    if args.phases:
        wrapper.write_text(WRAPPER)
        wrapper.chmod(0o755)
    python = [str(wrapper), sys.executable] if args.phases else [sys.executable]
    no_python = ["--no-python"] if args.phases else []
    copy_out = args.workdir / "copy"
    commands["copy"] = (["sh", "-c", f"mkdir -p {copy_out} && cat {' '.join(map(str, files))} > {copy_out / 'all.bin'}"],
                        copy_out)
    counts = [int(n) for n in args.procs.split(",")]
    runs_of = [(f"hf-merge, {n} process{'es' if n > 1 else ''}", n, "") for n in counts]
    if args.torchrun_one:
        runs_of.insert(1, ("hf-merge, torchrun, 1 process", 0, ""))
    if args.rank_writers:
        runs_of += [(f"hf-merge, {n} processes, --dist-writers rank", n, "--dist-writers rank") for n in counts if n > 1]
    runs_of += [(f"hf-merge, 1 process, {v.strip()}", 1, v.strip()) for v in args.variants.split(";") if v.strip()]
    for i, (name, n, more) in enumerate(runs_of):
        out = args.workdir / f"merged-{i}"
        tail = ["merge", str(args.ckpt), str(out), "--max-shard-size", args.max_shard_size, *args.extra.split(),
                *more.split()]
        if n == 1:
            cmd = [*python, "-m", "hf_merge", *tail]
        else:  # 0: torchrun with one process
            cmd = [*TORCHRUN, "--nproc-per-node", str(max(n, 1)), *no_python, *python, "-m", "hf_merge", *tail]
        commands[name] = (cmd, out)
    for n in counts if args.launcher else []:
        if n > 1 or args.torchrun_one:
            commands[f"torchrun launcher alone, {n} process{'es' if n > 1 else ''} of `true`"] = (
                [*TORCHRUN, "--nproc-per-node", str(n), "--no-python", "true"], args.workdir / "launcher")
    runs: dict[str, list[tuple[float, ...]]] = {name: [] for name in commands}
    load = os.getloadavg()[0]
    for _ in range(args.repeat):
        for name, (cmd, out) in commands.items():
            runs[name].append(timed(cmd, out, env, stamps if args.phases and name.startswith("hf-merge") else None))
            shutil.rmtree(out, ignore_errors=True)
    floor = statistics.median(r[0] for r in runs["copy"])
    print(f"checkpoint {args.ckpt} ({size / 1e9:.2f} GB, {len(files)} rank files); load average before: {load:.1f}, "
          f"after: {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs; medians of {args.repeat}")
    print("| run | wall s (median) | GB/s | ratio to copy | user s | sys s | runs s |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, timings in runs.items():
        med, user, system = (statistics.median(r[i] for r in timings) for i in range(3))
        print(f"| {name} | {med:.1f} | {size / 1e9 / med:.2f} | {med / floor:.2f}x | {user:.1f} | {system:.1f} | "
              f"{', '.join(f'{r[0]:.1f}' for r in timings)} |")
    if args.phases:
        print("\n| run (medians) | launched -> rank 0 starts s | rank 0's command s | last rank ends -> exit s |")
        print("|---|---:|---:|---:|")
        for name, timings in runs.items():
            if name.startswith("hf-merge"):
                print(f"| {name} | " + " | ".join(f"{statistics.median(r[i] for r in timings):.2f}" for i in (3, 4, 5)) + " |")
    if args.json:
        args.json.write_text(json.dumps({"bytes": size, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
