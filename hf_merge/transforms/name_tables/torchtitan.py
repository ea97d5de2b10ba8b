"""torchtitan 0.3 parameter names -> Hugging Face names (Llama 3, Qwen3 dense and MoE).

Facts from torchtitan 0.3.0 ``torchtitan/models/llama3/state_dict_adapter.py`` and
``torchtitan/models/qwen3/state_dict_adapter.py`` (``from_hf_map``, read, not copied): Llama 3
permutes q and k rows for its complex rotary embedding (undone here by ``rope_q`` / ``rope_k``, k
with the key-value head count); Qwen3 uses cos/sin rotary on HF's layout (no permutation) and keeps
q/k norms; MoE experts are grouped ``[E, F, D]`` (``w1_EFD`` / ``w3_EFD``) and ``[E, D, F]``
(``w2_EDF``), one HF tensor per expert. A tied ``lm_head`` is dropped later by the merge (the
config says ``tie_word_embeddings``), as the adapter drops it.
"""

from __future__ import annotations

from ..name_table import NameRule, NameTable

# Entries of a torchtitan training checkpoint that are not model weights (CheckpointManager keys).
NOT_MODEL = ("optimizer", "optimizer.*", "lr_scheduler", "lr_scheduler.*", "train_state*", "dataloader", "dataloader.*")

_L = "layers.{layer}."
_HF = "model.layers.{layer}."

_COMMON = (
    NameRule("tok_embeddings.weight", "model.embed_tokens.weight"),
    NameRule(_L + "attention.qkv_linear.wv.weight", _HF + "self_attn.v_proj.weight"),
    NameRule(_L + "attention.wo.weight", _HF + "self_attn.o_proj.weight"),
    NameRule(_L + "feed_forward.w1.weight", _HF + "mlp.gate_proj.weight"),
    NameRule(_L + "feed_forward.w3.weight", _HF + "mlp.up_proj.weight"),
    NameRule(_L + "feed_forward.w2.weight", _HF + "mlp.down_proj.weight"),
    NameRule(_L + "attention_norm.weight", _HF + "input_layernorm.weight"),
    NameRule(_L + "ffn_norm.weight", _HF + "post_attention_layernorm.weight"),
    NameRule("norm.weight", "model.norm.weight"),
    NameRule("lm_head.weight", "lm_head.weight"),
)

TABLES = [
    NameTable(
        name="torchtitan-llama3",
        source="torchtitan",
        model_types=("llama",),
        rules=(
            NameRule(_L + "attention.qkv_linear.wq.weight", _HF + "self_attn.q_proj.weight", op="rope_q"),
            NameRule(_L + "attention.qkv_linear.wk.weight", _HF + "self_attn.k_proj.weight", op="rope_k"),
            *_COMMON,
        ),
        skip=NOT_MODEL,
        description="torchtitan Llama 3 (q/k rotary permutation undone)",
        citation="torchtitan 0.3.0 torchtitan/models/llama3/state_dict_adapter.py",
    ),
    NameTable(
        name="torchtitan-qwen3",
        source="torchtitan",
        model_types=("qwen3", "qwen3_moe"),
        rules=(
            NameRule(_L + "attention.qkv_linear.wq.weight", _HF + "self_attn.q_proj.weight"),
            NameRule(_L + "attention.qkv_linear.wk.weight", _HF + "self_attn.k_proj.weight"),
            NameRule(_L + "attention.q_norm.weight", _HF + "self_attn.q_norm.weight"),
            NameRule(_L + "attention.k_norm.weight", _HF + "self_attn.k_norm.weight"),
            NameRule(_L + "moe.router.gate.weight", _HF + "mlp.gate.weight"),
            NameRule(_L + "moe.routed_experts.inner_experts.w1_EFD", _HF + "mlp.experts.{expert}.gate_proj.weight"),
            NameRule(_L + "moe.routed_experts.inner_experts.w3_EFD", _HF + "mlp.experts.{expert}.up_proj.weight"),
            NameRule(_L + "moe.routed_experts.inner_experts.w2_EDF", _HF + "mlp.experts.{expert}.down_proj.weight"),
            *_COMMON,
        ),
        skip=NOT_MODEL,
        description="torchtitan Qwen3 (dense and MoE; grouped experts unstacked)",
        citation="torchtitan 0.3.0 torchtitan/models/qwen3/state_dict_adapter.py",
    ),
]
