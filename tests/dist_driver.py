"""Run ``hf-merge`` commands on one rank of a distributed job, for tests/test_distributed.py.

``python dist_driver.py JOBS.json OUT_DIR`` (under torchrun, or with RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT set by hand). JOBS is a list of ``{"argv": [...], "missing_source_on_rank": r,
"die_on_rank": r}``; each job's exit code, stdout and stderr go to
``OUT_DIR/<job>.rank<r>.json``.

- ``--own-group`` (first argument): the driver initialises torch.distributed (gloo) itself once,
  as a training script would, and every job runs inside it with ``HF_MERGE_DISTRIBUTED=1``
  (hf_merge adds a gloo group of its own per merge). Without it each merge initialises and
  destroys the default group from the environment, as ``torchrun -m hf_merge`` does (one job
  per process then: torch does not re-initialise a destroyed default group reliably).
- ``missing_source_on_rank``: that rank is given a source path that does not exist (a node that
  does not see the checkpoint; for ``verify``, the target).
- ``die_on_rank``: that rank SIGKILLs itself when it starts writing its first output file.

Each result also says whether the rank imported torch (``"torch"``) and the CLI's parser (``"parser"``:
the merge command's module): a rank that had nothing to do returns before either.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
from pathlib import Path


def main() -> int:
    own_group = sys.argv[1] == "--own-group"
    jobs = json.loads(Path(sys.argv[1 + own_group]).read_text())
    out = Path(sys.argv[2 + own_group])
    rank = int(os.environ["RANK"])
    from hf_merge.cli.app import main as cli

    if own_group:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        os.environ["HF_MERGE_DISTRIBUTED"] = "1"
    for i, job in enumerate(jobs):
        argv = list(job["argv"])
        if job.get("missing_source_on_rank") == rank:
            argv[1] = argv[1] + "-not-mounted-here"
        if job.get("die_on_rank") == rank:
            import hf_merge.write.shards

            def dying_write_file(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            hf_merge.write.shards.write_file = dying_write_file
        err, std = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
            try:
                code = cli(argv)
            except SystemExit as e:
                code = e.code
        result = {"code": code, "stderr": err.getvalue(), "stdout": std.getvalue(), "torch": "torch" in sys.modules,
                  "parser": "hf_merge.cli.merge" in sys.modules}
        (out / f"{i}.rank{rank}.json").write_text(json.dumps(result))
    if own_group:
        dist.destroy_process_group()  # as a training script ends
    return 0


if __name__ == "__main__":
    sys.exit(main())
