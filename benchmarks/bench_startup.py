#!/usr/bin/env python
"""The fixed (size-independent) cost of a merge: fresh-interpreter wall time of a tiny merge.

    python benchmarks/bench_startup.py CKPT [--runs 7] [--ref OTHER_TREE] [--no-hub-layout] [--merge-args ARGS]

``CKPT`` is a tiny verl FSDP checkpoint (e.g. ``python examples/make_fsdp_checkpoint.py /tmp/tiny``
or a test fixture under ``$HF_MERGE_FIXTURE_CACHE``). Each run is ``python -m hf_merge merge CKPT
OUT --overwrite`` in a fresh interpreter, with ``PYTHONDONTWRITEBYTECODE`` removed from the
environment (users get ``.pyc`` files) after one warm-up run; runs of this tree and of ``--ref``
(another checkout, e.g. the branch before a change) alternate, so both see the same load. Also
timed: ``python -c "import torch"`` (the floor every merge pays). ``--no-hub-layout`` bypasses
``hf_merge.transforms.hub_layout`` (whose transformers import is another change), to show the
rest. Prints the median and min wall and CPU time per tree, the load average, and which heavy modules the
merge imported.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
HEAVY = [
    "torch.distributed.tensor", "torch.distributed.checkpoint", "transformers", "peft", "huggingface_hub.hf_api",
    "huggingface_hub", "jinja2", "yaml", "rich", "tqdm", "safetensors",
]
RUN = """
import importlib, json, sys, time
if {no_hub}:
    hl = importlib.import_module("hf_merge.transforms.hub_layout")
    hl.hub_layout = lambda model, config: (model, [])
from hf_merge.cli.app import main
code = main(sys.argv[1:])
import hf_merge
print(json.dumps({{"code": code, "tree": hf_merge.__file__, "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def _env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(tree)
    return env


def _once(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """``(wall s, CPU s (user + system of the child), stdout)``."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # cwd "/": ``python -c`` puts the working directory first on sys.path, before PYTHONPATH's tree
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd="/")
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return wall, cpu, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--ref", type=Path, default=None, help="another checkout to time alternately (before/after)")
    ap.add_argument("--no-hub-layout", action="store_true")
    ap.add_argument("--merge-args", default="", help='more merge arguments, one string (e.g. "--config DIR")')
    args = ap.parse_args()
    trees = {"this": HERE} | ({"ref": args.ref.resolve()} if args.ref else {})
    code = RUN.format(no_hub=args.no_hub_layout, heavy=HEAVY)
    out = Path(tempfile.mkdtemp(prefix="bench-startup-")) / "out"
    walls: dict[str, list[float]] = {name: [] for name in [*trees, "import torch"]}
    cpus: dict[str, list[float]] = {name: [] for name in walls}
    heavy: dict[str, list[str]] = {}
    load0 = os.getloadavg()
    for i in range(args.runs + 1):  # run 0: warm-up (writes .pyc files, warms the page cache)
        for name, tree in trees.items():
            wall, cpu, stdout = _once([sys.executable, "-c", code, "merge", str(args.ckpt), str(out), "--overwrite", *shlex.split(args.merge_args)], _env(tree))
            report = json.loads(stdout.strip().splitlines()[-1])
            if not report["tree"].startswith(str(tree)):
                raise SystemExit(f"{name} ran {report['tree']}, not the tree {tree}")
            heavy[name] = report["heavy"]
            if i:
                walls[name].append(wall)
                cpus[name].append(cpu)
        wall, cpu, _ = _once([sys.executable, "-c", "import torch"], _env(HERE))
        if i:
            walls["import torch"].append(wall)
            cpus["import torch"].append(cpu)
    load1 = os.getloadavg()
    print(f"load average {load0[0]:.2f} -> {load1[0]:.2f} (1 min); {args.runs} runs each, after one warm-up")
    for name, w in walls.items():
        c = cpus[name]
        print(
            f"{name:>12}: wall median {statistics.median(w):.3f} s, min {min(w):.3f} s | CPU (user+sys) median "
            f"{statistics.median(c):.3f} s, min {min(c):.3f} s  (walls {' '.join(f'{x:.2f}' for x in w)})"
        )
    for name, mods in heavy.items():
        print(f"{name:>12} imported: {', '.join(mods) or '-'}")


if __name__ == "__main__":
    main()
