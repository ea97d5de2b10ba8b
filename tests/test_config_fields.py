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


def test_a_megatron_config_lookup_does_not_import_transformers():
    """A Qwen2 config without ``head_dim`` (the Megatron reader checks it is a positive integer):
    the field's other spellings come from the config class's source, not from importing
    transformers (1.3 s of CPU a merge never needed otherwise; before: imported)."""
    import subprocess
    import sys

    code = (
        "import sys; from hf_merge import config_fields as c; "
        "assert c.get({'model_type': 'qwen2'}, 'head_dim') is None; "
        "assert c.get({'model_type': 'gpt2', 'n_head': 4}, 'num_attention_heads') == 4; "
        "assert c.get({'model_type': 'qwen3_moe', 'num_local_experts': 8}, 'num_experts') == 8; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_common_families_maps_are_read_from_source_and_are_the_classes_own():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for mt in ("qwen2", "qwen3", "qwen3_moe", "llama", "mistral", "mixtral", "deepseek_v3", "gpt2"):
        stated = config_fields._stated_map(mt)
        assert stated is not None, mt
        assert stated == dict(CONFIG_MAPPING[mt].attribute_map), mt


@pytest.mark.slow
def test_stated_attribute_maps_are_the_classes_own():
    """Every map read from a config class's source (an empty one too) equals the imported class's
    ``attribute_map``; the common families are read that way (not declined). 7-12 s: it imports
    every config class the source reading does not decline (510 of 831 with transformers 5.25)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    common = {"qwen2", "qwen3", "qwen3_moe", "llama", "mistral", "mixtral", "deepseek_v3", "gpt2"}
    stated = {mt: config_fields._stated_map(mt) for mt in CONFIG_MAPPING_NAMES}
    assert all(stated[mt] is not None for mt in common)
    checked = [mt for mt, amap in stated.items() if amap is not None]
    assert len(checked) > len(stated) // 2
    for mt in checked:
        assert stated[mt] == dict(CONFIG_MAPPING[mt].attribute_map), mt
