"""A merge across the ranks of a torch.distributed job (torchrun, one or two "nodes").

Real runs: torchrun launches the ranks, each plans the same output, writes its share of the
files, and rank 0 finishes the folder. Every output must be byte-identical to the single-process
merge of the same checkpoint (hf_merge.json aside: its time stamp and the "distributed" record).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_merge import merge
from hf_merge.write.distributed import Launch, assign_by_bytes, launched_by_torchrun, torchrun_launch, writing_ranks
from helpers import no_leftovers

REPO = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("dist_driver.py")
SHARD = "60KB"  # the tiny fixtures become several output files
TIMEOUT_S = "600"  # HF_MERGE_DIST_TIMEOUT, a hang guard only: on a loaded machine a rank may wait minutes for another


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_DISABLE_PROGRESS_BARS="1", HF_MERGE_DIST_TIMEOUT=TIMEOUT_S,
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    return env


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "0.1", *args]


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.Popen:
    """Start ``cmd`` in its own session; on timeout kill the session and every process below it:
    torchrun starts each worker in a session of its own, and a hung worker left alive holds the
    output pipe open (the test then never ends: seen with a rank hung on torch 2.6)."""
    proc = subprocess.Popen(cmd, env=kwargs.pop("env", _env()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, **kwargs)
    try:
        proc.output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        for pid in _descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.output = proc.communicate()[0]
        pytest.fail(f"{' '.join(cmd[:8])} ... did not finish in {timeout} s:\n{proc.output[-3000:]}")
    return proc


def _run_jobs(jobs: list[dict], tmp_path: Path, *, ranks: int, own_group: bool = True) -> dict[tuple[int, int], dict]:
    """``jobs`` (see dist_driver.py) in one torchrun job of ``ranks`` processes that initialised
    torch.distributed itself (``own_group``; else one job, as ``torchrun -m hf_merge`` runs it);
    ``{(job, rank): {"code", "stdout", "stderr", "torch"}}``."""
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    results = tmp_path / "results"
    results.mkdir()
    proc = _run(_torchrun("--nproc-per-node", str(ranks), str(DRIVER), *(["--own-group"] if own_group else []),
                          str(tmp_path / "jobs.json"), str(results)), timeout=600)
    assert proc.returncode == 0, proc.output
    return {(i, r): json.loads((results / f"{i}.rank{r}.json").read_text()) for i in range(len(jobs)) for r in range(ranks)}


def assert_same_folder(got: Path, want: Path, *, shared: bool = True) -> None:
    """Byte-identical files; hf_merge.json equal but for "created" and (``shared``: the files were
    written by several ranks) the "distributed" record."""
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    assert sum(n.endswith(".safetensors") for n in names) >= 2, names  # really split across ranks
    for name in names:
        if name == "hf_merge.json":
            a, b = json.loads((got / name).read_text()), json.loads((want / name).read_text())
            if shared:
                assert a.pop("distributed")["world_size"] >= 2
            a.pop("created"), b.pop("created")
            assert a == b
        else:
            assert (got / name).read_bytes() == (want / name).read_bytes(), name


@pytest.fixture(scope="module")
def fsdp_single(qwen2_fp32_ws2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "fsdp"
    merge(qwen2_fp32_ws2.actor, out, max_shard_size=SHARD)
    return out


def test_assign_by_bytes_balances_and_agrees():
    assert assign_by_bytes([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]
    assert assign_by_bytes([3, 3, 2, 2, 2], 2) == [[0, 2, 4], [1, 3]]
    assert assign_by_bytes([1], 3) == [[0], [], []]
    assert launched_by_torchrun({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert not launched_by_torchrun({"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert not launched_by_torchrun({})


def test_one_writing_rank_per_node_unless_every_rank_is_asked_for():
    assert writing_ranks(["a", "a", "a", "a"]) == [0]
    assert writing_ranks(["a", "a", "b", "b", "c"]) == [0, 2, 4]
    assert writing_ranks(["b", "a", "b", "a"]) == [0, 1]
    assert writing_ranks(["a", "a", "b"], "rank") == [0, 1, 2]


def test_torchrun_launch_from_the_environment_alone():
    """Which process merges, from torchrun's variables: once per node unless every rank is asked for."""
    job = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
           "GROUP_WORLD_SIZE": "1"}
    alone = torchrun_launch("node", {**job, "RANK": "0", "LOCAL_RANK": "0"})
    assert alone == Launch("alone", 0, 4, 1, 0)
    assert alone.environ()["WORLD_SIZE"] == "1"
    assert alone.describe(2) == ("torchrun: 4 ranks on 1 node: rank 0 merges alone, with forked writers on its 2 CPUs; "
                                 "ranks 1-3 had nothing to do (on one node, `hf-merge merge` without torchrun does "
                                 "the same and skips torchrun's start-up)")
    assert torchrun_launch("node", {**job, "RANK": "3", "LOCAL_RANK": "3"}).role == "idle"
    assert torchrun_launch("rank", {**job, "RANK": "3", "LOCAL_RANK": "3"}).role == "every"
    assert torchrun_launch("node", {**job, "RANK": "1", "LOCAL_RANK": "1", "HF_MERGE_DISTRIBUTED": "1"}) is None
    # 2 nodes x 2 ranks: local rank 0 of each node becomes rank GROUP_RANK of the 2 node leaders
    nodes = {**job, "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    leader = torchrun_launch("node", {**nodes, "RANK": "2", "LOCAL_RANK": "0"})
    assert leader.role == "leader" and leader.environ() == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                                            "LOCAL_WORLD_SIZE": "1"}
    assert torchrun_launch("node", {**nodes, "RANK": "3", "LOCAL_RANK": "1"}).role == "idle"
    # a launcher that does not say which ranks share a node: every rank takes part, as before
    assert torchrun_launch("node", {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "2", "RANK": "1"}).role == "every"


