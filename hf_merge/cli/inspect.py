"""``hf-merge inspect SOURCE``: what a checkpoint holds, from metadata only (no tensor data read)."""

from __future__ import annotations

import argparse

from ._formats import add_backend_argument
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a checkpoint without reading tensor data")
    p.add_argument("source", help="checkpoint folder")
    add_backend_argument(p)
    p.add_argument("--config", "--hf_model_path", dest="config", help="folder with config.json")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--tensors", action="store_true", help="also list every tensor")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..inspect import describe

    report = describe(args.source, backend=args.backend, config=args.config, tensors=args.tensors)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    width = max(len(k) for k in report if k != "tensors")
    for key, value in report.items():
        if key == "tensors":
            continue
        if isinstance(value, (list, dict)):
            value = json.dumps(value, default=str)
        print(f"{key.replace('_', ' '):<{width}}  {value}")
    for row in report.get("tensors", []):
        print(f"  {row['name']}  {row['shape']}  {row['dtype']}  {row.get('placement', '')}")
    return 0
