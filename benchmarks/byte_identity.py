#!/usr/bin/env python
"""Byte identity of hf-merge outputs across two source trees: sha256 of every file of every case.

    python benchmarks/byte_identity.py --tree /work/proof-base --inputs /work/bench/identity --out before.json
    python benchmarks/byte_identity.py --tree . --inputs /work/bench/identity --out after.json
    python benchmarks/byte_identity.py --compare before.json after.json      # exit 1 on any difference

Each case runs ``python -m hf_merge.cli.app merge SOURCE OUT ...`` (the torchrun case:
``python -m torch.distributed.run --standalone --nproc-per-node 2 -m hf_merge.cli.app merge ...``)
in a fresh interpreter with ``PYTHONPATH=TREE`` and the tree as working folder, so the tree's code is
what runs; ``HF_MERGE_CACHE=off``. The output goes to the same path for every tree
(``--work``/<case>), so paths written into the output do not differ between trees.

Sources are written once under ``--inputs`` by the real libraries, as the tests make them
(examples/make_fsdp_checkpoint.py: torch FSDP2 on gloo, PEFT; examples/make_megatron*_checkpoint.py:
megatron-core; examples/make_dcp_checkpoints.py: torch DCP), from THIS script's checkout, and reused
by every tree. DeepSpeed and ColossalAI use the committed fixtures under tests/data/ of this checkout.

Recorded per file: sha256 of the bytes. For ``hf_merge.json`` also a digest of the JSON with the
volatile fields removed (``created``, ``hf_merge_version``, keys naming paths or seconds), and for
``README.md`` (the model card) a digest with the version and any ISO date blanked; ``--compare``
judges those two files by the normalized digest (and shows whether the raw bytes differ too).
A case whose optional library is missing (nf4: bitsandbytes; k-quants: llama-cpp-python) is
recorded as skipped with the reason.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
DATA = REPO / "tests" / "data"
SHARD = "60KB"  # the tiny models become several output files (an index, several shards)
NORMALIZED = ("hf_merge.json", "README.md")


# ------------------------------------------------------------------------------------------------
# sources, built once
# ------------------------------------------------------------------------------------------------


def _once(folder: Path, build) -> Path:
    """Build ``folder`` with ``build(tmp)`` unless it is complete (``.done``); atomic by rename."""
    if (folder / ".done").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    build(tmp)
    (tmp / ".done").write_text(f"{time.perf_counter() - t0:.1f}s\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    print(f"built {folder} in {time.perf_counter() - t0:.1f} s", flush=True)
    return folder


def _fsdp(inputs: Path, name: str, **kwargs) -> Path:
    def build(tmp: Path) -> None:
        sys.path.insert(0, str(EXAMPLES))
        import make_fsdp_checkpoint as mk

        mk.write_fsdp_checkpoint(tmp / "ckpt", **kwargs)

    return _once(inputs / name, build) / "ckpt"


def sources(inputs: Path) -> dict[str, Path]:
    """name -> source folder (built on first use)."""
    return {
        "fsdp": _fsdp(inputs, "fsdp_qwen2_fp32_ws2", arch="qwen2", world_size=2) / "global_step_1" / "actor",
        "fsdp_root": _fsdp(inputs, "fsdp_qwen2_fp32_ws2", arch="qwen2", world_size=2),
        "lora": _fsdp(inputs, "fsdp_lora_ws2", lora=dict(r=4, lora_alpha=8, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])) / "global_step_1" / "actor",
        "megatron": _megatron(inputs),
        "megatron_moe": _megatron_moe(inputs),
        "dcp": _dcp(inputs),
    }


def _megatron(inputs: Path) -> Path:
    def build(tmp: Path) -> None:
        _generate([str(EXAMPLES / "make_megatron_checkpoint.py"), str(tmp), "--only", "qwen2_v1"], tmp)

    return _once(inputs / "megatron", build) / "qwen2_v1" / "actor"


def _megatron_moe(inputs: Path) -> Path:
    def build(tmp: Path) -> None:
        _generate([str(EXAMPLES / "make_megatron_moe_checkpoint.py"), str(tmp), "--only", "qwen2_moe"], tmp)

    return _once(inputs / "megatron_moe", build) / "qwen2_moe" / "actor"


def _dcp(inputs: Path) -> Path:
    def build(tmp: Path) -> None:
        _generate([str(EXAMPLES / "make_dcp_checkpoints.py"), str(tmp), "dcp_plain"], tmp)

    return _once(inputs / "dcp", build) / "dcp_plain" / "ckpt"


def _generate(argv: list[str], tmp: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with open(tmp / "generator.log", "w") as log:
        rc = subprocess.run([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    if rc != 0:
        raise SystemExit(f"{argv[0]} failed (rc={rc}), see {tmp / 'generator.log'}")


def cases(src: dict[str, Path]) -> dict[str, dict]:
    """name -> {"argv": merge arguments after SOURCE OUT, "source", optional "torchrun", "needs"}."""
    ds = DATA / "deepspeed" / "z3_bf16_tied_ws2"
    return {
        "fsdp_plain": dict(source=src["fsdp"], argv=["--max-shard-size", SHARD]),
        "fsdp_lora_both": dict(source=src["lora"], argv=["--lora", "both", "--max-shard-size", SHARD]),
        "fsdp_lora_adapter": dict(source=src["lora"], argv=["--lora", "adapter"]),
        "megatron_dense": dict(source=src["megatron"], argv=["--max-shard-size", SHARD]),
        "megatron_moe": dict(source=src["megatron_moe"], argv=["--max-shard-size", SHARD]),
        "deepspeed_z3": dict(source=ds, argv=["--config", str(ds / "reference" / "step2" / "config"), "--dtype", "float32"]),
        "deepspeed_z2_trainer": dict(source=DATA / "deepspeed" / "z2_bf16_trainer_ws2", argv=["--dtype", "auto"]),
        "dcp": dict(source=src["dcp"], argv=["--max-shard-size", SHARD]),
        "colossalai_hybrid": dict(source=DATA / "colossalai" / "hybrid_tp2_pp2_ws4", argv=["--dtype", "float32"]),
        "colossalai_ddp": dict(source=DATA / "colossalai" / "ddp_safetensors_ws2", argv=["--dtype", "bfloat16"]),
        "nf4": dict(source=src["fsdp"], argv=["--quantize", "nf4"], needs="bitsandbytes"),
        "gguf_q8_0": dict(source=src["fsdp_root"], argv=["--gguf", "q8_0", "--gguf-pre-tokenizer", "gpt-2"], needs="gguf"),
        "gguf_q4_0": dict(source=src["fsdp_root"], argv=["--gguf", "q4_0", "--gguf-pre-tokenizer", "gpt-2"], needs="gguf"),
        "gguf_q4_k_m": dict(source=src["fsdp_root"], argv=["--gguf", "q4_k_m", "--gguf-pre-tokenizer", "gpt-2"], needs="llama_cpp"),
        "torchrun_fsdp": dict(source=src["fsdp"], argv=["--max-shard-size", SHARD], torchrun=True),
    }


# ------------------------------------------------------------------------------------------------
# digests
# ------------------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _volatile(key: str) -> bool:
    k = key.lower()
    return k in ("created", "hf_merge_version") or k.endswith(("path", "dir", "seconds")) or k in ("host", "hostname")


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if not _volatile(k)}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def normalized(path: Path) -> str:
    """Digest of hf_merge.json without its volatile fields, or of the card without version and dates."""
    if path.name == "hf_merge.json":
        text = json.dumps(_strip(json.loads(path.read_text())), sort_keys=True)
    else:
        text = path.read_text()
        text = re.sub(r"\d{4}-\d\d-\d\d([T ]\d\d:\d\d(:\d\d)?(\.\d+)?(Z|[+-]\d\d:?\d\d)?)?", "<date>", text)
        text = re.sub(r"hf-merge \d+\.\d+[\w.+-]*", "hf-merge <version>", text)
    return hashlib.sha256(text.encode()).hexdigest()


def digest_folder(out: Path) -> dict[str, dict[str, str]]:
    files = {}
    for p in sorted(x for x in out.rglob("*") if x.is_file()):
        rel = p.relative_to(out).as_posix()
        files[rel] = {"sha256": sha256(p)}
        if p.name in NORMALIZED:
            files[rel]["normalized"] = normalized(p)
    return files


# ------------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------------


def run_case(tree: Path, case: dict, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HF_MERGE_DEBUG")}
    env.update(PYTHONPATH=str(tree), HF_MERGE_CACHE="off", HF_HUB_DISABLE_PROGRESS_BARS="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if case.get("torchrun") else [sys.executable]
    argv = [*launcher, "-m", "hf_merge.cli.app", "merge", str(case["source"]), str(out), *case["argv"]]
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tree, timeout=900)
    record = {"argv": argv[argv.index("merge"):], "rc": p.returncode, "seconds": round(time.perf_counter() - t0, 2)}
    if p.returncode != 0:
        record["stderr"] = p.stderr[-3000:]
    elif out.is_dir():
        record["files"] = digest_folder(out)
    shutil.rmtree(out, ignore_errors=True)
    return record


def measure(ns: argparse.Namespace) -> int:
    tree = ns.tree.resolve()
    if not (tree / "hf_merge").is_dir():
        raise SystemExit(f"{tree} holds no hf_merge/")
    ns.inputs.mkdir(parents=True, exist_ok=True)
    all_cases = cases(sources(ns.inputs.resolve()))
    chosen = ns.only or list(all_cases)
    results = {"tree": str(tree), "commit": ns.label or _commit(tree), "python": sys.executable, "cases": {}}
    print(f"{'case':24} {'rc':>3} {'files':>5} {'s':>6}  note")
    for name in chosen:
        case = all_cases[name]
        need = case.get("needs")
        if need and importlib.util.find_spec(need) is None:
            rec = {"skipped": f"{need} is not importable in {sys.executable}"}
        else:
            rec = run_case(tree, case, ns.work / name)
        results["cases"][name] = rec
        note = rec.get("skipped") or (rec.get("stderr", "").strip().splitlines() or [""])[-1][:90]
        print(f"{name:24} {rec.get('rc', '-')!s:>3} {len(rec.get('files', {})):>5} {rec.get('seconds', 0):>6.1f}  {note}", flush=True)
    ns.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {ns.out}")
    return 0 if all(r.get("rc", 0) == 0 for r in results["cases"].values()) else 1


def _commit(tree: Path) -> str | None:
    p = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return p.stdout.strip() or None


# ------------------------------------------------------------------------------------------------
# comparing
# ------------------------------------------------------------------------------------------------


def compare(a_path: Path, b_path: Path) -> int:
    a, b = (json.loads(Path(p).read_text())["cases"] for p in (a_path, b_path))
    differ = 0
    print(f"{'case':24} {'file':44} verdict")
    for name in sorted(set(a) | set(b)):
        ra, rb = a.get(name), b.get(name)
        if ra is None or rb is None:
            print(f"{name:24} {'':44} only in {'B' if ra is None else 'A'}")
            differ += 1
            continue
        if "skipped" in ra or "skipped" in rb:
            print(f"{name:24} {'':44} skipped ({ra.get('skipped') or rb.get('skipped')})")
            continue
        if ra["rc"] != rb["rc"] or ra["rc"] != 0:
            print(f"{name:24} {'':44} {'DIFFERENT' if ra['rc'] != rb['rc'] else 'both failed'}: rc {ra['rc']} vs {rb['rc']}")
            differ += ra["rc"] != rb["rc"]
            continue
        fa, fb = ra["files"], rb["files"]
        for f in sorted(set(fa) | set(fb)):
            if f not in fa or f not in fb:
                verdict = f"DIFFERENT: only in {'A' if f in fa else 'B'}"
            elif "normalized" in fa[f]:
                same = fa[f]["normalized"] == fb[f].get("normalized")
                raw = "raw same" if fa[f]["sha256"] == fb[f]["sha256"] else "raw differs"
                verdict = f"{'same' if same else 'DIFFERENT'} (normalized; {raw})"
            else:
                verdict = "same" if fa[f]["sha256"] == fb[f]["sha256"] else "DIFFERENT"
            differ += verdict.startswith("DIFFERENT")
            print(f"{name:24} {f:44} {verdict}")
    print(f"{differ} difference(s)")
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, help="source tree holding hf_merge/ (run with PYTHONPATH=TREE)")
    ap.add_argument("--inputs", type=Path, default=Path("/work/bench/identity"), help="cache of source checkpoints (built once)")
    ap.add_argument("--out", type=Path, help="results JSON")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "hf-merge-byte-identity",
                    help="output folders (the same path for every tree; removed after hashing)")
    ap.add_argument("--only", nargs="*", help="case names (default: all)")
    ap.add_argument("--label", help="what the tree is, recorded as its commit (default: git rev-parse HEAD in TREE)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"), help="compare two results; exit 1 on any difference")
    ns = ap.parse_args()
    if ns.compare:
        return compare(*ns.compare)
    if ns.tree is None or ns.out is None:
        ap.error("--tree and --out are needed (or --compare A B)")
    return measure(ns)


if __name__ == "__main__":
    sys.exit(main())
