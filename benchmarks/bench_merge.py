#!/usr/bin/env python
"""Benchmark `hf-merge merge` against a raw copy of the same bytes and against verl's own merger.

    make bench                                   # = .venv/bin/python benchmarks/bench_merge.py
    .venv/bin/python benchmarks/bench_merge.py --sizes 2 --skip-verl

For each size (number of decoder layers of a Qwen2-7B-shaped bf16 model: 2 ~3.1 GB, 8 ~5.9 GB)
a synthetic verl FSDP checkpoint of real DTensors (4 ranks) is created once and cached under
--workdir. Then, in the same run and on the same checkpoint:

  copy     `cat model_world_size_4_rank_*.pt > copy.bin`: the raw cost of moving those bytes
  hf-merge `python -m hf_merge.cli.app merge SRC DST --overwrite`
  verl     `python -m verl.model_merger merge --backend fsdp --local_dir SRC --target_dir DST`
           (verl 0.9.1 in its own venv, see benchmarks/setup_verl.sh)

Every measurement starts on a warm page cache (the rank files are read once just before it),
after the previous outputs were deleted and `sync`ed, and its wall time ends after an fsync of
every output file (time of that fsync shown separately). Memory is sampled every ~20 ms from
/proc/<pid>/status of the process and all its descendants, summed: RssAnon (anonymous memory;
memory-mapped file pages are not counted, which is why ru_maxrss is not used) and VmRSS (which
does count them), peaks reported for both. When hf-merge and verl both ran, their outputs are
compared tensor by tensor (names, dtype, shape and bytes, via safetensors.safe_open).

Two more modes (same method, same table; results in WORKDIR/results_lora.json / results_megatron.json):

  --lora      a PEFT-wrapped copy of the same model (LoRA r=16, alpha 32 on q,k,v,o,gate,up,down,
              `make_synthetic_checkpoint.py --lora`): cat of its rank files, `hf-merge merge` of the
              plain checkpoint, `hf-merge merge --lora fuse` of the LoRA one (ratio fused / plain
              printed; target <= 1.5x), verl on the LoRA one. Checks: the fused output against
              W + (B@A)*alpha/r from regenerated shards (first and last layer; every layer with
              --verify-source), verl's output against the plain merge and against the fused one.
  --megatron  a Megatron-Core torch_dist checkpoint in verl's v2 layout (TP=4,
              `make_synthetic_megatron.py`): `hf-merge inspect`, cat of the .distcp files,
              `hf-merge merge --backend megatron`, and a byte comparison of the output with the
              fused source as torch's DCP reader loads it (first and last layer + globals).

  --moe qwen3_30b_a3b
              a Qwen3-30B-A3B-shaped FSDP checkpoint (real widths, 128 experts, fused experts in
              transformers 5's in-memory layout, `make_synthetic_checkpoint.py --moe`; --sizes
              default 3 = 4.98 GB): cat, hf-merge, verl 0.9.1, outputs compared tensor by tensor;
              targets printed (wall <= 0.3x verl's, hf-merge peak anon <= 512 MB).

--repeat N runs every measurement N times and keeps the fastest (memory: the largest peak).
--interleave (default and --moe modes) instead runs N rounds of copy, hf-merge, verl (order rotated
each round) and reports each tool's median run, with every round's wall time, CPU seconds
(user + system of the process tree) and ratio to the copy of the same round.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_WORKDIR = REPO / "bench_out" / "bench"
DEFAULT_VERL_VENV = REPO / "bench_out" / "verl-venv"
WORLD = 4
SAMPLE_INTERVAL = 0.02

sys.path.insert(0, str(BENCH_DIR))
import make_synthetic_checkpoint as synth  # noqa: E402


# --------------------------------------------------------------------------- process memory

def _read_ppids() -> dict[int, int]:
    ppids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rfind(b")") + 2:].split()
        ppids[int(entry)] = int(rest[1])
    return ppids


def _status_kb(pid: int) -> tuple[int, int, int]:
    """(RssAnon, VmRSS, RssShmem) in kB; zeros if the process is gone."""
    anon = rss = shmem = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    anon = int(line.split()[1])
                elif line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith(b"RssShmem:"):
                    shmem = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return anon, rss, shmem


class TreeSampler(threading.Thread):
    """Samples the summed RssAnon / VmRSS / RssShmem of a process tree every ~20 ms."""

    def __init__(self, root_pid: int, interval: float = SAMPLE_INTERVAL):
        super().__init__(daemon=True)
        self.root = root_pid
        self.interval = interval
        self.peak_anon_kb = self.peak_rss_kb = self.peak_shmem_kb = 0
        self.max_procs = 0
        self.samples = 0
        self._halt = threading.Event()

    def tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for pid, ppid in _read_ppids().items():
            children.setdefault(ppid, []).append(pid)
        out, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, ()))
        return out

    def sample(self) -> None:
        pids = self.tree()
        anon = rss = shmem = 0
        for pid in pids:
            a, r, s = _status_kb(pid)
            anon += a
            rss += r
            shmem += s
        self.peak_anon_kb = max(self.peak_anon_kb, anon)
        self.peak_rss_kb = max(self.peak_rss_kb, rss)
        self.peak_shmem_kb = max(self.peak_shmem_kb, shmem)
        self.max_procs = max(self.max_procs, len(pids))
        self.samples += 1

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


# --------------------------------------------------------------------------- measurements

@dataclass
class Result:
    size: str
    tool: str
    command: str
    ok: bool = False
    returncode: int | None = None
    wall_s: float = 0.0          # process run time + fsync of the outputs
    run_s: float = 0.0
    fsync_s: float = 0.0
    peak_anon_mb: float = 0.0
    peak_rss_mb: float = 0.0
    peak_shmem_mb: float = 0.0
    max_procs: int = 0
    samples: int = 0
    output_bytes: int = 0
    cpu_s: float = 0.0           # user + system seconds of the process tree (reaped children)
    log: str = ""
    notes: list[str] = field(default_factory=list)


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_tree(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dirs = [path.parent] if path.is_file() else [path, path.parent]
    for d in dirs:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def warm_cache(files: list[Path]) -> float:
    """Read the files once so that every measurement starts on a warm page cache."""
    t0 = time.perf_counter()
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - t0


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def measure(size: str, tool: str, argv: list[str], output: Path, log_path: Path,
            inputs: list[Path], env: dict | None = None, fsync: bool = True) -> Result:
    cmd_str = shlex.join(argv)
    res = Result(size=size, tool=tool, command=cmd_str, log=str(log_path))
    remove(output)
    os.sync()  # flush the previous run's dirty pages now, not during this measurement
    warm_cache(inputs)
    load1 = os.getloadavg()[0]
    if load1 > 1.0:
        res.notes.append(f"machine busy before the run (1-min load average {load1:.1f}): timings are noisy")
    print(f"  [{tool}] (load {load1:.1f}) {cmd_str}", flush=True)
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env, start_new_session=True)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        try:
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            sampler.stop()
        t1 = time.perf_counter()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    res.cpu_s = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    res.returncode = rc
    res.run_s = t1 - t0
    if rc == 0 and output.exists():
        if fsync:
            t2 = time.perf_counter()
            fsync_tree(output)
            res.fsync_s = time.perf_counter() - t2
        res.ok = True
        res.output_bytes = dir_bytes(output)
    else:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        res.notes.append(f"failed rc={rc}; log {log_path}:\n    " + "\n    ".join(tail))
    res.wall_s = res.run_s + res.fsync_s
    res.peak_anon_mb = sampler.peak_anon_kb * 1024 / 1e6
    res.peak_rss_mb = sampler.peak_rss_kb * 1024 / 1e6
    res.peak_shmem_mb = sampler.peak_shmem_kb * 1024 / 1e6
    res.max_procs = sampler.max_procs
    res.samples = sampler.samples
    status = "ok" if res.ok else f"FAILED (rc={rc})"
    print(f"  [{tool}] {status}: {res.wall_s:.1f} s (fsync {res.fsync_s:.1f} s), CPU {res.cpu_s:.1f} s, "
          f"peak anon {res.peak_anon_mb:.0f} MB, peak RSS {res.peak_rss_mb:.0f} MB, "
          f"{res.max_procs} proc(s), {res.samples} samples", flush=True)
    return res


def measure_cpu(*args, **kwargs) -> tuple[Result, float]:
    """:func:`measure`, plus the CPU seconds (user + system) of the measured process tree: the
    resource usage of the children reaped during the run. Unlike wall time it barely depends on
    how busy the machine is, so it compares tools run on a loaded machine."""
    res = measure(*args, **kwargs)
    return res, res.cpu_s


def measure_copy_floor(size: str, inputs: list[Path], output: Path, log_path: Path, peer_wall: float | None = None,
                       target: float = 0.3) -> tuple[Result, float]:
    """The copy floor: ``cat`` of exactly ``inputs`` into the one file ``output``, fsynced, measured as
    the tools are (warm page cache, CPU seconds). When the peer's wall is given, a note says whether
    ``target`` x the peer's wall is below this floor (then no tool can meet it on this disk)."""
    script = "cat " + " ".join(shlex.quote(str(p)) for p in inputs) + " > " + shlex.quote(str(output))
    res, cpu = measure_cpu(size, "copy floor (cat + fsync)", ["bash", "-c", script], output, log_path, inputs)
    remove(output)
    if res.ok and peer_wall:
        goal = target * peer_wall
        res.notes.append(f"{target}x the peer's wall is {goal:.2f} s, the copy floor {res.wall_s:.2f} s "
                         f"({res.wall_s / peer_wall:.2f}x the peer): the target is "
                         + ("below the floor, out of reach on this disk" if goal < res.wall_s else "above the floor"))
        print("  " + res.notes[-1], flush=True)
    return res, cpu


