#!/usr/bin/env python
"""A/B of the one-pass GGUF merge: an older revision of hf_merge against this tree, interleaved.

    .venv/bin/python benchmarks/ab_gguf_onepass.py CKPT CONFIG_DIR [--old-rev 59e7982] [--pairs 3] \
        [--type q8_0] [--workdir DIR]

Runs ``hf-merge merge CKPT OUT --gguf TYPE --config CONFIG_DIR`` with the old revision and with
this tree alternately (old, new, old, new, ...; fresh processes, bytecode compiled first), and
prints one line per run and the medians: wall, CPU seconds of the process (user + system, from
``os.times``), CPU and wall of ``load_vocab`` alone, and peak anonymous memory (``RssAnon``
sampled every 20 ms), with the 1-min load average before each run. The last two outputs are
compared byte for byte. CONFIG_DIR as in bench_gguf.py: the checkpoint's config.json plus a
tokenizer llama.cpp knows (e.g. Qwen2's). The old revision is taken with ``git archive``.
Not part of `make test`.
"""

from __future__ import annotations

import argparse
import compileall
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_gguf_vocab import REPO, old_tree  # noqa: E402

CHILD = r"""
import json, os, sys, threading, time
t0, c0 = time.time(), sum(os.times()[:2])
peak = [0]
def sample():
    while True:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    peak[0] = max(peak[0], int(line.split()[1]) // 1024)
        time.sleep(0.02)
if os.path.exists("/proc/self/status"):
    threading.Thread(target=sample, daemon=True).start()
import hf_merge.gguf.tokenizer as T
inner, spent = T.load_vocab, {}
def timed(*a, **k):
    c, w = sum(os.times()[:2]), time.time()
    try:
        return inner(*a, **k)
    finally:
        spent.update(load_vocab_cpu=sum(os.times()[:2]) - c, load_vocab_wall=time.time() - w)
T.load_vocab = timed
from hf_merge.cli.app import main
rc = main(["-q", "merge", sys.argv[1], sys.argv[2], "--gguf", sys.argv[3], "--config", sys.argv[4], "--overwrite"])
print(json.dumps({"rc": rc, "wall": time.time() - t0, "cpu": sum(os.times()[:2]) - c0, "peak_anon_mb": peak[0], **spent}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("config", type=Path)
    ap.add_argument("--old-rev", default="59e7982")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hf-merge-ab-gguf")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    trees = {"old": old_tree(args.old_rev, args.workdir / f"old-{args.old_rev}"), "new": REPO}
    for tree in trees.values():
        compileall.compile_dir(str(tree / "hf_merge"), quiet=1)
    results: dict[str, list[dict]] = {"old": [], "new": []}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for _ in range(args.pairs):
        for which, tree in trees.items():
            out = args.workdir / which / "model"  # same folder name: same general.name in both files
            load = os.getloadavg()[0]
            r = subprocess.run([sys.executable, "-c", CHILD, str(args.ckpt.resolve()), str(out), args.type,
                                str(args.config.resolve())], cwd=tree, env=dict(env, PYTHONPATH=str(tree)),
                               capture_output=True, text=True)
            line = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"rc": r.returncode}
            line["load"] = load
            results[which].append(line)
            print(which, json.dumps(line), flush=True)
    for which, runs in results.items():
        ok = [r for r in runs if r.get("rc") == 0]
        if ok:
            med = {k: round(statistics.median(r[k] for r in ok), 2)
                   for k in ("wall", "cpu", "load_vocab_cpu", "load_vocab_wall", "peak_anon_mb")}
            print(f"median {which} ({len(ok)} runs, load {min(r['load'] for r in ok):.1f}-{max(r['load'] for r in ok):.1f}): {med}")
    files = [next((args.workdir / w / "model").glob("*.gguf"), None) for w in ("old", "new")]
    same = all(files) and filecmp.cmp(files[0], files[1], shallow=False)
    print("outputs byte-identical:", same)
    for w in ("old", "new"):
        shutil.rmtree(args.workdir / w, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
