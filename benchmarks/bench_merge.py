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
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
    print(f"  [{tool}] {status}: {res.wall_s:.1f} s (fsync {res.fsync_s:.1f} s), "
          f"peak anon {res.peak_anon_mb:.0f} MB, peak RSS {res.peak_rss_mb:.0f} MB, "
          f"{res.max_procs} proc(s), {res.samples} samples", flush=True)
    return res


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

def ensure_checkpoint(workdir: Path, layers: int) -> tuple[Path, dict]:
    ckpt = workdir / "ckpt" / f"qwen2-7b-shaped-L{layers}-ws{WORLD}"
    meta = ckpt / "synthetic.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        if info.get("layers") == layers and info.get("world_size") == WORLD:
            info["cached"] = True
            return ckpt, info
    print(f"  creating checkpoint {ckpt} ...", flush=True)
    cmd = [sys.executable, str(BENCH_DIR / "make_synthetic_checkpoint.py"), str(ckpt),
           "--layers", str(layers), "--world-size", str(WORLD)]
    subprocess.run(cmd, check=True, cwd=REPO)
    info = json.loads(meta.read_text())
    info["cached"] = False
    return ckpt, info


def hfmerge_available(python: str) -> tuple[bool, str]:
    r = subprocess.run([python, "-m", "hf_merge.cli.app", "merge", "--help"], cwd=REPO,
                       capture_output=True, text=True)
    return r.returncode == 0, (r.stderr or r.stdout).strip()[-500:]


def fmt_mb(x: float) -> str:
    return f"{x:,.0f}"


