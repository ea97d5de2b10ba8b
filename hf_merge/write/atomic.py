"""Atomic output folders: write beside the target, rename into place at the end.

A merge writes into ``.<target>.hf-merge-tmp-<pid>`` next to the target and renames it to the
target only when everything is written. An error or Ctrl-C removes the temporary folder (and the
parent folders created for the target); a killed process (SIGKILL) leaves only a temporary folder
that no tool mistakes for a model, and the next run removes it.

Concurrency: a run holds ``.<target>.hf-merge-lock`` (an ``flock``, so a killed run never leaves
a held lock) from before it reads the source until the target is in place; a second run on the same target
is refused at once. The final rename never replaces a target that appeared meanwhile unless
``overwrite`` is set (a directory is renamed only onto a missing or empty one).

Durability (see ``docs/durability.md``): before the rename every file and folder in the temporary
folder is fsynced (:func:`hf_merge.write.durable.sync_tree`), after it the parent folder, so after a
power loss the target is either absent (or the old one) or complete. ``overwrite`` keeps the old
target until the new one is in place: the two folders are swapped in one atomic step
(``renameat2(RENAME_EXCHANGE)``), the parent is fsynced, then the old one (now under the temporary
name) is removed. Where the swap is not available the old target is renamed aside to
``.<target>.hf-merge-old-<pid>`` first; a run killed between the two renames leaves it there, and
the next run on the target puts it back before doing anything else.

Symlinked targets: a symlink to a folder means that folder (the output is written beside the
real folder, so the final rename stays atomic); a dangling symlink is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator

from . import durable
from ..errors import InsufficientSpaceError, TargetExistsError
from ..progress import human_bytes

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
PROVENANCE_FILE = "hf_merge.json"  # the provenance record every merge writes (one name, used everywhere)

_TMP_TAG = ".hf-merge-tmp-"
_OLD_TAG = ".hf-merge-old-"
_LOCK_TAG = ".hf-merge-lock"


def resolve_target(target: Path) -> Path:
    """The absolute target, with a symlink to a folder followed; a dangling symlink is refused."""
    target = Path(target).absolute()
    if target.is_symlink():
        if not target.exists():
            raise TargetExistsError(
                f"{target} is a dangling symlink (to {os.readlink(target)}); remove it or choose another target"
            )
        real = Path(os.path.realpath(target))
        if not real.is_dir():
            raise TargetExistsError(f"{target} is a symlink to the file {real}; choose a target folder")
        return real
    return target


def check_free_space(target: Path, planned: int, side: int) -> None:
    """Refuse, before anything is written, a merge whose ``planned`` bytes of weight files plus
    ``side`` bytes of side files (a bound: :func:`hf_merge.side_files.side_files_bytes`) do not fit
    on the file system that will hold ``target``. Under ``--overwrite`` the old target stays until
    the new one is in place, so its space does not count as free."""
    folder = Path(target).absolute()
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    free = durable.free_bytes(folder)
    needed = planned + side
    if free < needed:
        raise InsufficientSpaceError(
            f"not enough free space for {target}: the merge writes {human_bytes(planned)} (plus up to {human_bytes(side)} "
            f"of side files), the file system of {folder} has {human_bytes(free)} free; free {human_bytes(needed - free)} or more, "
            "or choose a target on another file system"
        )


def check_apart(source: "str | Path", target: "str | Path") -> None:
    """Refuse a target that is the source or holds it (its parent, a symlink to it): replacing it,
    as ``--overwrite`` would, deletes the training checkpoint. A target inside the source (verl's
    ``actor/huggingface``) is fine."""
    src, tgt = Path(os.path.realpath(source)), Path(os.path.realpath(target))
    if tgt == src or tgt in src.parents or (src in tgt.parents and _holds_checkpoint(tgt)):
        raise TargetExistsError(
            f"{target} holds the source checkpoint {source}; choose another target folder (writing there would replace the checkpoint)"
        )


def _holds_checkpoint(folder: Path) -> bool:
    """A folder inside the source that a format other than a Hugging Face folder reads (the
    ``actor/`` of ``ckpts/``); a former merge output or ``actor/huggingface`` is not one."""
    from ..errors import HfMergeError
    from ..readers.formats import detect, is_hf_folder

    if not folder.is_dir() or holds_side_files_only(folder):
        return False
    try:
        return not is_hf_folder(detect(folder).chosen.name)
    except (HfMergeError, OSError):
        return False


def check_target(target: Path, *, overwrite: bool) -> None:
    """Refuse early (before reading anything) a target that exists and would be clobbered."""
    target = resolve_target(target)
    if target.exists() and not target.is_dir():
        raise TargetExistsError(f"{target} exists and is a file; choose another target folder")
    above = next((p for p in Path(target).absolute().parents if os.path.lexists(p)), None)
    if above is not None and not above.is_dir():  # the folders above the target cannot be made
        raise TargetExistsError(f"{above} is a file, so the target {target} cannot be made under it; choose another target folder")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise TargetExistsError(f"{target} exists and is not empty; pass --overwrite to replace it, or choose another folder")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    """Remove a file, a symlink (never its target) or a folder tree; missing is fine."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_temporaries(target: Path, *, locked: bool = False) -> list[Path]:
    """Delete temporary folders of earlier runs on this target whose process is gone (with
    ``locked``: every one but ours, since no other run can be writing this target). An old target
    that an ``overwrite`` killed between its two renames left aside is put back first, when the
    target is missing (it is the last complete model there was)."""
    removed = []
    parent = target.parent
    if not parent.is_dir():
        return removed
    for tag in (_OLD_TAG, _TMP_TAG):
        prefix = f".{target.name}{tag}"
        for p in sorted(parent.iterdir()):
            if p.name.startswith(prefix):
                pid = p.name[len(prefix):]
                if pid.isdigit() and int(pid) != os.getpid() and (locked or not _pid_alive(int(pid))):
                    if tag == _OLD_TAG and locked and not (target.exists() or target.is_symlink()):
                        os.rename(p, target)
                        durable.sync_dir(parent)
                        continue
                    _remove(p)
                    removed.append(p)
    return removed


