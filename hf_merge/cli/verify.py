"""``hf-merge verify TARGET --against SOURCE|HF_DIR``."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check a merged folder against its source checkpoint or a reference HF folder",
        description="Compare every tensor of TARGET with the source checkpoint (exact) or a reference HF folder (--atol/--rtol).",
    )
    p.add_argument("target", help="merged Hugging Face folder")
    p.add_argument("--against", required=True, help="the sharded source checkpoint, or a reference HF folder")
    p.add_argument("--backend", default="auto", choices=["auto", "fsdp", "megatron", "hf"], help="format of --against")
    p.add_argument("--config", "--hf_model_path", dest="config", help="config folder for the source, as in merge")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance against an HF folder (default 0)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance against an HF folder (default 0)")
    p.add_argument("--logits", action="store_true", help="also load TARGET with transformers and run a forward pass")
    p.add_argument("--logits-atol", type=float, default=1e-3, help="max logit difference against a reference folder")
    p.add_argument("--lora-alpha", type=float, default=None)
    p.add_argument("--base-model", default=None)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..preflight import check_verify

    check_verify(args.target, args.against, config=args.config, base_model=args.base_model)  # before torch is imported
    from ..verification import verify

    report = verify(
        args.target, args.against, atol=args.atol, rtol=args.rtol, logits=args.logits, logits_atol=args.logits_atol,
        backend=args.backend, config=args.config, lora_alpha=args.lora_alpha, base_model=args.base_model,
    )
    print(report.table())
    if not report.ok:
        print(f"error: {args.target} does not match {args.against}: {report.summary()}", file=sys.stderr)
        return 1
    return 0
