"""Hub-canonical output: real FSDP2 checkpoints of MoE / VLM models merged into exactly what
``save_pretrained`` of the unsharded model writes (names, shapes, dtypes, bytes), plus logits.

The checkpoints come from ONE 2-rank gloo run of ``examples/make_hub_checkpoints.py`` (session
scoped; kept between sessions under ``HF_MERGE_FIXTURE_CACHE``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import folder_tensors, read_json

import hf_merge
import make_fsdp_checkpoint as mk
import make_hub_checkpoints as mh
from hf_merge.checkpoint import open_checkpoint
from hf_merge.errors import MappingError, UnsupportedCheckpointError
from hf_merge.hf_files import checkpoint_config
from hf_merge.transforms.views import build_views
from hf_merge.transforms.hub_layout import HubLayout, hub_layout
from hf_merge.transformers_compat import has_weight_conversions
from hf_merge.transformers_compat import dtype_kwargs

#: transformers 4.x holds MoE experts one module each, as saved: no fused layout to revert
needs_conversions = pytest.mark.skipif(
    not has_weight_conversions(), reason="transformers 4.x has no weight conversions (no fused in-memory layout)"
)

MODELS = ["qwen3_moe", "mixtral", "deepseek_v3", "qwen2_5_vl", "gemma3"]
IMAGE_TEXT = {"qwen2_5_vl", "gemma3"}


def assert_bytes_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), (sorted(set(got) - set(want))[:5], sorted(set(want) - set(got))[:5])
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), f"{name}: bytes differ"


def merged_logits(folder: Path, name: str, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if name in IMAGE_TEXT else AutoModelForCausalLM
    model = auto.from_pretrained(folder, **dtype_kwargs(torch.float32)).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


@pytest.mark.compat
@pytest.mark.parametrize("name", MODELS)
def test_merge_equals_save_pretrained(hub_root, tmp_path, name):
    """Under transformers 4.x the checkpoint (written by that stack) holds MoE experts as saved and
    only a VLM's prefixes are renamed, as its save_pretrained does."""
    src, target = hub_root / name, tmp_path / name
    result = hf_merge.merge(src, target, verify=True)  # verify re-builds the same stack from the source
    import transformers.modeling_utils

    # 4.52-4.57 rename a VLM's prefixes on save (their VLMS list); 4.51 holds them as saved
    if has_weight_conversions() or (name in IMAGE_TEXT and hasattr(transformers.modeling_utils, "VLMS")):
        assert any(n.startswith("Hub layout:") for n in result.notes)
    assert_bytes_equal(folder_tensors(target), folder_tensors(src / "reference"))
    ref = torch.load(src / "reference" / "logits.pt", weights_only=True)
    torch.testing.assert_close(merged_logits(target, name, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-6)
    saved = read_json(src / "reference" / "config.json")
    assert read_json(target / "config.json")["architectures"] == saved["architectures"]


@pytest.mark.compat
@pytest.mark.parametrize("name", ["qwen2_5_vl", "gemma3", "deepseek_v3"])
def test_missing_generation_config_is_derived_as_save_pretrained_does(hub_root, tmp_path, name):
    """A VLM (tokens in its text_config) and a MoE whose folder lost generation_config.json: the
    merge writes the one save_pretrained of the trained model wrote into the reference folder."""
    import shutil

    src = Path(shutil.copytree(hub_root / name, tmp_path / "src", ignore=shutil.ignore_patterns("reference")))
    (src / "global_step_1" / "actor" / "huggingface" / "generation_config.json").unlink()
    result = hf_merge.merge(src, tmp_path / "out")
    assert result.provenance["derived_files"] == ["generation_config.json"]
    assert read_json(tmp_path / "out" / "generation_config.json") == \
        read_json(hub_root / name / "reference" / "generation_config.json")


@needs_conversions
def test_expert_splits_are_file_ranges_of_the_rank_files(hub_root):
    """A per-expert tensor is a run of rows of the fused rank-file tensor: zero-copy, file-backed."""
    from hf_merge.readers import file_runs

    ckpt = open_checkpoint(hub_root / "qwen3_moe")
    try:
        _, cfg = checkpoint_config(ckpt.info)
        view = build_views(ckpt, cfg, dtype="auto").model.base
        assert isinstance(view, HubLayout)
        name = "model.layers.1.mlp.experts.3.up_proj.weight"
        assert view.source_names(name) == ["model.layers.1.mlp.experts.gate_up_proj"]
        runs = list(view.read_rows(name, torch.float32))
        assert len(runs) == 1 and runs[0][0] == 0
        run = file_runs.run_of(runs[0][1])  # bytes the writer can copy_file_range
        assert run is not None and os.pread(run.fd, run.nbytes, run.offset) == run.tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        fused = ckpt.read("model.layers.1.mlp.experts.gate_up_proj")
        assert torch.equal(run.tensor, fused[3, 16:])
    finally:
        ckpt.close()


@pytest.mark.compat
def test_cast_merge_rounds_each_expert_once(hub_root, tmp_path):
    src = hub_root / "qwen3_moe"
    hf_merge.merge(src, tmp_path / "bf16", dtype="bfloat16")
    want = {k: v.to(torch.bfloat16) for k, v in folder_tensors(src / "reference").items()}
    assert_bytes_equal(folder_tensors(tmp_path / "bf16"), want)


@pytest.mark.compat
@pytest.mark.parametrize("name", sorted(IMAGE_TEXT))
def test_vlm_processor_files_and_loader(hub_root, tmp_path, name):
    from transformers import AutoModelForImageTextToText

    src, target = hub_root / name, tmp_path / name
    hf_merge.merge(src, target)
    hf = src / "global_step_1" / "actor" / "huggingface"
    for file in ("preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
        if (hf / file).is_file():
            assert (target / file).read_bytes() == (hf / file).read_bytes(), file
    assert (target / "preprocessor_config.json").is_file()
    loaded = AutoModelForImageTextToText.from_sharded_pretrained(src, dtype="float32")
    direct = hf_merge.from_sharded_pretrained(src, dtype="float32")  # class from architectures
    reference = AutoModelForImageTextToText.from_pretrained(target, **dtype_kwargs(torch.float32))
    assert type(loaded) is type(reference) is type(direct)
    assert type(reference).__name__ == read_json(target / "config.json")["architectures"][0]
    want = reference.state_dict()
    for model in (loaded, direct):
        got = model.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.compat
@pytest.mark.parametrize("name", ["qwen3_moe_lora", "gemma3_lora", pytest.param("qwen3_moe_lora_experts", marks=needs_conversions)])
def test_lora_equals_peft(hub_root, tmp_path, name):
    """LoRA on a MoE model's attention / on a VLM's text and vision attention / on the fused 3-D
    expert parameters (``target_parameters``): fused output = merge_and_unload() + save_pretrained
    (Hub layout: one tensor per expert); adapter folder = PEFT's save_pretrained, names included
    (PEFT 0.21 keeps the in-memory names there: ``model.language_model...``,
    ``mlp.experts.base_layer.lora_A``)."""
    src, target = hub_root / name, tmp_path / "lora"
    hf_merge.merge(src, target)
    assert_bytes_equal(folder_tensors(target), folder_tensors(src / "reference"))
    assert_bytes_equal(folder_tensors(target / "lora_adapter"), folder_tensors(src / "reference" / "adapter"))
    got, want = read_json(target / "lora_adapter" / "adapter_config.json"), read_json(src / "reference" / "adapter" / "adapter_config.json")
    for key in ("r", "lora_alpha", "peft_type", "task_type", "use_rslora"):
        assert got[key] == want[key], key
    assert sorted(got["target_modules"]) == sorted(want["target_modules"])
    assert sorted(got.get("target_parameters") or []) == sorted(want.get("target_parameters") or [])


@needs_conversions
def test_lora_on_expert_parameters_logits_equal_the_peft_model(hub_root, tmp_path):
    """The fused folder (per-expert tensors) computes what the PEFT model (ParamWrapper LoRA on
    ``gate_up_proj`` / ``down_proj``, nested) computes."""
    src, target = hub_root / "qwen3_moe_lora_experts", tmp_path / "fused"
    hf_merge.merge(src, target, lora="fuse")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in folder_tensors(target)
    peft_model = mh.build_model("qwen3_moe_lora_experts")  # the same seeded model the checkpoint was trained from
    ids = mh.input_ids()
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits.float()
    torch.testing.assert_close(merged_logits(target, "qwen3_moe_lora_experts", ids), want, rtol=0, atol=1e-5)


@needs_conversions
def test_lora_on_expert_parameters_reads_one_expert_at_a_time(hub_root, monkeypatch):
    """Each per-expert output computes its own expert's delta only (not all E experts' each time)."""
    from hf_merge.transforms.lora import FusedLora

    calls = []
    real = FusedLora._expert_rows

    def counted(self, name, module, dtype, lo, hi):
        calls.append(hi - lo)
        return real(self, name, module, dtype, lo, hi)

    monkeypatch.setattr(FusedLora, "_expert_rows", counted)
    ckpt = open_checkpoint(hub_root / "qwen3_moe_lora_experts")
    try:
        _, cfg = checkpoint_config(ckpt.info)
        view = build_views(ckpt, cfg, lora="fuse").model
        experts = [n for n in view.specs() if ".mlp.experts." in n]
        assert len(experts) == 2 * 4 * 3  # 2 layers, 4 experts, gate / up / down
        for n in experts:
            view.read(n)
    finally:
        ckpt.close()
    assert calls and set(calls) == {1}, calls


@needs_conversions
def test_inspect_names_the_adapted_expert_parameters(hub_root):
    from hf_merge.describe import describe

    lora = describe(hub_root / "qwen3_moe_lora_experts")["lora"]
    assert lora["target_modules"] == ["q_proj"]
    assert lora["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert lora["r"] == 4 and lora["modules"] == 2 + 2 * 2  # q_proj and two expert wrappers per layer


@pytest.mark.compat
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_from_sharded_pretrained_gives_the_references_logits(hub_root, name):
    """The MoE checkpoint loads straight into the model (transformers 5: fused experts filled by
    the lazy loader; 4.x: one module per expert, through transformers' own loop)."""
    model = hf_merge.from_sharded_pretrained(hub_root / name, dtype="float32")
    ref = torch.load(hub_root / name / "reference" / "logits.pt", weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"]).logits.float()
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-6)


@needs_conversions
def test_from_sharded_pretrained_keeps_the_in_memory_layout(hub_root):
    """The loader fills the model's own (fused) parameters: no Hub layout on that path."""
    model = hf_merge.from_sharded_pretrained(hub_root / "qwen3_moe", dtype="float32")
    fused = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    ckpt = open_checkpoint(hub_root / "qwen3_moe")
    try:
        assert torch.equal(fused, ckpt.read("model.layers.0.mlp.experts.gate_up_proj"))
    finally:
        ckpt.close()


def test_dense_model_passes_through(qwen2_fp32_ws2):
    ckpt = open_checkpoint(qwen2_fp32_ws2.actor)
    try:
        _, cfg = checkpoint_config(ckpt.info)
        view, notes = hub_layout(ckpt, cfg)
        assert view is ckpt and notes == []
    finally:
        ckpt.close()


@needs_conversions
def test_unknown_operation_is_an_error_naming_it(hub_root, monkeypatch):
    import transformers.conversion_mapping as cm
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class ScaleByTwo(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            return {target_patterns[0]: next(iter(input_dict.values()))[0] * 2}

        @property
        def reverse_op(self):
            return ScaleByTwo()

    real = cm.get_checkpoint_conversion_mapping

    def patched(model_type):
        if model_type == "qwen3_moe":
            return [WeightConverter("mlp.gate.weight", "mlp.gate.weight", operations=[ScaleByTwo()])]
        return real(model_type)

    monkeypatch.setattr(cm, "get_checkpoint_conversion_mapping", patched)
    ckpt = open_checkpoint(hub_root / "qwen3_moe")
    try:
        _, cfg = checkpoint_config(ckpt.info)
        with pytest.raises(MappingError, match=r"Qwen3MoeForCausalLM.*ScaleByTwo"):
            hub_layout(ckpt, cfg)
    finally:
        ckpt.close()


def test_fixture_record(hub_root):
    info = json.loads((hub_root / "fixture.json").read_text())
    assert set(MODELS) - set(hub_root.unbuilt) <= set(info["models"])
    # null where the torch here cannot run an FSDP2 forward on CPU (torch 2.6: no check was made)
    expected = 0.0 if mk.FSDP2_CPU_FORWARD else None
    assert all(m["fsdp_forward_max_abs_diff"] == expected for m in info["models"].values())


@needs_conversions
@pytest.mark.parametrize(
    ("name", "family", "layout"),
    [("qwen3_moe", "MoE with 4 experts", "Qwen3MoeForCausalLM.save_pretrained layout: 45 tensors from 25"),
     ("qwen2_5_vl", "VLM", "Qwen2_5_VLForConditionalGeneration.save_pretrained layout: 57 tensors from 57"),
     ("gemma3", "VLM", "Gemma3ForConditionalGeneration.save_pretrained layout: 62 tensors from 62")],
)
def test_inspect_shows_family_and_output_layout(hub_root, name, family, layout):
    from hf_merge.describe import describe

    report = describe(hub_root / name)
    assert report["model_kind"] == family
    assert report["output_layout"].startswith(layout), report["output_layout"]


def test_inspect_dense(qwen2_fp32_ws2):
    from hf_merge.describe import describe

    report = describe(qwen2_fp32_ws2.actor)
    assert report["model_kind"] == "dense"
    assert report["output_layout"].startswith("as stored")


@needs_conversions
def test_plan_cache_first_run_then_cached_run_without_transformers(hub_root, tmp_path, monkeypatch):
    """The first merge computes the Hub layout and stores it; the next one of the same model uses
    the stored plan (transformers' reverse conversion is not called) and writes the same bytes.
    A damaged entry is a miss: recomputed, still correct."""
    import transformers.core_model_loading as cml

    from hf_merge.transforms import layout_cache

    monkeypatch.setenv("HF_MERGE_CACHE", str(tmp_path / "cache"))
    src = hub_root / "qwen3_moe"
    want = folder_tensors(src / "reference")
    hf_merge.merge(src, tmp_path / "first")
    assert_bytes_equal(folder_tensors(tmp_path / "first"), want)
    entries = list((tmp_path / "cache" / "hub_layout").glob("*.json"))
    assert len(entries) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("the cached plan should have been used")

    with monkeypatch.context() as m:
        m.setattr(cml, "revert_weight_conversion", refuse)
        hf_merge.merge(src, tmp_path / "cached")
    assert_bytes_equal(folder_tensors(tmp_path / "cached"), want)

    entries[0].write_text('{"architecture": "X", "outputs": [["a", [1], "float32", {"call": "exec", "args": []}]]}')
    hf_merge.merge(src, tmp_path / "recomputed")
    assert_bytes_equal(folder_tensors(tmp_path / "recomputed"), want)
    assert layout_cache.get("hub_layout", entries[0].stem)["architecture"] == "Qwen3MoeForCausalLM"  # rewritten


@needs_conversions
def test_plan_cache_dense_passthrough(qwen2_fp32_ws2, tmp_path, monkeypatch):
    """A dense model's plan is "as stored"; the cached run does not ask transformers' mapping."""
    import transformers.conversion_mapping as cm

    from hf_merge.transforms import layout_cache

    monkeypatch.setenv("HF_MERGE_CACHE", str(tmp_path / "cache"))
    hf_merge.merge(qwen2_fp32_ws2.actor, tmp_path / "first")
    (entry,) = (tmp_path / "cache" / "hub_layout").glob("*.json")
    assert layout_cache.get("hub_layout", entry.stem) == {"passthrough": True}

    def refuse(*args, **kwargs):
        raise AssertionError("the cached plan should have been used")

    monkeypatch.setattr(cm, "get_checkpoint_conversion_mapping", refuse)
    hf_merge.merge(qwen2_fp32_ws2.actor, tmp_path / "cached")
    assert_bytes_equal(folder_tensors(tmp_path / "cached"), folder_tensors(tmp_path / "first"))


def test_plan_cache_off(tmp_path, monkeypatch):
    from hf_merge.transforms import layout_cache

    monkeypatch.setenv("HF_MERGE_CACHE", "off")
    assert layout_cache.cache_dir() is None
    layout_cache.put("hub_layout", "k", {"passthrough": True})
    assert layout_cache.get("hub_layout", "k") is None


def _tied_pairs_cached(ckpt, tmp_path, monkeypatch):
    """Merge the tied model once with an empty plan cache: (its source, the cache entry, the tensors)."""
    from hf_merge.transforms import layout_cache

    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_MERGE_CACHE", str(cache))
    hf_merge.merge(ckpt.actor, tmp_path / "first")
    (entry,) = (cache / "tied").glob("*.json")
    assert layout_cache.get("tied", entry.stem) == {"lm_head.weight": "model.embed_tokens.weight"}
    want = folder_tensors(tmp_path / "first")
    assert "lm_head.weight" not in want  # the alias is dropped, as save_pretrained does
    return ckpt.actor, entry, want


def test_plan_cache_tied_pairs(llama_tied_bf16_ws4, tmp_path, monkeypatch):
    """Which weights a tied model ties is asked of transformers (its class, or its skeleton) once:
    the answer is cached with the Hub layout and a later merge writes the same bytes from it; a
    damaged entry is a miss."""
    from hf_merge.transforms import layout_cache

    src, entry, want = _tied_pairs_cached(llama_tied_bf16_ws4, tmp_path, monkeypatch)
    hf_merge.merge(src, tmp_path / "cached")
    assert_bytes_equal(folder_tensors(tmp_path / "cached"), want)
    entry.write_text('{"lm_head.weight": 3}')
    hf_merge.merge(src, tmp_path / "recomputed")
    assert_bytes_equal(folder_tensors(tmp_path / "recomputed"), want)
    assert layout_cache.get("tied", entry.stem) == {"lm_head.weight": "model.embed_tokens.weight"}  # rewritten


@pytest.mark.slow  # a fresh interpreter; make test keeps test_conversion_keys' (untied, first merge)
def test_plan_cache_tied_pairs_without_transformers(llama_tied_bf16_ws4, tmp_path, monkeypatch):
    """With the tied pairs cached, a merge of the model imports no transformers at all (checked in
    a fresh process) and writes the same bytes."""
    import subprocess
    import sys

    src, _, want = _tied_pairs_cached(llama_tied_bf16_ws4, tmp_path, monkeypatch)
    code = ("import sys, hf_merge; hf_merge.merge(sys.argv[1], sys.argv[2]); "
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'); assert not loaded, loaded[:5]")
    repo = str(Path(hf_merge.__file__).resolve().parents[1])
    subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "cached")], check=True,
                   env=dict(os.environ, PYTHONPATH=repo))
    assert_bytes_equal(folder_tensors(tmp_path / "cached"), want)


# --- the model zoo: each family's quirk, on the transformers stack the test runs under ---------


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits.float()


@pytest.mark.compat
@pytest.mark.parametrize("name", sorted(mh.ZOO))
def test_zoo_merge_is_save_pretrained_and_loads_alike(zoo_root, tmp_path, name):
    """Tied Qwen2 / Llama 3.2 (llama3 RoPE), Gemma 2 / 3 (scaled embedding, (1 + w) norms,
    soft-capping), Qwen3, Mistral, Phi-3 (fused qkv / gate_up), GPT-OSS (fused experts with biases,
    sinks), and LoRA on tied, fused-projection and MoE models: the merge writes what
    save_pretrained of the unsharded model writes (tensors byte for byte, config.json,
    generation_config.json; LoRA: merge_and_unload()'s, and PEFT's adapter), and both it and
    from_sharded_pretrained of the checkpoint give the model's logits."""
    src, target = zoo_root / name, tmp_path / name
    hf_merge.merge(src, target)
    reference = src / "reference"
    assert_bytes_equal(folder_tensors(target), folder_tensors(reference))
    for file in ("config.json", "generation_config.json"):
        assert read_json(target / file) == read_json(reference / file), file
    ref = torch.load(reference / "logits.pt", weights_only=True)
    torch.testing.assert_close(merged_logits(target, name, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-6)
    loaded = hf_merge.from_sharded_pretrained(src, dtype="float32")
    torch.testing.assert_close(_logits(loaded, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-6)
    if mh.ZOO[name][2]:
        assert_bytes_equal(folder_tensors(target / "lora_adapter"), folder_tensors(reference / "adapter"))


@pytest.mark.compat
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_zoo_16_bit_merge_keeps_what_from_pretrained_keeps_in_float32(zoo_root, tmp_path, dtype):
    """GPT-OSS names its norms in ``_keep_in_fp32_modules``, which transformers (4.57 and 5) applies
    to a float16 load only: ``merge --dtype D`` writes each tensor as ``save_pretrained`` of
    ``from_pretrained(reference, dtype=D)`` does (float16: the norms float32, exact; bfloat16: none)."""
    from transformers import AutoModelForCausalLM

    src, want_dtype = zoo_root / "gpt_oss", getattr(torch, dtype)
    hf_merge.merge(src, tmp_path / "out", dtype=dtype)
    AutoModelForCausalLM.from_pretrained(src / "reference", **dtype_kwargs(want_dtype)).save_pretrained(tmp_path / "resaved")
    ours, theirs, exact = folder_tensors(tmp_path / "out"), folder_tensors(tmp_path / "resaved"), folder_tensors(src / "reference")
    assert sorted(ours) == sorted(theirs)
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k], t), k
    kept = {k for k, t in theirs.items() if t.dtype == torch.float32}
    if dtype == "float16":
        assert kept and kept == {k for k in theirs if k.endswith("norm.weight")}
        assert all(torch.equal(ours[k], exact[k]) for k in kept)
    else:
        assert kept == set()


@pytest.mark.compat
@pytest.mark.parametrize("name", ["qwen2_tied_lora", "mixtral_lora", "qwen3_moe_v4_lora"])
def test_zoo_lora_adapter_loads_with_peft(zoo_root, tmp_path, name):
    """``--lora adapter`` of a tied and of a MoE model: PEFT loads it onto the base model, and
    ``from_sharded_pretrained(lora="adapter")`` gives the same PeftModel; logits equal the trained one's."""
    from peft import PeftModel

    src = zoo_root / name
    hf_merge.merge(src, tmp_path / "adapter", lora="adapter")
    ref = torch.load(src / "reference" / "logits.pt", weights_only=True)
    peft_model = PeftModel.from_pretrained(mh.build_model(name, lora=False), tmp_path / "adapter")
    torch.testing.assert_close(_logits(peft_model, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-5)
    loaded = hf_merge.from_sharded_pretrained(src, dtype="float32", lora="adapter")
    assert isinstance(loaded, PeftModel)
    torch.testing.assert_close(_logits(loaded, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-5)


@pytest.mark.compat
def test_peft_alpha_pattern_regex_from_the_adapter_config(zoo_root, tmp_path):
    """An adapter_config.json beside the weights (verl's lora_adapter/, PEFT's own save) names
    per-module alphas with PEFT's regular expressions (``.*\\.gate_up_proj`` under transformers 5):
    matched as PEFT matches them, the fused output is merge_and_unload()'s."""
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(zoo_root / "qwen3_moe_v4_lora", src)
    actor = src / "global_step_1" / "actor"
    (actor / "lora_train_meta.json").unlink()
    (actor / "lora_adapter").mkdir()
    shutil.copy(src / "reference" / "adapter" / "adapter_config.json", actor / "lora_adapter")
    result = hf_merge.merge(src, tmp_path / "fused", lora="fuse")
    assert any("from lora_adapter/adapter_config.json" in n for n in result.notes)
    assert_bytes_equal(folder_tensors(tmp_path / "fused"), folder_tensors(src / "reference"))


# A real verl FSDP2 checkpoint of a tiny Qwen3-MoE written under transformers 5.25 (its rank files
# hold the experts fused: ``mlp.experts.gate_up_proj [E, 2F, H]``), committed so that the
# transformers 4.57 pass can read what a newer training stack wrote (tests/data/transformers_5/SOURCE).
TF5_QWEN3_MOE = Path(__file__).parent / "data" / "transformers_5" / "qwen3_moe"
needs_4x = pytest.mark.skipif(has_weight_conversions(), reason="transformers 5 reads its own fused experts")


@pytest.mark.compat
@needs_conversions
def test_a_transformers_5_moe_checkpoint_merges_under_5(tmp_path):
    """The committed checkpoint is what the 4.x refusal below is about: transformers 5 merges it
    into per-expert tensors that give the logits its unsharded model gave."""
    hf_merge.merge(TF5_QWEN3_MOE, tmp_path / "out", verify=True)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in folder_tensors(tmp_path / "out")
    ref = torch.load(TF5_QWEN3_MOE / "reference" / "logits.pt", weights_only=True)
    torch.testing.assert_close(merged_logits(tmp_path / "out", "qwen3_moe", ref["input_ids"]), ref["logits"], rtol=0, atol=1e-6)


@pytest.mark.compat
@needs_4x
def test_transformers_4_refuses_the_fused_experts_of_a_transformers_5_checkpoint(tmp_path):
    """Under transformers 4.x a checkpoint trained under 5.x holds expert tensors the 4.x model does
    not have, and 4.x has no conversion to write them per expert. Written as they are, they were
    ignored by from_pretrained (a Mixtral loaded with its experts left random, logits off by 0.38):
    refused, naming them, before anything is written; the loader says the same."""
    from helpers import error_line, run_cli

    line = error_line(run_cli("merge", TF5_QWEN3_MOE, tmp_path / "out"))
    import transformers

    assert "model.layers.0.mlp.experts.gate_up_proj" in line and f"transformers {transformers.__version__}" in line, line
    assert "transformers>=5" in line, line
    assert not (tmp_path / "out").exists()
    with pytest.raises(MappingError, match=r"fused expert.*experts\.gate_up_proj.*transformers>=5"):
        hf_merge.from_sharded_pretrained(TF5_QWEN3_MOE, dtype="float32")


# Checkpoints written under transformers 5.25 whose config.json keeps RoPE in rope_parameters, a field
# transformers 4.x does not read: a Llama 3.2-style tied model (llama3 RoPE, rope_theta 500000; 4.57 builds it
# with rope_theta 10000 and no scaling, logits off by 0.014), and a Qwen2.5-VL whose multimodal RoPE
# (mrope_section) sits in text_config.rope_parameters (4.x reads it from rope_scaling only, and its first
# forward raised a TypeError). name -> (folder, the error 4.x gives, a word of the merge's warning)
TF5_ROPE = {
    "llama3_tied": (Path(__file__).parent / "data" / "transformers_5" / "llama3_tied",
                    r"rope_parameters.*rope_theta 500000.0.*10000.*transformers>=5", "llama3"),
    "qwen2_5_vl": (Path(__file__).parent / "data" / "transformers_5" / "qwen2_5_vl",
                   r"rope_parameters.*text_config\.mrope_section.*transformers>=5", "mrope_section"),
}


@pytest.mark.compat
@needs_conversions
@pytest.mark.parametrize("name", sorted(TF5_ROPE))
def test_a_transformers_5_rope_checkpoint_loads_under_5(name):
    folder = TF5_ROPE[name][0]
    model = hf_merge.from_sharded_pretrained(folder, dtype="float32")
    ref = torch.load(folder / "reference" / "logits.pt", weights_only=True)
    torch.testing.assert_close(_logits(model, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-6)


@pytest.mark.compat
@needs_4x
@pytest.mark.parametrize("name", sorted(TF5_ROPE))
def test_transformers_4_says_it_cannot_read_a_transformers_5_rope_config(tmp_path, name):
    """from_sharded_pretrained refuses, naming the field; the merge (bytes as transformers 5's
    save_pretrained writes them) warns that 4.x would not load the output as trained."""
    from helpers import run_cli

    folder, error, word = TF5_ROPE[name]
    with pytest.raises(UnsupportedCheckpointError, match=error):
        hf_merge.from_sharded_pretrained(folder, dtype="float32")
    r = run_cli("merge", folder, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    (warning,) = [ln for ln in r.stderr.splitlines() if "rope_parameters" in ln]
    assert warning.startswith("warning:") and word in warning and "transformers>=5" in warning, warning
