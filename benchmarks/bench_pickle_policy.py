"""Time the pickle policy on a real DCP ``.metadata``: load_pickle (the walk, then the C fast path),
the walk alone, the pure-Python policy machine alone, and plain C pickle (which runs anything; for
comparison only).

    PYTHONPATH=$PWD python benchmarks/bench_pickle_policy.py PATH/TO/.metadata [REPEATS]
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import time
from pathlib import Path

from hf_merge.readers import safe_pickle as sp


def best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def main() -> None:
    path = Path(sys.argv[1])
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    data = path.read_bytes()
    allow = sp.DCP_METADATA | sp.torch_names()
    pure = lambda: sp._run(sp._PolicyUnpickler(io.BytesIO(data), allow, "x", resolve=True), "x")  # noqa: E731
    assert repr(sp.load_pickle(data, sp.DCP_METADATA, "x")) == repr(pure()) == repr(pickle.loads(data))
    print(f"{path} ({len(data)} bytes), best of {repeats}, load average {os.getloadavg()[0]:.1f}")
    print(f"  load_pickle (fast path):  {best_ms(lambda: sp.load_pickle(data, sp.DCP_METADATA, 'x'), repeats):7.1f} ms")
    if hasattr(sp, "_walk"):  # the abstract walk both paths start with (limits, argument schemas)
        print(f"  of which the walk:        {best_ms(lambda: sp._walk(data, allow, 'x', persistent=False), repeats):7.1f} ms")
    print(f"  pure-Python policy:       {best_ms(pure, repeats):7.1f} ms  (the machine alone)")
    print(f"  C pickle (no policy):     {best_ms(lambda: pickle.loads(data), repeats):7.1f} ms")


if __name__ == "__main__":
    main()
