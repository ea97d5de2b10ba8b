#!/usr/bin/env python
"""Benchmark ``from_sharded_pretrained`` against ``from_pretrained`` of the merged folder.

    .venv/bin/python benchmarks/bench_load.py [CKPT] [--config DIR] [--repeat 3] [--dtype bfloat16] [--floor]
                                              [--breakdown] [--code NAME=DIR ...]

CKPT is a checkpoint folder of any format hf_merge reads (verl FSDP, Megatron, DeepSpeed, DCP...;
``--config DIR`` when it has no Hugging Face config of its own, passed to both ``merge`` and
``from_sharded_pretrained``). Default: the synthetic Qwen2-7B-width verl FSDP one that
``benchmarks/bench_merge.py`` caches under ``bench_out/bench/ckpt/``; if there is none, a 1-layer
one (~2.6 GB) is written under ``--workdir`` with ``benchmarks/make_synthetic_checkpoint.py``).
It is merged once with ``hf_merge.merge`` into ``WORKDIR/<ckpt name>/merged`` (reused while the
source is unchanged), then each load runs in a fresh interpreter, alternating the two, ``--repeat`` times:

  from_sharded_pretrained   ``AutoModelForCausalLM.from_sharded_pretrained(CKPT, dtype=...)``
  from_pretrained           ``AutoModelForCausalLM.from_pretrained(WORKDIR/<ckpt name>/merged, dtype=...)``

``--breakdown`` adds one more run of each load (not in the timed rows) that says where the time
goes: the main thread under cProfile (open and plan, the model's construction on the meta device,
the fill, transformers' finishing steps) and, in the fill's worker threads, thread-seconds spent in
each reader's and transform's ``read_into`` (self time: a cast view's own time is the cast) and in
mapping pages.

``--no-crc-row`` adds ``from_sharded_pretrained(source_crc=False)``: the load without the CRC-32
check of the zip records (torch.save files), which reads every mapped byte once.

``--warm-imports`` imports ``transformers.modeling_utils`` and the model's modeling module in
each child before the timed call (as a second load in the same process finds them): what is left
when there is no import for the load to overlap its reads with. Every ``from_sharded_pretrained``
child also times its ``_resolve_model_class`` call (the first import of the model's code, when
not warm), printed below the table: whether the reads beside it slowed the import down.

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
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from hf_merge.transformers_compat import dtype_kwargs

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_CKPT = REPO / "bench_out" / "bench" / "ckpt" / "qwen2-7b-shaped-L2-ws4"
DEFAULT_WORKDIR = REPO / "bench_out" / "load"
MB = 1e6
NO_CRC = " (source_crc=False)"


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


class _ThreadTimes:
    """Self thread-seconds of every ``read_into`` / ``read_rows`` of the readers and transforms and of
    ``Mapper.tensor``, summed over the threads that call them (the fill's worker threads, which
    cProfile does not see). A method's self time excludes the nested calls timed here: a cast view's
    self time is the cast, a reader's the bytes it reads."""

    def __init__(self):
        self.self_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def wrap(self, owner, attr: str, label: str) -> None:
        fn = vars(owner)[attr]
        times = self

        def timed(*args, **kwargs):
            stack = times._local.__dict__.setdefault("stack", [])
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                nested = stack.pop()
                if stack:
                    stack[-1] += elapsed
                with times._lock:
                    times.self_s[label] = times.self_s.get(label, 0.0) + elapsed - nested
                    times.calls[label] = times.calls.get(label, 0) + 1

        setattr(owner, attr, timed)

    def install(self) -> None:
        import importlib
        import pkgutil

        import hf_merge.readers
        import hf_merge.transforms
        from hf_merge.checkpoint import LazyCheckpoint
        from hf_merge.load.page_mapper import Mapper

        for pkg in (hf_merge.readers, hf_merge.transforms):
            for info in pkgutil.iter_modules(pkg.__path__):
                with contextlib.suppress(Exception):
                    importlib.import_module(f"{pkg.__name__}.{info.name}")
        seen, todo = set(), [LazyCheckpoint]
        while todo:
            cls = todo.pop()
            for sub in cls.__subclasses__():
                if sub not in seen:
                    seen.add(sub)
                    todo.append(sub)
        for cls in seen:
            for attr in ("read_into", "read_rows"):
                if attr in cls.__dict__:
                    self.wrap(cls, attr, f"{cls.__name__}.{attr}")
        self.wrap(Mapper, "tensor", "Mapper.tensor (mapping pages)")
        from hf_merge.readers import record_crc

        self.wrap(record_crc, "_crc", "record_crc._crc (CRC-32 of the zip records)")


