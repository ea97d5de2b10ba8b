"""Streaming safetensors writer: fills planned files tensor by tensor, in place.

Each output file is created at its final size with its header already written, and every tensor
is written at its planned offset: runs of rows straight from the memory-mapped rank files
(``pwrite`` of a zero-copy view when no cast is needed; converted chunks of ~32 MB when it is),
small tensors whole, and large tensors with no row runs through a memory-mapped view of the output
(``read_into``). Memory in use is the tensors in flight, never a shard or the model.

Files are independent, so ``workers > 1`` forks processes that each write a share of the files
(the plan is deterministic and partitions by file).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import LazyCheckpoint
from .plan import INDEX_NAME, FilePlan, ShardPlan

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]


# A tensor without a row fast path is read whole into memory up to this size; larger ones are read
# into a memory-mapped view of the output file instead, so memory stays bounded either way.
WHOLE_TENSOR_LIMIT = 256 << 20


def _pwrite_all(fd: int, tensor: torch.Tensor, offset: int) -> None:
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def write_file(ckpt: LazyCheckpoint, plan: FilePlan, folder: Path, progress: ProgressFn | None = None) -> Path:
    """Write one planned safetensors file into ``folder``.

    Tensors stream into place with ``pwrite``: runs of rows from :meth:`LazyCheckpoint.read_rows`
    (zero-copy from the memory-mapped rank files when no cast is needed, else converted chunks),
    or the whole tensor when it is small. A large tensor without runs is read into a view of the
    memory-mapped output file.
    """
    path = Path(folder) / plan.name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    mapped = None
    try:
        os.pwrite(fd, plan.header, 0)
        os.ftruncate(fd, plan.file_size)
        for spec in plan.specs:
            if spec.nbytes == 0:
                continue
            start = plan.data_start + plan.offsets[spec.name]
            runs = ckpt.read_rows(spec.name, spec.dtype) if spec.shape else None
            if runs is not None:
                row_bytes = spec.nbytes // spec.shape[0]
                for first, rows in runs:
                    _pwrite_all(fd, rows, start + first * row_bytes)
            elif spec.nbytes <= WHOLE_TENSOR_LIMIT or start % spec.dtype.itemsize:
                _pwrite_all(fd, ckpt.read(spec.name, dtype=spec.dtype), start)
            else:
                if mapped is None:
                    mapped = torch.from_file(str(path), shared=True, size=plan.file_size, dtype=torch.uint8)
                ckpt.read_into(spec.name, mapped[start : start + spec.nbytes].view(spec.dtype).view(spec.shape))
            if progress:
                progress(spec.nbytes)
    finally:
        del mapped
        os.close(fd)
    return path


def _worker(ckpt: LazyCheckpoint, files: list[FilePlan], folder: Path, queue) -> None:
    torch.set_num_threads(1)  # forked children: no OpenMP pool, one core each
    try:
        for plan in files:
            write_file(ckpt, plan, folder, progress=lambda n: queue.put(("bytes", n)))
    except BaseException as e:  # hand the typed error to the parent, which re-raises it
        queue.put(("error", e))
        os._exit(1)
    queue.put(("done", None))


def default_workers(n_files: int) -> int:
    return max(1, min(n_files, (os.cpu_count() or 1), 8))


def write_shards(
    ckpt: LazyCheckpoint,
    plan: ShardPlan,
    folder: Path,
    *,
    workers: int | None = None,
    desc: str = "Writing",
) -> list[Path]:
    """Write every file of ``plan`` (and the index when sharded) into ``folder``."""
    from huggingface_hub.utils import tqdm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n = workers or default_workers(len(plan.files))
    n = max(1, min(n, len(plan.files)))
    with tqdm(total=plan.total_size, unit="B", unit_scale=True, desc=desc) as bar:
        if n == 1:
            for fp in plan.files:
                write_file(ckpt, fp, folder, progress=bar.update)
        else:
            _write_parallel(ckpt, plan.files, folder, n, bar.update)
    if plan.index is not None:
        (folder / INDEX_NAME).write_text(json.dumps(plan.index, indent=2, sort_keys=False) + "\n")
    return [folder / fp.name for fp in plan.files]


def _write_parallel(ckpt: LazyCheckpoint, files: list[FilePlan], folder: Path, n: int, update: ProgressFn) -> None:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    # Largest files first, round robin: shares of similar size.
    order = sorted(files, key=lambda f: -f.file_size)
    shares = [order[i::n] for i in range(n)]
    procs = [ctx.Process(target=_worker, args=(ckpt, share, folder, queue), daemon=True) for share in shares]
    for p in procs:
        p.start()
    done = 0
    try:
        while done < len(procs):
            try:
                kind, value = queue.get(timeout=1.0)
            except Exception:  # queue.Empty: check nobody died
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a writer process exited with code {dead[0].exitcode}") from None
                continue
            if kind == "error":
                raise value
            if kind == "bytes":
                update(value)
            else:
                done += 1
        for p in procs:
            p.join()
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"a writer process exited with code {failed[0]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
