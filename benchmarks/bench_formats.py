#!/usr/bin/env python
"""One table per checkpoint format: the merge against the copy floor, the sharded load against from_pretrained.

    python benchmarks/bench_formats.py [--rounds 3] [--workdir DIR] [--make NAME=CMD] NAME=DIR[:MERGE ARGS] ...
    python benchmarks/bench_formats.py @benchmarks/formats_issue28.txt      # every >= 3 GB input of this machine

For each input (``NAME=DIR``, optionally ``:`` and extra ``hf-merge merge`` arguments, e.g.
``zero3=/data/zero3:--config /data/zero3/config --dtype float32``; ``--config`` and ``--dtype``
are also given to both loads, whose dtype is otherwise bfloat16), one untimed merge writes
``WORKDIR/NAME/merged``, then ``--rounds`` rounds run these four, the order rotated every round
(``peer_rounds.run``), each on a warm page cache:

  copy floor               ``cat`` of the files the merge reads into one file + fsync (``bench_merge.measure_copy_floor``);
                           the weight files (``bench_load._weight_files``), for DeepSpeed only the fp32
                           masters (``*optim_states.pt`` as ``bench_deepspeed.py``, a universal folder's
                           ``fp32.pt``); the merged folder is deleted first (disk space), and made
                           again, untimed, before the next from_pretrained
  hf-merge                 ``python -m hf_merge.cli.app merge DIR WORKDIR/NAME/merged ARGS``, outputs fsynced
                           (``bench_merge.measure``: wall, CPU of the process tree, peak anonymous memory)
  from_sharded_pretrained  ``AutoModelForCausalLM.from_sharded_pretrained(DIR)`` + a first forward over 8 tokens
  from_pretrained          ``from_pretrained(WORKDIR/NAME/merged)`` + the same forward (both in a fresh
                           interpreter, ``bench_load.run_child``; imports not counted)

and prints one markdown table per format: median wall, every round's wall, median CPU seconds,
peak anonymous memory, and hf-merge / floor and from_sharded_pretrained / from_pretrained round by
round with their median; the 1-minute load average sampled after every run; whether both loads
hold the same weights (fingerprints of the first round). Then one summary table of all formats.
Markdown and JSON go to ``WORKDIR/formats.md`` / ``formats.json``. ``--make NAME=CMD``: when
NAME's folder is missing, ``bash -c CMD`` (``python`` = this interpreter) writes it first and it is
deleted after NAME's rounds (inputs that are cheap to remake need not stay on disk). The merged folder is deleted after each
format unless ``--keep-outputs``. Arguments may come from a file, one per line: ``@FILE``.
``--render A.json [B.json ...]`` measures nothing: it prints the tables of saved runs, concatenated.
Targets (issue 28): merge <= 1.3x the floor, load + first forward <= 1.5x from_pretrained's,
at >= 3 GB, peak anonymous memory of the merge <= 512 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_load  # noqa: E402
import bench_merge as bm  # noqa: E402
import peer_rounds  # noqa: E402

MERGE, SHARDED, PRETRAINED = "hf-merge", "from_sharded_pretrained", "from_pretrained"
TARGETS = {MERGE: (peer_rounds.FLOOR, 1.3), SHARDED: (PRETRAINED, 1.5)}


class Input:
    """One ``NAME=DIR[:MERGE ARGS]``: the folder, the merge's extra arguments, the loads' dtype and config."""

    def __init__(self, spec: str):
        name, sep, rest = spec.partition("=")
        folder, _, extra = rest.partition(":")
        if not sep or not name or not folder:
            sys.exit(f"error: {spec!r}: expected NAME=DIR[:MERGE ARGS]")
        self.name, self.dir, self.args = name, Path(folder), shlex.split(extra)
        opts = dict(zip(self.args, self.args[1:]))
        self.dtype = opts.get("--dtype", "bfloat16")
        self.config = Path(opts["--config"]) if "--config" in opts else None

    def files(self) -> tuple[list[Path], list[Path]]:
        """(every weight file, the files the copy floor reads)."""
        files = bench_load._weight_files(self.dir)
        # DeepSpeed: the fp32 masters (ZeRO partitions, or a universal checkpoint's per-parameter fp32.pt)
        masters = [p for p in files if p.name.endswith("optim_states.pt") or p.name == "fp32.pt"]
        return files, masters or files


def _load_result(name: str, tool: str, r: dict) -> bm.Result:
    """A load child's dict as a ``bench_merge.Result`` (wall and CPU = load + first forward), the dict kept in notes."""
    return bm.Result(size=name, tool=tool, command=tool, ok=True, wall_s=r["wall_s"] + r["forward_s"],
                     run_s=r["wall_s"], cpu_s=r["cpu_s"] + r["forward_cpu_s"], peak_anon_mb=r["peak_anon"] / 1e6,
                     peak_rss_mb=r["peak_rss"] / 1e6, notes=[json.dumps(r)])