def test_idle_rank_is_read_from_the_command_line_before_the_parser(monkeypatch):
    """Under torchrun a rank with nothing to do is known from the raw command line; anything less
    plain than `merge ... [--dist-writers node]` is left to the parser (which decides the same)."""
    from hf_merge.cli.app import idle_torchrun_rank

    src, out = "ckpts/", "./merged"
    assert not idle_torchrun_rank(["merge", src, out])  # not launched by torchrun
    job = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "RANK": "2",
           "LOCAL_RANK": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}
    for k, v in job.items():
        monkeypatch.setenv(k, v)
    for argv in (["merge", src, out], ["-q", "merge", src, out, "--dist-writers", "node"], [src, out, "-q"],
                 ["merge", src, out, "--dist-writers=node"], ["--backend", "fsdp", "--local_dir", src]):
        assert idle_torchrun_rank(argv), argv
    for argv in (["merge", src, out, "--dist-writers", "rank"], ["merge", src, out, "--dist-writers=rank"],
                 ["merge", src, out, "--dist-w", "node"], ["merge", "-h"], ["verify", out, "--against", src],
                 ["inspect", src], ["ckpts", "merged"], ["merge", src, out, "--dist-writers"], []):
        assert not idle_torchrun_rank(argv), argv
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    assert not idle_torchrun_rank(["merge", src, out])  # rank 0 merges


@pytest.mark.compat  # torch-runtime behaviour: also under make compat (torch 2.6, 2.15)
def test_the_exchanges_tensors_outlive_the_jobs_group(monkeypatch):
    """Every tensor a job's exchanges hand to gloo is still alive when its group is destroyed. Before
    torch 2.8 a gloo group is destroyed with the GIL held while it joins its threads; a thread that
    then frees the last reference to a tensor Python made needs the GIL: the rank hangs (torch 2.6:
    one rank of the 3-rank verify below never finished, stuck in ~ProcessGroupGloo)."""
    import datetime
    import weakref

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from hf_merge.write.distributed import Job

    handed: list[weakref.ref] = []
    alive_at_teardown: list[int] = []
    all_gather, destroy = distributed_c10d.all_gather, dist.destroy_process_group

    def recording_all_gather(tensor_list, tensor, *args, **kwargs):  # what torch's all_gather_object calls too
        handed.extend(weakref.ref(t) for t in (*tensor_list, tensor))
        return all_gather(tensor_list, tensor, *args, **kwargs)

    def recording_destroy(group=None):
        destroy(group)
        alive_at_teardown.append(sum(r() is not None for r in handed))

    for module in (dist, distributed_c10d):
        monkeypatch.setattr(module, "all_gather", recording_all_gather)
    monkeypatch.setattr(dist, "destroy_process_group", recording_destroy)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with Job(group=dist.new_group(backend="gloo"), owns_group=False, timeout=datetime.timedelta(seconds=60)) as job:
            assert job.exchange(None, {"plan": "abc", "tmp": None}) == [{"plan": "abc", "tmp": None}]
            assert job.share([3, 1], lambda mine: sorted(mine)) == [[0, 1]]
        assert handed and alive_at_teardown == [len(handed)], (alive_at_teardown, len(handed))
    finally:
        destroy()


