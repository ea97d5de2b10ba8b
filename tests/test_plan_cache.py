"""The plan cache cannot lie: a stored Hub layout is re-checked against the model it is used for,
and its key covers everything the plan is computed from.

Real FSDP2 checkpoints (``hub_root``); each tampered entry must be a miss (transformers' reverse
conversion runs again) and the merge must still write exactly ``save_pretrained``'s bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import assert_tensors_equal, folder_tensors

import hf_merge
from hf_merge.transforms import layout_cache


def _outputs(plan: dict) -> dict[str, list]:
    return {record[0]: record for record in plan["outputs"]}


def swap_lm_head_and_embed_tokens(plan: dict) -> None:
    """Two records of the plan swapped: each name gets the other's data (same shape)."""
    out = _outputs(plan)
    a, b = out["lm_head.weight"], out["model.embed_tokens.weight"]
    a[3], b[3] = b[3], a[3]


def point_expert_0_at_expert_1(plan: dict) -> None:
    """One record edited: expert 0's up_proj reads expert 1's rows of the fused tensor."""
    out = _outputs(plan)
    out["model.layers.0.mlp.experts.0.up_proj.weight"][3]["span"][1] = \
        out["model.layers.0.mlp.experts.1.up_proj.weight"][3]["span"][1]


def tamper(entry: Path, change, *, reseal: bool) -> None:
    """Apply ``change`` to the stored plan: in the file as it is, or stored again through the
    cache itself (an entry consistent in every way but its content)."""
    data = json.loads(entry.read_text())
    plan = data.get("value", data)
    change(plan)
    if reseal:
        layout_cache.put("hub_layout", entry.stem, plan)
    else:
        entry.write_text(json.dumps(data))


@pytest.fixture
def reverse_calls(monkeypatch) -> list:
    """Each call of transformers' revert_weight_conversion (a plan computed, not taken from the cache)."""
    import transformers.core_model_loading as cml

    calls: list = []
    real = cml.revert_weight_conversion
    monkeypatch.setattr(cml, "revert_weight_conversion", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("reseal", [False, True], ids=["edited-file", "resealed"])
@pytest.mark.parametrize("name, change", [("qwen2_5_vl", swap_lm_head_and_embed_tokens),
                                          ("qwen3_moe", point_expert_0_at_expert_1)])
def test_tampered_entry_is_a_miss(hub_root, tmp_path, monkeypatch, reverse_calls, name, change, reseal):
    monkeypatch.setenv("HF_MERGE_CACHE", str(tmp_path / "cache"))
    src = hub_root / name
    want = folder_tensors(src / "reference")
    hf_merge.merge(src, tmp_path / "first")
    (entry,) = (tmp_path / "cache" / "hub_layout").glob("*.json")
    tamper(entry, change, reseal=reseal)
    del reverse_calls[:]
    hf_merge.merge(src, tmp_path / "second")
    assert_tensors_equal(folder_tensors(tmp_path / "second"), want)
    assert reverse_calls == [1]  # computed afresh


def test_key_covers_conversions_registered_in_python(hub_root, tmp_path, monkeypatch):
    """A conversion registered with transformers changes what save_pretrained writes; the plan
    stored before it must not be used."""
    import transformers.conversion_mapping as cm

    monkeypatch.setenv("HF_MERGE_CACHE", str(tmp_path / "cache"))
    src = hub_root / "qwen3_moe"
    hf_merge.merge(src, tmp_path / "first")
    assert "model.layers.0.mlp.experts.0.up_proj.weight" in folder_tensors(tmp_path / "first")  # per expert
    table = dict(cm._checkpoint_conversion_mapping_cache or cm._build_checkpoint_conversion_mapping())
    monkeypatch.setattr(cm, "_checkpoint_conversion_mapping_cache", table)  # undone after the test
    monkeypatch.setattr(cm, "USER_REGISTERED_MAPPINGS", set())
    cm.register_checkpoint_conversion_mapping("qwen3_moe", [], overwrite=True)  # no conversion: saved as held
    hf_merge.merge(src, tmp_path / "registered")
    got = folder_tensors(tmp_path / "registered")
    assert "model.layers.0.mlp.experts.gate_up_proj" in got
    monkeypatch.setenv("HF_MERGE_CACHE", "off")
    hf_merge.merge(src, tmp_path / "uncached")
    assert_tensors_equal(got, folder_tensors(tmp_path / "uncached"))


def test_key_covers_transformers_sources(tmp_path):
    """A dev build of transformers changes its code, not always its version string."""
    import transformers.conversion_mapping as cm

    package = tmp_path / "transformers"
    package.mkdir()
    shutil.copy(cm.__file__, package / "conversion_mapping.py")
    before = layout_cache.source_fingerprint(str(package))
    with open(package / "conversion_mapping.py", "a") as f:
        f.write("\n# an edit of a dev build\n")
    layout_cache.source_fingerprint.cache_clear()
    assert layout_cache.source_fingerprint(str(package)) != before
    assert layout_cache.runtime()["transformers_files"] == layout_cache.source_fingerprint(str(Path(cm.__file__).parent))
