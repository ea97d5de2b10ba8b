"""One merge across the ranks of a ``torchrun`` job (several processes, several nodes).

``torchrun --nnodes N --nproc-per-node M -m hf_merge merge SOURCE TARGET`` (or ``hf-merge merge``
launched by torchrun) runs the same command on every rank. With ``--dist-writers node`` (the
default) the start-up is paid once per node (:func:`torchrun_launch`, from the environment alone,
before torch is imported): on one node local rank 0 runs the single-process merge (forked writers
on the node's CPUs) and the other ranks return at once; across nodes only each node's local rank 0
takes part, as rank ``GROUP_RANK`` of a job of ``GROUP_WORLD_SIZE`` node leaders whose default
group meets in the store torchrun already hosts at ``MASTER_ADDR:MASTER_PORT``. Inside a program
that runs torch.distributed (``distributed=True``) every rank joins; when they all share one host,
rank 0 merges alone and the others wait for its result (:meth:`Job.alone`).

What follows is the job of the ranks that take part. Each opens the source and plans
the output from specs alone, so every rank knows every output file without talking to the others;
then each writes a share of the files, balanced by bytes, into one temporary folder beside the
target (on a file system all ranks see). A gloo process group (CPU only; timeout
``HF_MERGE_DIST_TIMEOUT`` seconds, default 1800) carries three small exchanges:

1. after planning: every rank's outcome (an error line or the plan's fingerprint) and rank 0's
   temporary folder;
2. after writing: every rank's outcome and its files' digests;
3. after rank 0 has written index, config, side files, provenance and card and moved the folder
   into place: its outcome.

Any failure is known to every rank at the next exchange, and every rank then raises
:class:`~hf_merge.errors.DistributedError` naming the failed rank (the failed rank raises its own
error). A rank that dies breaks the group: the others get an error from gloo (at once, or at the
timeout) and raise too. Rank 0 only moves the folder into place after exchange 2 succeeded, so a
failure anywhere leaves no target. Progress is one bar on rank 0 counting every rank's bytes
(ranks add to a counter in the job's key-value store).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from .. import forks
from ..errors import DistributedError, HfMergeError
from ..progress import count, progress_bar
from ..settings import DIST_TIMEOUT_VAR as TIMEOUT_VAR
from ..settings import DISTRIBUTED_VAR as SWITCH_VAR  # "1": share merges across the ranks of a running job; "0": never
from ..settings import dist_timeout_s, distributed as distributed_from_environment

if TYPE_CHECKING:  # a rank that only decides its role (torchrun_launch) imports no more than this module's top
    import datetime as _dt

logger = logging.getLogger(__name__)

PROGRESS_FLUSH_BYTES = 64 << 20


def launched_by_torchrun(environ: "dict[str, str] | None" = None) -> bool:
    """True when torchrun (or any ``env://`` launcher: Slurm scripts, ...) started this process as
    one rank of a job of more than one process."""
    env = os.environ if environ is None else environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world > 1 and "RANK" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")


class Launch(NamedTuple):
    """What one rank of a torchrun merge does, decided from the launcher's environment alone (no
    torch import, no source read). ``role``:

    - ``"alone"``: every rank is on this node and this is local rank 0: the single-process merge;
    - ``"idle"``: another process merges for this node: nothing to do;
    - ``"leader"``: local rank 0 of one of several nodes: one rank of a job of the node leaders;
    - ``"every"``: every rank takes part (``--dist-writers rank``, or a launcher that does not say
      which ranks share a node).
    """

    role: str
    rank: int
    world_size: int
    nodes: int
    node_rank: int

    def environ(self) -> dict[str, str]:
        """The job as this process should see it: one process (``alone``), or rank ``node_rank`` of
        the ``nodes`` leaders, whose default group then meets at the same MASTER_ADDR:MASTER_PORT."""
        if self.role == "alone":
            return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        if self.role == "leader":
            return {"RANK": str(self.node_rank), "WORLD_SIZE": str(self.nodes), "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": "1"}
        return {}

    def describe(self, cpus: int) -> str:
        """One line for rank 0: what was chosen (``alone`` or ``leader``; ``every`` rank's job says it itself)."""
        where = f"torchrun: {self.world_size} ranks on {count(self.nodes, 'node')}"
        others = self.world_size - self.nodes
        if self.nodes == 1:
            return (f"{where}: rank 0 merges alone, with forked writers on its {cpus} CPUs; "
                    f"{_other_ranks(self.world_size)} had nothing to do (on one node, `hf-merge merge` without "
                    "torchrun does the same and skips torchrun's start-up)")
        return (f"{where}: local rank 0 of each node merges ({self.nodes} processes, each with forked writers on its "
                f"node's CPUs); the other {others} ranks had nothing to do")


def _other_ranks(world_size: int) -> str:
    return f"rank{'s 1-' if world_size > 2 else ' '}{world_size - 1}"


def torchrun_launch(writers: str = "node", environ: "dict[str, str] | None" = None) -> "Launch | None":
    """This rank's part in a merge launched by torchrun (None when not launched so, or when
    ``HF_MERGE_DISTRIBUTED`` decides). With ``writers="node"`` the start-up (torch import, opening
    and planning the source, the process group) is paid once per node: on one node
    (``LOCAL_WORLD_SIZE == WORLD_SIZE``) local rank 0 runs the single-process merge and the others
    return at once; across nodes only each node's local rank 0 joins, as rank ``GROUP_RANK`` of
    ``GROUP_WORLD_SIZE``."""
    env = os.environ if environ is None else environ
    if not launched_by_torchrun(env) or env.get(SWITCH_VAR, "") in ("0", "1"):
        return None
    known = {k: _int_or_none(env.get(k)) for k in LAUNCH_VARS}
    rank, world, local_rank = known["RANK"], known["WORLD_SIZE"], known["LOCAL_RANK"]
    nodes, node_rank = known["GROUP_WORLD_SIZE"], known["GROUP_RANK"]
    if known["LOCAL_WORLD_SIZE"] == world:
        nodes, node_rank = 1, 0
    if writers != "node" or rank is None or local_rank is None or nodes is None or node_rank is None:
        return Launch("every", rank or 0, world or 0, nodes or 0, node_rank or 0)
    if local_rank != 0:
        return Launch("idle", rank, world, nodes, node_rank)
    return Launch("alone" if nodes == 1 else "leader", rank, world, nodes, node_rank)


def _int_or_none(value: "str | None") -> "int | None":
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def enter_torchrun_merge(writers: str = "node") -> bool:
    """The CLI's first step of a merge under torchrun: False when this rank has nothing to do (another
    process merges for its node); otherwise this process's environment now describes the job it
    takes part in (:meth:`Launch.environ`). Rank 0 logs the choice. Reads nothing but the environment."""
    launch = torchrun_launch(writers)
    if launch is None or launch.role == "every":
        return True
    if launch.rank == 0:
        from ..forks import usable_cpus

        logger.info(launch.describe(usable_cpus()))
    os.environ.update(launch.environ())
    return launch.role != "idle"


def join_job(distributed: bool | None = None) -> "Job | None":
    """The distributed job this process belongs to, or None for a plain single-process merge.

    ``distributed=None``: a job only when launched by torchrun and no process group exists yet
    (the default group is then initialised here, gloo, and destroyed when the merge ends). A
    program that already initialised ``torch.distributed`` (any backend) passes True on every
    rank: a new gloo group over the same ranks is used, the program's group is left as it was.
    ``False``: never (e.g. only rank 0 merges). ``HF_MERGE_DISTRIBUTED=1`` / ``0`` in the environment
    stands for True / False when ``distributed`` is None (for the CLI run inside such a program).
    """
    if distributed is None:
        distributed = distributed_from_environment()
    if distributed is False or (distributed is None and not launched_by_torchrun()):
        return None
    import torch.distributed as dist

    if not dist.is_available():
        if distributed:
            raise DistributedError("distributed=True, but this torch build has no torch.distributed")
        return None
    if distributed is None and dist.is_initialized():
        return None  # the program runs its own job: only distributed=True shares the merge
    import datetime as _dt

    timeout = _dt.timedelta(seconds=dist_timeout_s())
    if dist.is_initialized():
        if dist.get_world_size() == 1:
            return None
        group = dist.new_group(backend="gloo", timeout=timeout)
        return Job(group=group, owns_group=False, timeout=timeout)
    if not launched_by_torchrun():
        raise DistributedError(
            "distributed=True, but no process group exists and RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are not "
            "set; launch with torchrun, or call torch.distributed.init_process_group first"
        )
    try:
        dist.init_process_group("gloo", timeout=timeout)
    except Exception as e:  # noqa: BLE001 - rendezvous failures become one line
        raise DistributedError(f"could not join the torchrun job's process group ({_first_line(e)}); check MASTER_ADDR/MASTER_PORT and that every rank started") from None
    return Job(group=None, owns_group=True, timeout=timeout)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, HfMergeError) else _first_line(e)


