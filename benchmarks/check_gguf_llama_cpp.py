#!/usr/bin/env python
"""Run hf-merge's GGUF files in llama.cpp (llama-cpp-python) and compare them with the HF model.

    PY=/path/to/venv-with-llama-cpp/bin/python
    $PY benchmarks/check_gguf_llama_cpp.py SOURCE --hf HF_DIR [--types f32,q8_0,q4_k_m,q5_k_m,q6_k]
        [--config CFG] [--workdir DIR] [--prompt "text"] [--new-tokens 16] [-- extra hf-merge merge args]

For each type, ``hf-merge merge SOURCE DIR/TYPE --gguf TYPE`` (K-quants: written as BF16, then
quantized by llama.cpp's C quantizer through llama-cpp-python), then llama.cpp evaluates the
prompt's token ids (the HF tokenizer's, so both sides see the same ids) and continues greedily
(argmax of its logits, no sampler) for ``--new-tokens`` tokens; the HF model (``HF_DIR``, float32)
does the same. Printed per file: the cosine similarity of llama.cpp's logits with the HF model's at
every prompt position (mean and minimum), how often their argmax agrees over the prompt, and how
many greedy tokens equal the HF model's before the first difference.

SOURCE may be any checkpoint hf-merge reads; HF_DIR is the same model as a Hugging Face folder
(e.g. ``hf-merge merge SOURCE HF_DIR``), or SOURCE itself when it is one. llama-cpp-python has
no wheel on the index: build it from source with
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"`` (the
native build of this CPU crashes in the AMX matmul on Q8_0 with more than one token per call).
Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
from hf_merge.transformers_compat import dtype_kwargs

REPO = Path(__file__).resolve().parent.parent


def hf_run(hf_dir: Path, ids: list[int], new_tokens: int) -> tuple[np.ndarray, list[int]]:
    """float32 logits at every prompt position, and the greedy continuation."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, **dtype_kwargs(torch.float32)).eval()
    with torch.no_grad():
        seq = torch.tensor([ids])
        logits = model(seq).logits[0].float().numpy()
        out: list[int] = []
        for _ in range(new_tokens):
            nxt = int(model(seq).logits[0, -1].argmax())
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return logits, out


def llama_cpp_run(path: Path, ids: list[int], new_tokens: int, threads: int) -> tuple[np.ndarray, list[int]]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=max(64, len(ids) + new_tokens + 8), n_batch=512, logits_all=True,
                n_threads=threads, verbose=False)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    out: list[int] = []
    for _ in range(new_tokens):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        llm.eval([nxt])
    del llm
    return logits, out


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("--hf", type=Path, default=None, help="the same model as a Hugging Face folder (default: SOURCE)")
    ap.add_argument("--types", default="f32,q8_0,q4_k_m,q5_k_m,q6_k")
    ap.add_argument("--workdir", type=Path, default=REPO / "bench_out" / "gguf-llama-cpp")
    ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse", action="store_true", help="keep GGUF files already in the workdir")
    ap.add_argument("merge_args", nargs="*", help="extra `hf-merge merge` arguments (after --)")
    args = ap.parse_args(argv)
    hf_dir = args.hf or args.source
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(hf_dir).encode(args.prompt)
    ref_logits, ref_tokens = hf_run(hf_dir, ids, args.new_tokens)
    rows = []
    for kind in args.types.split(","):
        out = args.workdir / kind
        files = sorted(out.glob("*.gguf")) if args.reuse and out.is_dir() else []
        if not files:
            cmd = [sys.executable, "-m", "hf_merge.cli.app", "-q", "merge", str(args.source), str(out), "--overwrite",
                   "--gguf", kind, *args.merge_args]
            subprocess.run(cmd, check=True, cwd=REPO)
            files = sorted(p for p in out.glob("*.gguf") if "-lora-" not in p.name)
        logits, tokens = llama_cpp_run(files[0], ids, args.new_tokens, args.threads)
        cos = cosine_rows(logits, ref_logits)
        top1 = float((logits.argmax(-1) == ref_logits.argmax(-1)).mean())
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
        rows.append((kind, files[0].stat().st_size, float(cos.mean()), float(cos.min()), top1, same))
    print(f"\nprompt: {len(ids)} tokens; greedy continuation: {args.new_tokens} tokens; reference: {hf_dir} (float32)\n")
    print("| type | .gguf bytes | logits cosine mean | min | prompt argmax agreement | greedy tokens equal |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, size, mean, low, top1, same in rows:
        print(f"| {kind} | {size:,} | {mean:.6f} | {low:.6f} | {top1:.3f} | {same}/{args.new_tokens} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
