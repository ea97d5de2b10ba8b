"""Run ``hf-merge ARGS`` and hold it at one phase, for the kill tests (tests/test_signals.py).

``python phase_driver.py PHASE EVENT_FD HOLD_FD ARGS...``

When the merge reaches PHASE, the process, thread or child doing that phase's work writes
``PHASE PID\\n`` to EVENT_FD and then blocks reading HOLD_FD, which the test never writes: the
test knows where the merge is (an event, not a delay) and sends its signal while that work is
held. The rest of the merge runs its real code meanwhile (the main thread waiting for writers,
encoder threads or fsyncs). Phases:

- ``locked``: the target is locked and its temporary folder made; the source is about to be
  opened (main thread);
- ``writing``: the first output file is written, the next one about to be (main thread);
- ``forked``: a forked writer process starts its file (the parent waits for its writers);
- ``encoding``: the GGUF encoder thread has a chunk to encode (the main thread waits for it);
- ``syncing``: the fsyncs of the output files before the rename (fsync threads);
- ``placed``: the target is renamed into place, its parent folder not fsynced yet (main thread);
- ``reading``: a reader process of the rank pool (readers/rank_pool.py, its size bar lowered to 0)
  starts a verl FSDP rank file (the parent waits for what it sends).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def main() -> int:
    phase, event_fd, hold_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    driver = os.getpid()

    def hold() -> None:
        os.write(event_fd, f"{phase} {os.getpid()}\n".encode())
        os.read(hold_fd, 1)  # never written: held until a signal ends this process
        raise RuntimeError("the hold pipe was written to")

    def hold_in(module, name: str, when=lambda *a: True) -> None:
        """``module.name`` holds first when ``when(*args)`` (looked up at call time by its callers)."""
        real = getattr(module, name)

        def held(*a, **k):
            if when(*a):
                hold()
            return real(*a, **k)

        setattr(module, name, held)

    import hf_merge.write.durable as durable
    import hf_merge.gguf.quant as quant
    import hf_merge.merging as merging
    import hf_merge.write.shards as writer

    calls = []

    def second_file(*a) -> bool:
        calls.append(1)
        return len(calls) == 2

    if phase == "locked":
        hold_in(merging, "open_checkpoint")
    elif phase == "writing":
        hold_in(writer, "write_file", second_file)
    elif phase == "forked":
        hold_in(writer, "write_file", lambda *a: os.getpid() != driver)
    elif phase == "encoding":
        hold_in(quant, "encode")
    elif phase == "syncing":
        hold_in(durable, "sync_file")
    elif phase == "reading":
        import hf_merge.readers.fsdp as fsdp
        import hf_merge.readers.rank_pool as rank_pool

        rank_pool.PARALLEL_PICKLE_BYTES = 0
        hold_in(fsdp, "local_records", lambda *a: os.getpid() != driver)
    elif phase == "placed":
        hold_in(durable, "sync_dir", lambda path: ".hf-merge-tmp-" not in str(path))  # the parent, after the rename
    else:
        raise SystemExit(f"unknown phase {phase}")
    os.environ.pop("HF_MERGE_DEBUG", None)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a shell's `&` ignores it)
    from hf_merge.cli.app import main as cli

    return cli([str(a) for a in sys.argv[4:]])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