def bench_one(inp: Input, workdir: Path, rounds: int) -> dict:
    work = workdir / inp.name
    work.mkdir(parents=True, exist_ok=True)
    merged = work / "merged"
    files, floor_files = inp.files()
    env = dict(os.environ, PYTHONPATH=str(bm.REPO), HF_HUB_DISABLE_PROGRESS_BARS="1")
    argv = [sys.executable, "-m", "hf_merge.cli.app", "merge", str(inp.dir), str(merged), *inp.args]

    def untimed_merge() -> bm.Result:
        return bm.measure(inp.name, "hf-merge (untimed, for from_pretrained)", argv, merged, work / "merge0.log", files, env=env)

    first = untimed_merge()
    if not first.ok:
        return {"name": inp.name, "error": "\n".join(first.notes)}
    loads: list[float] = []
    prints: dict[str, Path] = {}

    def load(tool: str, source: Path) -> bm.Result:
        if tool == PRETRAINED and not merged.is_dir():  # the floor deleted it
            untimed_merge()
        bench_load.warm_cache(source)
        fp = None if tool in prints else work / f"fingerprint-{tool}.json"
        try:
            r = bench_load.run_child(tool, source, inp.dtype, fp, device_map=None, config=inp.config)
        except SystemExit as e:  # run_child exits with the child's stderr
            print(f"  [{tool}] FAILED: {e}", flush=True)
            return bm.Result(size=inp.name, tool=tool, command=tool, notes=[str(e)])
        if fp is not None:
            prints[tool] = fp
        print(f"  [{tool}] {r['wall_s']:.2f} s + forward {r['forward_s']:.2f} s, CPU {r['cpu_s']:.2f} s, "
              f"peak anon {r['peak_anon'] / 1e6:,.0f} MB", flush=True)
        return _load_result(inp.name, tool, r)

    def sampled(fn):
        def run() -> bm.Result:
            r = fn()
            loads.append(os.getloadavg()[0])
            return r
        return run

    def floor() -> bm.Result:
        bm.remove(merged)  # the copy and the merged folder need not be on the disk at once
        return bm.measure_copy_floor(inp.name, floor_files, work / "floor.bin", work / "floor.log")[0]

    tools = {
        peer_rounds.FLOOR: floor,
        MERGE: lambda: bm.measure(inp.name, MERGE, argv, merged, work / "merge.log", files, env=env),
        SHARDED: lambda: load(SHARDED, inp.dir),
        PRETRAINED: lambda: load(PRETRAINED, merged),
    }
    loads.append(os.getloadavg()[0])
    per = peer_rounds.run(rounds, {k: sampled(fn) for k, fn in tools.items()})
    same, detail = (bench_load.compare(prints[SHARDED], prints[PRETRAINED]) if len(prints) == 2
                    else (False, "a load failed: " + " ".join(r.notes[0][-300:] for r in per[SHARDED] + per[PRETRAINED] if not r.ok)))
    out = {"name": inp.name, "dir": str(inp.dir), "merge_args": inp.args, "load_dtype": inp.dtype,
           "input_bytes": sum(p.stat().st_size for p in files), "floor_bytes": sum(p.stat().st_size for p in floor_files),
           "output_bytes": per[MERGE][-1].output_bytes, "same_weights": same, "weights_detail": detail,
           "load_avg": [round(x, 2) for x in loads], "cpus": os.cpu_count(), "rounds": rounds}
    for ours, (ref, _) in TARGETS.items():
        s = peer_rounds.summary({ours: per[ours], ref: per[ref]}, ours=ours, peer=ref)
        out.setdefault("tools", {}).update(s["tools"])
        out[f"{ours} / {ref}"] = s[f"{ours} / {ref}"]
    for tool in (SHARDED, PRETRAINED):  # load and forward apart, from the children's own numbers
        kids = [json.loads(r.notes[0]) for r in per[tool] if r.ok]
        for key in ("wall_s", "forward_s", "sys_s"):
            out["tools"][tool][f"median_{key.replace('wall', 'load')}"] = (
                statistics.median(k[key] for k in kids) if kids else None)
    return out


