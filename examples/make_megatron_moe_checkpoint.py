"""Write tiny, real Megatron-Core MoE checkpoints on CPU (test fixtures), verl v2 layout.

Two ranks on gloo, TP=1, **expert parallelism 2** (each rank holds half of the experts), written
with Megatron's own ``dist_checkpointing`` (``torch_dist``) exactly as
:mod:`make_megatron_checkpoint` does for dense models (same CUDA stubs, plus
``moe_utils.te_general_gemm = None``, which megatron-core 0.16 names without defining when
Transformer Engine is absent). Variants:

- ``qwen3_moe``: Qwen3-MoE-like (q/k RMSNorm, 4 experts, top-2, softmax over the chosen experts),
  Megatron's SequentialMLP experts; stacked ``[L, E, ...]`` expert tensors.
- ``qwen3_moe_singleton``: the same saved with ``singleton_local_shards`` (one key per layer and
  expert, gated fc1 as ``_w`` / ``_v``).
- ``qwen2_moe``: Qwen2-MoE-like (qkv bias, a shared expert with its sigmoid gate).
- ``mixtral``: Mixtral-like (Llama attention with GQA, every layer MoE, no shared expert).
- ``deepseek_v3``: DeepSeek-V3-like: multi-latent attention (q and kv LoRA with their norms, RoPE
  part of kv_a), first layer dense, then MoE with a shared expert, sigmoid router with expert bias,
  group-limited top-k and a routed scaling factor.

After saving, the same ranks reload each checkpoint at EP=1 through ``dist_checkpointing.load``
and record the logits of fixed input ids in ``<out>/<variant>/reference.pt``. ``qwen3_moe`` also
gets ``<out>/qwen3_moe/legacy/actor/model/mp_rank_00/model.pt``: the reloaded (EP=1) model's plain
``state_dict()``, as old verl saved it (SequentialMLP's ``local_experts.{e}`` names).

Usage::

    python examples/make_megatron_moe_checkpoint.py OUT_DIR [--only qwen3_moe ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_megatron_checkpoint as dense  # noqa: E402
from fork_ranks import rank_start_method  # noqa: E402

VOCAB = dense.VOCAB
SEQ = dense.SEQ
EP = 2

# name -> settings. hidden 32, 4 heads, 2 layers, 4 experts of width 16, top-2.
VARIANTS: dict[str, dict] = {
    "qwen3_moe": dict(kind="qwen3_moe", legacy=True),
    "qwen3_moe_singleton": dict(kind="qwen3_moe", singleton=True),
    "qwen2_moe": dict(kind="qwen2_moe"),
    "mixtral": dict(kind="mixtral"),
    "deepseek_v3": dict(kind="deepseek_v3"),
}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, EXPERTS, TOPK, MOE_FFN, DENSE_FFN = 32, 4, 2, 16, 2, 4, 2, 16, 48
# DeepSeek-V3 MLA sizes
Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_HEAD = 24, 16, 8, 4, 8


def hf_config_dict(kind: str) -> dict:
    """config.json of the tiny HF model matching the Megatron one."""
    common = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "dtype": "float32",
    }
    qwen = {
        **common,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": DENSE_FFN,
        "moe_intermediate_size": MOE_FFN,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOPK,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
    }
    if kind == "qwen3_moe":
        return {**qwen, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False}
    if kind == "qwen2_moe":
        return {
            **qwen,
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "shared_expert_intermediate_size": MOE_FFN,
            "qkv_bias": True,
        }
    if kind == "mixtral":
        return {
            **common,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "intermediate_size": MOE_FFN,
            "num_local_experts": EXPERTS,
            "num_experts_per_tok": TOPK,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_window": None,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.0,
        }
    assert kind == "deepseek_v3"
    return {
        **common,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_key_value_heads": HEADS,
        "intermediate_size": DENSE_FFN,
        "moe_intermediate_size": MOE_FFN,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": TOPK,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "q_lora_rank": Q_LORA,
        "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": QK_NOPE,
        "qk_rope_head_dim": QK_ROPE,
        "v_head_dim": V_HEAD,
        "head_dim": QK_ROPE,
        "rope_interleave": True,
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def _transformer_config(kind: str, ep: int):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        **dense.CPU_SETTINGS,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=MOE_FFN,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_router_dtype="fp32",
    )
    if kind in ("qwen3_moe", "mixtral"):
        return TransformerConfig(
            **kw, ffn_hidden_size=DENSE_FFN, num_query_groups=KV_HEADS, kv_channels=HEAD_DIM, qk_layernorm=kind == "qwen3_moe"
        )
    if kind == "qwen2_moe":
        return TransformerConfig(
            **kw,
            ffn_hidden_size=DENSE_FFN,
            num_query_groups=KV_HEADS,
            kv_channels=HEAD_DIM,
            add_qkv_bias=True,
            moe_shared_expert_intermediate_size=MOE_FFN,
            moe_shared_expert_gate=True,
        )
    return MLATransformerConfig(
        **kw,
        ffn_hidden_size=DENSE_FFN,
        multi_latent_attention=True,
        q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA,
        qk_head_dim=QK_NOPE,
        qk_pos_emb_head_dim=QK_ROPE,
        v_head_dim=V_HEAD,
        qk_layernorm=True,
        rope_type="rope",
        rotary_base=10000,
        rotary_scaling_factor=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
        moe_layer_freq=[0, 1],
        moe_shared_expert_intermediate_size=MOE_FFN,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5,
        moe_router_pre_softmax=False,
    )


class _MlaCoreAttention(torch.nn.Module):
    """Plain softmax attention for MLA (different q/k and v head widths). megatron-core 0.16's
    local ``DotProductAttention`` does not take ``k_channels`` / ``v_channels``; only Transformer
    Engine's does, and it needs a GPU."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, h, s, d]
        scores = (q @ k.transpose(-1, -2)) * self.softmax_scale
        scores = scores.masked_fill(attention_mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1).to(query.dtype)


