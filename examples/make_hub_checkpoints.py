"""Write REAL FSDP2 checkpoints of MoE and vision-language models whose Hub layout differs from
transformers' in-memory one, all in ONE run of 2 gloo processes (the imports are paid once).

For each model (tiny config, seeded, every element perturbed so that no two are alike) both ranks
build it, wrap it with FSDP2 ``fully_shard`` on a ``("fsdp",)`` mesh and ``torch.save`` its
``state_dict()`` as verl does; rank 0 also builds the same model unsharded and writes
``save_pretrained`` of it (the Hub layout the merge must reproduce byte for byte) plus its logits,
and checks that the FSDP2 forward reproduces them.

Layout, per model name ``M`` under ``root``::

    root/M/global_step_1/actor/model_world_size_2_rank_{0,1}.pt, fsdp_config.json
    root/M/global_step_1/actor/huggingface/   config.json, generation_config.json, tokenizer,
                                              VLMs: preprocessor_config.json,
                                              video_preprocessor_config.json, chat_template.jinja
    root/M/reference/                         save_pretrained of the unsharded model (+ logits.pt)
    root/M/reference/adapter/                 LoRA variants: PEFT's save_pretrained of the adapter
    root/fixture.json                         what was written

    python examples/make_hub_checkpoints.py OUT [--models qwen3_moe,gemma3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from hf_merge.transformers_compat import dtype_key

MODULE_NAME = "make_hub_checkpoints"
WORLD_SIZE = 2
STEP = 1

_TEXT = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=2, pad_token_id=0,
)

_QWEN2_5_VL = dict(
    text_config=dict(**_TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
    vision_config=dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1], window_size=56),
    image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4,
    architectures=["Qwen2_5_VLForConditionalGeneration"])

#: name -> (config class, kwargs, LoRA target modules ("all-linear", a list, or LoraConfig targets as a dict) or None)
MODELS: dict[str, tuple[str, dict[str, Any], Any]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        **_TEXT, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"]), None),
    "mixtral": ("MixtralConfig", dict(
        **_TEXT, num_local_experts=4, num_experts_per_tok=2, architectures=["MixtralForCausalLM"]), None),
    "deepseek_v3": ("DeepseekV3Config", dict(
        **{**_TEXT, "num_key_value_heads": 4}, moe_intermediate_size=16, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, architectures=["DeepseekV3ForCausalLM"]), None),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", _QWEN2_5_VL, None),
    "gemma3": ("Gemma3Config", dict(
        text_config=dict(**_TEXT, head_dim=8, sliding_window=4),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=5, boi_token_index=3, eoi_token_index=4,
        architectures=["Gemma3ForConditionalGeneration"]), None),
    # PEFT LoRA on a MoE model's attention
    "qwen3_moe_lora": ("Qwen3MoeConfig", dict(
        **_TEXT, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"]), ["q_proj", "v_proj", "o_proj"]),
    # PEFT LoRA on a VLM: the text model's and the vision tower's q/v projections
    "gemma3_lora": ("Gemma3Config", dict(
        text_config=dict(**_TEXT, head_dim=8, sliding_window=4),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=5, boi_token_index=3, eoi_token_index=4,
        architectures=["Gemma3ForConditionalGeneration"]), ["q_proj", "v_proj"]),
    # verl's default LoRA on a VLM: all-linear, i.e. every nn.Linear of the text model, the vision
    # blocks and the merger (attn.proj, mlp.0, mlp.2 ...) but not the Conv3d patch embedding or lm_head
    "qwen2_5_vl_lora": ("Qwen2_5_VLConfig", _QWEN2_5_VL, "all-linear"),
    # LoRA on the vision merger's two linears only (mlp.0 / mlp.2 of an nn.Sequential)
    "qwen2_5_vl_merger_lora": ("Qwen2_5_VLConfig", _QWEN2_5_VL, ["mlp.0", "mlp.2"]),
    # PEFT LoRA on the fused 3-D expert parameters (LoraConfig.target_parameters: nested ParamWrappers,
    # lora_A [r * E, in], lora_B [out, r * E]) and on attention
    "qwen3_moe_lora_experts": ("Qwen3MoeConfig", dict(
        **_TEXT, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"]),
        dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
}

#: The model zoo: dense and tied families whose Hub layout is the in-memory one, each with its own
#: quirk (tied embeddings, Gemma's scaled embedding and (1 + w) norms, soft-capping, Phi-3's fused
#: qkv / gate_up, GPT-OSS's fused experts with biases and sinks); written with ``--models`` or the
#: ``zoo_root`` fixture, not by default.
_GEMMA = dict(**_TEXT, head_dim=8, sliding_window=4)
ZOO: dict[str, tuple[str, dict[str, Any], Any]] = {
    "qwen2_tied": ("Qwen2Config", dict(**_TEXT, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]), None),
    "llama3_tied": ("LlamaConfig", dict(
        **_TEXT, tie_word_embeddings=True, head_dim=8, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        architectures=["LlamaForCausalLM"]), None),
    "gemma2": ("Gemma2Config", dict(**_GEMMA, architectures=["Gemma2ForCausalLM"]), None),
    "gemma3_text": ("Gemma3TextConfig", dict(**_GEMMA, architectures=["Gemma3ForCausalLM"]), None),
    "qwen3": ("Qwen3Config", dict(**_TEXT, head_dim=8, architectures=["Qwen3ForCausalLM"]), None),
    "mistral": ("MistralConfig", dict(**_TEXT, sliding_window=4, architectures=["MistralForCausalLM"]), None),
    "phi3": ("Phi3Config", dict(**_TEXT, architectures=["Phi3ForCausalLM"]), None),
    "gpt_oss": ("GptOssConfig", dict(
        **_TEXT, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], architectures=["GptOssForCausalLM"]), None),
    # LoRA on a tied model (attention and MLP; the tied embedding / lm_head stay frozen)
    "qwen2_tied_lora": ("Qwen2Config", dict(**_TEXT, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]),
                        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "gemma2_lora": ("Gemma2Config", dict(**_GEMMA, architectures=["Gemma2ForCausalLM"]), ["q_proj", "v_proj", "down_proj"]),
    # verl's default LoRA target, all-linear: Phi-3's fused qkv_proj / gate_up_proj, GPT-OSS's attention
    "phi3_lora": ("Phi3Config", dict(**_TEXT, architectures=["Phi3ForCausalLM"]), "all-linear"),
    "gpt_oss_lora": ("GptOssConfig", dict(
        **_TEXT, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], architectures=["GptOssForCausalLM"]), "all-linear"),
    # verl's LoRA targets written for transformers 4 (one Linear per expert projection) on a MoE model:
    # PEFT 0.21 under transformers 5 maps them to the fused expert parameters, gate_up_proj at rank
    # 2r and alpha 2 alpha (rank_pattern / alpha_pattern); verl records one r and one alpha
    "qwen3_moe_v4_lora": ("Qwen3MoeConfig", dict(
        **_TEXT, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"]), ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
    # verl's all-linear on the same: PEFT also wraps the router's weight (target_parameters gate.weight)
    "qwen3_moe_all_linear": ("Qwen3MoeConfig", dict(
        **_TEXT, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"]), "all-linear"),
    # LoRA on Mixtral's attention
    "mixtral_lora": ("MixtralConfig", dict(
        **_TEXT, num_local_experts=4, num_experts_per_tok=2, architectures=["MixtralForCausalLM"]), ["q_proj", "v_proj"]),
}
HUB_MODELS = list(MODELS)
MODELS.update(ZOO)

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_hub_checkpoints(root: str | os.PathLike, models: list[str] | None = None) -> dict[str, Any]:
    """Write the checkpoints of ``models`` (default: all of :data:`MODELS`) under ``root``."""
    import torch.multiprocessing as tmp

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import make_fsdp_checkpoint as mk

    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    spec = {"root": str(root), "models": list(models or HUB_MODELS), "port": mk._free_port()}
    t0 = time.perf_counter()
    worker = __import__(MODULE_NAME)._worker
    # The fork server of make_fsdp_checkpoint (torch, transformers, peft pre-imported) when the same
    # process already started it, so the ranks start warm.
    tmp.start_processes(worker, args=(spec,), nprocs=WORLD_SIZE, join=True, start_method=mk._start_method(None))
    info = json.loads((root / "fixture.json").read_text())
    info["seconds"] = round(time.perf_counter() - t0, 2)
    (root / "fixture.json").write_text(json.dumps(info, indent=2))
    return info


def input_ids() -> torch.Tensor:
    """Fixed text-only ids [2, 8], clear of the image / vision special tokens (3..6)."""
    return ((torch.arange(16, dtype=torch.long) * 7 + 9) % 90 + 7).view(2, 8)


def build_model(name: str, seed: int = 0, *, lora: bool = True):
    """The seeded model ``name`` (LoRA variants wrapped with PEFT, ``init_lora_weights=False``;
    ``lora=False``: the base model they were wrapped around)."""
    import transformers

    cfg_cls, kwargs, lora_targets = MODELS[name]
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, kwargs["architectures"][0])(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _n, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.config._name_or_path = model.name_or_path = f"tiny/{name}-base"
    model.eval()
    if lora_targets and lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 2)
        targets = lora_targets if isinstance(lora_targets, dict) else {"target_modules": lora_targets}
        lcfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                          init_lora_weights=False, **targets)
        model = get_peft_model(model, lcfg)
        model.eval()
    return model


def unbuildable(names: list[str]) -> dict[str, str]:
    """``{name: why}`` for the models of ``names`` the installed transformers / peft cannot build
    (the configs here are written for transformers >= 4.57: an older one lacks GPT-OSS, reads
    Qwen2.5-VL's ``text_config`` otherwise, ...)."""
    import transformers

    out = {}
    for name in names:
        try:
            build_model(name)
        except Exception as e:  # noqa: BLE001 - any failure to build is the reason given
            out[name] = f"transformers {transformers.__version__} cannot build {name}: {type(e).__name__}: {str(e)[:120]}"
    return out


def _side_files(name: str, model, hf: Path) -> None:
    import make_fsdp_checkpoint as mk
    from transformers import GenerationConfig

    hf.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.save_pretrained(hf)
    cj = json.loads((hf / "config.json").read_text())
    cj[dtype_key()] = "float32"  # under the key the installed transformers writes (torch_dtype before 4.56)
    (hf / "config.json").write_text(json.dumps(cj, indent=2, sort_keys=True) + "\n")
    if name in ZOO:  # verl copies the Hub model's generation config, which is the model's own
        base.generation_config.save_pretrained(hf)
    else:
        GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0).save_pretrained(hf)
    tokenizer = mk._tokenizer(128)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(hf)
    # Processor configs as plain JSON (their classes need PIL / torchvision, which tests do without);
    # what matters here is that a merge copies them byte for byte.
    if name == "qwen2_5_vl":
        pixels = {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
        _write_json(hf / "preprocessor_config.json", {"image_processor_type": "Qwen2VLImageProcessor", **pixels})
        _write_json(hf / "video_preprocessor_config.json", {"video_processor_type": "Qwen2VLVideoProcessor", **pixels})
    elif name == "gemma3":
        _write_json(hf / "preprocessor_config.json", {"image_processor_type": "Gemma3ImageProcessor",
                                                      "size": {"height": 28, "width": 28}})
    if not (hf / "chat_template.jinja").is_file():
        (hf / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    if MODELS[name][2]:
        (hf.parent / "lora_train_meta.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM"}))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _worker(rank: int, spec: dict[str, Any]) -> None:
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.utils import logging as hf_logging

    import make_fsdp_checkpoint as mk

    warnings.filterwarnings("ignore")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), HF_HUB_DISABLE_PROGRESS_BARS="1")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("fsdp",))
        root = Path(spec["root"])
        info: dict[str, Any] = {"world_size": WORLD_SIZE, "models": {}}
        ids = input_ids()
        for name in spec["models"]:
            t0 = time.perf_counter()
            actor = root / name / f"global_step_{STEP}" / "actor"
            actor.mkdir(parents=True, exist_ok=True)
            model = build_model(name)
            fully_shard(model, mesh=mesh)
            sd = model.state_dict()
            torch.save(sd, actor / f"model_world_size_{WORLD_SIZE}_rank_{rank}.pt")
            fsdp_logits = None  # not on a torch whose FSDP2 cannot run a forward on CPU (torch 2.6)
            if mk.FSDP2_CPU_FORWARD:
                with torch.no_grad():
                    fsdp_logits = model(input_ids=ids).logits.float()
            dist.barrier()
            if rank == 0:
                info["models"][name] = _reference(name, root / name, actor, fsdp_logits, ids)
                info["models"][name]["seconds"] = round(time.perf_counter() - t0, 2)
            del model, sd
        if rank == 0:
            (root / "fixture.json").write_text(json.dumps(info, indent=2))
    finally:
        dist.destroy_process_group()


