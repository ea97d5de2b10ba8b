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


def add_source_option_arguments(parser: argparse.ArgumentParser) -> None:
    """The format-specific reader options (DeepSpeed's ``--tag`` and ``--source-weights``), shared by merge and inspect."""
    parser.add_argument("--tag", default=None, help="DeepSpeed: the checkpoint tag to read (default: the one named in `latest`)")
    parser.add_argument("--source-weights", choices=["master", "module"], default=None,
                        help="DeepSpeed: master (default): the fp32 master weights; module: the 16-bit module weights (ZeRO 1/2)")


def source_options(args: argparse.Namespace) -> dict[str, str | None]:
    """The reader options of :func:`add_source_option_arguments`, as ``open_checkpoint`` takes them."""
    return {"tag": args.tag, "source_weights": args.source_weights}
