"""Megatron-Core ``GPTModel`` -> Hugging Face: Llama, Mistral, Qwen2 / Qwen2.5, Qwen3.

Source names as Megatron-Core 0.16 writes them (checked on real ``torch_dist`` saves and
``GPTModel.state_dict()``):

- ``dist_ckpt`` (``sharded_state_dict``) always spells the layer norms as the Transformer Engine
  fused ones (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), even for the
  local (non-TE) layer spec; a plain ``state_dict()`` of a local-spec model (legacy per-rank
  ``model.pt`` files) keeps ``input_layernorm`` / ``pre_mlp_layernorm``.
- With ``singleton_local_shards`` metadata (or non-homogeneous layers) the gated fc1 is stored as
  two tensors ``linear_fc1.weight_w`` (gate) and ``linear_fc1.weight_v`` (up).
- A verl critic replaces ``output_layer`` with a ``[1, hidden]`` head (no bias).
"""

from __future__ import annotations

from . import register

_LAYER_TENSORS = {
    # attention
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    # mlp
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight_w": "mlp.gate_proj.weight",
    "mlp.linear_fc1.weight_v": "mlp.up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}

_QK_NORM = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}

# Llama's attention_bias / mlp_bias: biases on every linear (Megatron add_bias_linear).
_LINEAR_BIASES = {
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc1.bias_w": "mlp.gate_proj.bias",
    "mlp.linear_fc1.bias_v": "mlp.up_proj.bias",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}

_QKV = {"split": "qkv", "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight"}
_QKV_BIAS = {"split": "qkv", "q": "self_attn.q_proj.bias", "k": "self_attn.k_proj.bias", "v": "self_attn.v_proj.bias"}
_GATE_UP = {"split": "gate_up", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight"}
_GATE_UP_BIAS = {"split": "gate_up", "gate": "mlp.gate_proj.bias", "up": "mlp.up_proj.bias"}

_TENSORS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}

_TENSOR_PARALLEL = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": "gate_up",
    "mlp.linear_fc2.weight": 1,
}

_COMMON = {
    "source": "megatron",
    "layer_prefix": "decoder.layers.",
    "hf_layer_prefix": "model.layers.{layer}.",
    "tensors": _TENSORS,
    "lm_head": {"output_layer.weight": "lm_head.weight"},
    "value_head": {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"},
    "tied_alias": "output_layer.weight",
    "ignore": ["*._extra_state", "*._extra_state/*", "*/_extra_state*"],
    "not_model": ["optimizer.*", "optimizer", "chained_*", "rng_state", "rng_state/*", "lr_scheduler*"],
}

_REQUIRED = [
    "embedding.word_embeddings.weight",
    "decoder.final_layernorm.weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc2.weight",
]

register(
    {
        **_COMMON,
        "name": "megatron_gpt.llama",
        "summary": "Llama (RMSNorm, SwiGLU, RoPE, GQA; optional attention_bias / mlp_bias)",
        "model_types": ["llama"],
        "architectures": {"causal_lm": "LlamaForCausalLM", "value": "LlamaForTokenClassification"},
        "layer_tensors": {**_LAYER_TENSORS, **_LINEAR_BIASES},
        "fused": {
            "self_attention.linear_qkv.weight": _QKV,
            "self_attention.linear_qkv.bias": _QKV_BIAS,
            "mlp.linear_fc1.weight": _GATE_UP,
            "mlp.linear_fc1.bias": _GATE_UP_BIAS,
        },
        "required": _REQUIRED,
        "config_checks": {
            "self_attention.linear_qkv.bias": {"attention_bias": True},
            "self_attention.linear_proj.bias": {"attention_bias": True},
            "mlp.linear_fc1.bias": {"mlp_bias": True},
            "mlp.linear_fc1.bias_w": {"mlp_bias": True},
            "mlp.linear_fc2.bias": {"mlp_bias": True},
        },
        "tensor_parallel": {**_TENSOR_PARALLEL, "self_attention.linear_proj.bias": 0, "mlp.linear_fc1.bias": "gate_up"},
    }
)

register(
    {
        **_COMMON,
        "name": "megatron_gpt.mistral",
        "summary": "Mistral (as Llama, no biases)",
        "model_types": ["mistral"],
        "architectures": {"causal_lm": "MistralForCausalLM", "value": "MistralForTokenClassification"},
        "layer_tensors": dict(_LAYER_TENSORS),
        "fused": {"self_attention.linear_qkv.weight": _QKV, "mlp.linear_fc1.weight": _GATE_UP},
        "required": _REQUIRED,
        "tensor_parallel": {k: v for k, v in _TENSOR_PARALLEL.items() if k != "self_attention.linear_qkv.bias"},
    }
)

register(
    {
        **_COMMON,
        "name": "megatron_gpt.qwen2",
        "summary": "Qwen2 / Qwen2.5 (q/k/v biases, no o_proj bias)",
        "model_types": ["qwen2"],
        "architectures": {"causal_lm": "Qwen2ForCausalLM", "value": "Qwen2ForTokenClassification"},
        "layer_tensors": dict(_LAYER_TENSORS),
        "fused": {
            "self_attention.linear_qkv.weight": _QKV,
            "self_attention.linear_qkv.bias": _QKV_BIAS,
            "mlp.linear_fc1.weight": _GATE_UP,
        },
        "required": [*_REQUIRED, "self_attention.linear_qkv.bias"],
        "tensor_parallel": _TENSOR_PARALLEL,
    }
)

register(
    {
        **_COMMON,
        "name": "megatron_gpt.qwen3",
        "summary": "Qwen3 (per-head q/k RMSNorm, explicit head_dim, no biases)",
        "model_types": ["qwen3"],
        "architectures": {"causal_lm": "Qwen3ForCausalLM", "value": "Qwen3ForTokenClassification"},
        "layer_tensors": {**_LAYER_TENSORS, **_QK_NORM},
        "fused": {"self_attention.linear_qkv.weight": _QKV, "mlp.linear_fc1.weight": _GATE_UP},
        "required": [*_REQUIRED, "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"],
        "tensor_parallel": {k: v for k, v in _TENSOR_PARALLEL.items() if k != "self_attention.linear_qkv.bias"},
    }
)
