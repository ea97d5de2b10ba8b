#!/usr/bin/env python
"""Interleaved A/B of `hf-merge merge` from two (or more) source trees, with the copy floor.

    python benchmarks/ab_trees.py CKPT --rounds 5 old=/work/main new=. \\
        "old-nock=/work/main --no-checksums" "new-nock=. --no-checksums"

Each round runs every variant once (plus `cat` of the rank files, the copy floor), in an order
rotated every round, each on a warm page cache after the previous output was deleted and synced;
a run's wall time ends after an fsync of its output. A variant is NAME=TREE [merge flags]: the
merge runs as `python -m hf_merge merge CKPT OUT FLAGS` with PYTHONPATH=TREE (and
PYTHONDONTWRITEBYTECODE unset). Printed: every run (wall, user, system CPU seconds of the process,
fsync, 1-minute load average before it) and, per variant, the medians and the per-round walls and
ratios to the same round's copy. On a shared machine compare CPU seconds and medians, not one run.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _sync_out(path: Path) -> None:
    for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _run(argv: list[str], env: dict | None, out: Path, shell_out: bool) -> tuple[float, float, float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    if shell_out:  # cat: its stdout is the output file
        with open(out, "wb") as f:
            subprocess.run(argv, stdout=f, check=True)
    else:
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t1 = time.perf_counter()
    _sync_out(out)
    t2 = time.perf_counter()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return t2 - t0, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, t2 - t1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path, help="FSDP checkpoint folder (model_world_size_*_rank_*.pt)")
    ap.add_argument("variants", nargs="+", help="NAME=TREE [merge flags]")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/hf-merge-ab"))
    ap.add_argument("--no-copy", action="store_true", help="do not run the cat of the rank files")
    args = ap.parse_args(argv)

    inputs = sorted(args.ckpt.glob("model_world_size_*_rank_*.pt"))
    if not inputs:
        ap.error(f"no rank files in {args.ckpt}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    variants: dict[str, tuple[str, list[str]]] = {}
    if not args.no_copy:
        variants["copy (cat)"] = ("", [])
    for v in args.variants:
        name, _, rest = v.partition("=")
        tree, *flags = shlex.split(rest)
        variants[name] = (str(Path(tree).resolve()), flags)
    names = list(variants)
    rows: dict[str, list[tuple[float, float, float, float, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out = args.workdir / ("copy.bin" if name == "copy (cat)" else "out")
            shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
            os.sync()
            for f in inputs:  # warm page cache
                subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, check=True)
            load = os.getloadavg()[0]
            if name == "copy (cat)":
                m = _run(["cat", *map(str, inputs)], None, out, True)
            else:
                tree, flags = variants[name]
                env = dict(os.environ, PYTHONPATH=tree)
                env.pop("PYTHONDONTWRITEBYTECODE", None)
                m = _run([sys.executable, "-m", "hf_merge", "merge", str(args.ckpt), str(out), *flags], env, out, False)
            rows[name].append((*m, load))
            print(f"round {r} {name:14s} wall {m[0]:6.2f} user {m[1]:5.2f} sys {m[2]:5.2f} "
                  f"fsync {m[3]:4.2f} load {load:.1f}", flush=True)
            shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
    copies = rows.get("copy (cat)", [])
    print("\nmedians (wall, user, sys, fsync) and per-round walls (ratio to that round's copy):")
    for name in names:
        med = [statistics.median(x) for x in zip(*rows[name])]
        per = " ".join(f"{w[0]:.2f}" + (f" ({w[0] / c[0]:.2f}x)" if c and name != "copy (cat)" else "")
                       for w, c in zip(rows[name], copies or [None] * len(rows[name])))
        print(f"{name:14s} wall {med[0]:6.2f} user {med[1]:5.2f} sys {med[2]:5.2f} fsync {med[3]:4.2f} | {per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
