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


# Mixture-of-experts blocks (qwen2_moe, qwen3_moe). llama.cpp stores each layer's experts stacked:
# ffn_{gate,up}_exps [E, F, H], ffn_down_exps [E, H, F]. transformers 5 holds them stacked too, in
# memory (FSDP rank files): gate_up_proj [E, 2F, H] = gate rows then up rows, down_proj [E, H, F];
# save_pretrained writes one tensor per expert ({expert}), which are stacked back in expert order.
_MOE: dict[str, str] = {
    "model.layers.{layer}.mlp.gate.weight": "blk.{layer}.ffn_gate_inp.weight",
    "model.layers.{layer}.mlp.experts.down_proj": "blk.{layer}.ffn_down_exps.weight",
    "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight": "blk.{layer}.ffn_gate_exps.weight",
    "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight": "blk.{layer}.ffn_up_exps.weight",
    "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight": "blk.{layer}.ffn_down_exps.weight",
}
_MOE_SPLITS: dict[str, tuple[str, ...]] = {  # one HF tensor -> equal parts along its dim 1
    "model.layers.{layer}.mlp.experts.gate_up_proj": ("blk.{layer}.ffn_gate_exps.weight", "blk.{layer}.ffn_up_exps.weight"),
}
_SHARED_EXPERT: dict[str, str] = {
    "model.layers.{layer}.mlp.shared_expert.gate_proj.weight": "blk.{layer}.ffn_gate_shexp.weight",
    "model.layers.{layer}.mlp.shared_expert.up_proj.weight": "blk.{layer}.ffn_up_shexp.weight",
    "model.layers.{layer}.mlp.shared_expert.down_proj.weight": "blk.{layer}.ffn_down_shexp.weight",
    "model.layers.{layer}.mlp.shared_expert_gate.weight": "blk.{layer}.ffn_gate_inp_shexp.weight",
}
_DENSE_ATTN = {k: v for k, v in _DENSE.items() if ".mlp." not in k}


@dataclass(frozen=True)
class GgufArch:
    """One architecture: ``name`` is llama.cpp's (``general.architecture`` and the KV prefix).

    ``tensors``: HF name template -> GGUF name template (an ``{expert}`` template stacks the
    experts into one GGUF tensor); ``splits``: HF template -> GGUF templates of its equal parts
    along dim 1; ``permute``: GGUF template -> which head count its rows are permuted with.
    """

    name: str
    tensors: dict[str, str]
    permute: dict[str, str] = field(default_factory=dict)
    splits: dict[str, tuple[str, ...]] = field(default_factory=dict)
    moe: bool = False
    flatten: tuple[str, ...] = ()  # GGUF templates llama.cpp reads as 1-D (a [1, H] gate is [H])

    def __post_init__(self) -> None:  # the schema: every permuted name is a produced name
        unknown = set(self.permute) - set(self.tensors.values())
        if unknown or set(self.permute.values()) - {"heads", "kv_heads"}:
            raise ValueError(f"GgufArch {self.name}: bad permute table {self.permute}")
        if any("{expert}" in gg for gg in self.tensors.values()):
            raise ValueError(f"GgufArch {self.name}: a GGUF name cannot hold {{expert}}")


ARCHITECTURES: dict[str, GgufArch] = {
    "llama": GgufArch("llama", _DENSE, _LLAMA_PERMUTE),
    "mistral": GgufArch("llama", _DENSE, _LLAMA_PERMUTE),  # llama.cpp runs Mistral as llama
    "qwen2": GgufArch("qwen2", _DENSE),
    "qwen3": GgufArch("qwen3", {**_DENSE, **_QK_NORM}),
    "qwen2_moe": GgufArch(
        "qwen2moe", {**_DENSE_ATTN, **_MOE, **_SHARED_EXPERT}, splits=_MOE_SPLITS, moe=True,
        flatten=("blk.{layer}.ffn_gate_inp_shexp.weight",),
    ),
    "qwen3_moe": GgufArch("qwen3moe", {**_DENSE_ATTN, **_QK_NORM, **_MOE}, splits=_MOE_SPLITS, moe=True),
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
    pattern = re.escape(template)
    for key in ("layer", "expert"):
        pattern = pattern.replace(r"\{" + key + r"\}", f"(?P<{key}>\\d+)")
    return re.compile("^" + pattern + "$")


@dataclass(frozen=True)
class Piece:
    """A Hugging Face tensor, or with ``part = (i, n)`` the i-th of n equal slices along its dim 1."""

    hf_name: str
    part: tuple[int, int] | None = None


@dataclass
class Mapped:
    """One GGUF tensor and where its rows come from (``stacked``: the pieces are experts, stacked
    along a new first dim; otherwise a single piece)."""

    gguf_name: str
    pieces: list[Piece]
    permute_heads: str | None = None
    stacked: bool = False
    flatten: bool = False
    _experts: list[int] = field(default_factory=list, repr=False)


def map_names(arch: GgufArch, hf_names: list[str]) -> list[Mapped]:
    """The GGUF tensors made from ``hf_names``, in order of first use; an unknown name is an error."""
    patterns = [(_compile(hf), gg) for hf, gg in arch.tensors.items()]
    splits = [(_compile(hf), ggs) for hf, ggs in arch.splits.items()]
    out: dict[str, Mapped] = {}
    for name in hf_names:
        for pattern, ggs in splits:
            if m := pattern.match(name):
                for i, gg in enumerate(ggs):
                    gname = gg.format(**m.groupdict())
                    _add(out, Mapped(gname, [Piece(name, (i, len(ggs)))]), name)
                break
        else:
            for pattern, gg in patterns:
                if m := pattern.match(name):
                    groups = m.groupdict()
                    expert = groups.pop("expert", None)
                    gname = gg.format(**groups)
                    if expert is None:
                        _add(out, Mapped(gname, [Piece(name)], arch.permute.get(gg), flatten=gg in arch.flatten), name)
                    else:
                        entry = out.setdefault(gname, Mapped(gname, [], stacked=True))
                        if not entry.stacked:  # the stacked and the per-expert layout at once
                            raise MappingError(f"{name} and {entry.pieces[0].hf_name} both map to GGUF tensor {gname}")
                        entry.pieces.append(Piece(name))
                        entry._experts.append(int(expert))
                    break
            else:
                raise MappingError(
                    f"tensor {name} has no GGUF name for architecture {arch.name}; "
                    "this model has weights the GGUF writer does not know (only plain decoder models are supported)"
                )
    for entry in out.values():
        if entry.stacked:
            order = sorted(range(len(entry.pieces)), key=entry._experts.__getitem__)
            if sorted(entry._experts) != list(range(len(entry._experts))):
                raise MappingError(f"{entry.gguf_name}: experts {sorted(entry._experts)} are not 0..{len(entry._experts) - 1}")
            entry.pieces = [entry.pieces[i] for i in order]
    return list(out.values())


def _add(out: dict[str, Mapped], entry: Mapped, hf_name: str) -> None:
    if entry.gguf_name in out and out[entry.gguf_name] is not entry:
        raise MappingError(f"{hf_name} and {out[entry.gguf_name].pieces[0].hf_name} both map to GGUF tensor {entry.gguf_name}")
    out[entry.gguf_name] = entry
