"""Megatron-Core ``GPTModel`` with MoE layers -> Hugging Face (Hub layout, one tensor per expert).

Families: Qwen3-MoE, Qwen2-MoE (shared expert + its gate), Mixtral, DeepSeek-V3 (multi-latent
attention, dense first layers, shared experts, router score-correction bias). The output names
are what transformers' ``save_pretrained`` writes (checked with transformers 5.24): per expert
``mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj`` (Mixtral:
``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``), router ``mlp.gate.weight``.

How megatron-core 0.16 stores the experts (read in ``megatron/core/transformer/moe/experts.py``,
and checked on real ``torch_dist`` saves at EP=2 for SequentialMLP):

- ``torch_dist``, default: SequentialMLP, TEGroupedMLP and the legacy GroupedMLP all write the same
  global keys, ``mlp.experts.experts.linear_fc1.weight`` ``[E, 2F, H]`` (gate rows, then up rows)
  and ``…linear_fc2.weight`` ``[E, H, F]``, after the layer axis when layers are stacked
  (``[L, E, 2F, H]``; models with dense and MoE layers mixed store one key per layer).
- ``torch_dist`` with ``singleton_local_shards``: one key per layer and expert,
  ``mlp.experts.experts.{e}.linear_fc1.weight_w`` (gate) / ``_v`` (up), ``…linear_fc2.weight``.
- a plain ``state_dict()`` (legacy ``mp_rank_XX`` files): SequentialMLP
  ``mlp.experts.local_experts.{e}.linear_fc1.weight``; TEGroupedMLP ``mlp.experts.linear_fc1.weight{e}``
  (from the source; not written on this machine: TEGroupedMLP needs Transformer Engine).
- the router ``mlp.router.weight`` ``[E, H]`` and, with ``moe_router_enable_expert_bias``,
  ``mlp.router.expert_bias`` ``[E]`` (fp32, = DeepSeek-V3's ``e_score_correction_bias``);
  shared experts ``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` and the Qwen2-MoE sigmoid gate
  ``mlp.shared_experts.gate_weight`` ``[1, H]``.

Multi-latent attention (``megatron/core/transformer/multi_latent_attention.py``): the local spec
writes ``linear_q_down_proj``, ``q_layernorm``, ``linear_q_up_proj``, ``linear_kv_down_proj``
(``[kv_lora_rank + qk_rope_head_dim, H]``: the compressed kv rows, then the shared RoPE key rows,
the split HF's ``kv_a_proj_with_mqa`` makes), ``kv_layernorm``, ``linear_kv_up_proj`` (per head
``qk_nope_head_dim`` key rows then ``v_head_dim`` value rows, as ``kv_b_proj``) and
``input_layernorm`` / ``pre_mlp_layernorm``; the Transformer Engine spec fuses the q / kv norms
into ``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight``. Megatron
applies RoPE to the interleaved pairs of the rope part (``multi_latent_attention`` in
``apply_rotary_pos_emb``) as HF's ``rope_interleave=True`` does, so every MLA tensor is a 1:1
rename.
"""

from __future__ import annotations

from ..name_table import Split, gate_up
from .megatron_gpt import DENSE_FUSED, GATE_UP, LAYER_TENSORS, QK_NORM, QKV, QKV_BIAS, REQUIRED, arch, megatron_table

_REQUIRED_ATTN = [r for r in REQUIRED if r != "mlp.linear_fc2.weight"]


def _experts(hf_block: str, gate: str, up: str, down: str) -> tuple[dict[str, str], dict[str, Split]]:
    """1:1 and fused entries of the routed experts, in every spelling megatron-core writes."""
    g, u, d = (f"{hf_block}.experts.{{expert}}.{n}.weight" for n in (gate, up, down))
    fc1 = gate_up(g, u)
    one_to_one = {
        # torch_dist, stacked experts axis [E, H, F]
        "mlp.experts.experts.linear_fc2.weight": d,
        # torch_dist with singleton_local_shards
        "mlp.experts.experts.{expert}.linear_fc1.weight_w": g,
        "mlp.experts.experts.{expert}.linear_fc1.weight_v": u,
        "mlp.experts.experts.{expert}.linear_fc2.weight": d,
        # plain state_dict: SequentialMLP, TEGroupedMLP
        "mlp.experts.local_experts.{expert}.linear_fc2.weight": d,
        "mlp.experts.linear_fc2.weight{expert}": d,
    }
    fused = {
        "mlp.experts.experts.linear_fc1.weight": fc1,
        "mlp.experts.local_experts.{expert}.linear_fc1.weight": fc1,
        "mlp.experts.linear_fc1.weight{expert}": fc1,
    }
    return one_to_one, fused


