"""The ``general.*`` and ``<arch>.*`` hyper-parameter keys of a GGUF file, from config.json.

Written as llama.cpp's converter writes them (block count, context / embedding / feed-forward
lengths, head counts, RoPE base and scaling, RMS-norm epsilon, key/value lengths when the config
names ``head_dim``). transformers 5 nests ``rope_theta`` and the scaling under ``rope_parameters``;
older configs keep ``rope_theta`` and ``rope_scaling`` at the top level: both are read.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import config_fields
from ..errors import MappingError
from .arch import GgufArch

DEFAULT_ROPE_THETA = 10000.0


rope_parameters = config_fields.rope_settings


def _field(config: dict[str, Any], name: str) -> Any:
    """A field config.json must have, under whichever spelling (:func:`hf_merge.config_fields.get`)."""
    value = config_fields.get(config, name)
    if value is None:
        raise MappingError(f"config.json has no {name!r}; GGUF output needs it")
    return value


def head_counts(config: dict[str, Any]) -> dict[str, int]:
    """``{"heads": query heads, "kv_heads": key/value heads}``: what the permute tables name."""
    heads = _field(config, "num_attention_heads")
    return {"heads": heads, "kv_heads": config_fields.get(config, "num_key_value_heads") or heads}


def head_dim(config: dict[str, Any]) -> int:
    return config_fields.get(config, "head_dim") or _field(config, "hidden_size") // _field(config, "num_attention_heads")


def rope_freqs(config: dict[str, Any]) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs`` factors for ``llama3`` RoPE scaling (None for other types).

    Per frequency: 1 above the high-frequency cut-off, ``factor`` below the low one, and the
    smooth interpolation ``1 / ((1 - s) / factor + s)`` between, as transformers' llama3 rule.
    """
    rope = rope_parameters(config)
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    base = float(rope.get("rope_theta", DEFAULT_ROPE_THETA))
    dim = head_dim(config)
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def add_hparams(writer, arch: GgufArch, config: dict[str, Any], ftype) -> None:
    """Add the hyper-parameter keys of ``config`` to a ``gguf.GGUFWriter``."""
    import gguf

    heads = head_counts(config)
    writer.add_block_count(_field(config, "num_hidden_layers"))
    if config_fields.get(config, "max_position_embeddings") is not None:
        writer.add_context_length(config_fields.get(config, "max_position_embeddings"))
    writer.add_embedding_length(_field(config, "hidden_size"))
    writer.add_feed_forward_length(_field(config, "intermediate_size"))
    writer.add_head_count(heads["heads"])
    writer.add_head_count_kv(heads["kv_heads"])
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = str(rope.get("rope_type", "default")).lower()
    if rope_type == "linear" and rope.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type == "yarn" and rope.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif rope_type not in ("default", "llama3"):  # llama3: the rope_freqs tensor carries it
        raise MappingError(f"RoPE scaling {rope_type!r} is not supported for GGUF output (default, linear, yarn, llama3 are)")
    if config.get("rms_norm_eps") is not None:
        writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch.moe:
        _add_moe(writer, arch, config)
    if arch.name == "llama":  # llama.cpp's llama converter also writes these two
        writer.add_vocab_size(_field(config, "vocab_size"))
        writer.add_rope_dimension_count(head_dim(config))
    writer.add_file_type(int(gguf.LlamaFileType[ftype.file_type]))
    if ftype.quantized:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# llama.cpp's router normalises the chosen experts' weights for qwen3moe and not for qwen2moe.
_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}


def _add_moe(writer, arch: GgufArch, config: dict[str, Any]) -> None:
    # transformers 5 spells the expert count num_local_experts for qwen3_moe, num_experts for qwen2_moe
    n_experts, top_k = config_fields.get(config, "num_experts"), config_fields.get(config, "num_experts_per_tok")
    for key, value in (("num_experts", n_experts), ("num_experts_per_tok", top_k),
                       ("moe_intermediate_size", config.get("moe_intermediate_size"))):
        if value is None:
            raise MappingError(f"config.json has no {key!r}; GGUF output of a {arch.name} model needs it")
    want = _NORM_TOPK[arch.name]
    if bool(config.get("norm_topk_prob", False)) != want:
        raise MappingError(
            f"config.json has norm_topk_prob={config.get('norm_topk_prob')}, but llama.cpp's {arch.name} always "
            f"uses {want}: the GGUF model would route differently, so it is not written"
        )
    writer.add_expert_count(n_experts)
    writer.add_expert_used_count(top_k)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch.name == "qwen2moe" and config.get("shared_expert_intermediate_size") is not None:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