def measure_best(repeat: int, size: str, tool: str, argv: list[str], output: Path, log_path: Path,
                 inputs: list[Path], env: dict | None = None, fsync: bool = True) -> Result:
    """``measure`` ``repeat`` times: the fastest successful run's times, the largest memory peaks."""
    runs = [measure(size, tool, argv, output, log_path, inputs, env=env, fsync=fsync) for _ in range(max(1, repeat))]
    ok = [r for r in runs if r.ok]
    if len(runs) == 1 or not ok:
        return runs[-1]
    best = min(ok, key=lambda r: r.wall_s)
    for attr in ("peak_anon_mb", "peak_rss_mb", "peak_shmem_mb", "max_procs"):
        setattr(best, attr, max(getattr(r, attr) for r in runs))
    best.notes = sorted({n for r in runs for n in r.notes})
    best.notes.append(f"best of {len(runs)} runs: wall " + ", ".join(f"{r.wall_s:.1f}" for r in runs)
                      + " s; memory peaks are the largest over the runs"
                      + ("" if len(ok) == len(runs) else f"; {len(runs) - len(ok)} run(s) failed"))
    return best


# --------------------------------------------------------------------------- output comparison

def safetensors_map(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / fname for name, fname in weight_map.items()}
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for name in h.keys():
                out[name] = f
    return out


def compare_outputs(a: Path, b: Path) -> tuple[bool, str]:
    """Same tensor names, dtypes, shapes and bytes, one tensor at a time."""
    import torch
    from safetensors import safe_open

    ma, mb = safetensors_map(a), safetensors_map(b)
    if set(ma) != set(mb):
        only_a = sorted(set(ma) - set(mb))[:5]
        only_b = sorted(set(mb) - set(ma))[:5]
        return False, f"tensor names differ: only in {a.name}: {only_a}, only in {b.name}: {only_b}"
    handles: dict[Path, object] = {}

    def get(path: Path, name: str):
        if path not in handles:
            handles[path] = safe_open(path, "pt")
        return handles[path].get_tensor(name)

    nbytes = 0
    for name in sorted(ma):
        ta, tb = get(ma[name], name), get(mb[name], name)
        if ta.dtype != tb.dtype or ta.shape != tb.shape:
            return False, f"{name}: {ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)}"
        if not torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)):
            return False, f"{name}: bytes differ"
        nbytes += ta.numel() * ta.element_size()
        del ta, tb
    return True, f"{len(ma)} tensors, {nbytes} bytes identical"


