#!/usr/bin/env python
"""Benchmark `hf-merge merge` on an accelerate FSDP2 checkpoint against `accelerate merge-weights`.

    .venv/bin/python benchmarks/bench_accelerate.py --workdir bench_out/accelerate            # ~1.07 GB fp32
    .venv/bin/python benchmarks/bench_accelerate.py --workdir /tmp/acc_small --layers 2       # a quick run
    .venv/bin/python benchmarks/bench_accelerate.py --workdir W --layers 64 --model-only --rounds 3   # 3.15 GB

A Qwen2-shaped model (fp32, untied; 18 layers of hidden 1024: 268 M parameters, 1.07 GB) is
saved by REAL accelerate on CPU (gloo, 2 ranks, FSDP2 plugin with ``SHARDED_STATE_DICT``; on CPU
accelerate falls back to DDP, so the state's distributed type is set to FSDP before ``prepare``,
as ``examples/make_dcp_checkpoints.py`` does) with ``Accelerator.save_state`` right after
``prepare`` (``pytorch_model_fsdp_0/`` + ``optimizer_0/``), cached under --workdir. Then, on the same
checkpoint and with the same method as bench_merge.py (warm page cache, fsync of the outputs,
RssAnon of the process tree sampled every 20 ms, CPU seconds of the process tree):

  accelerate  `accelerate merge-weights CKPT/pytorch_model_fsdp_0 OUT` (it refuses the save_state
              folder itself and writes one model.safetensors, no config)
  hf-merge    `python -m hf_merge.cli.app merge CKPT OUT --config CFG --dtype float32`

  copy floor  `cat pytorch_model_fsdp_0/*.distcp > one file` + fsync: the bytes both tools must read (about
              the output's size); if 0.3x accelerate's wall is below it, no tool meets that on this disk

and the two outputs are compared tensor by tensor (names, dtype, shape, bytes). ``--model-only``
prepares the model without an optimizer (no ``optimizer_0/``, whose Adam moments are twice the
model); ``--rounds N`` interleaves the three N times (benchmarks/peer_rounds.py). Targets (issue 28):
hf-merge wall <= 1.3x the copy floor at >= 3 GB, <= 0.5x accelerate's, peak anonymous memory <= 512 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_merge as bm  # noqa: E402
import peer_rounds  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
              num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False)


def _worker(rank: int, out: str, port: int, layers: int, model_only: bool = False) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Qwen2Config, Qwen2ForCausalLM

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True)
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    acc.state.distributed_type = DistributedType.FSDP  # CPU: accelerate chose DDP and dropped the plugin
    acc.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    torch.manual_seed(0)
    config = Qwen2Config(num_hidden_layers=layers, **CONFIG)
    model = Qwen2ForCausalLM(config)
    if model_only:  # save_state then writes pytorch_model_fsdp_0/ alone (no optimizer_0/: ~2x the model)
        model = acc.prepare(model)
    else:
        model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    acc.save_state(str(Path(out) / "ckpt"))
    if rank == 0:
        config.save_pretrained(Path(out) / "config")
    dist.barrier()
    dist.destroy_process_group()


def make(out: Path, layers: int, model_only: bool) -> None:
    if (out / "config" / "config.json").is_file() and (out / "ckpt").is_dir():  # bench_formats --make deletes ckpt/ alone
        return
    shutil.rmtree(out, ignore_errors=True)
    code = (f"import sys; sys.path.insert(0, {str(BENCH_DIR)!r}); import bench_accelerate as b; "
            f"import torch.multiprocessing as mp; mp.spawn(b._worker, args=({str(out)!r}, 29750, {layers}, {model_only}), nprocs=2)")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=bm.REPO / "bench_out" / "accelerate")
    ap.add_argument("--layers", type=int, default=18,
                    help="decoder layers (18: 1.07 GB fp32; 2: 0.33 GB; 64: 3.15 GB)")
    ap.add_argument("--model-only", action="store_true",
                    help="prepare and save the model without an optimizer (the checkpoint is the model's size, not 3x)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of floor, hf-merge and accelerate")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the two merged folders (deleted by default)")
    ap.add_argument("--make-only", action="store_true", help="save the checkpoint, measure nothing")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / (f"layers{args.layers}" + ("-model" if args.model_only else ""))
    make(src, args.layers, args.model_only)
    if args.make_only:
        return
    ckpt = src / "ckpt"
    model_dir = ckpt / "pytorch_model_fsdp_0"
    inputs = [p for p in model_dir.iterdir() if p.is_file()]
    size = f"accelerate-{args.layers}L"
    bindir = Path(sys.executable).parent
    peer_out, ours_out = args.workdir / "out_accelerate", args.workdir / "out_hfm"
    env = dict(os.environ, PYTHONPATH=str(bm.REPO), HF_HUB_DISABLE_PROGRESS_BARS="1")
    # the floor: cat of the .distcp files (the bytes both tools must read, ~ the output's size) into one file, fsynced
    distcp = sorted(p for p in inputs if p.suffix == ".distcp")
    tools = {
        peer_rounds.FLOOR: lambda: bm.measure_copy_floor(size, distcp, args.workdir / "floor.bin", args.workdir / "floor.log")[0],
        "hf-merge": lambda: bm.measure(size, "hf-merge", [sys.executable, "-m", "hf_merge.cli.app", "merge", str(ckpt),
                                                          str(ours_out), "--config", str(src / "config"), "--dtype", "float32"],
                                       ours_out, args.workdir / "hfm.log", inputs, env=env),
        "accelerate": lambda: bm.measure(size, "accelerate merge-weights", [str(bindir / "accelerate"), "merge-weights",
                                                                            str(model_dir), str(peer_out)],
                                         peer_out, args.workdir / "accelerate.log", inputs),
    }
    per = peer_rounds.run(args.rounds, tools)
    result = {"layers": args.layers, "model_only": args.model_only, "input_bytes": sum(p.stat().st_size for p in inputs),
              "floor_bytes": sum(p.stat().st_size for p in distcp),
              **peer_rounds.finish(size, per, "accelerate", peer_out, ours_out, args.keep_outputs)}
    (args.workdir / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