def _reference(
    name: str, folder: Path, actor: Path, fsdp_logits: torch.Tensor | None, ids: torch.Tensor
) -> dict[str, Any]:
    ref = build_model(name)
    with torch.no_grad():
        logits = ref(input_ids=ids).logits.float()
    diff = None if fsdp_logits is None else (fsdp_logits - logits).abs().max().item()
    if diff is not None and diff > 1e-5:
        raise RuntimeError(f"{name}: the FSDP2 forward differs from the unsharded model by {diff}")
    ref_dir = folder / "reference"
    if hasattr(ref, "peft_config"):
        ref.save_pretrained(ref_dir / "adapter")
        ref = ref.merge_and_unload()
        with torch.no_grad():
            logits = ref(input_ids=ids).logits.float()
    ref.save_pretrained(ref_dir)
    torch.save({"input_ids": ids, "logits": logits}, ref_dir / "logits.pt")
    _side_files(name, ref, actor / "huggingface")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": WORLD_SIZE}))
    (folder / "latest_checkpointed_iteration.txt").write_text(str(STEP))
    return {"architecture": MODELS[name][1]["architectures"][0], "fsdp_forward_max_abs_diff": diff}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--models", default=",".join(HUB_MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    info = write_hub_checkpoints(args.root, args.models.split(","))
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.modules.setdefault(MODULE_NAME, sys.modules["__main__"])
    sys.exit(main())