def check_against_source(out: Path, layers: int) -> tuple[bool, str]:
    """Regenerate the synthetic shards and compare the merged output with them (bytes)."""
    import torch
    from safetensors import safe_open

    shapes = synth.param_shapes(layers)
    m = safetensors_map(out)
    if set(m) != set(shapes):
        return False, (f"names differ from the source: missing {sorted(set(shapes) - set(m))[:5]}, "
                       f"extra {sorted(set(m) - set(shapes))[:5]}")
    handles: dict[Path, object] = {}
    for name, shape in shapes.items():
        if m[name] not in handles:
            handles[m[name]] = safe_open(m[name], "pt")
        t = handles[m[name]].get_tensor(name)
        ref = torch.cat([synth.local_shard(name, shape, r, WORLD) for r in range(WORLD)])
        if t.dtype != ref.dtype or t.shape != ref.shape or not torch.equal(
                t.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)):
            return False, f"{name} differs from the source"
    return True, f"{len(shapes)} tensors equal to the source shards"


# --------------------------------------------------------------------------- driver
KINDS = ("fsdp", "lora", "megatron", "moe")
MOE_SHAPE = "qwen3_30b_a3b"


def ckpt_dir(workdir: Path, layers: int, kind: str = "fsdp") -> Path:
    name = {"fsdp": f"qwen2-7b-shaped-L{layers}-ws{WORLD}",
            "moe": f"qwen3-30b-a3b-shaped-L{layers}-ws{WORLD}",
            "lora": f"qwen2-7b-shaped-lora-L{layers}-ws{WORLD}",
            "megatron": f"qwen2-7b-shaped-megatron-L{layers}-tp{WORLD}"}[kind]
    return workdir / "ckpt" / name


def ensure_checkpoint(workdir: Path, layers: int, kind: str = "fsdp") -> tuple[Path, dict]:
    """The cached synthetic checkpoint of ``kind`` (fsdp, lora: PEFT-wrapped FSDP, megatron:
    torch_dist in verl's v2 layout), created on first use."""
    ckpt = ckpt_dir(workdir, layers, kind)
    meta = ckpt / "synthetic.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        if (info.get("layers") == layers and info.get("world_size") == WORLD
                and (kind != "lora" or info.get("lora_r") == synth.LORA_R)
                and (kind != "moe" or info.get("moe") == MOE_SHAPE)):
            info["cached"] = True
            return ckpt, info
    print(f"  creating checkpoint {ckpt} ...", flush=True)
    if kind == "megatron":
        cmd = [sys.executable, str(BENCH_DIR / "make_synthetic_megatron.py"), str(ckpt),
               "--layers", str(layers), "--tp", str(WORLD)]
    else:
        cmd = [sys.executable, str(BENCH_DIR / "make_synthetic_checkpoint.py"), str(ckpt),
               "--layers", str(layers), "--world-size", str(WORLD)] + (["--lora"] if kind == "lora" else [])
        if kind == "moe":
            cmd += ["--moe", MOE_SHAPE]
    subprocess.run(cmd, check=True, cwd=REPO)
    info = json.loads(meta.read_text())
    info["cached"] = False
    return ckpt, info


def input_files(ckpt: Path, kind: str = "fsdp") -> list[Path]:
    """The data files of a checkpoint: what `cat` copies and what is read to warm the cache."""
    if kind == "megatron":
        return sorted((ckpt / "model" / "dist_ckpt").glob("*.distcp"))
    return [ckpt / f"model_world_size_{WORLD}_rank_{r}.pt" for r in range(WORLD)]


def tensor_diff(a: Path, b: Path) -> dict[str, list[str]]:
    """Tensor by tensor (names, dtype, shape, bytes), without stopping at the first difference."""
    import torch
    from safetensors import safe_open

    ma, mb = safetensors_map(a), safetensors_map(b)
    out: dict[str, list[str]] = {"equal": [], "differ": [], "only_a": sorted(set(ma) - set(mb)),
                                 "only_b": sorted(set(mb) - set(ma))}
    handles: dict[Path, object] = {}

    def get(path: Path, name: str):
        if path not in handles:
            handles[path] = safe_open(path, "pt")
        return handles[path].get_tensor(name)

    for name in sorted(set(ma) & set(mb)):
        ta, tb = get(ma[name], name), get(mb[name], name)
        same = ta.dtype == tb.dtype and ta.shape == tb.shape and torch.equal(
            ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8))
        out["equal" if same else "differ"].append(name)
        del ta, tb
    return out


def lora_targets(layers: int) -> list[str]:
    """HF names of the weights LoRA adapts in the synthetic PEFT checkpoint."""
    return sorted(n for n in synth.param_shapes(layers)
                  if n.endswith(".weight") and n.rsplit(".", 2)[-2] in synth.LORA_TARGETS)


