"""One table from exceptions to one-line messages (tracebacks only with HF_MERGE_DEBUG=1)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import traceback
import zipfile

from ..errors import HfMergeError, folded, redact_credentials

from ..settings import DEBUG_VAR, debug


def _os_error(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return f"no space left on the device while writing {e.filename or 'the output'}; free space or choose another target"
    if e.errno == errno.EROFS:
        return f"read-only file system: cannot write {e.filename or 'the output'}; choose a target on a writable file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied: {e.filename}; check the folder's permissions"
    return f"{e.strerror or e} ({e.filename})" if e.filename else str(e)


MAX_LINE = 600
def one_line(text: str) -> str:
    """The message as one short line: newlines folded, credentials redacted, length capped."""
    line = redact_credentials(folded(text))
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 20] + " ... (message cut)"


def _unicode(e: UnicodeDecodeError) -> str:
    return f"a checkpoint text file is not UTF-8 ({e.reason} at byte {e.start}); fix or remove that file"


# (exception class, message function, exit code); the first match wins.
CLI_ERROR_MAPPINGS = [
    (HfMergeError, lambda e: str(e), None),
    (zipfile.BadZipFile, lambda e: f"a checkpoint file is not a readable zip archive ({e}); re-copy it", 2),
    (UnicodeDecodeError, _unicode, 2),
    (KeyboardInterrupt, lambda e: "interrupted; nothing was written to the target", 130),
    (MemoryError, lambda e: "out of memory; lower --workers (each worker holds the tensors it is writing)", 3),
    (OSError, _os_error, 3),
]


def report(e: BaseException, *, as_json: bool = False) -> int:
    """Print one line for ``e`` on stderr and return the exit code. ``as_json`` (``--json``): also one
    JSON object on stdout, ``{"error": line, "type": class name, "exit_code": code}`` (rank 0 only
    under torchrun, as a result is), so that a script reading stdout learns of the failure."""
    if debug():
        traceback.print_exception(e, file=sys.stderr)
    for cls, message, code in CLI_ERROR_MAPPINGS:
        if isinstance(e, cls):
            line, code = one_line(message(e)), code if code is not None else getattr(e, "exit_code", 2)
            break
    else:
        line, code = one_line(f"unexpected {type(e).__name__}: {e} (set {DEBUG_VAR}=1 for the traceback, and please report it)"), 1
    print(f"error: {line}", file=sys.stderr)
    if as_json and os.environ.get("RANK", "0") == "0":
        with contextlib.suppress(OSError, ValueError):  # stdout closed: the stderr line stands
            print(json.dumps({"error": line, "type": type(e).__name__, "exit_code": code}), flush=True)
    return code
