"""Megatron-Core ``GPTModel`` -> Hugging Face: Llama, Mistral, Qwen2 / Qwen2.5, Qwen3.

Source names as Megatron-Core 0.16 writes them (checked on real ``torch_dist`` saves and
``GPTModel.state_dict()``):

- ``dist_ckpt`` (``sharded_state_dict``) always spells the layer norms as the Transformer Engine
  fused ones (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), even for the
  local (non-TE) layer spec; a plain ``state_dict()`` of a local-spec model (legacy per-rank
  ``model.pt`` files) keeps ``input_layernorm`` / ``pre_mlp_layernorm``.
- ``torch_dist`` stacks the layers on a leading axis (``decoder.layers.<suffix>`` ``[L, ...]``);
  with ``singleton_local_shards`` metadata (or non-homogeneous layers) each layer is its own key
  (``decoder.layers.<i>.<suffix>``), as in a ``state_dict()``, and the gated fc1 is stored as two
  tensors ``linear_fc1.weight_w`` (gate) and ``linear_fc1.weight_v`` (up).
- A verl critic replaces ``output_layer`` with a ``[1, hidden]`` head (no bias).

Every per-layer suffix is written once, by :func:`layer_rules`, and becomes two rules: the
per-layer spelling (``decoder.layers.{layer}.<suffix>``) and the stacked one
(``decoder.layers.<suffix>``, whose dim 0 is ``{layer}``). Megatron-Core writes several spellings
of one tensor (fused / local norms, stacked / per-layer, ``_w``/``_v`` / fused fc1, the expert
layouts of :mod:`.megatron_moe`); a later spelling of what an earlier rule writes is marked
``alt`` (a checkpoint holding two spellings of one tensor is an error).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from ..name_table import NameRule, NameTable, Split, gate_up, pattern_key, qkv

LAYER = "decoder.layers."  # Megatron's layer prefix
HF_LAYER = "model.layers.{layer}."
LAYER_INDEX = re.compile(r"^(\d+)\.(.+)$")  # what follows LAYER in a per-layer name: (index, suffix)
# Megatron-Core's own names for the tensors whose role the reader decides (not a mapping: the
# checkpoint's structure says whether the output layer is a language-model or a value head, tied
# or not).
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
OUTPUT_BIAS = "output_layer.bias"
CITATION = "megatron-core 0.16 megatron/core/models/gpt/gpt_model.py, transformer_layer.py (read, not copied)"


def _prefixed(target: str | Split) -> str | Split:
    if isinstance(target, Split):
        return Split(target.kind, tuple((role, HF_LAYER + t) for role, t in target.targets))
    return HF_LAYER + target


def layer_rules(entries: Mapping[str, str | Split]) -> list[NameRule]:
    """``{suffix: HF suffix or Split}`` -> the per-layer and the stacked rule of each suffix."""
    rules = []
    for suffix, target in entries.items():
        hf = _prefixed(target)
        rules.append(NameRule(f"{LAYER}{{layer}}.{suffix}", hf))
        rules.append(NameRule(LAYER + suffix, hf))
    return rules


def megatron_table(
    *,
    name: str,
    summary: str,
    model_types: tuple[str, ...],
    architectures: Mapping[str, str],
    layer_tensors: Mapping[str, str],
    fused: Mapping[str, Split],
    required: Iterable[str],
    config_checks: Mapping[str, Mapping[str, object]] | None = None,
    experts_config_key: str | None = None,
) -> NameTable:
    """One family's table: embedding, layer rules (1:1, then fused), final norm, output layer.
    ``required`` / ``config_checks`` name global sources or layer suffixes."""
    rules = [
        NameRule("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        *layer_rules(layer_tensors),
        *layer_rules(fused),
        NameRule("decoder.final_layernorm.weight", "model.norm.weight"),
        NameRule("output_layer.weight", "lm_head.weight"),
    ]
    written: set[str] = set()
    for i, rule in enumerate(rules):  # later spellings of a tensor are alternatives
        keys = {pattern_key(t) for _, t in rule.targets}
        if keys <= written:
            rules[i] = NameRule(rule.source, rule.target, alt=True)
        written |= keys
    globals_ = {r.source for r in rules if not r.source.startswith(LAYER)}

    def source(entry: str) -> str:
        return entry if entry in globals_ else f"{LAYER}{{layer}}.{entry}"

    sizes = {"layer": "num_hidden_layers"}
    if experts_config_key:
        sizes["expert"] = experts_config_key
    return NameTable(
        name=name,
        source="megatron",
        model_types=model_types,
        rules=tuple(rules),
        skip=NOT_MODEL,
        ignore=("*._extra_state", "*._extra_state/*", "*/_extra_state*"),
        description=summary,
        citation=CITATION,
        sizes=sizes,
        required=tuple(source(r) for r in required),
        complete=("expert",) if experts_config_key else (),
        config_checks={source(k): v for k, v in (config_checks or {}).items()},
        value_rules=(NameRule("output_layer.weight", "score.weight"), NameRule("output_layer.bias", "score.bias")),
        architectures=dict(architectures),
        order="table",
    )


#: dist_ckpt entries that are not model state (old verl saved the optimizer and rng beside it).
NOT_MODEL = ("optimizer.*", "optimizer", "chained_*", "rng_state", "rng_state/*", "lr_scheduler*")

LAYER_TENSORS = {
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

QK_NORM = {
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

QKV = qkv("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
QKV_BIAS = qkv("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
GATE_UP = gate_up("mlp.gate_proj.weight", "mlp.up_proj.weight")
#: the fused tensors of a layer without biases: QKV and the gated MLP's gate/up
DENSE_FUSED = {"self_attention.linear_qkv.weight": QKV, "mlp.linear_fc1.weight": GATE_UP}
_GATE_UP_BIAS = gate_up("mlp.gate_proj.bias", "mlp.up_proj.bias")

REQUIRED = [
    "embedding.word_embeddings.weight",
    "decoder.final_layernorm.weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc2.weight",
]


def arch(family: str) -> dict[str, str]:
    return {"causal_lm": f"{family}ForCausalLM", "value": f"{family}ForTokenClassification"}


TABLES = [
    megatron_table(
        name="megatron_gpt.llama",
        summary="Llama (RMSNorm, SwiGLU, RoPE, GQA; optional attention_bias / mlp_bias)",
        model_types=("llama",),
        architectures=arch("Llama"),
        layer_tensors={**LAYER_TENSORS, **_LINEAR_BIASES},
        fused={
            "self_attention.linear_qkv.weight": QKV,
            "self_attention.linear_qkv.bias": QKV_BIAS,
            "mlp.linear_fc1.weight": GATE_UP,
            "mlp.linear_fc1.bias": _GATE_UP_BIAS,
        },
        required=REQUIRED,
        config_checks={
            "self_attention.linear_qkv.bias": {"attention_bias": True},
            "self_attention.linear_proj.bias": {"attention_bias": True},
            "mlp.linear_fc1.bias": {"mlp_bias": True},
            "mlp.linear_fc1.bias_w": {"mlp_bias": True},
            "mlp.linear_fc2.bias": {"mlp_bias": True},
        },
    ),
    megatron_table(
        name="megatron_gpt.mistral",
        summary="Mistral (as Llama, no biases)",
        model_types=("mistral",),
        architectures=arch("Mistral"),
        layer_tensors=dict(LAYER_TENSORS),
        fused=dict(DENSE_FUSED),
        required=REQUIRED,
    ),
    megatron_table(
        name="megatron_gpt.qwen2",
        summary="Qwen2 / Qwen2.5 (q/k/v biases, no o_proj bias)",
        model_types=("qwen2",),
        architectures=arch("Qwen2"),
        layer_tensors=dict(LAYER_TENSORS),
        fused={
            "self_attention.linear_qkv.weight": QKV,
            "self_attention.linear_qkv.bias": QKV_BIAS,
            "mlp.linear_fc1.weight": GATE_UP,
        },
        required=[*REQUIRED, "self_attention.linear_qkv.bias"],
    ),
    megatron_table(
        name="megatron_gpt.qwen3",
        summary="Qwen3 (per-head q/k RMSNorm, explicit head_dim, no biases)",
        model_types=("qwen3",),
        architectures=arch("Qwen3"),
        layer_tensors={**LAYER_TENSORS, **QK_NORM},
        fused=dict(DENSE_FUSED),
        required=[*REQUIRED, "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"],
    ),
]