def check_lora_fused(out: Path, layers: int, check_layers: list[int]) -> tuple[bool, str]:
    """A fused LoRA merge against the regenerated source shards: every tensor LoRA does not touch
    byte-equal to the source; the adapted weights of ``check_layers`` equal PEFT's
    ``W + (B @ A) * lora_alpha / r`` computed in float32 and rounded once to bf16 (at most one bf16
    ulp apart: row-chunked and whole matmuls may round the float32 sum differently)."""
    import torch
    from safetensors import safe_open

    shapes = synth.param_shapes(layers)
    peft = synth.param_shapes(layers, synth.LORA_R)
    targets = set(lora_targets(layers))
    m = safetensors_map(out)
    if set(m) != set(shapes):
        return False, (f"names differ from the plain model: missing {sorted(set(shapes) - set(m))[:5]}, "
                       f"extra {sorted(set(m) - set(shapes))[:5]}")
    handles: dict[Path, object] = {}

    def got(name: str):
        if m[name] not in handles:
            handles[m[name]] = safe_open(m[name], "pt")
        return handles[m[name]].get_tensor(name)

    def source(name: str, shape) -> "torch.Tensor":
        return torch.cat([synth.local_shard(name, shape, r, WORLD) for r in range(WORLD)])

    scale = synth.LORA_ALPHA / synth.LORA_R
    exact = 0
    fused = checked_elems = identical_elems = changed_elems = 0
    worst = 0.0
    for name, shape in shapes.items():
        if name not in targets:
            t, ref = got(name), source(name, shape)
            if t.dtype != ref.dtype or t.shape != ref.shape or not torch.equal(
                    t.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)):
                return False, f"{name} (not adapted by LoRA) differs from the source"
            exact += 1
            continue
        layer = int(name.split(".")[2])
        if layer not in check_layers:
            continue
        module = synth.PEFT_PREFIX + name[: -len(".weight")]
        w = source(name, shape)
        a_name, b_name = f"{module}.lora_A.default.weight", f"{module}.lora_B.default.weight"
        a, b = source(a_name, peft[a_name]).float(), source(b_name, peft[b_name]).float()
        ref = (w.float() + (b @ a) * scale).to(torch.bfloat16)
        t = got(name)
        if t.dtype != ref.dtype or t.shape != ref.shape:
            return False, f"{name}: {t.dtype}{list(t.shape)} vs {ref.dtype}{list(ref.shape)}"
        diff = (t.float() - ref.float()).abs()
        tol = ref.float().abs() * 2.0 ** -7 + 1e-6  # one bf16 ulp (8 significant bits)
        if bool((diff > tol).any()):
            return False, f"{name}: fused weight off the reference by up to {diff.max().item():.3g}"
        worst = max(worst, diff.max().item())
        checked_elems += t.numel()
        identical_elems += int((t.view(torch.int16) == ref.view(torch.int16)).sum())
        changed_elems += int((t.view(torch.int16) != w.view(torch.int16)).sum())
        fused += 1
        del w, a, b, ref, t, diff, tol
    return True, (f"{exact} tensors LoRA does not adapt byte-equal to the source; {fused} fused weights "
                  f"(layers {check_layers}) = W + (B@A)*{scale:g} within one bf16 ulp "
                  f"({identical_elems / max(checked_elems, 1):.4%} of elements bit-identical to the float32 "
                  f"reference, max |diff| {worst:.2g}); LoRA changed {changed_elems / max(checked_elems, 1):.1%} "
                  "of the elements of those weights")


def describe_adapter(folder: Path) -> str:
    """What a verl / PEFT ``lora_adapter/`` folder holds."""
    from safetensors import safe_open

    cfg_path, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not folder.is_dir():
        return "no lora_adapter/ folder"
    parts = []
    if weights.is_file():
        with safe_open(weights, "pt") as h:
            parts.append(f"{len(list(h.keys()))} tensors in {weights.name} ({weights.stat().st_size / 1e6:.1f} MB)")
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        parts.append(f"adapter_config r={cfg.get('r')} lora_alpha={cfg.get('lora_alpha')} "
                     f"target_modules={sorted(cfg.get('target_modules') or [])}")
    return "; ".join(parts) or "empty lora_adapter/ folder"


