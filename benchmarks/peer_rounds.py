"""Interleaved rounds of hf-merge, its peer and the copy floor, shared by bench_deepspeed.py and bench_accelerate.py.

Each round runs every tool once, the order rotated every round, so that a slow minute of this
machine's disk hits every tool; per tool the median wall and CPU seconds and the largest peak
anonymous memory are reported, and every hf-merge round is divided by the copy floor of the same round.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import bench_merge as bm

FLOOR = "copy floor"


def run(rounds: int, tools: dict[str, Callable[[], bm.Result]]) -> dict[str, list[bm.Result]]:
    names = list(tools)
    per: dict[str, list[bm.Result]] = {name: [] for name in names}
    for i in range(max(1, rounds)):
        for name in names[i % len(names):] + names[: i % len(names)]:
            per[name].append(tools[name]())
    return per


def summary(per: dict[str, list[bm.Result]], ours: str = "hf-merge", peer: str | None = None) -> dict:
    """Medians per tool, and hf-merge's wall over the floor's and over the peer's, round by round."""
    out: dict = {"tools": {}}
    for name, runs in per.items():
        ok = [r for r in runs if r.ok]
        out["tools"][name] = {
            "ok": len(ok) == len(runs),
            "wall_s": [round(r.wall_s, 3) for r in runs],
            "cpu_s": [round(r.cpu_s, 3) for r in runs],
            "median_wall_s": statistics.median(r.wall_s for r in ok) if ok else None,
            "median_cpu_s": statistics.median(r.cpu_s for r in ok) if ok else None,
            "peak_anon_mb": max(r.peak_anon_mb for r in runs),
            "runs": [asdict(r) for r in runs],
        }
    for other in (FLOOR, peer):
        if other in per and ours in per:
            ratios = [o.wall_s / f.wall_s for o, f in zip(per[ours], per[other]) if o.ok and f.ok and f.wall_s]
            out[f"{ours} / {other}"] = {"per_round": [round(x, 3) for x in ratios],
                                        "median": statistics.median(ratios) if ratios else None}
    return out


def print_table(label: str, s: dict, ours: str = "hf-merge", peer: str | None = None) -> None:
    print(f"  {label}:", flush=True)
    for name, t in s["tools"].items():
        if t["median_wall_s"] is None:
            print(f"    {name:<28} FAILED", flush=True)
            continue
        print(f"    {name:<28} wall {t['median_wall_s']:6.2f} s  CPU {t['median_cpu_s']:6.2f} s  "
              f"anon {t['peak_anon_mb']:7.0f} MB  (rounds: {', '.join(f'{w:.2f}' for w in t['wall_s'])})", flush=True)
    for other in (FLOOR, peer):
        r = s.get(f"{ours} / {other}")
        if r and r["median"] is not None:
            print(f"    {ours} / {other}: {r['median']:.2f}x (rounds: {', '.join(f'{x:.2f}' for x in r['per_round'])})",
                  flush=True)


def finish(label: str, per: dict[str, list[bm.Result]], peer: str, peer_out: Path, ours_out: Path,
           keep_outputs: bool = False, ours: str = "hf-merge") -> dict:
    """The last round's two outputs compared tensor by tensor (then deleted unless ``keep_outputs``),
    the table printed; the summary with the comparison, for results.json."""
    ok = per[peer][-1].ok and per[ours][-1].ok
    same, detail = bm.compare_outputs(peer_out, ours_out) if ok else (False, "a run failed")
    print(f"  {label}: outputs {'identical' if same else 'DIFFER'} ({detail})", flush=True)
    s = summary(per, ours=ours, peer=peer)
    print_table(label, s, ours=ours, peer=peer)
    if not keep_outputs:
        bm.remove(peer_out)
        bm.remove(ours_out)
    return {"same": same, "detail": detail, "output_bytes": per[ours][-1].output_bytes, "load_avg": os.getloadavg(), **s}
