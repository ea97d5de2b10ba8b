"""hf_merge.transforms.conversion_keys: the keys transformers declares weight conversions for, read from its
source without importing it, equal what transformers itself builds; any unknown shape is "unknown".
That a first merge of an untied dense model imports no transformers at all is checked in
test_formats.py (one fresh interpreter for everything a plain merge leaves unimported)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hf_merge.transforms.conversion_keys import keys_from_source


def _source() -> str:
    spec = importlib.util.find_spec("transformers")
    return (Path(next(iter(spec.submodule_search_locations))) / "conversion_mapping.py").read_text()


def test_keys_equal_what_transformers_builds():
    from transformers.conversion_mapping import _build_checkpoint_conversion_mapping

    keys = keys_from_source(_source())
    assert keys is not None, "transformers' conversion_mapping.py has a shape hf_merge does not read: it imports it instead"
    assert keys == set(_build_checkpoint_conversion_mapping())
    assert {"qwen3_moe", "mixtral", "deepseek_v3"} <= keys and not {"qwen2", "llama", "Qwen2ForCausalLM"} & keys


BUILD = "def _build_checkpoint_conversion_mapping():\n    mapping = {'mixtral': [1]}\n"


@pytest.mark.parametrize("extra", [
    "    mapping.update({'qwen2': []})\n",                        # a key added by a method of the mapping
    "    if True:\n        mapping['qwen2'] = []\n",              # a conditional
    "    name = 'qwen2'\n    mapping[name] = []\n",                # a computed key
    "    for k in ('qwen2',):\n        mapping[k] = []\n",        # a loop over something else
    "    other['qwen2'] = []\n",                                   # a store into something else
])
def test_unknown_shapes_are_unknown(extra):
    module = "_MODEL_TO_CONVERSION_PATTERN = {'minimax': 'mixtral'}\n" + BUILD + extra + "    return mapping\n"
    assert keys_from_source(module) is None


def test_known_shapes_and_a_changed_pattern_table():
    loop = ("    for model_type, base in _MODEL_TO_CONVERSION_PATTERN.items():\n"
            "        if model_type in mapping:\n            continue\n"
            "        mapping[model_type] = mapping[base].copy()\n")
    body = BUILD + "    mapping['x'] = mapping['mixtral'].copy()\n    mapping['x'].append(2)\n    helper = 3\n" + loop + "    return mapping\n"
    table = "_MODEL_TO_CONVERSION_PATTERN = {'minimax': 'mixtral'}\n"
    assert keys_from_source(table + body) == {"mixtral", "x", "minimax"}
    assert keys_from_source(table + "_MODEL_TO_CONVERSION_PATTERN['y'] = 'mixtral'\n" + body) is None
    assert keys_from_source(table + "_MODEL_TO_CONVERSION_PATTERN.update(y='mixtral')\n" + body) is None
