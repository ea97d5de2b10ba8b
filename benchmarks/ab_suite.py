#!/usr/bin/env python
"""Speed kept? bench_ab.py on five workloads, tree A against tree B, one summary table.

    python benchmarks/ab_suite.py --a /work/proof-base --b . --runs 5            # the proof (issue 27)
    python benchmarks/ab_suite.py --a /work/proof-base --b . --runs 1 --only l2  # a smoke test
    python benchmarks/ab_suite.py --build-only                                     # make the inputs

Workloads (inputs made once under ``--bench``, default /work/bench, about 14 GB; reused):

  l2         make_synthetic_checkpoint.py --layers 2 (Qwen2-7B-shaped verl FSDP, 4 ranks, bf16, 3.1 GB)
  l9         the same with --layers 9 (6.4 GB)
  moe        make_synthetic_megatron_moe.py --layers 2 --experts 32 (Qwen3-30B-A3B widths,
             Megatron-Core torch_dist, EP=2, bf16, about 1.9 GB)
  zero3      bench_deepspeed.py's Qwen2.5-0.5B-shaped model saved by REAL DeepSpeed 0.19.8, ZeRO-3 on 2
             gloo ranks (needs the venv of ``bash benchmarks/setup_deepspeed.sh VENV``: --ds-venv),
             merged with --config CFG --dtype float32
  gguf_q8_0  l2 -> --gguf q8_0, with --config L2's config plus GPT-2's tokenizer (tests/data/gguf_gpt2_tokenizer;
             the synthetic checkpoint's own tokenizer has no merges)

Each workload's source is read once (warm page cache; ``--no-warm``), then one ``bench_ab.py --a A --b B --runs N`` (A, B, A, B ... interleaved, each run
fsynced). The table gives the medians of wall and CPU (user + system) seconds per tree and B/A; the
issue's bar is B/A <= 1.05 in wall and <= 1.10 in CPU. On a shared machine judge by CPU seconds.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
MEDIAN = re.compile(r"median (A|B) .*: wall ([\d.]+) s, user ([\d.]+) s, sys ([\d.]+) s, cpu ([\d.]+) s")
WORKLOADS = ["l2", "l9", "moe", "zero3", "gguf_q8_0"]


def _once(folder: Path, marker: str, argv: list[str], env: dict | None = None) -> Path:
    """Run the generator ``argv`` unless ``folder/marker`` exists."""
    if (folder / marker).exists():
        return folder
    t0 = time.perf_counter()
    print(f"building {folder} ...", flush=True)
    subprocess.run(argv, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    print(f"built {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    return folder


def gguf_config(bench: Path, src: Path) -> Path:
    """The checkpoint's config with a tokenizer llama.cpp knows (its own tiny one has no merges):
    GPT-2's, committed under tests/data/gguf_gpt2_tokenizer."""
    cfg = bench / "L2-gguf-config"
    if not (cfg / "tokenizer.json").is_file():
        cfg.mkdir(parents=True, exist_ok=True)
        tok = BENCH_DIR.parent / "tests" / "data" / "gguf_gpt2_tokenizer"
        for f in ("config.json", "generation_config.json"):
            if (src / "huggingface" / f).is_file():
                shutil.copy(src / "huggingface" / f, cfg / f)
        shutil.copy(tok / "tokenizer_config.json", cfg)
        (cfg / "tokenizer.json").write_bytes(gzip.decompress((tok / "tokenizer.json.gz").read_bytes()))
    return cfg


