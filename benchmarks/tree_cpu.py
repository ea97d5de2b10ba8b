#!/usr/bin/env python
"""Run a command; print its wall time and the CPU time of its whole process tree.

    python benchmarks/tree_cpu.py .venv/bin/python -m pytest -q -m "not slow" tests

``/usr/bin/time`` counts the processes its command waited for, and theirs. A multiprocessing fork
server (the FSDP fixture writers' ``forkserver``) is never waited for: it outlives the test
process and its rank processes' CPU is lost to ``/usr/bin/time``. This process makes itself the
child subreaper of the tree (Linux ``PR_SET_CHILD_SUBREAPER``), so orphans are re-parented here,
reaped here and counted. The line goes to stderr::

    tree_cpu: rc 0 wall 265.1 s user 230.2 s sys 45.0 s cpu 275.2 s
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if not argv:
        sys.exit(__doc__)
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")
    t0 = time.perf_counter()
    rc = subprocess.call(argv)
    while True:  # the orphans the command left: re-parented to this process
        try:
            os.wait()
        except ChildProcessError:
            break
    t = os.times()
    print(f"tree_cpu: rc {rc} wall {time.perf_counter() - t0:.1f} s user {t.children_user:.1f} s "
          f"sys {t.children_system:.1f} s cpu {t.children_user + t.children_system:.1f} s", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
