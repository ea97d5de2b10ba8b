"""Every architecture transformers declares a conversion for: the Hub-layout transform's specs
equal what ``save_pretrained`` would write (names, shapes, dtypes), on the meta device.

For each ``model_type`` key of ``transformers.conversion_mapping`` that has a config class, the
model is built on the meta device from the default config with 2 layers per stack (widths as
defaulted: meta tensors cost nothing). The expected names are what ``save_pretrained`` computes:
``remove_tied_weights_from_state_dict`` then ``revert_weight_conversion`` on the model's state
dict. The transform sees only the specs of that state dict, through ``build_views`` (tied alias
dropped, Hub layout). Architectures that cannot be built this way are skipped with the reason;
:data:`SKIPPED` lists the ones known at transformers 5.24 and why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_merge.checkpoint import CheckpointInfo, LazyCheckpoint
from hf_merge.errors import MappingError
from hf_merge.transforms.views import build_views
from hf_merge.spec import TensorSpec
from hf_merge.transformers_compat import has_weight_conversions

if not has_weight_conversions():
    pytest.skip("transformers 4.x declares no weight conversions: no Hub layout to walk", allow_module_level=True)

#: model types skipped on purpose (beyond those that fail to build, which skip with their error)
SKIPPED = {
    "legacy": "not an architecture: old-checkpoint renames that save_pretrained never reverses (add_legacy=False)",
}

#: model types whose saving uses an operation that is not pure data movement: the transform must
#: refuse them with an error naming the operation (never pass them through)
UNSUPPORTED = {
    "ernie4_5_vl_moe": "ErnieFuseAndSplitTextVisionExperts",
    "inkling2": "Inkling2UnpadVocab",
    "inkling2_loop": "Inkling2UnpadVocab",
    "inkling2_text": "Inkling2UnpadVocab",
    "inkling2_loop_text": "Inkling2LoopMergeMessageQueries",
}

#: walked by default (the families RL runs train most, and each kind of operation); set
#: HF_MERGE_WALK_ALL=1 to walk every architecture (about 4 minutes on 2 busy cores)
DEFAULT_TYPES = {
    "qwen3_moe", "deepseek_v3", "mixtral", "Qwen2_5_VLForConditionalGeneration", "gemma3", "llava", "ernie4_5_vl_moe",
}

LAYER_KEYS = ("num_hidden_layers", "num_layers", "depth", "encoder_layers", "decoder_layers", "num_decoder_layers")


class _MetaSpecs(LazyCheckpoint):
    """A meta-device state dict as a lazy checkpoint: specs only (nothing is ever read)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.info = CheckpointInfo("meta", Path("."))
        self._specs = {n: TensorSpec(n, tuple(t.shape), t.dtype) for n, t in state_dict.items()}

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs


def cls_name(model) -> str:
    return type(model).__name__


def _model_types() -> list[str]:
    """The mapping's keys: model types, and class names (``Qwen2VLForConditionalGeneration``...;
    not imported here: collection stays cheap)."""
    from transformers.conversion_mapping import _build_checkpoint_conversion_mapping
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    keys = _build_checkpoint_conversion_mapping()
    return sorted(k for k in keys if k in CONFIG_MAPPING_NAMES or k in SKIPPED or k[:1].isupper())


def _is_model_class(obj) -> bool:
    from transformers import PreTrainedModel

    return isinstance(obj, type) and issubclass(obj, PreTrainedModel)


def _model_class(model_type: str):
    import transformers

    if model_type[:1].isupper():  # a class-name key
        cls = getattr(transformers, model_type, None)
        return cls if _is_model_class(cls) else None
    from transformers.models.auto import modeling_auto as ma

    for table in ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES"):
        name = getattr(ma, table).get(model_type)
        if isinstance(name, (list, tuple)):
            name = name[0]
        cls = getattr(transformers, name, None) if name else None
        if cls is not None:
            return cls
    return None


def _config(model_type: str):
    """The default config with 2 layers where the config class accepts that (given as constructor
    arguments, so derived per-layer lists stay consistent), else the default config."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    small: dict = {key: 2 for key in LAYER_KEYS if isinstance(getattr(default, key, None), int) and getattr(default, key) > 2}
    for sub in getattr(default, "sub_configs", {}) or {}:
        child = getattr(default, sub, None)
        if child is not None and hasattr(child, "to_dict"):
            layers = {k: 2 for k in LAYER_KEYS if isinstance(getattr(child, k, None), int) and getattr(child, k) > 2}
            if layers:
                small[sub] = {**child.to_dict(), **layers}
    for attempt in (small, {k: v for k, v in small.items() if not isinstance(v, dict)}):
        try:
            config = config_class(**attempt)
            config_class(**config.to_dict())  # what the merge does with config.json
            return config
        except Exception:  # noqa: BLE001 - this shrink is not valid for this architecture; try less
            continue
    return default


def _build(model_type: str):
    cls = _model_class(model_type)
    if cls is None:
        pytest.skip(f"{model_type}: no model class in the Auto mappings")
    try:
        config = _config(cls.config_class.model_type if model_type == cls.__name__ else model_type)
        config.architectures = [cls.__name__]
        with torch.device("meta"):
            model = cls(config)
    except Exception as e:  # noqa: BLE001 - an architecture that does not build from defaults is skipped
        pytest.skip(f"{model_type}: {cls.__name__} does not build from its default config: {type(e).__name__}: {str(e)[:120]}")
    return model, config


@pytest.mark.parametrize("model_type", _model_types())
def test_specs_equal_save_pretrained(model_type):
    if model_type in SKIPPED:
        pytest.skip(SKIPPED[model_type])
    if model_type not in DEFAULT_TYPES and not os.environ.get("HF_MERGE_WALK_ALL"):
        pytest.skip("set HF_MERGE_WALK_ALL=1 to walk every architecture")
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model, config = _build(model_type)
    state = model.state_dict()
    try:
        want = revert_weight_conversion(model, remove_tied_weights_from_state_dict(dict(state), model))
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"{model_type}: save_pretrained itself cannot revert this model's conversion: {str(e)[:120]}")
    if model_type in UNSUPPORTED:
        with pytest.raises(MappingError, match=rf"{cls_name(model)}.*{UNSUPPORTED[model_type]}"):
            build_views(_MetaSpecs(state), config.to_dict(), dtype="auto")
        return
    view = build_views(_MetaSpecs(state), config.to_dict(), dtype="auto").model
    got = {n: (s.shape, s.dtype) for n, s in view.specs().items()}
    expected = {n: (tuple(t.shape), t.dtype) for n, t in want.items()}
    assert got.keys() == expected.keys(), (sorted(got.keys() - expected.keys())[:4], sorted(expected.keys() - got.keys())[:4])
    assert got == expected