@pytest.mark.slow  # a torchrun job: a launcher and 2-4 ranks, each importing torch
def test_one_node_torchrun_merge_runs_in_one_process(qwen2_fp32_ws2, fsdp_single, tmp_path):
    """`torchrun --nproc-per-node 3` running the CLI: rank 0 merges alone and says so; ranks 1 and 2
    return before importing torch, the CLI's parser or opening the source (rank 2 is handed a source
    that does not exist: it would fail if it read it). The output equals a single-process merge."""
    target = tmp_path / "merged"
    jobs = [{"argv": ["merge", str(qwen2_fp32_ws2.actor), str(target), "--max-shard-size", SHARD],
             "missing_source_on_rank": 2}]
    outcome = _run_jobs(jobs, tmp_path, ranks=3, own_group=False)
    assert [outcome[0, r]["code"] for r in range(3)] == [0, 0, 0], outcome
    assert "torchrun: 3 ranks on 1 node: rank 0 merges alone" in outcome[0, 0]["stderr"], outcome[0, 0]
    assert outcome[0, 0]["torch"] and not outcome[0, 1]["torch"] and not outcome[0, 2]["torch"], outcome
    assert outcome[0, 0]["parser"] and not outcome[0, 1]["parser"] and not outcome[0, 2]["parser"], outcome
    for r in (1, 2):
        assert not outcome[0, r]["stderr"] and not outcome[0, r]["stdout"], outcome[0, r]
    assert_same_folder(target, fsdp_single, shared=False)
    assert "distributed" not in json.loads((target / "hf_merge.json").read_text())


