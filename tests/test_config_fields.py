"""Config fields read as transformers' config classes read them (attribute_map, renamed keys)."""

from __future__ import annotations

import pytest

from hf_merge import config_fields

pytestmark = pytest.mark.compat


def test_attribute_map_aliases_of_a_real_config():
    """GPT-2's config stores n_layer / n_head / n_embd (its attribute_map's targets): the plain
    names read them, as ``config.num_hidden_layers`` does."""
    from transformers import GPT2Config

    config = GPT2Config(n_layer=3, n_head=4, n_embd=64).to_dict()
    assert "num_hidden_layers" not in config
    assert config_fields.get(config, "num_hidden_layers") == 3
    assert config_fields.get(config, "num_attention_heads") == 4
    assert config_fields.get(config, "hidden_size") == 64
    assert config_fields.get(config, "no_such_field", "x") == "x"


@pytest.mark.parametrize("model_type, stored", [("qwen3_moe", "num_experts"), ("qwen3_moe", "num_local_experts"),
                                                ("mixtral", "num_local_experts"), ("deepseek_v3", "n_routed_experts")])
def test_expert_count_under_every_spelling(model_type, stored):
    """Written by the installed transformers' config class (whichever name it stores), or by
    another release (the other spelling): the expert count is found under its common names."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).to_dict()
    for key in config_fields.RENAMES[0]:
        config.pop(key, None)
    config[stored] = 6
    assert config_fields.get(config, "num_experts") == 6
    assert config_fields.get(config, "num_local_experts") == 6


def test_dtype_and_rope_spellings():
    """``torch_dtype`` (before 4.56) and ``dtype``; ``rope_scaling`` + ``rope_theta`` (4.x) and
    ``rope_parameters`` (5.x): both read."""
    assert config_fields.get({"torch_dtype": "bfloat16"}, "dtype") == "bfloat16"
    assert config_fields.get({"dtype": "float16", "torch_dtype": "bfloat16"}, "dtype") == "float16"
    old = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    new = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}}
    for config in (old, new):
        assert config_fields.rope_settings(config) == {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0,
                                                       **({"type": "linear"} if "rope_scaling" in config else {})}
    assert config_fields.get(old, "rope_parameters") == old["rope_scaling"]