def assign_by_bytes(sizes: list[int], ranks: int) -> list[list[int]]:
    """Split items (by index) into ``ranks`` shares of balanced total size.

    Largest first, each to the share with the fewest bytes so far (ties: the lowest rank), so
    every rank computes the same shares from the same plan.
    """
    shares: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        shares[r].append(i)
        loads[r] += sizes[i]
    return [sorted(s) for s in shares]


WRITERS = ("node", "rank")  # who writes output files: the first rank of each node, or every rank


def writing_ranks(hosts: list[str], writers: str = "node") -> list[int]:
    """The ranks that write output files, in rank order: with ``"node"`` the first rank on each host
    (it writes its node's share with forked writers on all of that node's CPUs: on one node that is
    the single-process merge, so a torchrun merge is never slower than one process on the same node);
    with ``"rank"`` every rank (the share of each, where more writers help: a parallel file system)."""
    if writers not in WRITERS:
        raise HfMergeError(f"distributed writers {writers!r}: expected one of {', '.join(WRITERS)}")
    if writers == "rank":
        return list(range(len(hosts)))
    first: dict[str, int] = {}
    for rank, host in enumerate(hosts):
        first.setdefault(host, rank)
    return sorted(first.values())


def plan_fingerprint(files: list[Any]) -> str:
    """sha256 over every planned file's name and header: equal on ranks that planned the same output."""
    import hashlib

    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + bytes(f.header) + b"\0")
    return h.hexdigest()


