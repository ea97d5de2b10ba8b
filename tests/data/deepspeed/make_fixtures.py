"""Write the committed DeepSpeed ZeRO fixtures with REAL DeepSpeed on CPU (run once, commit the output).

    DS_ACCELERATOR=cpu /work/venv-ds/bin/python tests/data/deepspeed/make_fixtures.py tests/data/deepspeed

Needs deepspeed 0.19.x (not a test dependency: the tests read the committed files). Each variant
trains a tiny transformers model for two steps with ``deepspeed.initialize`` on a gloo group of
``world_size`` processes (mp.spawn), two parameter groups (decay / no-decay, as HF Trainer makes),
a plain ``torch.optim.AdamW`` (no compiled op), then ``engine.save_checkpoint``. Beside the
checkpoint it saves, from the same processes, what the tests compare against:

- ``reference/masters.safetensors``: every trained parameter's fp32 master as DeepSpeed itself
  gathers it (``deepspeed.utils.safe_get_full_fp32_param``); frozen parameters as the module holds them;
- ``reference/module.safetensors`` (stage 1/2): the 16-bit module weights (``engine.module.state_dict()``);
- ``reference/logits.pt``: logits of the model in fp32 loaded with the masters (LoRA: the PEFT model);
- ``reference/config/``: the model's config.json (LoRA: ``reference/base/`` is the base model folder).

Layouts: plain ``OUT/VARIANT/`` (``latest`` + ``global_stepN/``), or an HF Trainer run
``OUT/VARIANT/checkpoint-N/`` (config.json or adapter files beside ``global_stepN/``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS: dict[str, dict] = {
    # stage 1 + bf16 + fp32 gradient accumulation -> BF16_Optimizer files (bf16_zero_pp_rank_*), tied
    "z1_bf16_tied_ws2": dict(stage=1, dtype="bf16", tied=True, world_size=2),
    # stage 1 fp32 at world size 1
    "z1_fp32_ws1": dict(stage=1, dtype="fp32", tied=False, world_size=1),
    # stage 2 bf16, HF Trainer layout (checkpoint-1, checkpoint-2), two tags
    "z2_bf16_trainer_ws2": dict(stage=2, dtype="bf16", tied=False, world_size=2, trainer=True),
    # stage 2 fp32, 3 ranks, round-robin gradient order (param_shapes in that order), tied
    "z2_fp32_rr_tied_ws3": dict(stage=2, dtype="fp32", tied=True, world_size=3, round_robin=True),
    # stage 2 bf16, 3 ranks, per-parameter alignment padding (param_alignment_paddings != 0)
    "z2_bf16_align_ws3": dict(stage=2, dtype="bf16", tied=False, world_size=3, align=True),
    # stage 3 bf16 tied, small sub-groups so parameters span two of them
    "z3_bf16_tied_ws2": dict(stage=3, dtype="bf16", tied=True, world_size=2),
    # stage 3 fp32, 3 ranks (uneven slices)
    "z3_fp32_ws3": dict(stage=3, dtype="fp32", tied=False, world_size=3),
    # PEFT LoRA, stage 2 bf16, HF Trainer layout, exclude_frozen_parameters (adapter + base model)
    "z2_bf16_lora_trainer_ws2": dict(stage=2, dtype="bf16", tied=False, world_size=2, lora=True, trainer=True),
    # PEFT LoRA, stage 3 bf16, frozen base parameters saved as fragments
    "z3_bf16_lora_ws2": dict(stage=3, dtype="bf16", tied=True, world_size=2, lora=True),
}

VOCAB, HIDDEN, INTER = 101, 24, 40  # odd sizes so that partitions and padding do not line up


def model_config(tied: bool):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied, architectures=["Qwen2ForCausalLM"],
    )


def ds_config(v: dict) -> dict:
    zero: dict = {"stage": v["stage"]}
    if v["stage"] == 3:
        zero.update(sub_group_size=700, stage3_param_persistence_threshold=0, stage3_max_live_parameters=0)
    if v.get("align"):
        zero.update(parameter_alignment=True)
    if v.get("round_robin"):
        zero.update(round_robin_gradients=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if v["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
        if v["stage"] == 1:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def param_groups(model):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def build_model(v: dict, out: Path | None):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(model_config(v["tied"]))
    if out is not None and v.get("lora"):
        # the base as training holds it: DeepSpeed casts the module to the training dtype
        base = Qwen2ForCausalLM(model_config(v["tied"]))
        base.load_state_dict(model.state_dict())
        base.to(torch.bfloat16 if v["dtype"] == "bf16" else torch.float32).save_pretrained(out / "reference" / "base")
    if v.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False))
    return model


def worker(rank: int, name: str, v: dict, out: Path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(v["world_size"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=v["world_size"])
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(v, out if rank == 0 else None)
    base_names = [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(v))
    torch.manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 8)) for _ in range(2)]
    exclude = bool(v.get("lora") and v.get("trainer"))
    for step, ids in enumerate(batches, 1):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        save_dir = out / f"checkpoint-{step}" if v.get("trainer") else out
        if v.get("trainer") or step == len(batches):
            engine.save_checkpoint(str(save_dir), tag=f"global_step{step}", exclude_frozen_parameters=exclude)
        if v.get("trainer") or step == len(batches):
            save_reference(engine, v, out / "reference" / f"step{step}", rank, safe_get_full_fp32_param, base_names)
            if rank == 0 and v.get("trainer"):
                trainer_side_files(engine, v, save_dir, step)
    dist.barrier()
    dist.destroy_process_group()


def save_reference(engine, v, ref: Path, rank: int, full_fp32, names) -> None:
    from safetensors.torch import save_file

    params = dict(engine.module.named_parameters())
    masters = {}
    for n in names:
        p = params[n]
        if p.requires_grad:
            masters[n] = full_fp32(p).detach().clone()  # collective at stage 3: every rank calls it
        elif v["stage"] == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                masters[n] = p.detach().clone()
        else:
            masters[n] = p.detach().clone()
    module = None
    if v["stage"] < 3:
        module = {k: t.detach().clone() for k, t in engine.module.state_dict().items()}
    if rank != 0:
        return
    ref.mkdir(parents=True, exist_ok=True)
    if v.get("round_robin"):
        # DeepSpeed 0.19.8's safe_get_full_fp32_param returns other parameters' values under
        # round_robin_gradients; zero_to_fp32.py and the module agree with each other. At fp32 the
        # module parameters are the masters: use them, and record where the two differ.
        assert v["dtype"] == "fp32" and v["stage"] < 3
        wrong = sorted(k for k, t in masters.items() if not torch.equal(t, module[k]))
        (ref / "notes.json").write_text(json.dumps({"safe_get_full_fp32_param_differs_from_module": wrong}, indent=1) + "\n")
        masters = {k: module[k] for k in masters}
    # tied parameters appear once in named_parameters(); safetensors refuses shared storage
    save_file({k: t.contiguous() for k, t in masters.items()}, ref / "masters.safetensors")
    if module is not None:
        seen, unique = set(), {}
        for k, t in module.items():
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            unique[k] = t.contiguous()
        save_file(unique, ref / "module.safetensors")
    # logits of the fp32 model carrying the masters
    model = build_model(v, None).float()
    model.load_state_dict({k: t.float() for k, t in masters.items()}, strict=False)
    model.eval()
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    torch.save({"input_ids": ids, "logits": logits}, ref / "logits.pt")
    model_config(v["tied"]).save_pretrained(ref / "config")


def trainer_side_files(engine, v, folder: Path, step: int) -> None:
    """What HF Trainer writes beside global_stepN/ (the parts hf-merge reads)."""
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    if v.get("lora"):
        engine.module.save_pretrained(folder)  # adapter_config.json + adapter_model.safetensors (PEFT)
    else:
        model_config(v["tied"]).save_pretrained(folder)


def main(out_root: Path, only: list[str]) -> None:
    import deepspeed
    import peft
    import transformers

    out_root.mkdir(parents=True, exist_ok=True)
    for i, (name, v) in enumerate(VARIANTS.items()):
        if only and name not in only:
            continue
        out = out_root / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        mp.spawn(worker, args=(name, v, out, 29611 + i), nprocs=v["world_size"], join=True)
        (out / "variant.json").write_text(json.dumps(v, indent=1) + "\n")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            for p in out.rglob(script):
                p.unlink()  # DeepSpeed's own conversion scripts: not needed by the tests
        print(f"{name}: done", flush=True)
    (out_root / "versions.json").write_text(json.dumps({
        "deepspeed": deepspeed.__version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
