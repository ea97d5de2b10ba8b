"""Write the committed ColossalAI fixtures with REAL ColossalAI 0.5 on CPU (run once, commit the output).

    /work/venv-colossal/bin/python tests/data/colossalai/make_fixtures.py tests/data/colossalai [VARIANT ...]

Needs colossalai 0.5.x with its own torch (<= 2.5.1) and transformers 4.51.3, so not the test venv:
the tests read the committed files. Each variant builds a tiny transformers model from a config on
every process of a gloo group (``colossalai.launch`` picks the CPU accelerator, whose backend is
gloo), boosts it with a ColossalAI plugin, trains a step where the plugin allows it, and saves it
with ``booster.save_model(model, dir, shard=True, size_per_shard=..., use_safetensors=...)``. Beside
the checkpoint, from the same processes:

- ``reference/weights.safetensors``: the unsharded model's state dict as the training process holds
  it after training (tied alias dropped; LoRA: the PEFT model's own state dict, base + A/B);
- ``reference/logits.pt``: input ids and the logits of that model (fp32);
- ``reference/config/``: the base model's config.json (and ``reference/adapter/`` for LoRA: PEFT's
  own adapter save, from ``booster.save_lora_as_pretrained``).
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
    # TorchDDPPlugin, 2 ranks, safetensors shards model-0000K.safetensors, untied Qwen2
    "ddp_safetensors_ws2": dict(plugin="ddp", world_size=2, safetensors=True, model="qwen2", tied=False),
    # TorchDDPPlugin, .bin shards pytorch_model-0000K.bin, tied Llama
    "ddp_bin_tied_ws2": dict(plugin="ddp", world_size=2, safetensors=False, model="llama", tied=True),
    # TorchDDPPlugin + booster.enable_lora (PEFT LoRA), safetensors
    "ddp_lora_ws2": dict(plugin="ddp", world_size=2, safetensors=True, model="qwen2", tied=False, lora=True),
    # HybridParallelPlugin pp=2: one set of stage files per pipeline stage
    "hybrid_pp2_ws2": dict(plugin="hybrid", world_size=2, pp=2, tp=1, safetensors=True, model="llama", tied=False),
    # HybridParallelPlugin tp=2 x pp=2, .bin stage files; vocabulary 120, padded to 128 for tensor parallelism
    # in training and cut back in the save
    "hybrid_tp2_pp2_ws4": dict(plugin="hybrid", world_size=4, pp=2, tp=2, safetensors=False, model="qwen2", tied=False,
                               vocab=120),
    # DistributedCheckpointIO (ColossalAI pull request #6181, in no release): HybridParallelPlugin tp=2,
    # booster.save_model(..., gather_dtensor=False) -> per-rank pytorch_model-dist-* + meta-dist json.
    # Needs that pull request's tree (and the transformers 4.39.3 it pins) first on PYTHONPATH: see DIST_COMMAND.
    "dist_tp2_ws2": dict(plugin="hybrid", world_size=2, pp=1, tp=2, safetensors=False, model="llama", tied=False,
                         dist=True),
}
DIST_COMMAND = """\
mkdir -p /tmp/colpr && git -C ColossalAI archive 7e880a130 colossalai extensions | tar -x -C /tmp/colpr   # PR #6181 head
/work/venv-colossal/bin/pip install --target /tmp/tf439 --no-deps transformers==4.39.3 tokenizers==0.15.2
PYTHONPATH=/tmp/colpr:/tmp/tf439 COLOSSALAI_SOURCE="pull request #6181 at 7e880a130" \\
  /work/venv-colossal/bin/python tests/data/colossalai/make_fixtures.py tests/data/colossalai dist_tp2_ws2"""

VOCAB, HIDDEN, INTER = 128, 32, 48
SHARD_MB = 0.02  # ~20 KB shards: several files even for a tiny model


def model_config(v: dict):
    from transformers import LlamaConfig, Qwen2Config

    cls = Qwen2Config if v["model"] == "qwen2" else LlamaConfig
    return cls(
        vocab_size=v.get("vocab", VOCAB), hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=v["tied"], architectures=["Qwen2ForCausalLM" if v["model"] == "qwen2" else "LlamaForCausalLM"],
    )


def build_model(v: dict):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(v), torch_dtype=torch.float32)


def plugin_for(v: dict):
    from colossalai.booster.plugin import HybridParallelPlugin, TorchDDPPlugin

    if v["plugin"] == "ddp":
        return TorchDDPPlugin()
    return HybridParallelPlugin(tp_size=v["tp"], pp_size=v["pp"], num_microbatches=2, precision="fp32",
                                microbatch_size=1, enable_all_optimization=False)


def cpu_fixes() -> None:
    """The two fixes tensor parallelism needs on CPU. Shardformer's ``Linear1D_Col`` seeds a
    randomizer through the accelerator while replacing layers, and ColossalAI 0.5.0's ``CpuAccelerator``
    fails there: ``get_rng_state`` passes its ``device`` argument to ``torch.get_rng_state()``, which
    takes none ("get_rng_state() takes 0 positional arguments but 1 was given"), and ``manual_seed``
    raises "this method is not supported for cpu accelerator". Both get torch's CPU generator."""
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    CpuAccelerator.get_rng_state = lambda self, device=None: torch.get_rng_state()
    CpuAccelerator.manual_seed = lambda self, seed: torch.manual_seed(seed)