def _build_model(kind: str, ep: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = _transformer_config(kind, ep)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if kind == "deepseek_v3":
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = _MlaCoreAttention
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=128,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=10000 if kind == "deepseek_v3" else 1_000_000,
        parallel_output=False,
    )


def _fill_weights(model, ep_rank: int) -> None:
    """Deterministic values; expert parameters seeded by their global expert index."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for name, p in model.named_parameters():
            is_expert = not getattr(p, "allreduce", True)
            seed = zlib.crc32(f"{name}|ep{ep_rank if is_expert else 0}".encode())
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
            if "norm" in name or "layer_norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise * (0.5 if "embedding" in name else 0.25))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=torch.Generator().manual_seed(7)))
    del ps


def _paths(root: Path, name: str) -> dict[str, Path]:
    base = root / name / "actor"
    return {"base": base, "model": base / "model" / "dist_ckpt", "hf": base / "model" / "huggingface"}


def _write_side_files(root: Path, name: str, kind: str, ep: int) -> None:
    p = _paths(root, name)
    p["hf"].mkdir(parents=True, exist_ok=True)
    (p["hf"] / "config.json").write_text(json.dumps(hf_config_dict(kind), indent=2))
    tcfg = {
        "num_layers": LAYERS,
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "expert_model_parallel_size": ep,
        "num_moe_experts": EXPERTS,
        "moe_router_topk": TOPK,
        "moe_ffn_hidden_size": MOE_FFN,
    }
    if kind != "deepseek_v3":
        tcfg.update(num_query_groups=KV_HEADS, kv_channels=HEAD_DIM)
    (p["base"] / "transformer_config.json").write_text(json.dumps(tcfg, indent=2))
    manifest = {
        "schema_version": 2,
        "framework": "megatron",
        "role": "actor",
        "global_step": 1,
        "world_size": 2,
        "contents": {
            "model": {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint", "backend": "dist_checkpointing"},
            "transformer_config": {"path": "transformer_config.json", "format": "json"},
        },
    }
    (p["base"] / "ckpt_contents.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _metadata(settings: dict) -> dict:
    return {"singleton_local_shards": bool(settings.get("singleton")), "chained_optim_avoid_prefix": True}


def _worker(rank: int, world: int, port: int, root: str, names: list[str]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dense._stub_cuda()
    import warnings

    warnings.filterwarnings("ignore")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.transformer import multi_latent_attention as mla

    for te_name in ("TELinear", "TEColumnParallelLinear", "TELayerNormColumnParallelLinear"):
        if not isinstance(getattr(mla, te_name, None), type):  # a MagicMock placeholder without TE
            setattr(mla, te_name, type(te_name, (), {}))
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    out = Path(root)

    ps.initialize_model_parallel(expert_model_parallel_size=EP)
    for name in names:
        settings = VARIANTS[name]
        model = _build_model(settings["kind"], EP)
        _fill_weights(model, ps.get_expert_model_parallel_rank())
        dense._save_dist({"model": model.sharded_state_dict(metadata=_metadata(settings))}, _paths(out, name)["model"], _metadata(settings))
        if rank == 0:
            _write_side_files(out, name, settings["kind"], EP)
        torch.distributed.barrier()
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(expert_model_parallel_size=1)
    for name in names:
        settings = VARIANTS[name]
        model = _build_model(settings["kind"], 1)
        sd = {"model": model.sharded_state_dict(metadata=_metadata(settings))}
        loaded = dist_checkpointing.load(sd, str(_paths(out, name)["model"]))
        model.load_state_dict(loaded["model"], strict=True)
        model.eval()
        if rank == 0 and settings.get("legacy"):
            # old verl: torch.save([model.state_dict()]) per rank; here EP=1, TP=1: one file
            legacy = out / name / "legacy" / "actor"
            (legacy / "model" / "mp_rank_00").mkdir(parents=True, exist_ok=True)
            torch.save([model.state_dict()], legacy / "model" / "mp_rank_00" / "model.pt")
            shutil.copytree(_paths(out, name)["hf"], legacy / "huggingface")
        g = torch.Generator().manual_seed(1234)
        input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
        with torch.no_grad():
            logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
        if rank == 0:
            torch.save({"input_ids": input_ids, "logits": logits.float().contiguous()}, out / name / "reference.pt")
        torch.distributed.barrier()
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    dense.exit_worker()


def make_checkpoints(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Write the variants under ``root``; return ``{name: <root>/<name>/actor}``."""
    import torch.multiprocessing as mp

    names = list(names or VARIANTS)
    root = Path(root)
    for name in names:
        shutil.rmtree(root / name, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    method = rank_start_method((*dense.PRELOAD, "megatron.core.transformer.multi_latent_attention", "megatron.core.transformer.moe.moe_utils"))
    mp.start_processes(_worker, args=(EP, dense._free_port(), str(root), names), nprocs=EP, join=True, start_method=method)
    return {name: _paths(root, name)["base"] for name in names}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", nargs="*", choices=sorted(VARIANTS))
    args = ap.parse_args(argv)
    for name, path in make_checkpoints(args.out, args.only).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