def format_table(r: dict) -> str:
    if "error" in r:
        return f"### {r['name']}\n\nFAILED: {r['error']}\n"
    t = r["tools"]
    lines = [
        f"### {r['name']}: {r['input_bytes'] / 1e9:.2f} GB of weight files ({r['floor_bytes'] / 1e9:.2f} GB copied by the floor), "
        f"output {r['output_bytes'] / 1e9:.2f} GB, load dtype {r['load_dtype']}",
        "",
        f"`{r['dir']}` {' '.join(r['merge_args'])}; {r['rounds']} interleaved rounds; {r['cpus']} CPUs, "
        f"1-min load average {min(r['load_avg']):.1f}-{max(r['load_avg']):.1f} (sampled after every run); "
        f"same weights in both loads: {'yes' if r['same_weights'] else 'NO'} ({r['weights_detail']})",
        "",
        "| what | median wall s | rounds s | median CPU s | peak anon MB | x (median) | x per round | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tool in (peer_rounds.FLOOR, MERGE, PRETRAINED, SHARDED):
        s = t[tool]
        label = tool if tool in (peer_rounds.FLOOR, MERGE) else f"{tool} + 1st forward"
        if tool in (PRETRAINED, SHARDED) and s["median_load_s"] is not None:
            label += f" (load {s['median_load_s']:.2f} + fwd {s['median_forward_s']:.2f})"
        ratio, target = "", ""
        if tool in TARGETS:
            ref, bar = TARGETS[tool]
            q = r[f"{tool} / {ref}"]
            ratio = f"{q['median']:.2f} | {', '.join(f'{x:.2f}' for x in q['per_round'])}" if q["median"] else "| "
            target = f"<= {bar}x {ref}: {'met' if q['median'] and q['median'] <= bar else 'NOT met'}"
        else:
            ratio = "| "
        wall = f"{s['median_wall_s']:.2f}" if s["median_wall_s"] is not None else "FAILED"
        cpu = f"{s['median_cpu_s']:.2f}" if s["median_cpu_s"] is not None else ""
        lines.append(f"| {label} | {wall} | {', '.join(f'{w:.2f}' for w in s['wall_s'])} | {cpu} "
                     f"| {s['peak_anon_mb']:,.0f} | {ratio} | {target} |")
    return "\n".join(lines) + "\n"


def summary_table(results: list[dict]) -> str:
    lines = ["| format | GB (files / floor) | merge / floor (median of rounds) | merge s / floor s | CPU s merge / floor "
             "| merge peak anon MB | load+fwd / from_pretrained+fwd (median of rounds) | ours s / theirs s "
             "| CPU s ours / theirs | load peak anon MB ours / theirs | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | FAILED |" + " |" * 9)
            continue
        t, m, l = r["tools"], r[f"{MERGE} / {peer_rounds.FLOOR}"], r[f"{SHARDED} / {PRETRAINED}"]
        f, ours, ref = t[peer_rounds.FLOOR], t[SHARDED], t[PRETRAINED]
        lines.append(
            f"| {r['name']} | {r['input_bytes'] / 1e9:.2f} / {r['floor_bytes'] / 1e9:.2f} | {m['median']:.2f}x "
            f"| {t[MERGE]['median_wall_s']:.2f} / {f['median_wall_s']:.2f} | {t[MERGE]['median_cpu_s']:.2f} / {f['median_cpu_s']:.2f} "
            f"| {t[MERGE]['peak_anon_mb']:,.0f} | {l['median']:.2f}x | {ours['median_wall_s']:.2f} / {ref['median_wall_s']:.2f} "
            f"| {ours['median_cpu_s']:.2f} / {ref['median_cpu_s']:.2f} | {ours['peak_anon_mb']:,.0f} / {ref['peak_anon_mb']:,.0f} "
            f"| {min(r['load_avg']):.1f}-{max(r['load_avg']):.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 fromfile_prefix_chars="@")
    ap.add_argument("inputs", nargs="*", metavar="NAME=DIR[:MERGE ARGS]")
    ap.add_argument("--render", nargs="+", type=Path, metavar="JSON",
                    help="measure nothing: print the tables of earlier runs' formats.json files, concatenated")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the four (default 3)")
    ap.add_argument("--workdir", type=Path, default=bm.REPO / "bench_out" / "formats")
    ap.add_argument("--make", action="append", default=[], metavar="NAME=CMD",
                    help="when NAME's folder is missing: bash -c CMD writes it, deleted after NAME's rounds (repeatable)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run only these inputs (repeatable)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep every WORKDIR/NAME/merged")
    a = ap.parse_intermixed_args(argv)  # inputs and --make lines in any order
    if a.render:
        results = [r for f in a.render for r in json.loads(f.read_text())]
        print("\n".join(format_table(r) for r in results) + "\n## Summary\n\n" + summary_table(results))
        return 0
    inputs = [Input(s) for s in a.inputs]
    inputs = [i for i in inputs if not a.only or i.name in a.only]
    makers = dict(m.partition("=")[::2] for m in a.make)
    a.workdir.mkdir(parents=True, exist_ok=True)
    results, t0 = [], time.perf_counter()
    for inp in inputs:
        made = False
        if not inp.dir.is_dir():
            if inp.name not in makers:
                results.append({"name": inp.name, "error": f"{inp.dir} is missing (no --make {inp.name}=CMD)"})
                continue
            print(f"== {inp.name}: making {inp.dir}: {makers[inp.name]}", flush=True)
            t1 = time.perf_counter()
            made = True
            path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # `python`: this one
            rc = subprocess.run(["bash", "-c", makers[inp.name]], cwd=bm.REPO,
                                env=dict(os.environ, PYTHONPATH=str(bm.REPO), PATH=path)).returncode
            print(f"   made in {time.perf_counter() - t1:.0f} s (exit status {rc})", flush=True)
            if rc != 0 or not inp.dir.is_dir():
                bm.remove(inp.dir)
                results.append({"name": inp.name, "error": f"--make {inp.name} failed (exit status {rc})"})
                continue
        print(f"== {inp.name}: {inp.dir} {' '.join(inp.args)}", flush=True)
        try:
            r = bench_one(inp, a.workdir, a.rounds)
        finally:
            if not a.keep_outputs:
                bm.remove(a.workdir / inp.name / "merged")
            if made:
                bm.remove(inp.dir)
        results.append(r)
        print("\n" + format_table(r), flush=True)
    md = "\n".join(format_table(r) for r in results) + "\n## Summary\n\n" + summary_table(results)
    md += f"\n{len(results)} formats, {a.rounds} rounds each, {time.perf_counter() - t0:.0f} s in all\n"
    print("\n## Summary\n\n" + summary_table(results) + f"\n{time.perf_counter() - t0:.0f} s in all", flush=True)
    (a.workdir / "formats.md").write_text(md)
    (a.workdir / "formats.json").write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r and r["same_weights"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
