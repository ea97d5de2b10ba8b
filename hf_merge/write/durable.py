"""Making a finished output folder durable before it is renamed into place, and the rename itself.

A rename is atomic for readers, not for a power loss: the kernel may write the new directory
entry to disk before the file data it points at. So, before a temporary folder becomes the
target (:mod:`hf_merge.write.atomic`):

1. :func:`sync_tree` fsyncs every file in it (on a few threads: fsyncs on one file system are
   batched by its journal, and a file already written with ``O_DIRECT`` costs only its metadata),
   then every folder in it, deepest first, the temporary folder itself last;
2. the rename (or :func:`exchange` of the new folder with the old target under ``--overwrite``);
3. :func:`sync_dir` of the parent, which makes the rename itself durable.

:func:`free_bytes` is the one place the target file system's free space is read.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path

#: threads fsyncing the files of one folder
SYNC_THREADS = 8

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_file(path: Path) -> None:
    """``fsync`` one file through a descriptor of its own (any descriptor of the file will do)."""
    _fsync(path, os.O_NOFOLLOW)


def sync_dir(path: Path) -> None:
    """``fsync`` a folder: its entries (created, renamed, removed) are on disk afterwards."""
    _fsync(path, os.O_DIRECTORY)


def sync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then its folders deepest first, ``folder`` last (symlinks
    are entries of their folder, synced with it)."""
    files: list[Path] = []
    folders: list[Path] = []
    for root, dirs, names in os.walk(folder):
        folders.append(Path(root))
        for name in names:
            p = Path(root) / name
            if not p.is_symlink():
                files.append(p)
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
    _sync_files(files)
    for p in reversed(folders):  # os.walk is top-down: reversed, each folder comes after its children
        sync_dir(p)


def _sync_files(files: list[Path]) -> None:
    """fsync ``files`` on up to :data:`SYNC_THREADS` daemon threads; the first error is raised. An
    interrupt (SIGTERM, Ctrl-C) leaves at once: the fsyncs in flight (a slow disk's) are not waited
    for, here or at interpreter exit (which a thread pool's threads would be)."""
    todo = list(files)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                if not todo or errors:
                    return
                path = todo.pop()
            try:
                sync_file(path)
            except BaseException as e:  # noqa: BLE001 - raised by the caller
                with lock:
                    errors.append(e)

    threads = [threading.Thread(target=run, name="fsync", daemon=True) for _ in range(min(SYNC_THREADS, len(files)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Swap the entries ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the kernel, C library or file system cannot (nothing was changed then)."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged process may still write on ``folder``'s file system."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize
