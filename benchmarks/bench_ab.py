#!/usr/bin/env python
"""Interleaved A/B of one hf-merge command on two source trees: CPU seconds, not one wall time.

    python benchmarks/bench_ab.py --a /tmp/base-tree --b . --runs 4 -- \\
        merge /tmp/acc_full/layers18/ckpt {out} --config /tmp/acc_full/layers18/config --dtype float32

Runs ``python -m hf_merge.cli.app ARGS`` with ``PYTHONPATH`` set to tree A, then B, then A, ...
(``--runs`` each), ``{out}`` replaced by a fresh output folder (removed before and after each run;
``--out-root``), the output fsynced inside the timed run. For each run it prints wall seconds,
user and system CPU seconds of the process tree and the 1-minute load average; then the
median of each per tree. CPU seconds barely depend on how busy the machine is, wall seconds do:
compare trees by CPU, and by walls only from a quiet machine. ``--fresh-cache`` gives each run
an empty plan cache (``HF_MERGE_CACHE``: a first run of the Hub-layout decision).
A tree is a source folder holding ``hf_merge/`` (e.g. ``git archive REV | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_once(tree: Path, args: list[str], out_root: Path, fresh_cache: bool) -> dict[str, float]:
    out = out_root / "out"
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_DISABLE_PROGRESS_BARS="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # start-up with cached bytecode, as users run it
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=out_root)) if fresh_cache else None
    if cache is not None:
        env["HF_MERGE_CACHE"] = str(cache)
    argv = [sys.executable, "-m", "hf_merge.cli.app", *(a.replace("{out}", str(out)) for a in args)]
    os.sync()
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # the fsync runs in the same timed child, so the output's writeback is counted once, in the run
    script = f'"$@" > /dev/null && sync -f {str(out)!r}'
    # run from the tree: `python -m` puts the working folder first on sys.path
    subprocess.run(["bash", "-c", script, "ab", *argv], check=True, env=env, cwd=tree, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(out, ignore_errors=True)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)
    return {"wall": wall, "user": after.ru_utime - before.ru_utime, "sys": after.ru_stime - before.ru_stime,
            "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), "load": load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="tree A (holds hf_merge/)")
    ap.add_argument("--b", type=Path, required=True, help="tree B (holds hf_merge/)")
    ap.add_argument("--runs", type=int, default=4, help="runs per tree, interleaved A, B, A, B ...")
    ap.add_argument("--out-root", type=Path, default=Path(tempfile.gettempdir()) / "hf-merge-ab",
                    help="where the runs write (OUT_ROOT/out); removed at the end only if this run made it")
    ap.add_argument("--fresh-cache", action="store_true", help="an empty plan cache for every run")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then the hf-merge arguments; {out} is the output folder")
    ns = ap.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    made_root = not ns.out_root.exists()  # a folder given that already exists is left as it was
    ns.out_root.mkdir(parents=True, exist_ok=True)
    trees = {"A": ns.a.resolve(), "B": ns.b.resolve()}
    results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for i in range(ns.runs):
        for label, tree in trees.items():
            r = run_once(tree, args, ns.out_root, ns.fresh_cache)
            results[label].append(r)
            print(f"run {i + 1} {label}: wall {r['wall']:.2f} s, user {r['user']:.2f} s, sys {r['sys']:.2f} s, "
                  f"cpu {r['cpu']:.2f} s, load {r['load']:.1f}", flush=True)
    for label, tree in trees.items():
        med = {k: statistics.median(r[k] for r in results[label]) for k in ("wall", "user", "sys", "cpu")}
        print(f"median {label} ({tree}): wall {med['wall']:.2f} s, user {med['user']:.2f} s, sys {med['sys']:.2f} s, "
              f"cpu {med['cpu']:.2f} s over {ns.runs} runs")
    if made_root:
        shutil.rmtree(ns.out_root, ignore_errors=True)


if __name__ == "__main__":
    main()
