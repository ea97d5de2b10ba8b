"""Architectures hf_merge writes as GGUF, as data: llama.cpp's name for each, its tensor names and
which tensors get llama.cpp's RoPE row permutation.

Tensor names follow llama.cpp's ``gguf`` tensor table (``blk.{layer}.attn_q.weight``...). Each
table entry maps a Hugging Face name template to a GGUF name template; ``{layer}`` is the decoder
layer index. A Hugging Face tensor no entry matches is an error naming it, never silently dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import MappingError

# Hugging Face name (template) -> GGUF name (template), shared by the dense families.
_DENSE: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{layer}.input_layernorm.weight": "blk.{layer}.attn_norm.weight",
    "model.layers.{layer}.self_attn.q_proj.weight": "blk.{layer}.attn_q.weight",
    "model.layers.{layer}.self_attn.k_proj.weight": "blk.{layer}.attn_k.weight",
    "model.layers.{layer}.self_attn.v_proj.weight": "blk.{layer}.attn_v.weight",
    "model.layers.{layer}.self_attn.o_proj.weight": "blk.{layer}.attn_output.weight",
    "model.layers.{layer}.self_attn.q_proj.bias": "blk.{layer}.attn_q.bias",
    "model.layers.{layer}.self_attn.k_proj.bias": "blk.{layer}.attn_k.bias",
    "model.layers.{layer}.self_attn.v_proj.bias": "blk.{layer}.attn_v.bias",
    "model.layers.{layer}.post_attention_layernorm.weight": "blk.{layer}.ffn_norm.weight",
    "model.layers.{layer}.mlp.gate_proj.weight": "blk.{layer}.ffn_gate.weight",
    "model.layers.{layer}.mlp.up_proj.weight": "blk.{layer}.ffn_up.weight",
    "model.layers.{layer}.mlp.down_proj.weight": "blk.{layer}.ffn_down.weight",
}
_QK_NORM: dict[str, str] = {
    "model.layers.{layer}.self_attn.q_norm.weight": "blk.{layer}.attn_q_norm.weight",
    "model.layers.{layer}.self_attn.k_norm.weight": "blk.{layer}.attn_k_norm.weight",
}

# Which GGUF tensors are permuted from HF's rotate-half rows to llama.cpp's interleaved rows, and
# with which head count ("heads": num_attention_heads, "kv_heads": num_key_value_heads).
_LLAMA_PERMUTE = {
    "blk.{layer}.attn_q.weight": "heads",
    "blk.{layer}.attn_q.bias": "heads",
    "blk.{layer}.attn_k.weight": "kv_heads",
    "blk.{layer}.attn_k.bias": "kv_heads",
}


@dataclass(frozen=True)
class GgufArch:
    """One architecture: ``name`` is llama.cpp's (``general.architecture`` and the KV prefix)."""

    name: str
    tensors: dict[str, str]
    permute: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:  # the schema: every permuted name is a produced name
        unknown = set(self.permute) - set(self.tensors.values())
        if unknown or set(self.permute.values()) - {"heads", "kv_heads"}:
            raise ValueError(f"GgufArch {self.name}: bad permute table {self.permute}")


ARCHITECTURES: dict[str, GgufArch] = {
    "llama": GgufArch("llama", _DENSE, _LLAMA_PERMUTE),
    "mistral": GgufArch("llama", _DENSE, _LLAMA_PERMUTE),  # llama.cpp runs Mistral as llama
    "qwen2": GgufArch("qwen2", _DENSE),
    "qwen3": GgufArch("qwen3", {**_DENSE, **_QK_NORM}),
}


def arch_for(config: dict) -> GgufArch:
    """The GGUF architecture of a config.json, or a MappingError listing what is supported."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise MappingError(
            f"GGUF output does not support model_type {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]


def _compile(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)") + "$")


@dataclass(frozen=True)
class Mapped:
    gguf_name: str
    permute_heads: str | None  # "heads" / "kv_heads" / None


def map_names(arch: GgufArch, hf_names: list[str]) -> dict[str, Mapped]:
    """``{hf name: Mapped}`` for every tensor, in the order given; an unknown name is an error."""
    patterns = [(_compile(hf), gg) for hf, gg in arch.tensors.items()]
    out: dict[str, Mapped] = {}
    for name in hf_names:
        for pattern, gg in patterns:
            m = pattern.match(name)
            if m:
                out[name] = Mapped(gg.format(**m.groupdict()), arch.permute.get(gg))
                break
        else:
            raise MappingError(
                f"tensor {name} has no GGUF name for architecture {arch.name}; "
                "this model has weights the GGUF writer does not know (only plain decoder models are supported)"
            )
    return out
