"""The format options the commands share, built from the format registry: ``--backend`` (its
choices, aliases and help) and each format's own reader options (``SourceFormat.cli``)."""

from __future__ import annotations

import argparse


def _format_name(value: str) -> str:
    """``--backend``'s type: an alias becomes its format's name; anything else is left for ``choices`` to refuse."""
    from ..readers.formats import find_declared

    found = find_declared(value)
    return found.name if found is not None else value


def add_backend_argument(parser: argparse.ArgumentParser, help_prefix: str = "source format") -> None:
    from ..readers.formats import declared

    formats = declared()  # from the readers' source: no torch import for --help
    listing = "; ".join(
        f"{f.name}: {f.description}" + (f" (also: {', '.join(f.aliases)})" if f.aliases else "") for f in formats
    )
    parser.add_argument(
        "--backend",
        default="auto",
        type=_format_name,
        choices=["auto", *(f.name for f in formats)],
        help=f"{help_prefix} (default: auto, detected from file names). {listing}",
    )


def _cli_options():
    """Every format's declared CLI options, once each (by ``dest``), in the registry's order."""
    from ..readers.formats import declared

    seen: dict[str, object] = {}
    for fmt in declared():
        for option in fmt.cli:
            seen.setdefault(option.dest, option)
    return list(seen.values())


def add_source_option_arguments(parser: argparse.ArgumentParser) -> None:
    """The formats' own reader options (``SourceFormat.cli``: DeepSpeed's ``--tag`` and
    ``--source-weights``...), shared by merge, inspect and verify."""
    for option in _cli_options():
        parser.add_argument(option.flag, dest=option.dest, default=None, choices=option.choices, help=option.help)


def source_options(args: argparse.Namespace) -> dict[str, str | None]:
    """The reader options of :func:`add_source_option_arguments`, as ``open_checkpoint`` takes them."""
    return {option.dest: getattr(args, option.dest) for option in _cli_options()}
