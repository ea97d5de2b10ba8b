"""Files are read from inside the checkpoint only: a symlink that leaves it is refused.

A checkpoint folder is data someone else may have prepared. A symlink in it could make a merge
read (and print, merge, push) any file this user can read: another local checkpoint's weights,
``/proc/self/environ``, a key file. So every file a reader opens goes through :func:`check`, with
the checkpoint folder the user named as the root (:func:`reading`, set by
:func:`hf_merge.readers.formats.open_source` around detection and opening):

- a path under the root whose real path stays under the root's real path is fine (a symlink
  *inside* the checkpoint, e.g. ``latest -> global_step_9``, a folder the user named through a
  symlink);
- a path under the root whose real path leaves it is refused (:class:`UnsafeCheckpointError`),
  except the one layout that is made of such links on purpose: a Hugging Face cache snapshot
  (``models--x/snapshots/REV/file -> ../../blobs/HASH``), whose links may reach their own
  repository's ``blobs/`` folder;
- a path beside the root that a format looks at on purpose (DeepSpeed's save folder above a tag
  folder the user named) is fine when its last component is not a symlink.

Messages name the link and where it points (paths only, redacted like every line the CLI prints),
never any of the file's content.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from pathlib import Path
from typing import Iterator

from ..errors import UnsafeCheckpointError

_root: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("hf_merge_checkpoint_root", default=None)


@contextlib.contextmanager
def reading(root: "str | Path") -> Iterator[None]:
    """Within the block, :func:`check` refuses files that leave ``root`` through a symlink."""
    given = os.path.abspath(root)
    real = os.path.realpath(root)
    if os.path.isfile(real):  # a single file named by the user: its folder is the checkpoint
        given, real = os.path.dirname(given), os.path.dirname(real)
    token = _root.set((given, real))
    try:
        yield
    finally:
        _root.reset(token)


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _hub_blob(link: str, target: str) -> bool:
    """``.../models--x/snapshots/REV/...`` pointing into ``.../models--x/blobs/``."""
    parts = Path(link).parts
    if "snapshots" not in parts:
        return False
    i = len(parts) - 1 - parts[::-1].index("snapshots")
    repo = os.path.realpath(os.path.join(*parts[:i])) if i else ""
    return bool(repo) and _under(target, os.path.join(repo, "blobs"))


def check(path: "str | Path", root: "str | Path | None" = None) -> Path:
    """``path``, after refusing it when it reaches outside the checkpoint through a symlink.

    ``root``: the checkpoint folder; default the one :func:`reading` set (none set: no check).
    """
    path = Path(path)
    if root is not None:
        given, real_root = os.path.abspath(root), os.path.realpath(root)
    else:
        current = _root.get()
        if current is None:
            return path
        given, real_root = current
    lexical = os.path.abspath(path)
    if not os.path.lexists(lexical):
        return path
    target = os.path.realpath(lexical)
    if _under(lexical, given) or _under(lexical, real_root):
        if _under(target, real_root) or _hub_blob(lexical, target):
            return path
        raise UnsafeCheckpointError(
            f"{path} leads outside the checkpoint {given} through a symlink (to {target}); hf-merge reads only files "
            "inside the checkpoint folder: copy the file in, or pass the folder it lives in"
        )
    if os.path.islink(lexical):
        raise UnsafeCheckpointError(
            f"{path} is a symlink (to {target}) beside the checkpoint {given}; copy the file in, or pass its folder"
        )
    return path