# main-thread phases, by (file name ending, function name); cumulative seconds under cProfile
_PHASES = [
    ("imports (modules first used by the load)", "<frozen importlib._bootstrap>", "_find_and_load"),
    ("open the checkpoint", "hf_merge/checkpoint.py", "open_checkpoint"),
    ("config + transform stack", "hf_merge/load/model.py", "_load_config"),
    ("config + transform stack", "hf_merge/transforms/views.py", "model_view"),
    ("config + transform stack", "hf_merge/load/model.py", "_resolve_model_class"),
    ("model on meta (ours)", "hf_merge/load/model.py", "_meta_model"),
    ("plan + checks", "hf_merge/load/model.py", "plan_load"),
    ("plan + checks", "hf_merge/load/model.py", "_check_plan"),
    ("fill (wall)", "hf_merge/load/model.py", "_fill"),
    ("finish (transformers)", "hf_merge/load/model.py", "_finalize"),
    ("config (transformers)", "transformers/configuration_utils.py", "from_pretrained"),
    ("model construction (transformers)", "transformers/modeling_utils.py", "_from_config"),
    ("weights (transformers)", "transformers/modeling_utils.py", "_load_pretrained_model"),
    ("finish (transformers)", "transformers/modeling_utils.py", "_finalize_model_loading"),
    ("safetensors metadata (transformers)", "transformers/modeling_utils.py", "_get_resolved_checkpoint_files"),
    ("weights (transformers)", "transformers/core_model_loading.py", "convert_and_load_state_dict_in_model"),
]


def _phases(stats) -> dict[str, float]:
    """Cumulative main-thread seconds per phase (the largest of a phase's functions when several
    nest), plus the model's construction: the outermost ``__init__`` of a ``modeling_*.py`` class."""
    out: dict[str, float] = {}
    construction = 0.0
    for (filename, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
        filename = filename.replace(os.sep, "/")
        for phase, tail, name in _PHASES:
            if func == name and filename.endswith(tail):
                out[phase] = out.get(phase, 0.0) + ct
        if func == "__init__" and "/models/" in filename and Path(filename).name.startswith("modeling_"):
            construction = max(construction, ct)
    out["model __init__ (either)"] = construction
    return out


def _warm_imports(config_dir: str) -> None:
    """Import what a first load imports: ``transformers.modeling_utils`` and the causal-LM class of
    the model in ``config_dir`` (its modeling module)."""
    import transformers
    import transformers.modeling_utils  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(transformers.AutoConfig.from_pretrained(config_dir))]


class _ClassTimer:
    """Seconds spent in ``hf_merge.load.model._resolve_model_class`` (either tree's)."""

    def __init__(self):
        import hf_merge.load.model as model

        self.seconds = 0.0
        real = model._resolve_model_class

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        model._resolve_model_class = timed


def child(tool: str, source: str, dtype: str, fingerprint_path: str | None, device_map: str | None = None,
          config: str | None = None, breakdown_path: str | None = None, warm_from: str | None = None) -> dict:
    t_import = time.perf_counter()
    import torch
    import transformers
    import hf_merge.load.auto

    hf_merge.load.auto.install()
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    if warm_from:
        _warm_imports(warm_from)
    import_s = time.perf_counter() - t_import
    class_timer = _ClassTimer() if tool.startswith("from_sharded_pretrained") else None
    if device_map and device_map != "cpu":  # CUDA's start-up and cuBLAS's first call are not the load's
        x = torch.ones(256, 256, device="cuda")
        (x @ x).sum().item()
        _sync(device_map)
    kwargs = {"device_map": device_map} if device_map else {}
    if config and tool.startswith("from_sharded_pretrained"):
        kwargs["config"] = config
    if tool.endswith(NO_CRC):
        kwargs["source_crc"] = False
    profiler = thread_times = None
    if breakdown_path:
        import cProfile

        thread_times = _ThreadTimes()
        thread_times.install()
        profiler = cProfile.Profile()
        profiler.enable()
    baseline_anon, baseline_rss = _Sampler.read()
    sampler = _Sampler()
    sampler.start()
    c0, t0 = os.times(), time.perf_counter()
    if tool.startswith("from_sharded_pretrained"):
        model = AutoModelForCausalLM.from_sharded_pretrained(source, dtype=dtype, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, **dtype_kwargs(dtype), **kwargs)
    _sync(device_map)
    wall, c1 = time.perf_counter() - t0, os.times()
    if profiler is not None:
        import pstats

        profiler.disable()
        profiler.dump_stats(f"{breakdown_path}.prof")  # for a closer look: python -m pstats FILE
        phases = _phases(pstats.Stats(profiler))
        Path(breakdown_path).write_text(json.dumps({
            "tool": tool, "wall_s": wall, "cpu_s": _cpu(c0, c1), "main_thread": phases,
            "threads_self_s": thread_times.self_s, "threads_calls": thread_times.calls,
        }))
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
    if class_timer is not None:
        result["class_s"] = class_timer.seconds
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

    files = _weight_files(Path(source))

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
    """The files that hold the weights (in subfolders too: Megatron's dist_ckpt, DeepSpeed's global_step)."""
    return sorted(p for p in ckpt.rglob("*") if p.suffix in (".pt", ".distcp", ".bin", ".safetensors") and p.is_file())


def ensure_merged(ckpt: Path, workdir: Path, dtype: str, config: Path | None = None) -> Path:
    import hf_merge

    merged = workdir / ckpt.name / "merged"
    stamp = {
        "source": str(ckpt.resolve()),
        "dtype": dtype,
        "config": str(config.resolve()) if config else None,
        "mtimes": {p.name: p.stat().st_mtime for p in sorted(_weight_files(ckpt))},
    }
    stamp_file = workdir / ckpt.name / "merged.json"
    if merged.is_dir() and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return merged
    print(f"merging {ckpt} -> {merged} ...", file=sys.stderr, flush=True)
    merged.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    hf_merge.merge(ckpt, merged, dtype=dtype, overwrite=True, **({"config": config} if config else {}))
    print(f"merged in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    stamp_file.write_text(json.dumps(stamp))
    return merged


def run_child(tool: str, source: Path, dtype: str, fingerprint: Path | None, code: Path = REPO,
              device_map: str | None = None, config: Path | None = None, breakdown: Path | None = None,
              warm_from: Path | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", tool, str(source), "--dtype", dtype]
    if warm_from:
        cmd += ["--warm-from", str(warm_from)]
    if device_map:
        cmd += ["--device-map", device_map]
    if config:
        cmd += ["--config", str(config)]
    if breakdown:
        cmd += ["--breakdown-out", str(breakdown)]
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


def breakdown_table(breakdowns: dict[str, dict]) -> str:
    """Where the time goes: main-thread phases (cumulative s under cProfile, which slows Python
    code) and the fill's worker threads (self thread-seconds, summed over threads)."""
    tools = list(breakdowns)
    lines = ["| where (profiled run) | " + " | ".join(tools) + " |", "|---" * (len(tools) + 1) + "|"]
    lines.append("| load wall / CPU s (profiled) | " + " | ".join(
        f"{b['wall_s']:.2f} / {b['cpu_s']:.2f}" for b in breakdowns.values()) + " |")
    phases = list(dict.fromkeys(p for p, _, _ in _PHASES)) + ["model __init__ (either)"]
    for phase in phases:
        cells = [b["main_thread"].get(phase) for b in breakdowns.values()]
        if any(cells):
            lines.append(f"| main thread: {phase} | " + " | ".join(f"{c:.2f}" if c else "" for c in cells) + " |")
    labels = sorted({k for b in breakdowns.values() for k in b["threads_self_s"]},
                    key=lambda k: -max(b["threads_self_s"].get(k, 0.0) for b in breakdowns.values()))
    for label in labels:
        cells = [(b["threads_self_s"].get(label), b["threads_calls"].get(label)) for b in breakdowns.values()]
        if max(c[0] or 0.0 for c in cells) >= 0.005:
            lines.append(f"| threads: {label} | " + " | ".join(
                f"{s:.2f} ({n} calls)" if s is not None else "" for s, n in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", nargs="?", type=Path, help=f"checkpoint folder, any format (default {DEFAULT_CKPT})")
    p.add_argument("--config", type=Path, default=None,
                   help="folder with config.json for a checkpoint without one (DeepSpeed): given to merge and to from_sharded_pretrained")
    p.add_argument("--breakdown", action="store_true",
                   help="one more run of each load, profiled: where the time goes (not in the timed rows)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--dtype", default="bfloat16", help="load dtype for both (default bfloat16)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-crc-row", action="store_true",
                   help="also run from_sharded_pretrained(source_crc=False): the load without the CRC-32 check of zip records")
    p.add_argument("--floor", action="store_true", help="also time the preadv copy floor on 1 and 2 threads")
    p.add_argument("--code", action="append", default=[], metavar="NAME=DIR",
                   help="also run from_sharded_pretrained from the hf_merge tree in DIR (repeatable)")
    p.add_argument("--warm-imports", action="store_true",
                   help="import transformers.modeling_utils and the model's modeling module before each timed load")
    p.add_argument("--device-map", default=None, help="device_map for both loads, e.g. cuda (default: none, the CPU)")
    p.add_argument("--child", nargs=2, metavar=("TOOL", "SOURCE"), help=argparse.SUPPRESS)
    p.add_argument("--fingerprint", help=argparse.SUPPRESS)
    p.add_argument("--breakdown-out", help=argparse.SUPPRESS)
    p.add_argument("--warm-from", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        tool, source = a.child
        if tool.startswith("floor"):
            print(json.dumps(floor_child(source, int(tool[len("floor"):]))))
        else:
            print(json.dumps(child(tool, source, a.dtype, a.fingerprint, a.device_map,
                                   str(a.config) if a.config else None, a.breakdown_out, a.warm_from)))
        return 0

    codes = {"from_sharded_pretrained": REPO}
    for item in a.code:
        name, sep, folder = item.partition("=")
        if not sep or not (Path(folder) / "hf_merge" / "__init__.py").is_file():
            sys.exit(f"error: --code {item}: expected NAME=DIR with DIR/hf_merge/")
        codes[f"from_sharded_pretrained@{name}"] = Path(folder).resolve()
    a.workdir.mkdir(parents=True, exist_ok=True)
    ckpt = ensure_checkpoint(a.ckpt, a.workdir)
    merged = ensure_merged(ckpt, a.workdir, a.dtype, a.config)
    if a.no_crc_row:
        codes["from_sharded_pretrained" + NO_CRC] = REPO
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
            r = run_child(tool, source, a.dtype, fp, codes.get(tool, REPO), a.device_map, a.config,
                          warm_from=merged if a.warm_imports else None)
            if fp:
                prints[tool] = fp
            rows.append(r)
            loads.append(os.getloadavg()[0])
            print(
                f"  run {i + 1} {r['tool']}: {r['wall_s']:.2f} s + forward {r['forward_s']:.2f} s, CPU {r['cpu_s']:.2f} s "
                f"(system {r['sys_s']:.2f}) + {r['forward_cpu_s']:.2f} s"
                + (f", peak anon {r['peak_anon'] / MB:,.0f} MB, peak RSS {r['peak_rss'] / MB:,.0f} MB" if "peak_anon" in r else "")
                + (f", model class {r['class_s']:.2f} s" if "class_s" in r else ""),
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
        f"{os.cpu_count()} CPUs, load average {min(loads):.1f}-{max(loads):.1f} (1 min, sampled after each run)"
        + ("; transformers.modeling_utils and the model's module imported before each timed load (--warm-imports)"
           if a.warm_imports else "") + "\n"
    )
    names = {"floor1": "preadv floor (1 thread)", "floor2": "preadv floor (2 threads)"}
    for r in rows:
        r["tool"] = names.get(r["tool"], r["tool"])
    print(table(rows, model_bytes, [names.get(t, t) for t in tools]))
    print(f"\nsame weights: {'yes' if equal else 'NO'} ({'; '.join(d for _, d in details)})")
    print("in _resolve_model_class (the model code's first import unless warm), median s: " + ", ".join(
        f"{t} {statistics.median(r['class_s'] for r in rows if r['tool'] == t):.2f}" for t in codes))
    breakdowns = {}
    if a.breakdown:
        for tool in [t for t in tools if not t.startswith("floor")]:
            source = merged if tool == "from_pretrained" else ckpt
            warm_cache(source)
            out = merged.parent / f"breakdown-{tool}.json"
            run_child(tool, source, a.dtype, None, codes.get(tool, REPO), a.device_map, a.config, out,
                      warm_from=merged if a.warm_imports else None)
            breakdowns[tool] = json.loads(out.read_text())
        print("\n" + breakdown_table(breakdowns))
    (merged.parent / "results.json").write_text(json.dumps(
        {"ckpt": str(ckpt), "rows": rows, "equal": equal, "breakdown": breakdowns}, indent=2))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