class Bench:
    """Shared state of one harness run: what to run, and what was measured and checked."""

    def __init__(self, args: argparse.Namespace, workdir: Path, python: str, fsync: bool,
                 run_hfmerge: bool, run_verl: bool, verl_python: Path):
        self.args, self.workdir, self.python, self.fsync = args, workdir, python, fsync
        self.run_hfmerge, self.run_verl, self.verl_python = run_hfmerge, run_verl, verl_python
        self.results: list[Result] = []
        self.copy_walls: dict[str, float] = {}
        self.checks: list[str] = []
        self.ckpt_info: dict[str, dict] = {}
        self.summary: list[str] = []  # extra section lines (LoRA ratios, Megatron memory vs size)
        self.summary_title = ""

    def out(self, name: str) -> Path:
        return self.workdir / "out" / name

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / name

    def check(self, line: str) -> None:
        print("  " + line, flush=True)
        self.checks.append(line)

    def copy(self, size: str, tool: str, inputs: list[Path], stem: str, repeat: int | None = None) -> Result:
        out = self.out(f"{stem}-copy.bin")
        script = "cat " + " ".join(shlex.quote(str(p)) for p in inputs) + " > " + shlex.quote(str(out))
        r = measure_best(repeat or self.args.repeat, size, tool, ["bash", "-c", script], out,
                         self.log(f"{stem}-copy.log"), inputs, fsync=self.fsync)
        if repeat is None:
            self.results.append(r)
            if r.ok:
                self.copy_walls[size] = r.wall_s
        remove(out)
        return r

    def hfmerge(self, size: str, tool: str, src: Path, stem: str, inputs: list[Path],
                extra: list[str] = (), repeat: int | None = None, fresh_plan: bool = True) -> tuple[Result, Path]:
        out = self.out(f"{stem}-hfmerge")
        cmd = [self.python, "-m", "hf_merge.cli.app", "merge", str(src), str(out), "--overwrite", *extra,
               *shlex.split(self.args.hfmerge_args)]
        # An empty plan cache: run 1 computes the Hub-layout plan (first run), later runs reuse it.
        plans = self.out(f"{stem}-plancache")
        if fresh_plan:
            remove(plans)
        env = dict(os.environ, HF_MERGE_CACHE=str(plans))
        r = measure_best(repeat or self.args.repeat, size, tool, cmd, out, self.log(f"{stem}-hfmerge.log"), inputs,
                         env=env, fsync=self.fsync)
        if repeat is None:
            r.notes.append("hf-merge run 1 starts with an empty plan cache (first run); runs 2+ use the cached Hub-layout plan")
            remove(plans)
            self.results.append(r)
        return r, out

    def verl(self, size: str, tool: str, src: Path, stem: str, inputs: list[Path],
             repeat: int | None = None) -> tuple[Result, Path]:
        out = self.out(f"{stem}-verl")
        cmd = [str(self.verl_python), "-m", "verl.model_merger", "merge", "--backend", "fsdp",
               "--local_dir", str(src), "--target_dir", str(out)]
        r = measure_best(repeat or self.args.repeat, size, tool, cmd, out, self.log(f"{stem}-verl.log"), inputs,
                         fsync=self.fsync)
        if repeat is None:
            self.results.append(r)
        return r, out

    def interleaved(self, size: str, stem: str, src: Path, inputs: list[Path]) -> dict[str, tuple[Result, Path | None]]:
        """--interleave: ``--repeat`` rounds of one copy, one hf-merge and one verl run each, the order
        rotated every round, so that a minute in which this machine's disk is slow hits every tool.
        Per tool: the run with the median wall time (memory: the largest peaks), with every round's
        wall and CPU seconds and the ratio to the copy of the same round in its notes."""
        runs: dict[str, Callable[[], tuple[Result, Path | None]]] = {}
        if not self.args.skip_copy:
            runs["copy (cat)"] = lambda: (self.copy(size, "copy (cat)", inputs, stem, repeat=1), None)
        if self.run_hfmerge:
            plans = self.out(f"{stem}-plancache")
            remove(plans)  # round 1 computes the plan, later rounds reuse it (as measure_best does)
            runs["hf-merge"] = lambda: self.hfmerge(size, "hf-merge", src, stem, inputs, repeat=1, fresh_plan=False)
        if self.run_verl:
            runs["verl 0.9.1"] = lambda: self.verl(size, "verl 0.9.1", src, stem, inputs, repeat=1)
        tools = list(runs)
        per: dict[str, list[Result]] = {t: [] for t in tools}
        outs: dict[str, Path | None] = {}
        rounds = max(1, self.args.repeat)
        for i in range(rounds):
            for tool in tools[i % len(tools):] + tools[: i % len(tools)]:
                r, out = runs[tool]()
                per[tool].append(r)
                outs[tool] = out
                if out is not None and i < rounds - 1 and tool != "hf-merge":
                    remove(out)
        copies = per.get("copy (cat)", [])
        chosen: dict[str, tuple[Result, Path | None]] = {}
        for tool, rs in per.items():
            ok = sorted((r for r in rs if r.ok), key=lambda r: r.wall_s)
            med = ok[(len(ok) - 1) // 2] if ok else rs[-1]
            for attr in ("peak_anon_mb", "peak_rss_mb", "peak_shmem_mb", "max_procs"):
                setattr(med, attr, max(getattr(r, attr) for r in rs))
            med.notes = sorted({n for r in rs for n in r.notes})
            rows = []
            for j, r in enumerate(rs):
                c = copies[j] if j < len(copies) else None
                ratio = f" = {r.wall_s / c.wall_s:.2f}x the copy" if c and c.ok and c.wall_s and r is not c else ""
                rows.append(f"{r.wall_s:.1f} s (CPU {r.cpu_s:.1f} s){ratio}")
            med.notes.append(f"median of {len(rs)} interleaved rounds; per round: " + "; ".join(rows))
            if tool == "hf-merge":
                med.notes.append("hf-merge's round 1 starts with an empty plan cache (first run); later rounds reuse it")
            if tool == "copy (cat)" and med.ok:
                self.copy_walls[size] = med.wall_s
            self.results.append(med)
            chosen[tool] = (med, outs.get(tool))
        remove(self.out(f"{stem}-plancache"))
        return chosen

    def drop(self, *outs: Path) -> None:
        if not self.args.keep_outputs:
            for o in outs:
                remove(o)


def bench_fsdp(b: Bench, layers: int) -> None:
    """The default mode: copy, hf-merge and verl on the plain FSDP checkpoint."""
    args, python = b.args, b.python
    ckpt, info = ensure_checkpoint(b.workdir, layers)
    size = f"L{layers} {info['rank_file_bytes'] / 1e9:.2f} GB"
    b.ckpt_info[size] = info
    print(f"== {size}: {ckpt} ({'cached' if info['cached'] else 'created'}; "
          f"creation took {info['create_seconds']} s)", flush=True)
    inputs = input_files(ckpt)
    outs = {}

    if args.interleave:
        for tool, (r, out) in b.interleaved(size, f"L{layers}", ckpt, inputs).items():
            if r.ok and out is not None:
                outs["verl" if tool.startswith("verl") else tool] = out
    elif not args.skip_copy:
        b.copy(size, "copy (cat)", inputs, f"L{layers}")

    if b.run_hfmerge and not args.interleave:
        out = b.out(f"L{layers}-hfmerge")
        if args.hfmerge_cmd:
            cmd = shlex.split(args.hfmerge_cmd.format(python=python, src=ckpt, dst=out))
            label = "custom (--hfmerge-cmd)"
            r = measure_best(args.repeat, size, label, cmd, out, b.log(f"L{layers}-hfmerge.log"), inputs, fsync=b.fsync)
            b.results.append(r)
        else:
            r, out = b.hfmerge(size, "hf-merge", ckpt, f"L{layers}", inputs)
        if r.ok:
            outs["hf-merge"] = out

    if b.run_verl and not args.interleave:
        r, out = b.verl(size, "verl 0.9.1", ckpt, f"L{layers}", inputs)
        if r.ok:
            outs["verl"] = out

    if "hf-merge" in outs and "verl" in outs:
        t0 = time.perf_counter()
        same, msg = compare_outputs(outs["hf-merge"], outs["verl"])
        b.check(f"{size}: hf-merge vs verl outputs {'EQUAL' if same else 'DIFFER'}: {msg} "
                f"({time.perf_counter() - t0:.0f} s)")
    if args.verify_source:
        for tool, out in outs.items():
            same, msg = check_against_source(out, layers)
            b.check(f"{size}: {tool} output vs source shards {'EQUAL' if same else 'DIFFER'}: {msg}")
    b.drop(*outs.values())


def bench_moe(b: Bench, layers: int) -> None:
    """--moe: copy, hf-merge and verl on a Qwen3-30B-A3B-shaped FSDP checkpoint (fused experts in
    the rank files; both tools write one tensor per expert, the Hub layout)."""
    args = b.args
    ckpt, info = ensure_checkpoint(b.workdir, layers, "moe")
    size = f"L{layers} {info['rank_file_bytes'] / 1e9:.2f} GB"
    b.ckpt_info[size] = info
    print(f"== {size}: {ckpt} (Qwen3-30B-A3B widths, 128 experts; {'cached' if info['cached'] else 'created'}; "
          f"creation took {info['create_seconds']} s)", flush=True)
    inputs = input_files(ckpt)
    stem = f"L{layers}-moe"
    res: dict[str, Result] = {}
    outs: dict[str, Path] = {}
    if args.interleave:
        for tool, (r, out) in b.interleaved(size, stem, ckpt, inputs).items():
            key = "verl" if tool.startswith("verl") else tool
            res[key] = r
            if r.ok and out is not None:
                outs[key] = out
    elif not args.skip_copy:
        b.copy(size, "copy (cat)", inputs, stem)
    if b.run_hfmerge and not args.interleave:
        r, out = b.hfmerge(size, "hf-merge", ckpt, stem, inputs)
        res["hf-merge"] = r
        if r.ok:
            outs["hf-merge"] = out
    if b.run_verl and not args.interleave:
        r, out = b.verl(size, "verl 0.9.1", ckpt, stem, inputs)
        res["verl"] = r
        if r.ok:
            outs["verl"] = out
    for tool, out in outs.items():
        m = safetensors_map(out)
        experts = [n for n in m if ".mlp.experts." in n]
        b.check(f"{size}: {tool} wrote {len(m)} tensors, {len(experts)} of them per-expert "
                f"(e.g. {min(experts) if experts else 'none'}), fused left: "
                f"{sorted(n for n in m if n.endswith(('gate_up_proj', 'experts.down_proj')))[:2]}")
    if "hf-merge" in outs and "verl" in outs:
        t0 = time.perf_counter()
        same, msg = compare_outputs(outs["hf-merge"], outs["verl"])
        b.check(f"{size}: hf-merge vs verl outputs {'EQUAL' if same else 'DIFFER'}: {msg} "
                f"({time.perf_counter() - t0:.0f} s)")
    h, v = res.get("hf-merge"), res.get("verl")
    if h and h.ok:
        b.summary_title = "MoE: targets (wall <= 0.3x verl's, hf-merge peak anon <= 512 MB)"
        if v and v.ok:
            ratio = h.wall_s / v.wall_s
            b.summary.append(f"{size}: wall {h.wall_s:.1f} s / {v.wall_s:.1f} s = {ratio:.2f}x verl's "
                             f"({'met' if ratio <= 0.3 else 'NOT met'})")
        b.summary.append(f"{size}: hf-merge peak anon {h.peak_anon_mb:,.0f} MB "
                         f"({'met' if h.peak_anon_mb <= 512 else 'NOT met'}; {h.max_procs} process(es))"
                         + (f"; verl {v.peak_anon_mb:,.0f} MB" if v and v.ok else ""))
    b.drop(*outs.values())


def bench_lora(b: Bench, layers: int) -> None:
    """--lora: plain merge of the plain checkpoint vs `--lora fuse` of the PEFT one (same model
    plus LoRA on every linear), and verl's merger on the PEFT one."""
    args = b.args
    plain, pinfo = ensure_checkpoint(b.workdir, layers, "fsdp")
    lora, linfo = ensure_checkpoint(b.workdir, layers, "lora")
    size = f"L{layers} {linfo['rank_file_bytes'] / 1e9:.2f} GB"
    b.ckpt_info[size] = {"plain": pinfo, "lora": linfo}
    for what, path, info in (("plain", plain, pinfo), ("LoRA", lora, linfo)):
        print(f"== {size}: {what} {path} ({info['rank_file_bytes'] / 1e9:.2f} GB, "
              f"{'cached' if info['cached'] else 'created'}; creation took {info['create_seconds']} s)", flush=True)
    plain_inputs, lora_inputs = input_files(plain), input_files(lora)
    stem = f"L{layers}-lora"
    check_layers = list(range(layers)) if args.verify_source else sorted({0, layers - 1})
    res: dict[str, Result] = {}
    outs: dict[str, Path] = {}

    if not args.skip_copy:
        b.copy(size, "copy (cat) LoRA ckpt", lora_inputs, stem)
    if b.run_hfmerge:
        r, out = b.hfmerge(size, "hf-merge plain ckpt", plain, f"L{layers}-plain", plain_inputs)
        res["plain"] = r
        if r.ok:
            outs["plain"] = out
        r, out = b.hfmerge(size, "hf-merge --lora fuse", lora, stem, lora_inputs, ["--lora", "fuse"])
        res["fused"] = r
        if r.ok:
            outs["fused"] = out
            t0 = time.perf_counter()
            ok, msg = check_lora_fused(out, layers, check_layers)
            b.check(f"{size}: hf-merge --lora fuse vs source {'OK' if ok else 'WRONG'}: {msg} "
                    f"({time.perf_counter() - t0:.0f} s)")
    if b.run_verl:
        r, out = b.verl(size, "verl 0.9.1 LoRA ckpt", lora, stem, lora_inputs)
        if r.ok:
            outs["verl"] = out
            b.check(f"{size}: verl's lora_adapter/: {describe_adapter(out / 'lora_adapter')}")
            targets = set(lora_targets(layers))
            if "plain" in outs:
                d = tensor_diff(out, outs["plain"])
                same = not d["differ"] and not d["only_a"] and not d["only_b"]
                b.check(f"{size}: verl (LoRA ckpt) vs hf-merge (plain ckpt) {'EQUAL' if same else 'DIFFER'}: "
                        f"{len(d['equal'])} tensors identical, {len(d['differ'])} differ"
                        + (": verl wrote the base weights without folding LoRA in (adapter kept apart in "
                           "lora_adapter/)" if same else f" ({d['differ'][:3]})"))
            if "fused" in outs:
                d = tensor_diff(out, outs["fused"])
                only_targets = set(d["differ"]) == targets and not d["only_a"] and not d["only_b"]
                b.check(f"{size}: verl (LoRA ckpt) vs hf-merge --lora fuse: {len(d['equal'])} tensors identical, "
                        f"{len(d['differ'])} differ"
                        + (f" = exactly the {len(targets)} LoRA-adapted weights (q,k,v,o,gate,up,down x {layers} "
                           "layers), which verl leaves unfused" if only_targets
                           else f" (unexpected: {sorted(set(d['differ']) ^ targets)[:4]})"))
    b.drop(*outs.values())

    plain_r, fused_r = res.get("plain"), res.get("fused")
    if plain_r and fused_r and plain_r.ok and fused_r.ok:
        b.summary_title = "LoRA: fused merge vs plain merge (target <= 1.5x)"
        wall = fused_r.wall_s / plain_r.wall_s
        anon = fused_r.peak_anon_mb / plain_r.peak_anon_mb if plain_r.peak_anon_mb else float("nan")
        b.summary.append(
            f"{size}: wall {fused_r.wall_s:.1f} s / {plain_r.wall_s:.1f} s = {wall:.2f}x "
            f"({'within' if wall <= 1.5 else 'OVER'} 1.5x); peak anon {fused_r.peak_anon_mb:,.0f} / "
            f"{plain_r.peak_anon_mb:,.0f} MB = {anon:.2f}x ({fused_r.max_procs} / {plain_r.max_procs} process(es): "
            "hf-merge forks one writer per output file, up to the CPU count)")


def bench_megatron(b: Bench, layers: int) -> None:
    """--megatron: hf-merge --backend megatron vs cat of the .distcp files, plus a spot check."""
    import make_synthetic_megatron as mega

    args = b.args
    ckpt, info = ensure_checkpoint(b.workdir, layers, "megatron")
    size = f"L{layers} {info['rank_file_bytes'] / 1e9:.2f} GB"
    b.ckpt_info[size] = info
    print(f"== {size}: {ckpt} (torch_dist, TP={info['tp']}, {info['data_files']} .distcp files; "
          f"{'cached' if info['cached'] else 'created'}; creation took {info['create_seconds']} s)", flush=True)
    inputs = input_files(ckpt, "megatron")
    stem = f"L{layers}-megatron"

    r = subprocess.run([b.python, "-m", "hf_merge.cli.app", "inspect", str(ckpt)], cwd=REPO,
                       capture_output=True, text=True)
    b.log(f"{stem}-inspect.log").write_text(r.stdout + r.stderr)
    fields = {}
    for line in r.stdout.splitlines():  # "key   value" lines, columns two or more spaces apart
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        if len(parts) == 2:
            fields[parts[0]] = parts[1]
    if r.returncode == 0:
        shown = {k: fields.get(k, "?") for k in ("format", "layout", "tp", "pp", "family", "num layers", "tensors count")}
        b.check(f"{size}: `hf-merge inspect` reads it: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    else:
        b.check(f"{size}: `hf-merge inspect` FAILED (rc={r.returncode}): {(r.stderr or r.stdout).strip()[-300:]}")

    if not args.skip_copy:
        b.copy(size, "copy (cat .distcp)", inputs, stem)
    if b.run_hfmerge:
        r, out = b.hfmerge(size, "hf-merge --backend megatron", ckpt, stem, inputs, ["--backend", "megatron"])
        if r.ok:
            t0 = time.perf_counter()
            check_layers = list(range(layers)) if args.verify_source else None
            ok, msg = mega.check_merged(ckpt, out, check_layers)
            b.check(f"{size}: hf-merge output vs torch_dist source {'EQUAL' if ok else 'DIFFER'}: {msg} "
                    f"({time.perf_counter() - t0:.0f} s)")
            b.summary_title = "Megatron: hf-merge memory vs checkpoint size"
            b.summary.append(f"{size}: peak anon {r.peak_anon_mb:,.0f} MB = {r.peak_anon_mb * 1e6 / info['rank_file_bytes']:.1%} "
                             f"of the checkpoint, {r.max_procs} process(es) ({r.peak_anon_mb / max(r.max_procs, 1):,.0f} MB "
                             f"per process); wall {r.wall_s:.1f} s")
        b.drop(out)


def hfmerge_available(python: str) -> tuple[bool, str]:
    r = subprocess.run([python, "-m", "hf_merge.cli.app", "merge", "--help"], cwd=REPO,
                       capture_output=True, text=True)
    return r.returncode == 0, (r.stderr or r.stdout).strip()[-500:]


def fmt_mb(x: float) -> str:
    return f"{x:,.0f}"


def table(results: list[Result], copy_walls: dict[str, float]) -> str:
    lines = ["| size | tool | wall s | ratio to copy | CPU s | peak anon MB | peak RSS MB | output bytes |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.size} | {r.tool} | failed (rc={r.returncode}) | | | "
                         f"{fmt_mb(r.peak_anon_mb)} | {fmt_mb(r.peak_rss_mb)} | |")
            continue
        copy = copy_walls.get(r.size)
        ratio = f"{r.wall_s / copy:.2f}x" if copy else "n/a"
        lines.append(f"| {r.size} | {r.tool} | {r.wall_s:.1f} | {ratio} | {r.cpu_s:.1f} | {fmt_mb(r.peak_anon_mb)} | "
                     f"{fmt_mb(r.peak_rss_mb)} | {r.output_bytes:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None,
                    help="comma-separated decoder-layer counts of the Qwen2-7B-shaped model "
                         "(2 ~3.1 GB, 8 ~5.9 GB; default 2,8; --moe: 3 = 4.98 GB)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--lora", action="store_true",
                      help="LoRA mode: plain merge of the plain checkpoint vs `--lora fuse` of a PEFT-wrapped one "
                           f"(LoRA r={synth.LORA_R} on q,k,v,o,gate,up,down), and verl on the PEFT one")
    mode.add_argument("--megatron", action="store_true",
                      help="Megatron mode: `--backend megatron` on a synthetic torch_dist checkpoint (verl v2 "
                           "layout, TP=4) vs cat of its .distcp files; verl is not run")
    mode.add_argument("--moe", choices=[MOE_SHAPE], default=None,
                      help="MoE mode: a Qwen3-30B-A3B-shaped FSDP checkpoint (128 experts, fused in the rank "
                           "files); copy, hf-merge and verl, outputs compared; --sizes defaults to 3 (4.98 GB)")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                    help=f"checkpoints (cached), outputs, logs (default {DEFAULT_WORKDIR.relative_to(REPO)})")
    ap.add_argument("--skip-verl", action="store_true", help="do not run verl's merger")
    ap.add_argument("--skip-hfmerge", action="store_true", help="do not run hf-merge")
    ap.add_argument("--skip-copy", action="store_true", help="do not measure the raw copy")
    ap.add_argument("--verl-venv", type=Path, default=DEFAULT_VERL_VENV,
                    help="venv with verl 0.9.1 (created by benchmarks/setup_verl.sh if missing)")
    ap.add_argument("--hfmerge-args", default="",
                    help="extra arguments for `hf-merge merge`, e.g. '--workers 2'")
    ap.add_argument("--hfmerge-cmd", default=None,
                    help="replace the hf-merge command (template with {python} {src} {dst}); "
                         "for testing the harness (default mode only)")
    ap.add_argument("--no-fsync", action="store_true",
                    help="do not fsync outputs (wall time then ends when the process exits)")
    ap.add_argument("--verify-source", action="store_true",
                    help="also check each merged output byte for byte against regenerated source shards "
                         "(--lora / --megatron: check every layer, not only the first and last)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep merged outputs after the run")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each measurement N times and report the fastest (memory: the largest peak); "
                         "for a busy machine (default 1)")
    ap.add_argument("--interleave", action="store_true",
                    help="default and --moe modes: run copy, hf-merge and verl in --repeat rounds, one run of each "
                         "per round in a rotating order, and report each tool's median run with every round's "
                         "wall, CPU seconds and ratio to that round's copy (for a machine whose disk speed drifts)")
    ap.add_argument("--json", type=Path, default=None,
                    help="write results here (default WORKDIR/results.json; results_lora.json / "
                         "results_megatron.json in those modes)")
    args = ap.parse_args(argv)
    kind = "lora" if args.lora else "megatron" if args.megatron else "moe" if args.moe else "fsdp"
    if args.sizes is None:
        args.sizes = "3" if kind == "moe" else "2,8"
    if args.hfmerge_cmd and kind != "fsdp":
        ap.error("--hfmerge-cmd is for the default mode only")

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    workdir = args.workdir.resolve()
    (workdir / "out").mkdir(parents=True, exist_ok=True)
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    fsync = not args.no_fsync
    python = sys.executable

    run_hfmerge = not args.skip_hfmerge
    if run_hfmerge and args.hfmerge_cmd is None:
        ok, msg = hfmerge_available(python)
        if not ok:
            print(f"hf-merge CLI not usable (`{python} -m hf_merge.cli.app merge --help` failed): {msg}",
                  file=sys.stderr)
            print("rerun with --skip-hfmerge to benchmark the rest", file=sys.stderr)
            return 2

    verl_python = args.verl_venv / "bin" / "python"
    run_verl = not args.skip_verl and kind != "megatron"
    if run_verl:
        print("setting up verl's venv (skipped when already there) ...", flush=True)
        subprocess.run(["bash", str(BENCH_DIR / "setup_verl.sh"), str(args.verl_venv)], check=True, cwd=REPO)

    print(f"machine: {os.cpu_count()} CPUs, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB RAM")
    if kind != "fsdp":
        load = os.getloadavg()
        print(f"mode: {kind}; load average at start {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} (1, 5, 15 min)")
    print("method: each measurement runs on a warm page cache (rank files read once right before it); "
          + ("wall time includes an fsync of all output files" if fsync else "outputs are not fsynced")
          + f"; memory = sum over the process tree of /proc/PID/status, sampled every {SAMPLE_INTERVAL * 1000:.0f} ms "
          "(peak anon = RssAnon, mmapped file pages excluded; peak RSS = VmRSS, includes them; MB = 10^6 bytes)\n", flush=True)

    b = Bench(args, workdir, python, fsync, run_hfmerge, run_verl, verl_python)
    run = {"fsdp": bench_fsdp, "lora": bench_lora, "megatron": bench_megatron, "moe": bench_moe}[kind]
    for layers in sizes:
        run(b, layers)
    results, checks = b.results, b.checks

    print("\n## Results\n")
    print(table(results, b.copy_walls))
    print()
    for r in results:
        extra = f" (peak shmem {r.peak_shmem_mb:.0f} MB)" if r.peak_shmem_mb > 64 else ""
        print(f"- {r.size} {r.tool}: run {r.run_s:.1f} s + fsync {r.fsync_s:.1f} s, "
              f"{r.max_procs} process(es){extra}: `{r.command}`")
        for n in r.notes:
            print(f"  {n}")
    if b.summary:
        print(f"\n## {b.summary_title}\n")
        for line in b.summary:
            print(f"- {line}")
    if kind == "megatron":
        print("\n(verl's Megatron merger is not run: it builds the model through megatron-core)")
    if checks:
        print("\n## Output checks\n")
        for c in checks:
            print(f"- {c}")
    else:
        print("\n(no output comparison: hf-merge and verl did not both run)")

    default_json = {"fsdp": "results.json", "lora": "results_lora.json", "megatron": "results_megatron.json",
                    "moe": "results_moe.json"}[kind]
    json_path = args.json or workdir / default_json
    payload = {"results": [asdict(r) for r in results], "checks": checks,
               "checkpoints": b.ckpt_info, "fsync": fsync}
    if kind != "fsdp":
        payload.update(mode=kind, summary=b.summary)
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nresults written to {json_path}")
    bad = (" DIFFER", " WRONG", " FAILED")
    return 0 if all(r.ok for r in results) and not any(x in c for c in checks for x in bad) else 1


if __name__ == "__main__":
    sys.exit(main())
