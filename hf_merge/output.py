"""Atomic output folders: write beside the target, rename into place at the end.

A merge writes into ``.<target>.hf-merge-tmp-<pid>`` next to the target and renames it to the
target only when everything is written. An error or Ctrl-C removes the temporary folder; a killed
process (SIGKILL) leaves only a temporary folder that no tool mistakes for a model, and the next
run removes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from .errors import TargetExistsError

_TMP_TAG = ".hf-merge-tmp-"
_OLD_TAG = ".hf-merge-old-"


def check_target(target: Path, *, overwrite: bool) -> None:
    """Refuse early (before reading anything) a target that exists and would be clobbered."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise TargetExistsError(f"{target} exists and is a file; choose another target folder")
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


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Delete temporary folders of earlier runs on this target whose process is gone."""
    removed = []
    parent = target.parent
    if not parent.is_dir():
        return removed
    for tag in (_TMP_TAG, _OLD_TAG):
        prefix = f".{target.name}{tag}"
        for p in parent.iterdir():
            if p.name.startswith(prefix):
                pid = p.name[len(prefix):]
                if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p)
    return removed


def make_temporary(target: Path, *, overwrite: bool = False) -> Path:
    """Create (empty) the temporary folder beside ``target`` that becomes it on :func:`commit`."""
    target = Path(target).absolute()
    check_target(target, overwrite=overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    tmp = target.parent / f".{target.name}{_TMP_TAG}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def commit(tmp: Path, target: Path) -> None:
    """Move the finished temporary folder into place (replacing an existing target)."""
    target = Path(target).absolute()
    if target.exists():
        old = target.parent / f".{target.name}{_OLD_TAG}{os.getpid()}"
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)


@contextlib.contextmanager
def atomic_folder(target: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes ``target``, on any error it is removed."""
    tmp = make_temporary(target, overwrite=overwrite)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit(tmp, target)
