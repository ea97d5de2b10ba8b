"""``hf-merge verify TARGET [--against SOURCE|HF_DIR]``, and verl's ``test`` (``--test_hf_dir``)."""

from __future__ import annotations

import argparse
import sys

from ..errors import redact_credentials
from ._formats import add_backend_argument, add_source_option_arguments, source_options

VERIFY_EXAMPLES = """examples:
  hf-merge verify ./merged --against checkpoints/global_step_100/actor      # exact, against the source
  hf-merge verify ./merged --against ./reference-hf --rtol 0.004 --logits   # tolerances + a forward pass
  hf-merge verify ./downloaded                                            # the checksums recorded at merge time
"""
TEST_EXAMPLES = """examples:
  hf-merge test --backend fsdp --local_dir checkpoints/global_step_100/actor --test_hf_dir ./reference-hf
"""
# verl's own tolerances in model_merger test: FSDP 1e-6 / 1e-6, Megatron atol 1e-2, rtol 5e-2.
VERL_TOLERANCES = {"megatron": (1e-2, 5e-2)}
DEFAULT_TOLERANCE = (1e-6, 1e-6)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check a merged folder against its source checkpoint or a reference HF folder",
        description="Compare every tensor of TARGET with the source checkpoint (exact) or a reference HF folder "
        "(--atol/--rtol). A LoRA adapter folder, and the lora_adapter/ of a --lora both merge, are checked too. "
        "Without --against, check only the file checksums hf_merge.json recorded at merge time.",
        epilog=VERIFY_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", help="merged Hugging Face folder (or PEFT adapter folder)")
    p.add_argument("--against", help="the sharded source checkpoint, or a reference HF folder (default: only the "
                   "checksums recorded at merge time)")
    _source_options(p)
    add_source_option_arguments(p)  # default: the ones hf_merge.json recorded
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance against an HF folder (default 0)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance against an HF folder (default 0)")
    p.add_argument("--logits", action="store_true", help="also load TARGET with transformers and run a forward pass")
    p.add_argument("--logits-atol", type=float, default=1e-3, help="max logit difference against a reference folder (default 1e-3)")
    p.set_defaults(run=run)

    t = sub.add_parser(
        "test",
        help="verl's model_merger test: compare a checkpoint, merged in memory, with an HF folder",
        description="verl's `model_merger test`: merge the checkpoint in memory (nothing is written) and compare it "
        "with --test_hf_dir: names and shapes must match, values within --atol/--rtol after reading each tensor in "
        "the reference's dtype (verl's tolerances by default: 1e-6 for FSDP, atol 1e-2 / rtol 5e-2 for Megatron).",
        epilog=TEST_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("source", nargs="?", help="checkpoint folder (or --local_dir)")
    t.add_argument("--local_dir", "--local-dir", dest="local_dir", help="verl spelling of SOURCE")
    t.add_argument("--test_hf_dir", "--test-hf-dir", dest="test_hf_dir", required=True, help="the reference Hugging Face folder")
    _source_options(t)
    t.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: verl's for the backend)")
    t.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: verl's for the backend)")
    for flag in ("--tie-word-embedding", "--trust-remote-code", "--is-value-model", "--use_cpu_initialization"):
        t.add_argument(flag, action="store_true", help="verl compatibility; changes nothing here")
    t.set_defaults(run=run_test)


def _source_options(p: argparse.ArgumentParser) -> None:
    add_backend_argument(p, "format of the source")
    p.add_argument("--config", "--hf_model_path", dest="config", help="config folder for the source, as in merge")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha, when neither the checkpoint nor hf_merge.json records it")
    p.add_argument("--base-model", default=None, help="HF folder with the base weights, for save_lora_only checkpoints")


def run(args: argparse.Namespace) -> int:
    from ..write.distributed import launched_by_torchrun
    from ..preflight import check_verify

    if not launched_by_torchrun():  # a rank of a distributed verification reports to the others instead
        check_verify(args.target, args.against, config=args.config, base_model=args.base_model)  # before torch is imported
    from ..verification import verify

    report = verify(
        args.target, args.against, atol=args.atol, rtol=args.rtol, logits=args.logits, logits_atol=args.logits_atol,
        backend=args.backend, config=args.config, lora_alpha=args.lora_alpha, base_model=args.base_model,
        source_options=source_options(args),
    )
    if report.rank != 0:  # a distributed verification: rank 0 prints the one report; every rank's exit code
        return 0 if report.ok else 1
    return _print(report, f"{args.target} does not match {report.against}")


def run_test(args: argparse.Namespace) -> int:
    from ..errors import HfMergeError
    from ..verification import check_source

    from ..preflight import check_folder

    source = args.source or args.local_dir
    if not source:
        raise HfMergeError("need the checkpoint: hf-merge test --local_dir SOURCE --test_hf_dir HF_DIR")
    check_folder(source, "SOURCE", "pass the checkpoint's actor/ or global_step_N folder")
    check_folder(args.test_hf_dir, "--test_hf_dir", "pass the reference Hugging Face folder")
    atol, rtol = VERL_TOLERANCES.get(args.backend, DEFAULT_TOLERANCE)
    report = check_source(
        source, args.test_hf_dir, atol=atol if args.atol is None else args.atol, rtol=rtol if args.rtol is None else args.rtol,
        backend=args.backend, config=args.config, lora_alpha=args.lora_alpha, base_model=args.base_model,
    )
    return _print(report, f"{source} does not match {args.test_hf_dir}")


def _print(report, failure: str) -> int:
    print(redact_credentials(report.table()))
    if not report.ok:
        print(redact_credentials(f"error: {failure}: {report.summary()}"), file=sys.stderr)
        return 1
    return 0