@pytest.mark.slow  # a torchrun job: a launcher and 2-4 ranks, each importing torch
def test_two_nodes_c10d_rendezvous(qwen2_fp32_ws2, fsdp_single, tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 2 -m hf_merge merge` twice, rendezvous on localhost.

    Only local rank 0 of each "node" takes part: the two meet as ranks 0 and 1 of a job of the node
    leaders (in the store torchrun's agents host), find that they share a host, and rank 0 merges
    alone; the other two ranks return at once.

    The rendezvous store is hosted here, as on a cluster where it outlives every node's agent:
    when one of the two agents hosts it (torchrun's default on the endpoint's machine), that agent
    may leave torchelastic's exit barrier and take the store down while the other agent still
    waits on it; that agent then fails after the 300 s barrier timeout (torch's race, pytorch#69520),
    after a complete merge."""
    from torch.distributed import TCPStore

    target = tmp_path / "merged"
    port = _free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    cmd = _torchrun("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"127.0.0.1:{port}", "--rdzv-conf", "is_host=false,join_timeout=120,close_timeout=30",
                    "--rdzv-id", "hf-merge-test", "-m", "hf_merge", "merge", str(qwen2_fp32_ws2.actor), str(target),
                    "--max-shard-size", SHARD)
    nodes = [subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for _ in range(2)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        del store
    assert [p.returncode for p in nodes] == [0, 0], logs
    assert_same_folder(target, fsdp_single, shared=False)
    # both "nodes" run on this host: one process wrote every file (with its forked writers), and said so
    said = "torchrun: 4 ranks on 2 nodes: local rank 0 of each node merges (2 processes"
    assert sum(log.count(said) for log in logs) == 1, logs
    assert sum(log.count("2 ranks on 1 node: rank 0 merges alone") for log in logs) == 1, logs
    assert sum(log.count("wrote ") for log in logs) == 1, logs  # one report, from rank 0
    assert not any("exit barrier" in log.lower() and "error" in log.lower() for log in logs), logs


@pytest.mark.slow  # a torchrun job: a launcher and 2-4 ranks, each importing torch
def test_every_rank_writing_shows_no_bar_without_a_terminal(qwen2_fp32_ws2, fsdp_single, tmp_path):
    """`torchrun --nproc-per-node 2 -m hf_merge merge ... --dist-writers rank 2>log`: progress bars
    left on (no HF_HUB_DISABLE_PROGRESS_BARS), the output a pipe. Rank 0's bar follows the same
    terminal check as a one-process merge: no tqdm lines (``\\rMerging: 0%|...``) in the log."""
    target = tmp_path / "merged"
    env = {k: v for k, v in _env().items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    proc = _run(_torchrun("--nproc-per-node", "2", "-m", "hf_merge", "merge", str(qwen2_fp32_ws2.actor), str(target),
                          "--max-shard-size", SHARD, "--dist-writers", "rank"), timeout=600, env=env)
    assert proc.returncode == 0, proc.output
    assert "every rank writes a share of the files" in proc.output, proc.output
    assert "Merging" not in proc.output and "%|" not in proc.output, proc.output  # (text mode reads \r as \n)
    assert_same_folder(target, fsdp_single)


@pytest.mark.slow  # a torchrun job: a launcher and 2-4 ranks, each importing torch
def test_three_ranks_fsdp_megatron_quantized(qwen2_fp32_ws2, fsdp_single, megatron_root, tmp_path):
    """One torchrun --nproc-per-node 3 job: FSDP, Megatron and nf4 merges, then a rank without the source."""
    pytest.importorskip("bitsandbytes")
    import make_megatron_checkpoint as mk

    variant = next(v for v in mk.DEFAULT_VARIANTS if v.name == "qwen2_v1")
    megatron_src = megatron_root / variant.name / variant.role
    fsdp_src = qwen2_fp32_ws2.actor
    singles = tmp_path / "single"
    merge(megatron_src, singles / "megatron", max_shard_size=SHARD)
    merge(fsdp_src, singles / "nf4", max_shard_size=SHARD, quantize="nf4")
    out = tmp_path / "dist"
    jobs = [  # in one job that initialised torch.distributed itself (as a training script would)
        {"argv": ["merge", str(megatron_src), str(out / "megatron"), "--max-shard-size", SHARD]},
        {"argv": ["merge", str(fsdp_src), str(out / "nf4"), "--max-shard-size", SHARD, "--quantize", "nf4"]},
        {"argv": ["merge", str(fsdp_src), str(out / "blind"), "--max-shard-size", SHARD, "--dist-writers", "rank"],
         "missing_source_on_rank": 1},
        {"argv": ["merge", str(fsdp_src), str(out / "fsdp"), "--max-shard-size", SHARD, "--dist-writers", "rank"]},
        {"argv": ["merge", str(fsdp_src), str(out / "alone"), "--max-shard-size", SHARD], "missing_source_on_rank": 2},
    ]
    outcome = _run_jobs(jobs, tmp_path, ranks=3)
    for i in (0, 1, 3, 4):
        assert [outcome[i, r]["code"] for r in range(3)] == [0, 0, 0], outcome
    assert_same_folder(out / "fsdp", fsdp_single)
    shared = json.loads((out / "fsdp" / "hf_merge.json").read_text())["distributed"]
    assert shared["writers"] == "rank" and sum(n > 0 for n in shared["files_per_rank"]) >= 2, shared
    # --dist-writers node (the default) on one node: rank 0 runs the single-process merge, the
    # others wait for it without reading the source (rank 2's does not exist); one note says so
    assert_same_folder(out / "megatron", singles / "megatron", shared=False)
    assert_same_folder(out / "nf4", singles / "nf4", shared=False)
    assert_same_folder(out / "alone", fsdp_single, shared=False)
    assert "3 ranks on 1 node: rank 0 merges alone" in outcome[4, 0]["stderr"], outcome[4, 0]
    assert not outcome[4, 1]["stderr"] + outcome[4, 1]["stdout"] + outcome[4, 2]["stderr"], outcome
    # a rank that cannot see the source: every rank fails with one line, nothing is left behind
    for r in range(3):
        assert outcome[2, r]["code"] == 2
        lines = [ln for ln in outcome[2, r]["stderr"].splitlines() if ln.startswith("error: ")]
        assert len(lines) == 1 and "not-mounted-here does not exist" in lines[0], outcome[2, r]
        if r != 1:
            assert lines[0].startswith("error: rank 1 of 3 "), lines
    assert not (out / "blind").exists() and no_leftovers(out / "blind")


def test_killed_rank_fails_every_rank_and_leaves_no_target(qwen2_fp32_ws2, tmp_path):
    """Two ranks started by hand (env:// as torchrun sets it); rank 1 is SIGKILLed when it starts
    writing. Rank 0 must notice by itself, exit non-zero, and leave neither a target nor a temporary."""
    target = tmp_path / "merged"
    jobs = [{"argv": ["merge", str(qwen2_fp32_ws2.actor), str(target), "--max-shard-size", SHARD, "--dist-writers", "rank"],
             "die_on_rank": 1}]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    port = str(_free_port())
    procs = [
        subprocess.Popen([sys.executable, str(DRIVER), str(tmp_path / "jobs.json"), str(tmp_path)],
                         env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for r in range(2)
    ]
    try:  # rank 0 must not hang: it notices the lost rank, or times out (HF_MERGE_DIST_TIMEOUT)
        logs = [p.communicate(timeout=int(TIMEOUT_S) + 240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert procs[1].returncode == -signal.SIGKILL, logs
    assert (tmp_path / "0.rank0.json").is_file(), (procs[0].returncode, logs)  # rank 0 ended through the CLI
    rank0 = json.loads((tmp_path / "0.rank0.json").read_text())
    assert rank0["code"] != 0 and "error: lost contact with the other ranks" in rank0["stderr"], rank0
    assert not target.exists() and no_leftovers(target)


def _corrupt_file_of_rank(folder: Path, rank: int, ranks: int) -> str:
    """Flip one byte in the tensor data of a file that ``rank`` checks (the merge's balancing by bytes)."""
    import struct

    files = sorted(p.name for p in folder.glob("*.safetensors"))
    share = assign_by_bytes([(folder / f).stat().st_size for f in files], ranks)[rank]
    name = files[share[0]]
    data = bytearray((folder / name).read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[start + (len(data) - start) // 2] ^= 0x40
    (folder / name).write_bytes(bytes(data))
    return name


@pytest.mark.slow  # a torchrun job: a launcher and 2-4 ranks, each importing torch
@pytest.mark.compat  # torchrun and gloo of each tested torch (on torch 2.6 a rank hung here: see the test above)
def test_distributed_verify_finds_a_corrupted_file(qwen2_fp32_ws2, fsdp_single, tmp_path):
    """`hf-merge verify` on 3 ranks: a sound folder passes, a byte flipped in a file that rank 2 checks
    fails every rank with rank 0's one report, and a rank that cannot see the target fails every rank.
    Without --against (the recorded checksums only) the flipped byte fails every rank too."""
    import shutil

    good, bad = tmp_path / "good", tmp_path / "bad"
    shutil.copytree(fsdp_single, good)
    shutil.copytree(fsdp_single, bad)
    corrupted = _corrupt_file_of_rank(bad, 2, 3)
    src = str(qwen2_fp32_ws2.actor)
    jobs = [{"argv": ["verify", str(good), "--against", src]}, {"argv": ["verify", str(bad), "--against", src]},
            {"argv": ["verify", str(good), "--against", src], "missing_source_on_rank": 1},
            {"argv": ["verify", str(bad)]}]  # no source: the recorded checksums, shared out the same way
    outcome = _run_jobs(jobs, tmp_path, ranks=3)
    n_files = len(list(good.glob("*.safetensors")))
    assert n_files >= 3
    assert [outcome[0, r]["code"] for r in range(3)] == [0, 0, 0], outcome
    table = outcome[0, 0]["stdout"]
    n_recorded = len(json.loads((good / "hf_merge.json").read_text())["files"])  # weights, config, index...
    assert "file checksums  ok" in table and f"{n_recorded} files" in table and "bit-exact" in table, table
    assert not outcome[0, 1]["stdout"] and not outcome[0, 2]["stdout"]  # one report, from rank 0
    # the corrupted file is checked by rank 2 alone; every rank fails, rank 0 says which file
    assert [outcome[1, r]["code"] for r in range(3)] == [1, 1, 1], outcome
    assert f"{corrupted}: crc32 differs" in outcome[1, 0]["stdout"] and "not bit-identical" in outcome[1, 0]["stdout"]
    assert "error: " in outcome[1, 0]["stderr"] and not outcome[1, 2]["stdout"]
    for r in range(3):
        lines = [ln for ln in outcome[2, r]["stderr"].splitlines() if ln.startswith("error: ")]
        assert outcome[2, r]["code"] == 2 and len(lines) == 1 and "not-mounted-here" in lines[0], outcome[2, r]
        if r != 1:
            assert lines[0].startswith("error: rank 1 of 3 ") and "the verification did not finish" in lines[0], lines
    assert [outcome[3, r]["code"] for r in range(3)] == [1, 1, 1], outcome
    assert f"{corrupted}: crc32 differs" in outcome[3, 0]["stdout"] and not outcome[3, 1]["stdout"], outcome[3, 0]


@pytest.mark.slow  # a torchrun job: a launcher and 2-4 ranks, each importing torch
def test_torchrun_verify_cli_exits_non_zero_on_every_rank(qwen2_fp32_ws2, fsdp_single, tmp_path):
    """`torchrun --nproc-per-node 2 -m hf_merge verify` on a corrupted folder: torchrun (every rank) fails."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(fsdp_single, bad)
    corrupted = _corrupt_file_of_rank(bad, 1, 2)
    proc = _run(_torchrun("--nproc-per-node", "2", "-m", "hf_merge", "verify", str(bad), "--against",
                          str(qwen2_fp32_ws2.actor)), timeout=600)
    assert proc.returncode != 0, proc.output
    assert proc.output.count("file checksums  FAIL") == 1 and f"{corrupted}: crc32 differs" in proc.output, proc.output


@pytest.mark.slow  # a torchrun job: a launcher and 2-4 ranks, each importing torch
def test_gguf_under_torchrun_has_one_writer(qwen2_fp32_ws2, tmp_path):
    """GGUF is one stream: the distributed executor gives it to one writer (rank 0, the node's writer)
    while rank 1 waits; both exit 0 with one report, the file equals a single-process one and its
    sha256 is recorded. A failure on rank 0 fails rank 1 too, naming rank 0."""
    pytest.importorskip("gguf")
    src = str(qwen2_fp32_ws2.actor)
    single = tmp_path / "single"
    merge(src, single, gguf="q8_0", gguf_pre_tokenizer="gpt-2", checksums="sha256")
    out = tmp_path / "dist"
    # every rank joins (--dist-writers rank), so the distributed executor itself hands the one file out
    gguf_args = ["--gguf", "q8_0", "--gguf-pre-tokenizer", "gpt-2", "--dist-writers", "rank", "--checksum", "sha256"]
    jobs = [{"argv": ["merge", src, str(out / "ok"), *gguf_args]},
            {"argv": ["merge", src, str(out / "blind"), *gguf_args], "missing_source_on_rank": 0}]
    outcome = _run_jobs(jobs, tmp_path, ranks=2)
    assert [outcome[0, r]["code"] for r in range(2)] == [0, 0], outcome
    assert "wrote" in outcome[0, 0]["stderr"] + outcome[0, 0]["stdout"] and not outcome[0, 1]["stdout"], outcome
    files = sorted(p.name for p in (out / "ok").iterdir())
    assert files == sorted(p.name for p in single.iterdir()) and sum(f.endswith(".gguf") for f in files) == 1
    name = next(f for f in files if f.endswith(".gguf"))
    assert (out / "ok" / name).read_bytes() == (single / name).read_bytes()
    record = json.loads((out / "ok" / "hf_merge.json").read_text())  # the distributed executor ran it
    assert record["distributed"]["files_per_rank"] == [1, 0], record
    assert record["files"] == json.loads((single / "hf_merge.json").read_text())["files"]
    assert record["files"][name] == hashlib.sha256((single / name).read_bytes()).hexdigest()
    assert no_leftovers(out / "ok")
    for r in range(2):
        assert outcome[1, r]["code"] == 2, outcome[1, r]
        lines = [ln for ln in outcome[1, r]["stderr"].splitlines() if ln.startswith("error: ")]
        assert len(lines) == 1 and "not-mounted-here does not exist" in lines[0], outcome[1, r]
    assert lines[0].startswith("error: rank 0 of 2 "), lines
    assert not (out / "blind").exists() and no_leftovers(out / "blind")
