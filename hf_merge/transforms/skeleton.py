"""The transformers class of a config.json, and that class built on the meta device.

Two questions only transformers can answer need the model object itself, not just its class:
which tensors ``save_pretrained`` writes under which names (:mod:`hf_merge.transforms.hub_layout`)
and which weights it ties (:func:`hf_merge.hf_files.tied_pairs`: some models declare their ties as
regular expressions or fill them in ``__init__``). Both use the one skeleton built here, once per
process and config: no memory (meta device), no weight init.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from ..errors import MappingError

__all__ = ["experts_transposed", "model_class_for", "skeleton"]

_LOCK = threading.Lock()
_LAST: tuple[Any, Any] | None = None  # ((class, config digest), model): the last skeleton built


def model_class_for(config: dict[str, Any]):
    """The transformers class ``save_pretrained`` would run on: ``architectures[0]``, or None
    (no architectures, or custom code: transformers converts neither)."""
    import transformers
    from transformers import PreTrainedModel

    for arch in config.get("architectures") or []:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    return None


def skeleton(cls, config: dict[str, Any]):
    """``cls`` built on the meta device from the config dict (no memory, no init); the same
    object for the same class and config within a process. Callers must not modify it."""
    global _LAST
    key = (cls, json.dumps(config, sort_keys=True, default=str))
    with _LOCK:
        if _LAST is not None and _LAST[0] == key:
            return _LAST[1]
        model = _build(cls, config)
        _LAST = (key, model)
        return model


def _build(cls, config: dict[str, Any]):
    from transformers import AutoConfig

    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    config_class = getattr(cls, "config_class", None)
    if isinstance(config_class, type) and getattr(config_class, "model_type", None) == model_type:
        config_obj = config_class(**cfg)  # also the classes the Auto mapping does not list (Bark's sub-models)
    elif model_type is None:
        raise MappingError(f"config.json has no model_type; cannot build {cls.__name__} to find its saved layout")
    else:
        config_obj = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        try:
            from transformers.initialization import no_init_weights
        except ImportError:  # transformers 4.x and early 5.x
            from transformers.modeling_utils import no_init_weights
        with no_init_weights():
            return cls(config_obj)


def experts_transposed(config: dict[str, Any], module: str) -> bool:
    """Whether the experts module ``module`` stores its 3-D parameters as ``[E, in, out]``: the
    ``is_transposed`` attribute transformers' ``use_experts_implementation`` sets (PEFT reads it
    to lay out LoRA on those parameters); False when the module does not say."""
    cls = model_class_for(config)
    if cls is None:
        raise MappingError(f"{module}: transformers does not know the model's class, so the layout of its experts is unknown")
    try:
        sub = skeleton(cls, config).get_submodule(module)
    except AttributeError:
        raise MappingError(f"{cls.__name__} has no module {module}; is config.json the trained model's?") from None
    return bool(getattr(sub, "is_transposed", False))
