"""One table from exceptions to one-line messages (tracebacks only with HF_MERGE_DEBUG=1)."""

from __future__ import annotations

import errno
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


def report(e: BaseException) -> int:
    """Print one line for ``e`` on stderr and return the exit code."""
    if debug():
        traceback.print_exception(e, file=sys.stderr)
    for cls, message, code in CLI_ERROR_MAPPINGS:
        if isinstance(e, cls):
            print(f"error: {one_line(message(e))}", file=sys.stderr)
            return code if code is not None else getattr(e, "exit_code", 2)
    print(one_line(f"error: unexpected {type(e).__name__}: {e} (set {DEBUG_VAR}=1 for the traceback, and please report it)"), file=sys.stderr)
    return 1
