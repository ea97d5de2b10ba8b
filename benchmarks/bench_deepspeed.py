#!/usr/bin/env python
"""Benchmark `hf-merge merge` on DeepSpeed ZeRO-2 / ZeRO-3 checkpoints against DeepSpeed's `zero_to_fp32.py`.

    bash benchmarks/setup_deepspeed.sh /work/venv-ds      # once: deepspeed 0.19.8 + CPU torch 2.13.0
    DS_VENV=/work/venv-ds .venv/bin/python benchmarks/bench_deepspeed.py --workdir bench_out/deepspeed
    DS_VENV=... .venv/bin/python benchmarks/bench_deepspeed.py --workdir W --stages 2 --layers 34 --rounds 3   # >= 3 GB

A Qwen2.5-0.5B-shaped model (untied, ~0.63 B parameters, bf16) is saved by REAL DeepSpeed on CPU
(gloo, 2 ranks, ``deepspeed.initialize`` + ``save_checkpoint`` right after initialisation: the
masters are the initial weights) once per stage, cached under --workdir; this needs a venv with
deepspeed 0.19.x (--ds-venv). Then, on the same checkpoint and with the same method as
bench_merge.py (warm page cache, fsync of the outputs, RssAnon of the process tree sampled every 20 ms):

  zero_to_fp32  `python zero_to_fp32.py SAVE_DIR OUT --safe_serialization` (DeepSpeed's script, fp32 output)
  hf-merge      `python -m hf_merge.cli.app merge SAVE_DIR OUT --config CFG --dtype float32` (same fp32 output)

  copy floor    `cat *_optim_states.pt > one file` + fsync: the fp32 partitions both tools must read
                (about the output's size); if 0.3x zero_to_fp32's wall is below it, no tool meets that on this disk

and the two outputs are compared tensor by tensor (names, dtype, shape, bytes). ``--layers 34``
makes a 0.78 B-parameter model (3.12 GB of fp32 output; ZeRO-2 saves 4.7 GB, ZeRO-3 3.1 GB);
``--rounds N`` runs the three N times interleaved, the order rotated each round, and prints the
medians and hf-merge's wall over the floor's and the peer's of the same round (benchmarks/peer_rounds.py).
The merged folders are deleted at the end (``--keep-outputs`` keeps them). Besides wall time
and memory, the CPU seconds (user + system) of each tool's process tree are reported: on a busy
machine they compare the tools where wall times do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_merge as bm  # noqa: E402
import peer_rounds  # noqa: E402

CONFIG = dict(  # Qwen2.5-0.5B's shape, untied (zero_to_fp32 --safe_serialization fails on tied weights)
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
    architectures=["Qwen2ForCausalLM"], dtype="bfloat16",
)


def _worker(rank: int, stage: int, out: str, port: int, layers: int = 24) -> None:  # runs in the deepspeed venv
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import deepspeed
    from transformers import Qwen2Config, Qwen2ForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # build in bf16: no fp32 copy of the model per rank
    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **CONFIG))
    torch.set_default_dtype(torch.float32)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "zero_force_ds_cpu_optimizer": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-4), config=config)
    engine.save_checkpoint(out, tag="global_step1")
    if rank == 0:
        Qwen2Config(num_hidden_layers=layers, **CONFIG).save_pretrained(Path(out) / "config")
    dist.barrier()
    dist.destroy_process_group()


def make(stage: int, out: Path, ds_python: str, layers: int) -> None:
    if (out / "latest").is_file():
        return
    code = (f"import sys; sys.path.insert(0, {str(BENCH_DIR)!r}); import bench_deepspeed as b; "
            f"import torch.multiprocessing as mp; mp.spawn(b._worker, args=({stage}, {str(out)!r}, {29700 + stage}, {layers}), nprocs=2)")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    subprocess.run([ds_python, "-c", code], check=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=bm.REPO / "bench_out" / "deepspeed")
    ap.add_argument("--ds-venv", type=Path, default=Path(os.environ.get("DS_VENV", "/work/venv-ds")))
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--layers", type=int, default=24,
                    help="decoder layers (24: 0.63 B parameters, 2.52 GB fp32; 34: 0.78 B, 3.12 GB)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of floor, hf-merge and zero_to_fp32")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the two merged folders (deleted by default)")
    ap.add_argument("--make-only", action="store_true", help="save the checkpoints, measure nothing")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    ds_python = str(args.ds_venv / "bin" / "python")
    results = []
    for stage in map(int, args.stages.split(",")):
        size = f"zero{stage}" if args.layers == 24 else f"zero{stage}-{args.layers}L"
        src = args.workdir / size
        make(stage, src, ds_python, args.layers)
        if args.make_only:
            continue
        inputs = [p for p in (src / "global_step1").iterdir() if p.is_file()]
        peer_out, ours_out = args.workdir / f"out_z2f_{stage}", args.workdir / f"out_hfm_{stage}"
        env = dict(os.environ, PYTHONPATH=str(bm.REPO), HF_HUB_DISABLE_PROGRESS_BARS="1")
        # the floor: both tools must read the fp32 partitions (the optim_states files, ~ the output's size)
        # and write as many bytes; cat of those files into one file, fsynced, is the least that costs
        partitions = sorted(p for p in inputs if p.name.endswith("optim_states.pt"))
        tools = {
            peer_rounds.FLOOR: lambda: bm.measure_copy_floor(size, partitions, args.workdir / f"floor_{stage}.bin",
                                                             args.workdir / f"floor_{stage}.log")[0],
            "hf-merge": lambda: bm.measure(size, "hf-merge", [sys.executable, "-m", "hf_merge.cli.app", "merge", str(src),
                                                              str(ours_out), "--config", str(src / "config"),
                                                              "--dtype", "float32"],
                                           ours_out, args.workdir / f"hfm_{stage}.log", inputs, env=env),
            "zero_to_fp32": lambda: bm.measure(size, "zero_to_fp32", [ds_python, str(src / "zero_to_fp32.py"), str(src),
                                                                      str(peer_out), "--safe_serialization"],
                                               peer_out, args.workdir / f"z2f_{stage}.log", inputs,
                                               env=dict(os.environ, DS_ACCELERATOR="cpu")),
        }
        per = peer_rounds.run(args.rounds, tools)
        results.append({"stage": stage, "layers": args.layers, "input_bytes": sum(p.stat().st_size for p in inputs),
                        "floor_bytes": sum(p.stat().st_size for p in partitions),
                        **peer_rounds.finish(size, per, "zero_to_fp32", peer_out, ours_out, args.keep_outputs)})
    (args.workdir / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
