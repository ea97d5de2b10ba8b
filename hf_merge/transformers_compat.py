"""What differs between the transformers releases hf-merge runs on (4.56 to the newest 5.x), in one place.

transformers 5 keeps some models in memory in another layout than the one it saves (fused MoE
experts, VLM prefixes) and declares the difference as weight conversions
(``transformers.conversion_mapping``, ``transformers.core_model_loading``); its loader is built on
them. transformers 4.x has none of that: a MoE model holds one module per expert, as the Hub
does, so there is no layout to revert. What 4.x does rename is a VLM's prefixes: its
``save_pretrained`` turns the class's ``_checkpoint_conversion_mapping`` around (``model.language_model.*``
saved as ``model.*``, ``model.visual.*`` as ``visual.*``). Ties are a dict ``{alias: source}`` in 5,
a list of alias names in 4.x (tied to the input embeddings by ``tie_weights``).

Everything else in hf-merge asks this module, never the version number itself.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Any

__all__ = ["has_weight_conversions", "legacy_saved_names", "major_version", "tied_weights"]


@functools.lru_cache(maxsize=1)
def major_version() -> int | None:
    """The installed transformers' major version (read from its metadata: nothing imported), or
    None when it is not installed."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    head = re.match(r"\d+", version)
    return int(head.group()) if head else None


def has_weight_conversions() -> bool:
    """transformers >= 5: weight conversions (``conversion_mapping``, ``core_model_loading``) and
    the loader built on them exist."""
    major = major_version()
    return major is not None and major >= 5


def tied_weights(model: Any) -> dict[str, str]:
    """``{alias: source}``: the weights ``tie_weights`` ties and ``save_pretrained`` writes once.

    transformers 5 computes them on the model (``all_tied_weights_keys``). transformers 4.x ties
    the output embeddings to the input embeddings when ``tie_word_embeddings`` is set and lists the
    alias names in ``_tied_weights_keys``; the pair is found from the modules themselves.
    """
    if has_weight_conversions():
        return {str(k): str(v) for k, v in (getattr(model, "all_tied_weights_keys", None) or {}).items()}
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return {}
    try:
        output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return {}
    if output is None or inputs is None:
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    out_name, in_name = names.get(id(output)), names.get(id(inputs))
    if out_name is None or in_name is None or out_name == in_name:
        return {}
    return {f"{out_name}.weight": f"{in_name}.weight"}


def legacy_saved_names(model_class: Any, names: list[str]) -> dict[str, str]:
    """transformers 4.x: ``{saved name: in-memory name}`` as that release's ``save_pretrained``
    renames a VLM (the reverse of its ``_checkpoint_conversion_mapping``, first match wins); empty
    when nothing is renamed. Only for 4.x: transformers 5 declares this as a weight conversion."""
    if has_weight_conversions():
        raise RuntimeError("legacy_saved_names is transformers 4.x's rule; transformers 5 has weight conversions")
    from transformers.modeling_utils import VLMS

    is_vlm = any(vlm in klass.__name__.lower() for klass in model_class.__mro__[:-1] for vlm in VLMS)
    mapping = getattr(model_class, "_checkpoint_conversion_mapping", None) or {}
    if not is_vlm or not mapping:
        return {}
    reverse = [(pattern, re.sub(r"\(.*\)", "", replacement.lstrip("^"))) for replacement, pattern in mapping.items()]
    out: dict[str, str] = {}
    for name in names:
        saved = name
        for pattern, replacement in reverse:
            saved, count = re.subn(pattern, replacement, saved)
            if count:
                break
        out[saved] = name
    if len(out) != len(names):
        raise ValueError("two tensors would be saved under one name")
    return out if any(k != v for k, v in out.items()) else {}
