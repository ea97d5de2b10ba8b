"""``hf-merge`` entry point: registers the commands, runs one, maps errors to one line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NoReturn

from ..version import SUMMARY, __version__
from ..errors import redact_credentials


class _NoteFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = "warning" if record.levelno >= logging.WARNING else "note"
        return redact_credentials(f"{prefix}: {record.getMessage()}")


def _setup_logging(quiet: bool) -> None:
    from .._quiet import quiet_bitsandbytes

    quiet_bitsandbytes()  # bitsandbytes' optional-kernel notice; int8 layers' cast notice once
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_NoteFormatter())
    log = logging.getLogger("hf_merge")
    log.handlers[:] = [handler]
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    log.propagate = False
    if quiet:  # progress bars too (HF_HUB_DISABLE_PROGRESS_BARS=1 does the same without -q)
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


TOP_LEVEL_FLAGS = ("-h", "--help", "--version", "-q", "--quiet")


def _on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    from . import inspect as inspect_cmd
    from . import merge as merge_cmd

    parser = argparse.ArgumentParser(
        prog="hf-merge",
        description=f"Turn {SUMMARY}.",
    )
    parser.add_argument("--version", action="version", version=f"hf-merge {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors: no notes, no progress bars")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [merge_cmd, inspect_cmd]
    for optional in ("verify", "push", "extension"):
        try:
            modules.append(__import__(f"hf_merge.cli.{optional}", fromlist=["add_parser"]))
        except ImportError:
            continue
    for module in modules:
        module.add_parser(sub)
    return parser


def idle_torchrun_rank(argv: list[str]) -> bool:
    """True when this process is a torchrun rank with nothing to do in the merge on its command line
    (:func:`~hf_merge.write.distributed.torchrun_launch`: another process merges for its node).

    Read from the raw command line, so that such a rank leaves before the parser (and every
    command's module) is imported: on one node, the N-1 idle ranks start beside rank 0's merge
    and share its CPUs. Anything less plain than ``merge ... [--dist-writers node]`` (another
    command, help, an abbreviated ``--dist-...`` flag, a first word that is neither ``merge``, a
    flag nor a path) is left to the parser, after which the same decision is taken."""
    if "WORLD_SIZE" not in os.environ:
        return False
    args = [a for a in argv if a not in ("-q", "--quiet")]
    if not args or not (args[0] == "merge" or args[0].startswith("-") or os.sep in args[0]):
        return False
    writers = "node"
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if arg in ("-h", "--help", "--version", "--"):
            return False
        if name == "--dist-writers":
            writers = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        elif len(name) > 2 and "--dist-writers".startswith(name):
            return False
    if writers != "node":
        return False
    from ..write.distributed import torchrun_launch

    launch = torchrun_launch(writers)
    return launch is not None and launch.role == "idle"


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    if hasattr(signal, "SIGPIPE"):  # `hf-merge inspect X | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    argv = list(sys.argv[1:] if argv is None else argv)
    if idle_torchrun_rank(argv):  # under torchrun, another process merges for this node
        return 0
    parser = build_parser()
    if argv and argv[0] not in ("-q", "--quiet") and any(a in ("-q", "--quiet") for a in argv):
        argv = ["--quiet"] + [a for a in argv if a not in ("-q", "--quiet")]  # -q anywhere on the line
    commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    first = 1 if argv[:1] == ["--quiet"] else 0
    if len(argv) > first and argv[first] not in commands and argv[first] not in TOP_LEVEL_FLAGS:
        # `hf-merge SRC TGT`, `hf merge SRC TGT` and `hf merge --backend fsdp --local_dir ...` mean merge
        argv.insert(first, "merge")
    from ._args import check_flags, reject_unknown

    check_flags(parser, argv)  # a misspelled flag: a suggestion and the command's usage
    args, extra = parser.parse_known_args(argv)
    if extra:
        reject_unknown(parser, getattr(args, "command", None), extra)
    from huggingface_hub.utils import are_progress_bars_disabled

    bars_were_off = are_progress_bars_disabled()
    _setup_logging(args.quiet)
    try:
        if hasattr(args, "dist_writers"):  # merge: under torchrun, once per node
            from ..options import MergeOptions
            from ..write.distributed import enter_torchrun_merge

            if not enter_torchrun_merge(args.dist_writers or MergeOptions.dist_writers):
                return 0
        return int(args.run(args) or 0)
    except BaseException as e:  # noqa: BLE001 - the one place errors become exit codes
        if isinstance(e, SystemExit):
            raise
        from . import _errors

        return _errors.report(e, as_json=bool(getattr(args, "json", False)))
    finally:
        if args.quiet and not bars_were_off:  # -q is for this command only (main() may run again in-process)
            from huggingface_hub.utils import enable_progress_bars

            enable_progress_bars()


def run() -> NoReturn:
    """The console entry point (``hf-merge``, ``python -m hf_merge``): :func:`main`, then exit."""
    exit_now(main())


def exit_now(code: int) -> NoReturn:
    """Leave at once once the command is done: flush the streams and ``os._exit``.

    A finished command needs nothing of the interpreter's teardown, and with torch imported that
    teardown (its modules' finalisers and atexit hooks) takes ~0.25 s here, a tenth of a 3 GB
    merge. Everything a command writes is written, fsynced (every file and folder before the
    rename into place, the parent after it: docs/durability.md) and renamed into place before
    :func:`main` returns; its threads are joined or are daemons. Inside a
    ``torch.distributed`` program that still has a process group, the normal exit runs instead.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream: what Python's own exit reports as status 120
            code = code or 120
    os._exit(code)


if __name__ == "__main__":
    run()
