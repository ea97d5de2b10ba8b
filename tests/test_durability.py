"""Output that survives a power loss: a simulation of what is on disk at the final rename.

The test records, in this process, every ``fsync`` / ``fdatasync`` (the file's identity, size and
mtime at that moment) and every rename of a temporary output folder into place (including the
atomic exchange ``--overwrite`` uses). At the rename every file and folder under the temporary
folder must have been fsynced, after its last change; after it, the parent folder must be
fsynced before the merge returns; the old target of an overwrite must still be whole until then.
After a power loss, only what was fsynced is certain to be there: these orderings are what make
the target either absent (or the old one) or complete.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from helpers import assert_tensors_equal, folder_tensors, no_leftovers

import hf_merge
from hf_merge.write import atomic

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

TMP = ".hf-merge-tmp-"


def _key(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class DiskOrder:
    """The calls that decide what a power loss leaves, in the order they were made."""

    def __init__(self):
        self.lock = threading.Lock()
        self.events: list[tuple] = []
        self.placed: list[dict] = []  # one per rename of a temporary folder into place

    def synced(self, fd: int) -> None:
        st = os.fstat(fd)
        with self.lock:
            self.events.append(("sync", _key(st), st.st_size, st.st_mtime_ns))

    def placing(self, tmp: Path, target: Path) -> None:
        """Called just before ``tmp`` becomes ``target``: what is in it, and what was fsynced so far."""
        tree = {}
        for root, _, names in os.walk(tmp):  # every folder comes once as root
            for p in [Path(root), *(Path(root) / n for n in names)]:
                if not p.is_symlink():
                    st = p.stat()
                    tree[str(p.relative_to(tmp))] = (_key(st), st.st_size, st.st_mtime_ns, p.is_dir())
        old = None  # the target being replaced: in place, or renamed aside (where there is no swap)
        held = target if target.is_dir() else next(target.parent.glob(f".{target.name}.hf-merge-old-*"), None)
        if held is not None:
            old = {str(p.relative_to(held)): p.stat().st_size for p in held.rglob("*") if p.is_file()}
        with self.lock:
            self.placed.append({"at": len(self.events), "tree": tree, "target": target, "old": old})
            self.events.append(("place", str(tmp), str(target)))

    def check(self) -> Path:
        """Every rule above, for the one folder placed; returns the target."""
        assert len(self.placed) == 1, self.placed
        place = self.placed[0]
        before = self.events[: place["at"]]
        after = self.events[place["at"] + 1 :]
        synced = {}
        for _, key, size, mtime in (e for e in before if e[0] == "sync"):
            synced[key] = (size, mtime)
        missing = [rel for rel, (key, size, mtime, is_dir) in place["tree"].items()
                   if key not in synced or (not is_dir and synced[key] != (size, mtime))]
        assert not missing, f"not fsynced (after their last change) before the rename into place: {sorted(missing)}"
        target = place["target"]
        parent = _key(target.parent.stat())
        assert any(e[0] == "sync" and e[1] == parent for e in after), "the parent folder was not fsynced after the rename"
        return target


@pytest.fixture
def disk_order(monkeypatch):
    order = DiskOrder()
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)

        def recorded(fd, real=real):
            real(fd)
            order.synced(fd)

        monkeypatch.setattr(os, name, recorded)
    for name in ("rename", "replace"):
        real = getattr(os, name)

        def renamed(src, dst, *a, real=real, **k):
            if TMP in Path(src).name:
                order.placing(Path(src), Path(dst))
            return real(src, dst, *a, **k)

        monkeypatch.setattr(os, name, renamed)
    try:  # the atomic swap of an overwrite (absent from code that has none)
        durable = importlib.import_module("hf_merge.write.durable")
    except ImportError:
        durable = None
    if durable is not None:
        real_exchange = durable.exchange

        def exchanged(a, b):
            order.placing(Path(a), Path(b))
            done = real_exchange(a, b)
            if not done:  # not swapped: the rename that follows is the placing one
                order.placed.pop()
                order.events.pop()
            return done

        monkeypatch.setattr(durable, "exchange", exchanged)
    return order


def test_single_process_merge_fsyncs_everything_before_the_rename(qwen2_fp32_ws2, tmp_path, disk_order):
    target = tmp_path / "deep" / "out"  # parent folders made by the merge: synced too
    hf_merge.merge(qwen2_fp32_ws2.actor, target, workers=1, max_shard_size="20KB")
    assert disk_order.check() == target
    assert len(list(target.glob("*.safetensors"))) > 1 and (target / "model.safetensors.index.json").is_file()
    assert any(e[0] == "sync" and e[1] == _key(tmp_path.stat()) for e in disk_order.events)  # "deep"'s entry


def test_forked_writers_output_is_fsynced_before_the_rename(qwen2_fp32_ws2, tmp_path, disk_order):
    target = tmp_path / "out"
    hf_merge.merge(qwen2_fp32_ws2.actor, target, workers=2, max_shard_size="20KB")
    disk_order.check()
    assert_tensors_equal(folder_tensors(target), folder_tensors(qwen2_fp32_ws2.reference), dtype=torch.bfloat16)


def test_adapter_and_side_files_are_fsynced(lora_ckpt, tmp_path, disk_order):
    target = tmp_path / "out"
    hf_merge.merge(lora_ckpt.actor, target, lora="both")
    disk_order.check()
    tree = disk_order.placed[0]["tree"]
    from hf_merge.merging import ADAPTER_SUBDIR

    assert f"{ADAPTER_SUBDIR}/adapter_config.json" in tree and "README.md" in tree, sorted(tree)


def test_gguf_folder_is_fsynced_before_the_rename(qwen2_fp32_ws2, tmp_path, disk_order):
    pytest.importorskip("gguf")
    target = tmp_path / "gguf"
    hf_merge.merge(qwen2_fp32_ws2.actor, target, gguf="q8_0", gguf_pre_tokenizer="gpt-2")
    disk_order.check()
    assert {p.suffix for p in target.iterdir()} >= {".gguf", ".json", ".md"}


@pytest.mark.parametrize("swap", ["exchange", "rename aside"])
def test_overwrite_keeps_the_old_target_until_the_new_one_is_durable(swap, qwen2_fp32_ws2, tmp_path, monkeypatch, disk_order):
    target = tmp_path / "out"
    hf_merge.merge(qwen2_fp32_ws2.actor, target, dtype="bfloat16")
    old_files = {p.name: p.stat().st_size for p in target.iterdir()}
    disk_order.placed.clear()
    disk_order.events.clear()
    removed_at = []
    real_rmtree = shutil.rmtree

    def rmtree(path, *a, **k):
        if Path(path).is_dir() and (Path(path) / "hf_merge.json").is_file():  # a whole model going away
            removed_at.append(len(disk_order.events))
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    if swap == "rename aside":
        monkeypatch.setattr("hf_merge.write.durable._renameat2", lambda: None)
    hf_merge.merge(qwen2_fp32_ws2.actor, target, overwrite=True)
    disk_order.check()
    place = disk_order.placed[0]
    assert place["old"] and set(place["old"]) >= {n for n in old_files if not n.startswith(".")}, place["old"]
    parent = _key(target.parent.stat())
    synced_parent = [i for i, e in enumerate(disk_order.events) if i > place["at"] and e[0] == "sync" and e[1] == parent]
    assert removed_at and removed_at[0] >= synced_parent[0], (removed_at, synced_parent)
    assert_tensors_equal(folder_tensors(target), folder_tensors(qwen2_fp32_ws2.reference), dtype=torch.bfloat16)
    assert no_leftovers(target)


def test_an_old_target_left_aside_is_put_back_by_the_next_run(qwen2_fp32_ws2, tmp_path):
    """A run killed between the two renames of the fallback leaves the old target aside (and no
    target): the next run on the target puts it back before anything else, then works as asked."""
    target = tmp_path / "out"
    hf_merge.merge(qwen2_fp32_ws2.actor, target)
    before = folder_tensors(target)
    aside = tmp_path / f".out{atomic._OLD_TAG}999999999"  # a pid that cannot be running
    os.rename(target, aside)
    with pytest.raises(hf_merge.errors.TargetExistsError):  # put back: not replaced without --overwrite
        hf_merge.merge(qwen2_fp32_ws2.actor, target)
    assert_tensors_equal(folder_tensors(target), before)
    assert no_leftovers(target)


def _statvfs_with(free: int, under: Path, monkeypatch) -> None:
    """``os.statvfs`` of a folder under ``under`` says ``free`` bytes are available (in 1-byte blocks)."""
    real = os.statvfs

    def statvfs(path):
        st = real(path)
        if not Path(path).absolute().is_relative_to(under):
            return st
        return os.statvfs_result((st.f_bsize, 1, max(free, st.f_blocks), free, free, st.f_files, st.f_ffree,
                                  st.f_favail, st.f_flag, st.f_namemax))

    monkeypatch.setattr(os, "statvfs", statvfs)


@pytest.mark.parametrize("gguf", [None, "q8_0"])
def test_free_space_is_checked_before_writing(gguf, qwen2_fp32_ws2, tmp_path, monkeypatch):
    """The planned bytes plus a bound on the side files must be free on the target's file system:
    less is refused with a typed error (exit 3, one line) and leaves nothing; that much merges.
    Safetensors files are planned to the byte (one byte less is refused); a GGUF file's plan is its
    tensor data (its metadata is in the side files' bound). The bound follows the side files' real
    sizes: a 184 kB merge fits on a file system with 300 kB free (it asked for 64 MB more)."""
    if gguf:
        pytest.importorskip("gguf")
    from helpers import error_line, run_cli

    from hf_merge.side_files import side_files_bytes
    from hf_merge.progress import human_bytes

    args = [qwen2_fp32_ws2.actor, "--max-shard-size", "20KB"] if gguf is None else [
        qwen2_fp32_ws2.actor, "--gguf", gguf, "--gguf-pre-tokenizer", "gpt-2"]
    sizing = tmp_path / "sizing"
    proc = run_cli("merge", args[0], sizing, *args[1:])
    assert proc.returncode == 0, proc.stderr
    weights = sum(p.stat().st_size for p in sizing.iterdir() if p.suffix in (".safetensors", ".gguf"))
    written = sum(p.stat().st_size for p in sizing.iterdir()) - weights
    index = json.loads((sizing / "model.safetensors.index.json").read_text())["weight_map"] if gguf is None else None
    side = side_files_bytes([Path(qwen2_fp32_ws2.actor) / "huggingface"], index, scale=2 if gguf else 1)
    assert written <= side < 300_000 - weights, (written, side, weights)
    needed = weights + side
    target = tmp_path / "space" / "out"
    _statvfs_with(needed - 1 if gguf is None else weights // 2, tmp_path / "space", monkeypatch)
    proc = run_cli("merge", args[0], target, *args[1:])
    assert proc.returncode == 3, proc.stderr
    line = error_line(proc)
    assert "not enough free space" in line and "choose a target on another file system" in line, line
    if gguf is None:  # sizes a user can act on (before: "writes 0.00 GB ... free 0.00 GB or more")
        assert f"the merge writes {human_bytes(weights)} (plus up to {human_bytes(side)}" in line and "free 1 B or more" in line, line
    assert not (tmp_path / "space").exists()  # nothing written, the parent folder made for it gone too
    _statvfs_with(300_000, tmp_path / "space", monkeypatch)
    proc = run_cli("merge", args[0], target, *args[1:])
    assert proc.returncode == 0, proc.stderr
    assert no_leftovers(target)