def table(results: list[Result], copy_walls: dict[str, float]) -> str:
    lines = ["| size | tool | wall s | ratio to copy | peak anon MB | peak RSS MB | output bytes |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.size} | {r.tool} | failed (rc={r.returncode}) | | "
                         f"{fmt_mb(r.peak_anon_mb)} | {fmt_mb(r.peak_rss_mb)} | |")
            continue
        copy = copy_walls.get(r.size)
        ratio = f"{r.wall_s / copy:.2f}x" if copy else "n/a"
        lines.append(f"| {r.size} | {r.tool} | {r.wall_s:.1f} | {ratio} | {fmt_mb(r.peak_anon_mb)} | "
                     f"{fmt_mb(r.peak_rss_mb)} | {r.output_bytes:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,8",
                    help="comma-separated decoder-layer counts of the Qwen2-7B-shaped model "
                         "(2 ~3.1 GB, 8 ~5.9 GB; default 2,8)")
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
                         "for testing the harness")
    ap.add_argument("--no-fsync", action="store_true",
                    help="do not fsync outputs (wall time then ends when the process exits)")
    ap.add_argument("--verify-source", action="store_true",
                    help="also check each merged output byte for byte against regenerated source shards")
    ap.add_argument("--keep-outputs", action="store_true", help="keep merged outputs after the run")
    ap.add_argument("--json", type=Path, default=None, help="write results here (default WORKDIR/results.json)")
    args = ap.parse_args(argv)

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
    run_verl = not args.skip_verl
    if run_verl:
        print("setting up verl's venv (skipped when already there) ...", flush=True)
        subprocess.run(["bash", str(BENCH_DIR / "setup_verl.sh"), str(args.verl_venv)], check=True, cwd=REPO)

    print(f"machine: {os.cpu_count()} CPUs, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB RAM")
    print("method: each measurement runs on a warm page cache (rank files read once right before it); "
          + ("wall time includes an fsync of all output files" if fsync else "outputs are not fsynced")
          + f"; memory = sum over the process tree of /proc/PID/status, sampled every {SAMPLE_INTERVAL * 1000:.0f} ms "
          "(peak anon = RssAnon, mmapped file pages excluded; peak RSS = VmRSS, includes them; MB = 10^6 bytes)\n", flush=True)

    results: list[Result] = []
    copy_walls: dict[str, float] = {}
    checks: list[str] = []
    ckpt_info: dict[str, dict] = {}
    for layers in sizes:
        ckpt, info = ensure_checkpoint(workdir, layers)
        size = f"L{layers} {info['rank_file_bytes'] / 1e9:.2f} GB"
        ckpt_info[size] = info
        print(f"== {size}: {ckpt} ({'cached' if info['cached'] else 'created'}; "
              f"creation took {info['create_seconds']} s)", flush=True)
        inputs = [ckpt / f"model_world_size_{WORLD}_rank_{r}.pt" for r in range(WORLD)]
        outs = {}

        if not args.skip_copy:
            out = workdir / "out" / f"L{layers}-copy.bin"
            script = "cat " + " ".join(shlex.quote(str(p)) for p in inputs) + " > " + shlex.quote(str(out))
            r = measure(size, "copy (cat)", ["bash", "-c", script], out, workdir / "logs" / f"L{layers}-copy.log",
                        inputs, fsync=fsync)
            results.append(r)
            if r.ok:
                copy_walls[size] = r.wall_s
            remove(out)

        if run_hfmerge:
            out = workdir / "out" / f"L{layers}-hfmerge"
            if args.hfmerge_cmd:
                cmd = shlex.split(args.hfmerge_cmd.format(python=python, src=ckpt, dst=out))
            else:
                cmd = [python, "-m", "hf_merge.cli.app", "merge", str(ckpt), str(out), "--overwrite",
                       *shlex.split(args.hfmerge_args)]
            label = "hf-merge" if not args.hfmerge_cmd else "custom (--hfmerge-cmd)"
            r = measure(size, label, cmd, out, workdir / "logs" / f"L{layers}-hfmerge.log", inputs, fsync=fsync)
            results.append(r)
            if r.ok:
                outs["hf-merge"] = out

        if run_verl:
            out = workdir / "out" / f"L{layers}-verl"
            cmd = [str(verl_python), "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                   "--local_dir", str(ckpt), "--target_dir", str(out)]
            r = measure(size, "verl 0.9.1", cmd, out, workdir / "logs" / f"L{layers}-verl.log", inputs, fsync=fsync)
            results.append(r)
            if r.ok:
                outs["verl"] = out

        if "hf-merge" in outs and "verl" in outs:
            t0 = time.perf_counter()
            same, msg = compare_outputs(outs["hf-merge"], outs["verl"])
            line = f"{size}: hf-merge vs verl outputs {'EQUAL' if same else 'DIFFER'}: {msg} " \
                   f"({time.perf_counter() - t0:.0f} s)"
            print("  " + line, flush=True)
            checks.append(line)
        if args.verify_source:
            for tool, out in outs.items():
                same, msg = check_against_source(out, layers)
                line = f"{size}: {tool} output vs source shards {'EQUAL' if same else 'DIFFER'}: {msg}"
                print("  " + line, flush=True)
                checks.append(line)
        if not args.keep_outputs:
            for out in outs.values():
                remove(out)

    print("\n## Results\n")
    print(table(results, copy_walls))
    print()
    for r in results:
        extra = f" (peak shmem {r.peak_shmem_mb:.0f} MB)" if r.peak_shmem_mb > 64 else ""
        print(f"- {r.size} {r.tool}: run {r.run_s:.1f} s + fsync {r.fsync_s:.1f} s, "
              f"{r.max_procs} process(es){extra}: `{r.command}`")
        for n in r.notes:
            print(f"  {n}")
    if checks:
        print("\n## Output checks\n")
        for c in checks:
            print(f"- {c}")
    else:
        print("\n(no output comparison: hf-merge and verl did not both run)")

    json_path = args.json or workdir / "results.json"
    json_path.write_text(json.dumps({"results": [asdict(r) for r in results], "checks": checks,
                                     "checkpoints": ckpt_info, "fsync": fsync}, indent=2) + "\n")
    print(f"\nresults written to {json_path}")
    return 0 if all(r.ok for r in results) and not any(" DIFFER" in c for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
