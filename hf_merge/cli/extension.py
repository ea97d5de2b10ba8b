"""``hf-merge install-extension``: make ``hf merge ...`` work (huggingface_hub CLI extension)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "install-extension",
        help="register hf-merge so that `hf merge ...` runs it (offline)",
        description="Write the manifest huggingface_hub's `hf` CLI reads for extensions "
        "(~/.local/share/hf/extensions/hf-merge/), so that `hf merge ARGS` runs `hf-merge ARGS`. No network.",
    )
    p.add_argument("--executable", default=None, help="path of the hf-merge executable (default: this environment's)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..extension import install_extension

    path = install_extension(args.executable)
    print(f"registered: `hf merge ...` now runs hf-merge ({path})")
    return 0
