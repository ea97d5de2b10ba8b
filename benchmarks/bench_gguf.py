#!/usr/bin/env python
"""Training checkpoint -> Q8_0 GGUF: hf-merge in one pass vs hf-merge to HF + llama.cpp's converter.

    .venv/bin/python benchmarks/bench_gguf.py --llama-cpp LLAMA_CPP_DIR --tokenizer TOK_DIR [--sizes 2,8]

Same synthetic checkpoints and method as bench_merge.py (warm page cache, fsync of the outputs,
memory of the whole process tree sampled every 20 ms), plus the CPU time (user + system) of each
command, which stays meaningful when the machine is shared. Per size:
  one pass  `hf-merge merge SRC DST --gguf q8_0 --config CFG`
  pair      `hf-merge merge SRC HF --config CFG && python LLAMA_CPP/convert_hf_to_gguf.py HF --outtype q8_0`
            (llama.cpp's own script, with its bundled gguf-py on PYTHONPATH; --pythonpath adds more,
            e.g. a folder holding sentencepiece, which the script imports)
CFG = the checkpoint's huggingface/config.json plus the tokenizer files of TOK_DIR: a tokenizer
llama.cpp recognises (the synthetic checkpoint's own has no merges), e.g. Qwen2's, rebuilt offline
from llama.cpp's models/ggml-vocab-qwen2.gguf with AutoTokenizer.from_pretrained(dir, gguf_file=...).
Not part of `make test`.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_merge as bm  # noqa: E402


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source folder (convert_hf_to_gguf.py, gguf-py/)")
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with a tokenizer llama.cpp knows (vocab <= 152064)")
    ap.add_argument("--sizes", default="2", help="decoder layers per checkpoint, comma-separated (2 ~3.1 GB, 8 ~5.9 GB)")
    ap.add_argument("--workdir", type=Path, default=bm.DEFAULT_WORKDIR)
    ap.add_argument("--pythonpath", default="", help="extra PYTHONPATH entries for the converter")
    args = ap.parse_args(argv)
    py = sys.executable
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(args.llama_cpp / "gguf-py"), args.pythonpath])))
    rows = []
    for layers in [int(s) for s in args.sizes.split(",")]:
        ckpt, info = bm.ensure_checkpoint(args.workdir, layers)
        cfg = args.workdir / f"cfg-L{layers}"
        bm.remove(cfg)
        shutil.copytree(args.tokenizer, cfg)
        shutil.copy(ckpt / "huggingface" / "config.json", cfg / "config.json")
        size = f"L{layers} {info['rank_file_bytes'] / 1e9:.2f} GB"
        inputs = bm.input_files(ckpt)
        (args.workdir / "logs").mkdir(parents=True, exist_ok=True)
        out, hf, pair_out = (args.workdir / "out" / f"L{layers}-{n}" for n in ("gguf", "hf", "pair"))
        one = [py, "-m", "hf_merge.cli.app", "-q", "merge", str(ckpt), str(out), "--overwrite", "--gguf", "q8_0",
               "--config", str(cfg)]
        convert = [py, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "q8_0", "--outfile", str(pair_out / "model-q8_0.gguf")]
        pair = ["sh", "-c", f"rm -rf {shlex.quote(str(hf))} && {shlex.join(one[:5] + [str(ckpt), str(hf), '--config', str(cfg)])}"
                f" && mkdir -p {shlex.quote(str(pair_out))} && {shlex.join(convert)}"]
        for tool, cmd, target, e in (("hf-merge --gguf q8_0 (one pass)", one, out, None),
                                     ("hf-merge + convert_hf_to_gguf.py", pair, pair_out, env)):
            c0 = cpu_seconds()
            r = bm.measure(size, tool, cmd, target, args.workdir / "logs" / f"gguf-L{layers}-{len(rows)}.log", inputs, env=e)
            rows.append((r, cpu_seconds() - c0))
        bm.remove(hf)
    print("\n| size | tool | wall s | CPU s | peak anon MB | peak RSS MB | output bytes |\n|---|---|---:|---:|---:|---:|---:|")
    for r, cpu in rows:
        wall = f"{r.wall_s:.1f}" if r.ok else f"failed (rc={r.returncode})"
        print(f"| {r.size} | {r.tool} | {wall} | {cpu:.1f} | {bm.fmt_mb(r.peak_anon_mb)} | {bm.fmt_mb(r.peak_rss_mb)} | {r.output_bytes:,} |")
    for r, _ in rows:
        for note in r.notes:
            print(f"- {r.tool}: {note}")
    return 0 if all(r.ok for r, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
