"""hf_merge.transforms.conversion_keys: the keys transformers declares weight conversions for, read from its
source without importing it, equal what transformers itself builds; any unknown shape is "unknown"."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import folder_tensors

import hf_merge
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


def test_dense_first_merge_imports_no_transformers(qwen2_fp32_ws2, tmp_path):
    """An untied dense model with an empty plan cache: the Hub-layout decision ("as stored") is
    made from transformers' declarations read from its source; transformers is never imported."""
    code = ("import sys, hf_merge; hf_merge.merge(sys.argv[1], sys.argv[2]); "
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'); assert not loaded, loaded[:5]")
    repo = str(Path(hf_merge.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=repo, HF_MERGE_CACHE=str(tmp_path / "cache"))
    subprocess.run([sys.executable, "-c", code, str(qwen2_fp32_ws2.actor), str(tmp_path / "out")], check=True, env=env)
    assert list((tmp_path / "cache" / "hub_layout").glob("*.json"))  # the passthrough plan, stored
    hf_merge.merge(qwen2_fp32_ws2.actor, tmp_path / "asked")  # in this process transformers is imported: asked
    want = folder_tensors(tmp_path / "asked")
    got = folder_tensors(tmp_path / "out")
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
