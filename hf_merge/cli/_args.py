"""Shared argument types and messages of the CLI: sizes, dtypes, misspelled flags.

Values are checked when the command line is parsed (argparse ``type=`` functions), so a bad
``--max-shard-size`` or ``--dtype`` is reported with the command's usage before any checkpoint
is opened.
"""

from __future__ import annotations

import argparse
import difflib

# --dtype spellings -> the canonical name; "auto" keeps the shards' dtypes.
DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def size_arg(value: str) -> int:
    """``--max-shard-size`` type: ``5GB``, ``2G``, ``500MB``, ``4GiB``, ``2000000000`` -> bytes."""
    from ..sizes import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(value: str) -> int:
    """``--workers`` type: a whole number of at least 1."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of at least 1")
    return n


def _dtype(value: str, extra: tuple[str, ...]) -> str:
    key = value.strip().lower().removeprefix("torch.")
    if key in extra:
        return key
    if key in DTYPE_ALIASES:
        return DTYPE_ALIASES[key]
    names = list(DTYPE_CHOICES) + list(extra)
    close = difflib.get_close_matches(key, names, n=1) or difflib.get_close_matches(key, list(DTYPE_ALIASES), n=1)
    hint = f" (did you mean {DTYPE_ALIASES.get(close[0], close[0])}?)" if close else ""
    raise argparse.ArgumentTypeError(
        f"unknown dtype {value!r}{hint}; use {', '.join(names)} (or bf16, fp16, fp32)"
    )


def dtype_arg(value: str) -> str:
    """``--dtype`` type: float32/bfloat16/float16 (aliases fp32, bf16, fp16, float, half) or auto."""
    return _dtype(value, ("auto",))


def float_dtype_arg(value: str) -> str:
    """A floating dtype with the same aliases, ``auto`` not allowed (e.g. ``--quant-compute-dtype``)."""
    return _dtype(value, ())


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def check_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Before parsing: a ``--flag`` the command does not have (nor abbreviates) is reported with
    its closest match, even when argparse would first complain about a missing required one."""
    command = next((a for a in argv if not a.startswith("-")), None)
    target = _subparser(parser, command)
    if target is parser:
        return
    flags = [s for a in target._actions for s in a.option_strings if s.startswith("--")]
    for arg in argv[argv.index(command) + 1:]:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if arg.startswith("--") and name not in flags and not any(f.startswith(name) for f in flags):
            reject_unknown(parser, command, [arg])


def reject_unknown(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> None:
    """Exit (status 2) with the subcommand's usage, naming the first unknown argument and the
    closest flag it has, as argparse does for an invalid choice."""
    target = _subparser(parser, command)
    flags = [s for a in target._actions for s in a.option_strings if s.startswith("--")]
    unknown = next((a for a in extra if a.startswith("-")), extra[0])
    message = f"unrecognized argument {unknown}"
    if unknown.startswith("-"):
        close = difflib.get_close_matches(unknown.split("=", 1)[0], flags, n=1, cutoff=0.6)
        if close:
            message += f" (did you mean {close[0]}?)"
    else:
        message += " (more positional arguments than the command takes)"
    target.error(message)