@contextlib.contextmanager
def target_lock(target: Path) -> Iterator[Path]:
    """Hold ``.<target>.hf-merge-lock`` beside ``target``; refuse if another run holds it."""
    import fcntl

    path = target.parent / f".{target.name}{_LOCK_TAG}"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:  # permissions, a read-only or full disk have their own lines (cli/_errors.py)
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC):
                raise
            # e.g. /proc or /sys: a folder that exists but takes no new files
            raise TargetExistsError(f"no file can be created in {target.parent} ({e.strerror}); "
                                    "choose another target folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = ""
            with contextlib.suppress(OSError, ValueError):
                holder = f" (pid {int(path.read_text().strip())})"
            raise TargetExistsError(
                f"another hf-merge run{holder} is writing {target}; wait for it to finish or choose another target"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino  # not unlinked by a run that just finished
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)


def _make_parents(folder: Path) -> list[Path]:
    """``mkdir -p folder``; return the folders it created, deepest first."""
    created = []
    p = folder
    while not p.exists() and p != p.parent:
        created.append(p)
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return created


def _appeared(target: Path) -> TargetExistsError:
    return TargetExistsError(
        f"{target} appeared while merging (another process wrote it); pass --overwrite to replace it, "
        "or choose another folder"
    )


def _place(tmp: Path, target: Path, overwrite: bool) -> None:
    """Make ``tmp`` durable and rename it to ``target`` (durably); replace an existing target only
    with ``overwrite``, keeping the old one until the new one is in place."""
    durable.sync_tree(tmp)
    parent = target.parent
    if target.is_symlink() or target.exists():
        if not overwrite and not (target.is_dir() and not target.is_symlink() and not any(target.iterdir())):
            raise _appeared(target)
        if overwrite:
            if durable.exchange(tmp, target):  # one step: the old target now has tmp's name
                durable.sync_dir(parent)
                _remove(tmp)
                return
            old = parent / f".{target.name}{_OLD_TAG}{os.getpid()}"
            _remove(old)
            os.rename(target, old)  # killed from here to the next rename: the next run puts it back
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
            durable.sync_dir(parent)
            _remove(old)
            return
    try:
        os.rename(tmp, target)  # onto a missing or empty folder only: the kernel refuses anything else
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise _appeared(target) from None
        raise
    durable.sync_dir(parent)


class StagedFolder:
    """A locked temporary folder beside ``target`` that becomes it on :meth:`commit`.

    Created by :func:`stage`; holds the target's lock until :meth:`commit` or :meth:`discard`
    (a distributed merge's rank 0 stages, every rank writes into ``tmp``, rank 0 commits).
    """

    def __init__(self, target: Path, *, overwrite: bool):
        target = resolve_target(target)
        check_target(target, overwrite=overwrite)
        self.target, self.overwrite = target, overwrite
        self._created = _make_parents(target.parent)
        self.tmp = target.parent / f".{target.name}{_TMP_TAG}{os.getpid()}"
        self._lock = target_lock(target)
        try:
            self._lock.__enter__()
            try:
                remove_stale_temporaries(target, locked=True)  # may put back an old target left aside
                check_target(target, overwrite=overwrite)  # again, now that no other run can write it
                _remove(self.tmp)
                self.tmp.mkdir()
            except BaseException:
                self._lock.__exit__(None, None, None)
                raise
        except BaseException:
            self._remove_created()
            raise
        self._open = True

    def commit(self) -> None:
        """Move the finished folder into place; the lock is released either way."""
        try:
            _place(self.tmp, self.target, self.overwrite)
            for folder in self._created:  # parent folders this run made: their entries too
                durable.sync_dir(folder.parent)
        except BaseException:
            self.discard()
            raise
        self._release()

    def discard(self) -> None:
        """Remove the temporary folder (and parent folders created for the target). Safe twice."""
        if not self._open:
            return
        _remove(self.tmp)
        self._release()
        self._remove_created()

    def _release(self) -> None:
        if self._open:
            self._open = False
            _remove(self.tmp)
            self._lock.__exit__(None, None, None)

    def _remove_created(self) -> None:
        for folder in self._created:  # deepest first; only if still empty
            with contextlib.suppress(OSError):
                folder.rmdir()


def stage(target: Path, *, overwrite: bool = False) -> StagedFolder:
    """Lock ``target`` and create its temporary folder (see :class:`StagedFolder`)."""
    return StagedFolder(Path(target), overwrite=overwrite)


@contextlib.contextmanager
def committed(staged: StagedFolder) -> Iterator[Path]:
    """Yield ``staged``'s temporary folder; on success it becomes the target, on any error it is removed."""
    try:
        yield staged.tmp
    except BaseException:
        staged.discard()
        raise
    staged.commit()


@contextlib.contextmanager
def atomic_folder(target: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes ``target``, on any error it is removed."""
    with committed(stage(target, overwrite=overwrite)) as tmp:
        yield tmp


def holds_side_files_only(folder: Path) -> bool:
    """True for a non-empty folder of config / tokenizer / generation files and no weights (verl's
    ``actor/huggingface``), which a merge may fill in place."""
    items = list(Path(folder).iterdir()) if Path(folder).is_dir() else []
    return (Path(folder) / "config.json").is_file() and all(
        item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and item.name not in WEIGHT_INDEXES
        and item.name != PROVENANCE_FILE
        for item in items
    )