class Job:
    """This process's place in a distributed merge: rank, world size and the gloo group."""

    consequence = "no target was written"  # what a failure means, in every rank's error line

    def __init__(self, *, group: Any, owns_group: bool, timeout: "_dt.timedelta"):
        import socket

        import torch.distributed as dist

        self.failed = False  # an exchange reported a failure: every rank knows, none waits for more
        self.group = group
        self.owns_group = owns_group
        self.timeout = timeout
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.host = socket.gethostname()
        self.hosts = [self.host]
        self._store = _default_store()
        self._sent: list[Any] = []  # every tensor an exchange handed to gloo, kept until the group is gone (_gather)
        if self.rank != 0:  # notes once, from rank 0; warnings and errors from every rank
            log = logging.getLogger("hf_merge")
            self._log_level = log.level
            log.setLevel(max(log.level, logging.WARNING))

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        if self.rank != 0:
            logging.getLogger("hf_merge").setLevel(self._log_level)
        if dist.is_initialized() and (self.owns_group or self.group is not None):
            try:
                if exc[0] is None and not self.failed:
                    # leave together: no rank tears down its end of the group (or the launcher's store)
                    # while another still talks to it
                    dist.barrier(group=self.group)
                # the program's own default group stays; the gloo group made for this job goes (left
                # to interpreter exit, its threads can abort the process while it is torn down)
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - a broken group is already reported
                pass
        self.group = None  # its last reference goes here, while self._sent still holds the tensors (_gather)

    # -- exchanges ---------------------------------------------------------------------------
    def exchange(self, error: BaseException | None, payload: Any = None) -> list[Any]:
        """Every rank's ``payload``; raises on every rank when any rank reports an error."""
        import torch.distributed as dist

        mine = {"rank": self.rank, "host": self.host, "error": _describe(error) if error else None, "payload": payload}
        try:
            gathered = self._gather(mine)
        except Exception as e:  # noqa: BLE001 - a dead or hung rank breaks the group
            self.failed = True
            if error is not None:
                raise error
            raise DistributedError(
                f"lost contact with the other ranks ({_first_line(e)}): a rank died or did not answer within "
                f"{self.timeout.total_seconds():.0f} s ({TIMEOUT_VAR}); {self.consequence}"
            ) from None
        self.hosts = [g["host"] for g in gathered]
        failed = [g for g in gathered if g["error"]]
        self.failed = bool(failed)
        if error is not None:
            raise error
        if failed:
            first = failed[0]
            raise DistributedError(
                f"rank {first['rank']} of {self.world_size} (on {first['host']}) failed: {first['error']}; {self.consequence}"
            )
        return [g["payload"] for g in gathered]

    def _gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, pickled as ``torch.distributed.all_gather_object`` does, but in tensors
        this job holds until its group is destroyed. Before torch 2.8 a gloo group is destroyed with
        the GIL held while it joins its threads; a thread that still drops a finished collective frees
        the last reference to that collective's tensor there, which needs the GIL when Python made the
        tensor: both wait forever (torch 2.6, tests/test_distributed.py: a rank of a 3-rank verify hung at the
        job's end). A tensor Python still holds is only unreferenced by that thread, without the GIL.
        The payloads come from the job's own ranks, as all_gather_object's do."""
        import pickle

        import torch
        import torch.distributed as dist

        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._sent += [size, *sizes]
        dist.all_gather(sizes, size, group=self.group)
        width = max(int(n) for n in sizes)
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
        self._sent += [mine, *every]
        dist.all_gather(every, mine, group=self.group)
        return [pickle.loads(t[: int(n)].numpy().tobytes()) for t, n in zip(every, sizes)]

    def share(self, sizes: list[int], work: Callable[[list[int]], Any]) -> list[Any]:
        """``work(indices)`` on this rank's share of the items (balanced by ``sizes``, as the merge shares
        its files); every rank's result, in rank order, on every rank. A failure anywhere fails all."""
        mine = assign_by_bytes(sizes, self.world_size)[self.rank]
        result = error = None
        try:
            result = work(mine)
        except BaseException as e:  # noqa: BLE001 - reported to every rank
            error = e
        return self.exchange(error, result)

    def run(self, job: Callable[[], Any]) -> Any:
        """``job()`` on every rank, whose :meth:`share` calls are its only collectives; ends with an
        exchange, so an error a rank raises between shares reaches the others too (at their next
        share or at the end: every exchange is the same gather)."""
        try:
            result = job()
        except BaseException as e:  # noqa: BLE001 - told to the others unless they know already
            if self.failed:
                raise
            self.exchange(e)
            raise
        self.exchange(None)
        return result

    def on_one_node(self) -> bool:
        """True when every rank runs on this host (one exchange of the host names)."""
        self.exchange(None)
        return len(set(self.hosts)) == 1

    def alone(self, work: Callable[[], Any]) -> Any:
        """Every rank on one node: ``work()`` (the single-process merge, with its forked writers) on
        rank 0 alone; the other ranks read nothing, wait for its result (up to the job's timeout) and
        return it with their own rank. A failure on rank 0 fails every rank."""
        result = error = None
        if self.rank == 0:
            logger.info(f"torch.distributed: {self.world_size} ranks on 1 node: rank 0 merges alone, with forked "
                        f"writers on its CPUs; the other ranks read nothing and wait for its result")
            try:
                result = work()
            except BaseException as e:  # noqa: BLE001 - reported to every rank
                error = e
        first = self.exchange(error, result)[0]
        return _with_rank(first, self.rank)

    # -- the merge ---------------------------------------------------------------------------
    def merge(
        self,
        prepare: Callable[[], Any],
        target: Path,
        options: Any,
        *,
        overwrite: bool,
        result: Callable[[Any, bool], Any],
    ) -> Any:
        """The distributed executor of any output (:mod:`hf_merge.pipeline`): ``prepare()`` it on every
        rank, write this rank's share of its planned files (:func:`writing_ranks`), let rank 0 finish
        and commit; ``result(output, main)`` on every rank. ``options``: the merge's
        :class:`~hf_merge.options.MergeOptions` (workers, checksums, dist_writers). See the module docstring."""
        from .atomic import stage
        from ..pipeline import Writing, warm_up
        from ..publish.preload import preload

        writers = options.dist_writers
        if writers == "rank":  # every rank on a node reads the source: their reader processes share its CPUs
            forks.share_cpus(_int_or_none(os.environ.get("LOCAL_WORLD_SIZE")) or 1)

        main = self.rank == 0
        output = tmp = staged = None
        error = None
        try:
            if main:  # locked before the source is read (see hf_merge.write.atomic)
                staged = stage(target, overwrite=overwrite)
                tmp = staged.tmp
            output = prepare()
        except BaseException as e:  # noqa: BLE001 - reported to every rank
            error = e
        try:
            files = list(output.plan()) if output is not None else []
            info = self.exchange(error, {"plan": plan_fingerprint(files), "tmp": str(tmp)})
            if len({i["plan"] for i in info}) != 1:
                odd = next(r for r, i in enumerate(info) if i["plan"] != info[0]["plan"])
                raise DistributedError(
                    f"rank {odd} planned different output files than rank 0 (different source files or options "
                    "on its node?); every rank must see the same checkpoint; no target was written"
                )
            tmp = Path(info[0]["tmp"])
            chosen = writing_ranks(self.hosts, writers)
            share = []
            if self.rank in chosen:
                shares = assign_by_bytes([f.data_size for f in files], len(chosen))
                share = [files[i] for i in shares[chosen.index(self.rank)]]
            here = sum(1 for r in chosen if self.hosts[r] == self.host)
            finishing = preload(first=warm_up(output)) if main else None  # rank 0's finish imports, meanwhile
            digests: dict[str, str | None] = {}
            error = None
            with self._progress(sum(f.data_size for f in files), str(tmp)) as progress:
                try:
                    if share:
                        how = Writing(workers=options.workers, checksum=options.checksum(), progress=progress.update,
                                      processes_here=here)
                        digests = output.write(tmp, share, how)
                    progress.flush()
                except BaseException as e:  # noqa: BLE001 - reported to every rank
                    error = e
                gathered = self.exchange(error, digests)  # rank 0's bar runs until every rank is done
            error = None
            if main:
                try:
                    finishing.join()
                    every = {k: v for d in gathered for k, v in d.items()}
                    output.provenance["distributed"] = {
                        "world_size": self.world_size,
                        "hosts": len(set(self.hosts)),
                        "writers": writers,
                        "files_per_rank": [len(d) for d in gathered],
                        "backend": "torch.distributed (gloo)",
                    }
                    note = _writers_note(self.world_size, self.hosts, chosen, writers)
                    output.notes.append(note)
                    logger.info(note)
                    output.finish(tmp, {f.name: every[f.name] for f in files})
                    staged.commit()
                    staged = None
                except BaseException as e:  # noqa: BLE001 - reported to every rank
                    error = e
            self.exchange(error)
            return _with_rank(result(output, main), self.rank)
        finally:
            if staged is not None:
                staged.discard()
            if output is not None:
                output.close()

    def _progress(self, total: int, key: str) -> "_Progress":
        return _Progress(self._store, f"hf_merge/bytes/{key}", total, show=self.rank == 0)