def inputs(bench: Path, names: list[str], ds_venv: Path) -> dict[str, list[str]]:
    """workload -> hf-merge arguments ({out}: the output folder); builds what is missing."""
    py = sys.executable
    args: dict[str, list[str]] = {}
    for name in names:
        if name in ("l2", "gguf_q8_0", "l9"):
            layers = 9 if name == "l9" else 2
            src = _once(bench / f"L{layers}", "fsdp_config.json",
                        [py, str(BENCH_DIR / "make_synthetic_checkpoint.py"), str(bench / f"L{layers}"), "--layers", str(layers)])
            args[name] = ["merge", str(src), "{out}"]
            if name == "gguf_q8_0":
                args[name] += ["--config", str(gguf_config(bench, src)), "--gguf", "q8_0"]
        elif name == "moe":
            src = _once(bench / "moe-L2-E32", "ckpt_contents.json",
                        [py, str(BENCH_DIR / "make_synthetic_megatron_moe.py"), str(bench / "moe-L2-E32"), "--layers", "2", "--experts", "32"])
            args[name] = ["merge", str(src), "{out}"]
        elif name == "zero3":
            ds_python = ds_venv / "bin" / "python"
            if not ds_python.is_file():
                raise SystemExit(f"zero3 needs a DeepSpeed venv: bash benchmarks/setup_deepspeed.sh {ds_venv}")
            src = bench / "zero3"
            sys.path.insert(0, str(BENCH_DIR))
            import bench_deepspeed

            if not (src / "latest").is_file():
                t0 = time.perf_counter()
                print(f"building {src} ...", flush=True)
                bench_deepspeed.make(3, src, str(ds_python))
                print(f"built {src} in {time.perf_counter() - t0:.0f} s", flush=True)
            args[name] = ["merge", str(src), "{out}", "--config", str(src / "config"), "--dtype", "float32"]
        else:
            raise SystemExit(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    return args


def warm(folder: Path) -> None:
    """Read every file of the source once: the first timed run does not pay for a cold page cache."""
    for p in sorted(x for x in Path(folder).rglob("*") if x.is_file()):
        with open(p, "rb") as f:
            while f.read(1 << 23):
                pass


def run_ab(a: Path, b: Path, runs: int, argv: list[str], log: Path) -> dict[str, dict[str, float]]:
    # an output root of its own: bench_ab.py removes its root at the end, and others may run it too
    out_root = tempfile.mkdtemp(prefix="hf-merge-ab-suite-")
    cmd = [sys.executable, str(BENCH_DIR / "bench_ab.py"), "--a", str(a), "--b", str(b), "--runs", str(runs),
           "--out-root", out_root, "--", *argv]
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        f.write(p.stdout)
    if p.returncode != 0:
        raise RuntimeError(f"bench_ab failed (rc={p.returncode}), see {log}")
    med = {}
    for m in MEDIAN.finditer(p.stdout):
        med[m.group(1)] = {"wall": float(m.group(2)), "cpu": float(m.group(5))}
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, help="tree A (before; holds hf_merge/)")
    ap.add_argument("--b", type=Path, help="tree B (after; holds hf_merge/)")
    ap.add_argument("--runs", type=int, default=5, help="runs per tree and workload, interleaved")
    ap.add_argument("--only", nargs="*", default=WORKLOADS, help=f"workloads (default: {' '.join(WORKLOADS)})")
    ap.add_argument("--bench", type=Path, default=Path("/work/bench"), help="where the inputs are made and kept")
    ap.add_argument("--ds-venv", type=Path, default=Path(os.environ.get("DS_VENV", "/work/venvs/proof-ds")),
                    help="venv with deepspeed 0.19.8 (benchmarks/setup_deepspeed.sh), for zero3's input")
    ap.add_argument("--logs", type=Path, default=None, help="bench_ab.py outputs (default: BENCH/ab-logs)")
    ap.add_argument("--no-warm", action="store_true", help="do not read each source once before its first run")
    ap.add_argument("--build-only", action="store_true", help="make the inputs and stop")
    ns = ap.parse_args()
    ns.bench.mkdir(parents=True, exist_ok=True)
    work = inputs(ns.bench, ns.only, ns.ds_venv)
    if ns.build_only:
        return 0
    if ns.a is None or ns.b is None:
        ap.error("--a and --b are needed")
    logs = ns.logs or ns.bench / "ab-logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, argv in work.items():
        t0 = time.perf_counter()
        if not ns.no_warm:
            warm(Path(argv[1]))
        med = run_ab(ns.a.resolve(), ns.b.resolve(), ns.runs, argv, logs / f"{name}.log")
        rows.append((name, med, time.perf_counter() - t0))
        print(f"{name}: done in {rows[-1][2]:.0f} s (log {logs / f'{name}.log'})", flush=True)
    print(f"\nA = {ns.a}, B = {ns.b}, medians of {ns.runs} interleaved runs each; load now {os.getloadavg()[0]:.1f}\n")
    print("| workload | A wall s | B wall s | B/A wall | A CPU s | B CPU s | B/A CPU | within 5% wall / 10% CPU |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    ok = True
    for name, med, _ in rows:
        a, b = med["A"], med["B"]
        rw, rc = b["wall"] / a["wall"], b["cpu"] / a["cpu"]
        good = rw <= 1.05 and rc <= 1.10
        ok &= good
        print(f"| {name} | {a['wall']:.2f} | {b['wall']:.2f} | {rw:.3f} | {a['cpu']:.2f} | {b['cpu']:.2f} | {rc:.3f} | "
              f"{'yes' if good else 'NO'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