def worker(rank: int, name: str, v: dict, out: Path, port: int) -> None:
    import colossalai
    from colossalai.booster import Booster

    cpu_fixes()

    torch.set_num_threads(1)
    colossalai.launch(rank=rank, world_size=v["world_size"], host="127.0.0.1", port=port, local_rank=rank, verbose=False)
    model = build_model(v)
    plugin = plugin_for(v)
    booster = Booster(plugin=plugin)
    if v.get("lora"):
        from peft import LoraConfig

        model = booster.enable_lora(model, lora_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False, task_type="CAUSAL_LM"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(1)
    ids = torch.randint(0, v.get("vocab", VOCAB), (2, 8))
    if v["plugin"] == "ddp":
        model, optimizer, *_ = booster.boost(model, optimizer)
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        reference = _unique(model.unwrap().state_dict()) if rank == 0 else None
    else:
        # the reference is the model before sharding (same seed on every rank); the pipeline
        # plugin's save must give back exactly these tensors
        reference = _unique(model.state_dict())
        model, optimizer, *_ = booster.boost(model, optimizer)
    extra = {"gather_dtensor": False} if v.get("dist") else {}
    booster.save_model(model, str(out), shard=True, size_per_shard=SHARD_MB, use_safetensors=v["safetensors"], **extra)
    if v.get("lora") and rank == 0:
        booster.save_lora_as_pretrained(model, str(out / "reference" / "adapter"), use_safetensors=True)
    dist.barrier()
    if rank == 0:
        save_reference(v, out / "reference", reference)
    dist.barrier()
    if not v.get("dist"):  # the pull request's tree fails destroying its own mesh groups ("Invalid process group")
        dist.destroy_process_group()


def _unique(state: dict) -> dict:
    """Detached copies, a tied alias (same storage as an earlier tensor) left out: safetensors refuses it."""
    seen, out = set(), {}
    for k, t in state.items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[k] = t.detach().clone().contiguous()
    return out


def save_reference(v: dict, ref: Path, state: dict) -> None:
    from safetensors.torch import save_file

    ref.mkdir(parents=True, exist_ok=True)
    save_file(state, ref / "weights.safetensors")
    model = build_model(v)
    if v.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 task_type="CAUSAL_LM"))
        model.get_base_model().load_state_dict(_peft_names(state), strict=True)
        model = model.merge_and_unload()
    else:
        model.load_state_dict(state, strict=not v["tied"])  # tied: lm_head follows the embedding
    model.eval()
    torch.manual_seed(2)
    ids = torch.randint(0, v.get("vocab", VOCAB), (2, 8))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    torch.save({"input_ids": ids, "logits": logits}, ref / "logits.pt")
    model_config(v).save_pretrained(ref / "config")


def _peft_names(state: dict) -> dict:
    """ColossalAI's PEFT unwrapper names a LoRA layer's base weight without ``.base_layer``: put it back."""
    out = {}
    for k, t in state.items():
        module = k.rsplit(".", 1)[0]
        if any(f"{module}.lora_A." in s for s in state) and k.endswith((".weight", ".bias")) and ".lora_" not in k:
            k = f"{module}.base_layer.{k.rsplit('.', 1)[1]}"
        out[k] = t
    return out


def main(out_root: Path, only: list[str]) -> None:
    import colossalai
    import peft
    import transformers

    out_root.mkdir(parents=True, exist_ok=True)
    for i, (name, v) in enumerate(VARIANTS.items()):
        if (only and name not in only) or (not only and v.get("dist")):
            continue
        out = out_root / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        mp.spawn(worker, args=(name, v, out, 29711 + i), nprocs=v["world_size"], join=True)
        (out / "reference" / "variant.json").write_text(json.dumps({**v, "versions": {
            "colossalai": os.environ.get("COLOSSALAI_SOURCE") or colossalai.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__, "python": sys.version.split()[0],
        }}, indent=1) + "\n")
        print(f"{name}: done", flush=True)
    write_versions(out_root)


def write_versions(out_root: Path) -> None:
    """VERSIONS: what wrote each committed variant, and how to run it again."""
    lines = ["# written by make_fixtures.py; each variant's reference/variant.json has the same 'versions'"]
    for ref in sorted(out_root.glob("*/reference/variant.json")):
        versions = json.loads(ref.read_text()).get("versions", {})
        lines.append(f"{ref.parent.parent.name}: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    lines += ["", "command (all but dist_tp2_ws2):",
              "/work/venv-colossal/bin/python tests/data/colossalai/make_fixtures.py tests/data/colossalai " +
              " ".join(n for n, v in VARIANTS.items() if not v.get("dist")),
              "", "command (dist_tp2_ws2):", DIST_COMMAND, ""]
    (out_root / "VERSIONS").write_text("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main(Path(sys.argv[1]), sys.argv[2:])
