"""``hf-merge push TARGET REPO_ID``: upload a merged folder, with its model card, to the Hub.

A thin layer over :func:`hf_merge.publish.hub.push`; errors are :class:`~hf_merge.errors.HubError`,
which ``hf_merge.cli.app`` prints as one ``error: ...`` line.
"""

from __future__ import annotations

import argparse

EXAMPLES = [
    "hf-merge push ./merged my-org/qwen2.5-0.5b-grpo --private",
    "hf-merge push ./merged my-org/qwen2.5-0.5b-grpo --revision step-100",
    "hf-merge push ./adapter my-org/qwen2.5-0.5b-grpo-lora --create-pr --commit-message 'LoRA from step 100'",
]

HELP = "upload a merged model or adapter folder to the Hugging Face Hub"
DESCRIPTION = """\
Upload TARGET (a folder written by `hf-merge merge`) to the Hub model repo REPO_ID, creating the
repo when it does not exist. When TARGET has an hf_merge.json, its README.md (model card) is
written or extended from it first. The push replaces the model in the repo: the model/adapter
files of an earlier upload that TARGET does not have (old weights, shard indexes, configs,
lora_adapter/) are deleted in the same commit; README.md, .gitattributes and other files are kept.
The token comes from HF_TOKEN or `hf auth login`; it is never printed. An interrupted push is
resumed by running the same command again.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``push`` command on ``subparsers``; return its parser."""
    parser = subparsers.add_parser(
        "push",
        help=HELP,
        description=DESCRIPTION,
        epilog="examples:\n" + "\n".join(f"  {example}" for example in EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="TARGET", help="the folder to upload")
    parser.add_argument("repo_id", metavar="REPO_ID", help="namespace/name of the model repo")
    parser.add_argument(
        "--private",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="create the repo private (--private) or public (--no-private); default: the Hub's "
        "default. An existing repo's visibility is never changed: a push asking for the other one is refused",
    )
    parser.add_argument("--revision", default=None, help="branch to push to (created when missing)")
    parser.add_argument("--commit-message", default=None, help="commit title")
    parser.add_argument(
        "--create-pr", action="store_true", help="open a pull request instead of committing to main"
    )
    parser.add_argument(
        "--token",
        default=None,
        help="Hub token; prefer HF_TOKEN or `hf auth login` (a token on the command line is "
        "visible to other users of the machine)",
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Push ``args.target`` to ``args.repo_id``; print the URL; return the exit status (0)."""
    from ..publish.hub import push

    url = push(
        args.target,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        commit_message=args.commit_message,
        create_pr=args.create_pr,
        token=args.token,
    )
    from ..errors import redact_credentials

    print(redact_credentials(url))
    return 0
