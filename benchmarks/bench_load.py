#!/usr/bin/env python
"""Benchmark ``from_sharded_pretrained`` against ``from_pretrained`` of the merged folder.

    .venv/bin/python benchmarks/bench_load.py [CKPT] [--repeat 3] [--dtype bfloat16] [--floor] [--code NAME=DIR ...]

CKPT is a verl FSDP checkpoint folder (default: the synthetic Qwen2-7B-width one that
``benchmarks/bench_merge.py`` caches under ``bench_out/bench/ckpt/``; if there is none, a 1-layer
one (~2.6 GB) is written under ``--workdir`` with ``benchmarks/make_synthetic_checkpoint.py``).
It is merged once with ``hf_merge.merge`` into ``WORKDIR/<ckpt name>/merged`` (reused while the
source is unchanged), then each load runs in a fresh interpreter, alternating the two, ``--repeat`` times:

  from_sharded_pretrained   ``AutoModelForCausalLM.from_sharded_pretrained(CKPT, dtype=...)``
  from_pretrained           ``AutoModelForCausalLM.from_pretrained(WORKDIR/<ckpt name>/merged, dtype=...)``

``--floor`` adds the copy floor: the rank files' bytes ``preadv``-ed into fresh ``torch.empty``
buffers (page cache to anonymous memory, nothing else), on 1 and on 2 threads, in fresh
interpreters like the loads. ``--code NAME=DIR`` adds ``from_sharded_pretrained`` as imported from
another tree of hf_merge (``git archive COMMIT | tar -x -C DIR``), for A/B runs of two versions;
every run of a round is interleaved, the order rotating each round.

Before each load the input files are read once (warm page cache for both). Inside the child a
thread samples ``/proc/self/status`` every 5 ms: ``RssAnon`` (anonymous memory: tensors, heap;
memory-mapped file pages excluded) and ``VmRSS`` (includes them). Wall time is the load call
alone (imports excluded, measured separately); CPU is user + system seconds of the process
(``os.times``, all threads) over the same span. Each child also fingerprints every tensor
(float64 sum and a sample of bytes); both loads must agree. Prints a markdown table with the
median time, the worst peaks, and the targets: load + first forward <= 1.5x from_pretrained's, peak anon <=
1.1x model + 512 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_CKPT = REPO / "bench_out" / "bench" / "ckpt" / "qwen2-7b-shaped-L2-ws4"
DEFAULT_WORKDIR = REPO / "bench_out" / "load"
MB = 1e6


# --------------------------------------------------------------------------- the child


class _Sampler(threading.Thread):
    """Peak RssAnon / VmRSS of this process, from /proc/self/status every ``interval`` s."""

    def __init__(self, interval: float = 0.005):
        super().__init__(daemon=True)
        self.interval = interval
        self.peak_anon = self.peak_rss = 0
        self._done = threading.Event()

    @staticmethod
    def read() -> tuple[int, int]:
        anon = rss = 0
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        return anon, rss

    def sample(self) -> None:
        anon, rss = self.read()
        self.peak_anon, self.peak_rss = max(self.peak_anon, anon), max(self.peak_rss, rss)

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            time.sleep(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.sample()


def _fingerprint(model) -> dict[str, list]:
    import torch

    out = {}
    for name, t in list(model.state_dict().items()):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        out[name] = [str(t.dtype), list(t.shape), float(t.double().sum()), flat[::step].float().tolist()[:64]]
    return out


def _sync(device_map: str | None) -> None:
    import torch

    if device_map and device_map != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


def child(tool: str, source: str, dtype: str, fingerprint_path: str | None, device_map: str | None = None) -> dict:
    t_import = time.perf_counter()
    import torch
    import transformers
    import hf_merge.load.auto

    hf_merge.load.auto.install()
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    import_s = time.perf_counter() - t_import
    if device_map and device_map != "cpu":  # CUDA's start-up and cuBLAS's first call are not the load's
        x = torch.ones(256, 256, device="cuda")
        (x @ x).sum().item()
        _sync(device_map)
    kwargs = {"device_map": device_map} if device_map else {}
    baseline_anon, baseline_rss = _Sampler.read()
    sampler = _Sampler()
    sampler.start()
    c0, t0 = os.times(), time.perf_counter()
    if tool.startswith("from_sharded_pretrained"):
        model = AutoModelForCausalLM.from_sharded_pretrained(source, dtype=dtype, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    _sync(device_map)
    wall, c1 = time.perf_counter() - t0, os.times()
    load_peak_anon, load_peak_rss = sampler.peak_anon, sampler.peak_rss
    # First use: a forward pass over 8 tokens touches every weight. from_pretrained's weights are
    # memory-mapped file pages that are only read now; ours were read during the load.
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    t1 = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids)
    _sync(device_map)
    forward, c2 = time.perf_counter() - t1, os.times()
    sampler.stop()
    seen = set()
    model_bytes = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            model_bytes += t.numel() * t.element_size()
    result = {
        "tool": tool,
        "wall_s": wall,
        "forward_s": forward,
        "cpu_s": _cpu(c0, c1),
        "forward_cpu_s": _cpu(c1, c2),
        "sys_s": c1.system - c0.system,
        "import_s": import_s,
        "load_peak_anon": load_peak_anon,
        "load_peak_rss": load_peak_rss,
        "peak_anon": sampler.peak_anon,
        "peak_rss": sampler.peak_rss,
        "baseline_anon": baseline_anon,
        "baseline_rss": baseline_rss,
        "model_bytes": model_bytes,
        "class": type(model).__name__,
        "dtype": str(model.dtype),
    }
    if fingerprint_path:
        Path(fingerprint_path).write_text(json.dumps(_fingerprint(model)))
    return result


def _cpu(a, b) -> float:
    return (b.user - a.user) + (b.system - a.system)


def floor_child(source: str, threads: int) -> dict:
    """The copy floor: every rank file read with ``preadv`` into one fresh ``torch.empty`` buffer
    each (the files split over ``threads`` threads); wall, CPU and system seconds."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    files = sorted(Path(source).glob("*.pt"))

    def read(path: Path) -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            view = memoryview(torch.empty(size, dtype=torch.uint8).numpy())
            done = 0
            while done < size:
                done += os.preadv(fd, [view[done : done + (256 << 20)]], done)
            return size
        finally:
            os.close(fd)

    c0, t0 = os.times(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, files))
    wall, c1 = time.perf_counter() - t0, os.times()
    return {"tool": f"preadv floor ({threads} thread{'s' if threads > 1 else ''})", "wall_s": wall, "forward_s": 0.0,
            "cpu_s": _cpu(c0, c1), "forward_cpu_s": 0.0, "sys_s": c1.system - c0.system, "bytes": total}