def _shared(hf: str) -> tuple[dict[str, str], dict[str, Split]]:
    one_to_one = {
        "mlp.shared_experts.linear_fc2.weight": f"{hf}.down_proj.weight",
        "mlp.shared_experts.linear_fc1.weight_w": f"{hf}.gate_proj.weight",
        "mlp.shared_experts.linear_fc1.weight_v": f"{hf}.up_proj.weight",
    }
    fused = {"mlp.shared_experts.linear_fc1.weight": gate_up(f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight")}
    return one_to_one, fused


_EXPERTS, _EXPERTS_FUSED = _experts("mlp", "gate_proj", "up_proj", "down_proj")
_ROUTER = {"mlp.router.weight": "mlp.gate.weight"}
_QWEN2_SHARED, _QWEN2_SHARED_FUSED = _shared("mlp.shared_expert")
_MIXTRAL, _MIXTRAL_FUSED = _experts("block_sparse_moe", "w1", "w3", "w2")
_MLA = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",  # q_lora_rank = None
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}
_DS_SHARED, _DS_SHARED_FUSED = _shared("mlp.shared_experts")

TABLES = [
    megatron_table(
        name="megatron_moe.qwen3_moe",
        summary="Qwen3-MoE (q/k RMSNorm, routed experts, optional dense mlp_only_layers)",
        model_types=("qwen3_moe",),
        architectures=arch("Qwen3Moe"),
        experts_config_key="num_experts",
        layer_tensors={**LAYER_TENSORS, **QK_NORM, **_ROUTER, **_EXPERTS},
        fused={**DENSE_FUSED, **_EXPERTS_FUSED},
        required=[*_REQUIRED_ATTN, "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"],
    ),
    megatron_table(
        name="megatron_moe.qwen2_moe",
        summary="Qwen2-MoE (q/k/v biases, routed experts, a shared expert with a sigmoid gate)",
        model_types=("qwen2_moe",),
        architectures=arch("Qwen2Moe"),
        experts_config_key="num_experts",
        layer_tensors={
            **LAYER_TENSORS,
            **_ROUTER,
            **_EXPERTS,
            **_QWEN2_SHARED,
            "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
        },
        fused={**DENSE_FUSED, "self_attention.linear_qkv.bias": QKV_BIAS, **_EXPERTS_FUSED, **_QWEN2_SHARED_FUSED},
        required=[*_REQUIRED_ATTN, "self_attention.linear_qkv.bias"],
    ),
    megatron_table(
        name="megatron_moe.mixtral",
        summary="Mixtral (Llama attention, routed experts as block_sparse_moe w1/w3/w2)",
        model_types=("mixtral",),
        architectures=arch("Mixtral"),
        experts_config_key="num_local_experts",
        layer_tensors={
            **{k: v for k, v in LAYER_TENSORS.items() if not v.startswith("mlp.")},  # no dense MLP
            "mlp.router.weight": "block_sparse_moe.gate.weight",
            **_MIXTRAL,
        },
        fused={"self_attention.linear_qkv.weight": QKV, **_MIXTRAL_FUSED},
        required=_REQUIRED_ATTN,
    ),
    megatron_table(
        name="megatron_moe.deepseek_v3",
        summary="DeepSeek-V3 (multi-latent attention, dense first layers, routed + shared experts, router bias)",
        model_types=("deepseek_v3",),
        architectures=arch("DeepseekV3"),
        experts_config_key="n_routed_experts",
        layer_tensors={
            **_MLA,
            "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
            "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
            "mlp.linear_fc1.weight_w": "mlp.gate_proj.weight",
            "mlp.linear_fc1.weight_v": "mlp.up_proj.weight",
            "mlp.linear_fc2.weight": "mlp.down_proj.weight",
            **_ROUTER,
            "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
            **_EXPERTS,
            **_DS_SHARED,
        },
        fused={"mlp.linear_fc1.weight": GATE_UP, **_EXPERTS_FUSED, **_DS_SHARED_FUSED},
        required=["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "self_attention.linear_proj.weight",
                  "self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.weight"],
    ),
]