def _writers_note(world_size: int, hosts: list[str], chosen: list[int], writers: str) -> str:
    nodes = len(set(hosts))
    where = f"{world_size} ranks on {count(nodes, 'node')}"
    if writers == "node":
        ranks = ", ".join(map(str, chosen))
        return (f"{where}: files written by rank{'s' if len(chosen) > 1 else ''} {ranks}, one process per node with "
                "forked writers on its CPUs (--dist-writers rank: every rank writes a share)")
    return f"{where}: every rank writes a share of the files (--dist-writers rank)"


def _with_rank(result: Any, rank: int) -> Any:
    result.rank = rank
    return result


def _default_store() -> Any:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API; without it rank 0's bar counts its own bytes
        return None


class _Progress:
    """Bytes written by every rank, counted in the job's store; a bar on rank 0 only."""

    def __init__(self, store: Any, key: str, total: int, *, show: bool):
        self._store, self._key, self._total, self._show = store, key, total, show
        self._pending = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._bar = self._thread = None

    def __enter__(self) -> "_Progress":
        if self._show:  # a bar on a terminal only, plain lines elsewhere (as a one-process merge)
            self._bar = progress_bar(total=self._total, desc="Merging")
            if self._store is not None:
                self._thread = threading.Thread(target=self._poll, name="hf-merge progress", daemon=True)
                self._thread.start()
        return self

    def update(self, n: int) -> None:
        if self._store is None:
            if self._bar is not None:
                self._bar.update(n)
            return
        self._pending += n
        now = time.monotonic()
        if self._pending >= PROGRESS_FLUSH_BYTES or now - self._last > 0.5:
            self.flush()
            self._last = now

    def flush(self) -> None:
        """Hand the bytes counted so far to the store (before telling the others this rank is done)."""
        if self._pending and self._store is not None:
            self._store.add(self._key, self._pending)
            self._pending = 0

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            self._show_total()

    def _show_total(self) -> None:
        try:
            done = self._store.add(self._key, 0)
        except Exception:  # noqa: BLE001 - the store went away with a dead rank; the exchange reports it
            return
        if self._bar is not None and done > self._bar.n:
            self._bar.update(min(done, self._total) - self._bar.n)

    def __exit__(self, *exc: object) -> None:
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - see _show_total
            pass
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._show_total()
        if self._bar is not None:
            self._bar.close()
