"""The ``--backend`` option, shared by the commands: its choices and help come from the format registry."""

from __future__ import annotations

import argparse


def add_backend_argument(parser: argparse.ArgumentParser, help_prefix: str = "source format") -> None:
    from ..formats import declared

    formats = declared()  # from the readers' source: no torch import for --help
    listing = "; ".join(f"{f.name}: {f.description}" for f in formats)
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", *(f.name for f in formats)],
        help=f"{help_prefix} (default: auto, detected from file names). {listing}",
    )
