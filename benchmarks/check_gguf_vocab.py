#!/usr/bin/env python
"""A/B of the GGUF vocabulary step: an older revision of hf_merge against this tree.

    .venv/bin/python benchmarks/check_gguf_vocab.py [--old-rev 59e7982] [--repeat 3] \
        [--llama-cpp LLAMA_CPP_DIR] [FOLDER[:VOCAB_SIZE[:PRE]] ...]

For each tokenizer folder, old and new run alternately (old, new, old, new, ...; each a fresh
process) and each writes a GGUF holding only the metadata keys (``general.*`` + every
``tokenizer.ggml.*`` key, no tensors) through ``hf_merge.gguf.writer.write_file``: the two files
must be byte-identical (or both runs fail with the same message). Reported per folder: the
``tokenizer.ggml.pre`` name, whether the files are identical, and the median CPU seconds
(user + system, from ``os.times`` inside the process) of ``load_vocab`` and of writing the keys.

``--llama-cpp`` adds llama.cpp's own vocabularies (``models/ggml-vocab-*.gguf``) rebuilt as
Hugging Face tokenizer folders by transformers' GGUF loader (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)`` + ``save_pretrained``) under ``--workdir``; VOCAB_SIZE defaults to the tokenizer's
size rounded up to a multiple of 128 (so ``[PAD<i>]`` entries are written too). The old revision is
taken with ``git archive`` from this repository. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCABS = ("gpt-2", "llama-bpe", "qwen2", "qwen35", "deepseek-coder", "deepseek-llm", "falcon", "starcoder",
          "refact", "mpt", "command-r", "gpt-neox", "phi-3")

CHILD = r"""
import json, os, sys
from pathlib import Path
from hf_merge.errors import HfMergeError
from hf_merge.gguf.tokenizer import add_to_writer, load_vocab
from hf_merge.gguf.writer import write_file
folder, size, pre, out = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None, Path(sys.argv[4])
cpu = lambda: sum(os.times()[:2])
t0 = cpu()
try:
    vocab = load_vocab(Path(folder), size, pre_tokenizer=pre)
except HfMergeError as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    sys.exit(0)
t1 = cpu()
def keys(w):
    w.add_type("model")
    w.add_name("vocab-check")
    add_to_writer(w, vocab)
write_file(None, out, "llama", [], keys)
print(json.dumps({"pre": vocab.pre, "load_vocab_s": t1 - t0, "write_keys_s": cpu() - t1}))
"""


def old_tree(rev: str, dest: Path) -> Path:
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev, "hf_merge"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def rebuild(llama_cpp: Path, name: str, workdir: Path) -> Path | None:
    folder = workdir / f"vocab-{name}"
    if (folder / "tokenizer.json").is_file():
        return folder
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(llama_cpp / "models", gguf_file=f"ggml-vocab-{name}.gguf")
    except Exception as e:  # noqa: BLE001 - a vocabulary transformers cannot rebuild is reported and skipped
        print(f"- {name}: transformers could not rebuild it ({type(e).__name__}: {str(e)[:100]})")
        return None
    tok.save_pretrained(folder)
    return folder


def run(tree: Path, folder: Path, size: int, pre: str, out: Path) -> dict:
    import os

    env = dict(os.environ, PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, "-c", CHILD, str(folder.resolve()), str(size), pre, str(out.resolve())], env=env,
                       cwd=tree, capture_output=True, text=True)  # cwd: `python -c` puts it first on sys.path
    if r.returncode:
        return {"error": f"crashed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def vocab_size(folder: Path) -> int:
    """The tokenizer's largest id + 1, rounded up to a multiple of 128."""
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"].get("vocab")
    top = max(vocab.values()) if isinstance(vocab, dict) else len(vocab) - 1
    top = max([top, *(e["id"] for e in data.get("added_tokens") or [])])
    return (top + 1 + 127) // 128 * 128


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="*", help="FOLDER[:VOCAB_SIZE[:PRE]]")
    ap.add_argument("--old-rev", default="59e7982", help="git revision of the old code (default: before this change)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each, interleaved")
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source folder: also check its models/ggml-vocab-*.gguf")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hf-merge-vocab-check")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    cases: list[tuple[Path, int, str]] = []
    for spec in args.folders:
        folder, *rest = spec.split(":")
        cases.append((Path(folder), int(rest[0]) if rest and rest[0] else vocab_size(Path(folder)), rest[1] if len(rest) > 1 else ""))
    if args.llama_cpp:
        for name in VOCABS:
            folder = rebuild(args.llama_cpp, name, args.workdir)
            if folder is not None:
                cases.append((folder, vocab_size(folder), ""))
    trees = {"old": old_tree(args.old_rev, args.workdir / f"old-{args.old_rev}"), "new": REPO}
    outdir = Path(tempfile.mkdtemp(prefix="outputs-", dir=args.workdir))  # this run's own files
    print("| tokenizer | vocab | pre | identical | load_vocab CPU s old → new | write keys CPU s old → new |")
    print("|---|---:|---|---|---:|---:|")
    ok = True
    for folder, size, pre in cases:
        results: dict[str, list[dict]] = {"old": [], "new": []}
        files: dict[str, bytes | None] = {}
        for _ in range(args.repeat):
            for which in ("old", "new"):
                out = outdir / f"{which}.gguf"
                out.unlink(missing_ok=True)
                results[which].append(run(trees[which], folder, size, pre, out))
                files[which] = out.read_bytes() if out.is_file() else None
        old, new = results["old"][-1], results["new"][-1]
        same = files["old"] == files["new"] and old.get("error") == new.get("error")
        ok &= same
        label = f"{folder.name}{' --gguf-pre-tokenizer ' + pre if pre else ''}"
        if "error" in old or "error" in new:
            print(f"| {label} | {size} | {old.get('error') or old['pre']} / {new.get('error') or new['pre']} | {same} | | |")
            continue

        def med(which: str, key: str) -> str:
            return f"{statistics.median(r[key] for r in results[which]):.2f}"

        print(f"| {label} | {size} | {new['pre']} | {same} | {med('old', 'load_vocab_s')} → {med('new', 'load_vocab_s')} "
              f"| {med('old', 'write_keys_s')} → {med('new', 'write_keys_s')} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
