#!/usr/bin/env python
"""Many tensors saved by many ranks: hf-merge (one or two source trees) against verl's merger.

    python benchmarks/bench_ranks.py --workdir W --layers 180 --world-sizes 2,8,32 --rounds 2 \\
        [--tree new=. --tree old=/tmp/base-tree] [--verl-python /work/venvs/verl-venv/bin/python]

Each world size gets a verl FSDP2 checkpoint written by real FSDP2 on gloo
(``make_tiny_many_tensors.py fsdp``: tiny widths, 12 tensors per layer, so the time is the rank
files' metadata, not their bytes), made once under ``W``. Rounds interleave the tools (the order
rotates each round); each run is one process tree, its output fsynced; the table gives medians of
wall and CPU seconds (user + system, children included) and hf-merge's wall against verl's.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make(workdir: Path, layers: int, world_size: int) -> Path:
    src = workdir / f"fsdp-L{layers}-ws{world_size}"
    if not (src / "huggingface" / "config.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        subprocess.run([sys.executable, str(HERE / "make_tiny_many_tensors.py"), "fsdp", str(src), "--layers", str(layers),
                        "--world-size", str(world_size)], check=True, stdout=subprocess.DEVNULL)
    return src


def timed(argv: list[str], out: Path, env: dict[str, str], cwd: Path) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(["bash", "-c", f'"$@" > /dev/null 2>&1 && sync -f {str(out)!r}', "run", *argv], check=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(out, ignore_errors=True)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=180)
    ap.add_argument("--world-sizes", default="2,8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                    help="an hf-merge source tree (holds hf_merge/); default: this checkout")
    ap.add_argument("--verl-python", type=Path, help="python of a venv with verl (benchmarks/setup_verl.sh)")
    ns = ap.parse_args()
    ns.workdir.mkdir(parents=True, exist_ok=True)
    trees = dict(t.split("=", 1) for t in ns.tree) or {"hf-merge": str(HERE.parent)}
    tools: dict[str, tuple[list[str], dict[str, str], Path]] = {}
    for label, tree in trees.items():
        env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
        tools[label] = ([sys.executable, "-m", "hf_merge", "-q", "merge", "{src}", "{out}"], env, Path(tree).resolve())
    if ns.verl_python:
        tools["verl"] = ([str(ns.verl_python), "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                          "--local_dir", "{src}", "--target_dir", "{out}"], dict(os.environ), ns.workdir)
    rows = []
    for ws in (int(w) for w in ns.world_sizes.split(",")):
        src = make(ns.workdir, ns.layers, ws)
        out = ns.workdir / "out"
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in tools}
        names = list(tools)
        for r in range(ns.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                argv, env, cwd = tools[name]
                wall, cpu = timed([a.replace("{src}", str(src)).replace("{out}", str(out)) for a in argv], out, env, cwd)
                got[name].append((wall, cpu))
                print(f"ws {ws} round {r + 1} {name}: wall {wall:.2f} s, cpu {cpu:.2f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        med = {name: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for name, v in got.items()}
        rows.append((ws, med))
    tensors = 12 * ns.layers + 3
    print(f"\n{ns.layers} layers ({tensors} tensors), medians of {ns.rounds} rounds\n")
    print("| world size | records | " + " | ".join(f"{n} wall / CPU s" for n in tools)
          + (" | " + " | ".join(f"{n} / verl" for n in trees) if "verl" in tools else "") + " |")
    print("|---" * (2 + len(tools) + (len(trees) if "verl" in tools else 0)) + "|")
    for ws, med in rows:
        cells = [f"{med[n][0]:.2f} / {med[n][1]:.2f}" for n in tools]
        ratios = [f"{med[n][0] / med['verl'][0]:.2f}x" for n in trees] if "verl" in tools else []
        print(f"| {ws} | {ws * tensors:,} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