# --------------------------------------------------------------------------- the parent


def warm_cache(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in (".pt", ".safetensors", ".distcp"):
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass


def ensure_checkpoint(ckpt: Path | None, workdir: Path) -> Path:
    if ckpt is not None:
        if not ckpt.is_dir():
            sys.exit(f"error: {ckpt} is not a folder")
        return ckpt
    if DEFAULT_CKPT.is_dir() and (DEFAULT_CKPT / "fsdp_config.json").is_file():
        return DEFAULT_CKPT
    own = workdir / "ckpt-L1"
    if not (own / "synthetic.json").is_file():
        print(f"writing a synthetic 1-layer checkpoint to {own} ...", file=sys.stderr, flush=True)
        subprocess.run(
            [sys.executable, str(BENCH_DIR / "make_synthetic_checkpoint.py"), str(own), "--layers", "1"], check=True
        )
    return own


def _weight_files(ckpt: Path) -> list[Path]:
    return [p for p in ckpt.iterdir() if p.suffix in (".pt", ".distcp")]


def ensure_merged(ckpt: Path, workdir: Path, dtype: str) -> Path:
    import hf_merge

    merged = workdir / ckpt.name / "merged"
    stamp = {
        "source": str(ckpt.resolve()),
        "dtype": dtype,
        "mtimes": {p.name: p.stat().st_mtime for p in sorted(_weight_files(ckpt))},
    }
    stamp_file = workdir / ckpt.name / "merged.json"
    if merged.is_dir() and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return merged
    print(f"merging {ckpt} -> {merged} ...", file=sys.stderr, flush=True)
    merged.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    hf_merge.merge(ckpt, merged, dtype=dtype, overwrite=True)
    print(f"merged in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    stamp_file.write_text(json.dumps(stamp))
    return merged


def run_child(tool: str, source: Path, dtype: str, fingerprint: Path | None, code: Path = REPO,
              device_map: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", tool, str(source), "--dtype", dtype]
    if device_map:
        cmd += ["--device-map", device_map]
    if fingerprint:
        cmd += ["--fingerprint", str(fingerprint)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")])))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"error: {tool} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def compare(a: Path, b: Path) -> tuple[bool, str]:
    fa, fb = json.loads(a.read_text()), json.loads(b.read_text())
    if fa.keys() != fb.keys():
        return False, f"different tensors: {sorted(fa.keys() ^ fb.keys())[:5]}"
    bad = [k for k in fa if fa[k] != fb[k]]
    return (not bad), (f"{len(bad)} tensors differ, e.g. {bad[:3]}" if bad else f"all {len(fa)} tensors equal")


def table(rows: list[dict], model_bytes: int, tools: list[str]) -> str:
    def med(tool: str, key) -> float:
        return statistics.median(key(r) for r in rows if r["tool"] == tool)

    ref_load = med("from_pretrained", lambda r: r["wall_s"])
    ref_total = med("from_pretrained", lambda r: r["wall_s"] + r["forward_s"])
    ref_cpu = med("from_pretrained", lambda r: r["cpu_s"] + r["forward_cpu_s"])
    budget = 1.1 * model_bytes + 512 * 2**20
    lines = [
        "| load | load s (median) | load runs | x | load + 1st forward s | x | CPU s load + forward (of it system) | x "
        "| peak anon MB (load / +forward) | anon - baseline MB | peak RSS MB (load / +forward) | anon <= 1.1x model + 512 MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tool in tools:
        rs = [r for r in rows if r["tool"] == tool]
        load = med(tool, lambda r: r["wall_s"])
        total = med(tool, lambda r: r["wall_s"] + r["forward_s"])
        cpu = med(tool, lambda r: r["cpu_s"] + r["forward_cpu_s"])
        sys_s = med(tool, lambda r: r["sys_s"])
        runs = ", ".join(f"{r['wall_s']:.2f}" for r in rs)
        head = (
            f"| {tool} | {load:.2f} | {runs} | {load / ref_load:.2f} | {total:.2f} | {total / ref_total:.2f} "
            f"| {cpu:.2f} ({sys_s:.2f}) | {cpu / ref_cpu:.2f} "
        )
        if "peak_anon" not in rs[0]:  # the copy floor
            lines.append(head + "| | | | |")
            continue
        anon = max(r["peak_anon"] for r in rs)
        delta = max(r["peak_anon"] - r["baseline_anon"] for r in rs)
        ok = "ok" if anon <= budget else "OVER"
        lines.append(
            head + f"| {max(r['load_peak_anon'] for r in rs) / MB:,.0f} / {anon / MB:,.0f} | "
            f"{delta / MB:,.0f} | {max(r['load_peak_rss'] for r in rs) / MB:,.0f} / {max(r['peak_rss'] for r in rs) / MB:,.0f} | "
            f"{ok} ({budget / MB:,.0f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", nargs="?", type=Path, help=f"verl FSDP checkpoint folder (default {DEFAULT_CKPT})")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--dtype", default="bfloat16", help="load dtype for both (default bfloat16)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--floor", action="store_true", help="also time the preadv copy floor on 1 and 2 threads")
    p.add_argument("--code", action="append", default=[], metavar="NAME=DIR",
                   help="also run from_sharded_pretrained from the hf_merge tree in DIR (repeatable)")
    p.add_argument("--device-map", default=None, help="device_map for both loads, e.g. cuda (default: none, the CPU)")
    p.add_argument("--child", nargs=2, metavar=("TOOL", "SOURCE"), help=argparse.SUPPRESS)
    p.add_argument("--fingerprint", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        tool, source = a.child
        if tool.startswith("floor"):
            print(json.dumps(floor_child(source, int(tool[len("floor"):]))))
        else:
            print(json.dumps(child(tool, source, a.dtype, a.fingerprint, a.device_map)))
        return 0

    codes = {"from_sharded_pretrained": REPO}
    for item in a.code:
        name, sep, folder = item.partition("=")
        if not sep or not (Path(folder) / "hf_merge" / "__init__.py").is_file():
            sys.exit(f"error: --code {item}: expected NAME=DIR with DIR/hf_merge/")
        codes[f"from_sharded_pretrained@{name}"] = Path(folder).resolve()
    a.workdir.mkdir(parents=True, exist_ok=True)
    ckpt = ensure_checkpoint(a.ckpt, a.workdir)
    merged = ensure_merged(ckpt, a.workdir, a.dtype)
    tools = list(codes) + ["from_pretrained"] + (["floor1", "floor2"] if a.floor else [])
    loads = [os.getloadavg()[0]]
    if loads[0] > 1.5:
        print(f"warning: load average {loads[0]:.1f}: timings are noisy on a busy machine", file=sys.stderr)
    rows = []
    prints = {}
    for i in range(a.repeat):
        order = tools[i % len(tools):] + tools[: i % len(tools)]
        for tool in order:
            source = merged if tool == "from_pretrained" else ckpt
            warm_cache(source)
            fp = merged.parent / f"fingerprint-{tool}.json" if i == 0 and not tool.startswith("floor") else None
            r = run_child(tool, source, a.dtype, fp, codes.get(tool, REPO), a.device_map)
            if fp:
                prints[tool] = fp
            rows.append(r)
            loads.append(os.getloadavg()[0])
            print(
                f"  run {i + 1} {r['tool']}: {r['wall_s']:.2f} s + forward {r['forward_s']:.2f} s, CPU {r['cpu_s']:.2f} s "
                f"(system {r['sys_s']:.2f}) + {r['forward_cpu_s']:.2f} s"
                + (f", peak anon {r['peak_anon'] / MB:,.0f} MB, peak RSS {r['peak_rss'] / MB:,.0f} MB" if "peak_anon" in r else ""),
                file=sys.stderr,
                flush=True,
            )
    details = [compare(prints[t], prints["from_pretrained"]) for t in codes]
    equal = all(ok for ok, _ in details)
    loaded = [r for r in rows if "model_bytes" in r]
    model_bytes = loaded[0]["model_bytes"]
    src_bytes = sum(f.stat().st_size for f in _weight_files(ckpt))
    print(
        f"\n{ckpt} ({src_bytes / 1e9:.2f} GB of rank files), device_map {a.device_map or 'none (CPU)'} -> {loaded[0]['class']} in {loaded[0]['dtype']}, "
        f"model {model_bytes / MB:,.0f} MB; imports {statistics.median(r['import_s'] for r in loaded):.1f} s (not counted); "
        f"{os.cpu_count()} CPUs, load average {min(loads):.1f}-{max(loads):.1f} (1 min, sampled after each run)\n"
    )
    names = {"floor1": "preadv floor (1 thread)", "floor2": "preadv floor (2 threads)"}
    for r in rows:
        r["tool"] = names.get(r["tool"], r["tool"])
    print(table(rows, model_bytes, [names.get(t, t) for t in tools]))
    print(f"\nsame weights: {'yes' if equal else 'NO'} ({'; '.join(d for _, d in details)})")
    (merged.parent / "results.json").write_text(json.dumps({"ckpt": str(ckpt), "rows": rows, "equal": equal}, indent=2))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
