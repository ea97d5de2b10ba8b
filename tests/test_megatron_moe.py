"""Megatron-Core MoE and multi-latent attention: real megatron-core saves at EP=2 -> Hub layout.

The session fixture runs ``examples/make_megatron_moe_checkpoint.py`` once (2 gloo ranks on CPU,
expert parallelism 2): Qwen3-MoE-like (stacked ``[L, E, ...]`` experts, and the same with
``singleton_local_shards``; plus the legacy ``state_dict()`` of it), Qwen2-MoE-like (shared expert
and its gate), Mixtral-like and DeepSeek-V3-like (MLA, a dense first layer, shared expert, router bias). Each is
reloaded at EP=1 by Megatron and its logits recorded. The merged output must give the same logits
and be exactly what ``save_pretrained`` writes (names, shapes, dtypes, bytes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from hf_merge import transformers_compat as compat
from hf_merge.errors import MappingError
from hf_merge.readers.dcp import DcpCheckpoint
from hf_merge.readers.megatron import hf_names, open_megatron
from hf_merge.transforms import Renamed
from hf_merge.transforms.name_table import NameRule, NameTable, Split, find_table
from hf_merge.transformers_compat import dtype_kwargs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "tests"))
import make_megatron_moe_checkpoint as mk  # noqa: E402
from helpers import dcp_no_dist, folder_tensors  # noqa: E402

# variant -> folder under the fixture root
SOURCES = {
    "qwen3_moe": "qwen3_moe/actor",
    "qwen3_moe_singleton": "qwen3_moe_singleton/actor",
    "qwen3_moe_legacy": "qwen3_moe/legacy/actor",
    "qwen2_moe": "qwen2_moe/actor",
    "mixtral": "mixtral/actor",
    "deepseek_v3": "deepseek_v3/actor",
}


def _dcp_load(dist: Path, keys) -> dict[str, torch.Tensor]:
    """The named full tensors of a dist_ckpt, read by PyTorch DCP itself (the independent reader)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(dist)).read_metadata()
    state = {k: torch.empty(meta.state_dict_metadata[k].size, dtype=meta.state_dict_metadata[k].properties.dtype) for k in keys}
    dcp.load(state, storage_reader=FileSystemReader(str(dist)), **dcp_no_dist())
    return state


def _hf_model(config_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((config_dir / "config.json").read_text())
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", **dtype_kwargs(torch.float32)).eval()


@pytest.fixture(scope="module")
def merged(megatron_moe_root, tmp_path_factory):
    """Every variant merged with the CLI (in process)."""
    from hf_merge.cli.app import main

    out = {}
    base = tmp_path_factory.mktemp("moe_merged")
    for name, rel in SOURCES.items():
        target = base / name
        assert main(["-q", "merge", str(megatron_moe_root / rel), str(target), "--no-checksums"]) == 0
        out[name] = target
    return out


@pytest.fixture(scope="module")
def save_pretrained_layout(megatron_moe_root, tmp_path_factory):
    """{kind: {name: (shape, dtype)}} of save_pretrained of the HF model built from each config."""
    from safetensors import safe_open

    out = {}
    for kind in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"):
        d = tmp_path_factory.mktemp(f"sp_{kind}")
        _hf_model(megatron_moe_root / kind / "actor" / "model" / "huggingface").save_pretrained(d)
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            out[kind] = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    return out


@pytest.mark.parametrize("name", list(SOURCES))
def test_logits_equal_megatron(megatron_moe_root, merged, name):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged[name], attn_implementation="eager", **dtype_kwargs(torch.float32)).eval()
    ref = torch.load(megatron_moe_root / name.removesuffix("_legacy") / "reference.pt", weights_only=True)
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    assert logits.shape == ref["logits"].shape
    torch.testing.assert_close(logits, ref["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(SOURCES))
def test_output_is_save_pretrained_layout(merged, save_pretrained_layout, name):
    """Names, shapes and dtypes are exactly what save_pretrained writes for this architecture,
    and the bytes are what save_pretrained writes for the loaded model."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    kind = name.removesuffix("_legacy").removesuffix("_singleton")
    got = {}
    for path in sorted(merged[name].glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            got.update({k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()})
    want = save_pretrained_layout[kind]
    assert sorted(got) == sorted(want), (sorted(set(got) - set(want))[:5], sorted(set(want) - set(got))[:5])
    assert got == want
    expert = "block_sparse_moe.experts.3.w2" if kind == "mixtral" else "mlp.experts.3.down_proj"
    assert f"model.layers.1.{expert}.weight" in got

    resaved = merged[name].parent / f"{name}_resaved"
    AutoModelForCausalLM.from_pretrained(merged[name], **dtype_kwargs(torch.float32)).save_pretrained(resaved)
    ours, theirs = folder_tensors(merged[name]), folder_tensors(resaved)
    assert sorted(ours) == sorted(theirs)
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k], t), k


def test_experts_match_megatron_tensors_bit_for_bit(megatron_moe_root, merged):
    """Every expert of the stacked [L, E, 2F, H] / [L, E, H, F] tensors, read with PyTorch DCP,
    lands in its own per-expert tensor unchanged (gate rows first, then up rows)."""
    dist = megatron_moe_root / "qwen3_moe" / "actor" / "model" / "dist_ckpt"
    keys = {
        "fc1": "decoder.layers.mlp.experts.experts.linear_fc1.weight",
        "fc2": "decoder.layers.mlp.experts.experts.linear_fc2.weight",
        "router": "decoder.layers.mlp.router.weight",
        "norm": "decoder.layers.mlp.linear_fc1.layer_norm_weight",
    }
    state = _dcp_load(dist, keys.values())
    out = folder_tensors(merged["qwen3_moe"])
    fc1, fc2 = state[keys["fc1"]], state[keys["fc2"]]
    assert fc1.shape == (mk.LAYERS, mk.EXPERTS, 2 * mk.MOE_FFN, mk.HIDDEN)
    for layer in range(mk.LAYERS):
        p = f"model.layers.{layer}."
        assert torch.equal(out[p + "mlp.gate.weight"], state[keys["router"]][layer])
        assert torch.equal(out[p + "post_attention_layernorm.weight"], state[keys["norm"]][layer])
        for e in range(mk.EXPERTS):
            q = f"{p}mlp.experts.{e}."
            assert torch.equal(out[q + "gate_proj.weight"], fc1[layer, e, : mk.MOE_FFN])
            assert torch.equal(out[q + "up_proj.weight"], fc1[layer, e, mk.MOE_FFN :])
            assert torch.equal(out[q + "down_proj.weight"], fc2[layer, e])
    # the two EP ranks hold different experts: the experts really differ
    assert not torch.equal(out["model.layers.0.mlp.experts.0.gate_proj.weight"], out["model.layers.0.mlp.experts.2.gate_proj.weight"])


@pytest.mark.parametrize("other", ["qwen3_moe_singleton", "qwen3_moe_legacy"])
def test_other_spellings_give_identical_output(merged, other):
    """singleton_local_shards (`experts.{e}.linear_fc1.weight_w/_v`) and the legacy state_dict
    (`local_experts.{e}`) of the same weights merge to the same bytes as the stacked layout."""
    a, b = folder_tensors(merged["qwen3_moe"]), folder_tensors(merged[other])
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_mla_tensors_are_megatron_tensors(megatron_moe_root, merged):
    """DeepSeek-V3 MLA: 1:1 renames (kv_a keeps the RoPE rows after the compressed kv rows)."""
    dist = megatron_moe_root / "deepseek_v3" / "actor" / "model" / "dist_ckpt"
    pairs = {
        "decoder.layers.1.self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
        "decoder.layers.1.self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
        "decoder.layers.1.self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
        "decoder.layers.1.self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "decoder.layers.1.self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
        "decoder.layers.1.self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
        "decoder.layers.1.mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
    }
    state = _dcp_load(dist, pairs)
    out = folder_tensors(merged["deepseek_v3"])
    for src, hf in pairs.items():
        assert torch.equal(out[f"model.layers.1.{hf}"], state[src]), src
    assert out["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (mk.KV_LORA + mk.QK_ROPE, mk.HIDDEN)
    assert "model.layers.0.mlp.gate_proj.weight" in out and "model.layers.0.mlp.gate.weight" not in out


def test_inspect_says_moe(megatron_moe_root, capsys):
    from hf_merge.cli.app import main
    from hf_merge.describe import describe

    report = describe(megatron_moe_root / "deepseek_v3" / "actor")
    assert report["moe"].startswith("MoE with 4 experts (top-2) in 1 of 2 layers")
    assert "mlp.experts.{e}.gate_proj.weight" in report["moe"]
    assert report["family"] == "deepseek_v3" and report["ep"] == 2
    assert main(["inspect", str(megatron_moe_root / "qwen3_moe" / "actor")]) == 0
    assert "MoE with 4 experts (top-2) in 2 of 2 layers" in capsys.readouterr().out


def test_missing_expert_is_an_error_naming_it(megatron_moe_root):
    """A per-expert checkpoint lacking one expert is refused, naming the layer and expert."""
    ck = open_megatron(megatron_moe_root / "qwen3_moe_singleton" / "actor")
    dist = DcpCheckpoint(megatron_moe_root / "qwen3_moe_singleton" / "actor" / "model" / "dist_ckpt")
    lacking = Renamed(dist, {k: k for k in dist.specs() if k != "decoder.layers.1.mlp.experts.experts.3.linear_fc2.weight"})
    config = json.loads((ck.info.hf_dir / "config.json").read_text())
    table = find_table("megatron", config)
    with pytest.raises(MappingError, match=r"decoder\.layers\.1\.mlp\.experts\.experts\.\{expert\}\.linear_fc2\.weight lacks experts \[3\]"):
        hf_names(lacking, table, config, is_value_model=None, where="x")
    config["num_experts"] = 8  # the stacked layout checks the expert axis against the config
    stacked = DcpCheckpoint(megatron_moe_root / "qwen3_moe" / "actor" / "model" / "dist_ckpt")
    with pytest.raises(MappingError, match=r"leading stacked axes should be num_hidden_layers=2, num_experts=8"):
        hf_names(stacked, table, config, is_value_model=None, where="x")


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_from_sharded_pretrained_gives_megatrons_logits(megatron_moe_root, name):
    """Loading straight into a model (no merged folder) reads every expert too."""
    import hf_merge

    model = hf_merge.from_sharded_pretrained(megatron_moe_root / name / "actor", dtype="float32", attn_implementation="eager")
    ref = torch.load(megatron_moe_root / name / "reference.pt", weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(model(ref["input_ids"]).logits, ref["logits"], atol=1e-4, rtol=0)


@pytest.mark.skipif(not compat.has_weight_conversions(), reason="transformers 4.x keeps one module per expert")
@pytest.mark.parametrize("name", list(SOURCES))
def test_from_sharded_pretrained_fills_the_stacked_experts_itself(megatron_moe_root, merged, name, monkeypatch, tmp_path):
    """transformers 5 holds each layer's experts stacked ([E, 2F, H], [E, H, F]); the per-expert
    checkpoint tensors are read straight into their slices of those parameters, without
    transformers' weight loop (its many-to-one converters), and the model equals
    ``from_pretrained`` of the merge, tensor by tensor and in its logits; its ``save_pretrained``
    writes the merge's tensors (the conversions used are recorded on the model)."""
    import transformers.modeling_utils as mu
    from transformers import AutoModelForCausalLM

    import hf_merge

    ref = AutoModelForCausalLM.from_pretrained(merged[name], attn_implementation="eager", **dtype_kwargs(torch.float32)).eval()
    loops = []
    weight_loop = mu.convert_and_load_state_dict_in_model
    monkeypatch.setattr(mu, "convert_and_load_state_dict_in_model", lambda *a, **k: loops.append(1) or weight_loop(*a, **k))
    ours = hf_merge.from_sharded_pretrained(megatron_moe_root / SOURCES[name], dtype="float32", attn_implementation="eager")
    assert loops == []
    want, got = ref.state_dict(), ours.state_dict()
    assert sorted(got) == sorted(want)
    stacked = [k for k in got if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacked and all(got[k].dim() == 3 for k in stacked)
    for key, value in got.items():
        assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key
    ids = torch.arange(3, 11).unsqueeze(0) % ref.config.vocab_size
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, ref(input_ids=ids).logits)
    ours.save_pretrained(tmp_path / "resaved")
    a, b = folder_tensors(tmp_path / "resaved"), folder_tensors(merged[name])
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.skipif(not compat.has_weight_conversions(), reason="transformers 4.x keeps one module per expert")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stacked_experts_through_the_staging_ring(megatron_moe_root, merged, dtype, monkeypatch):
    """The accelerator branch of the stacked fill (each expert through a stager's ring of buffers
    into its slice), walked on the CPU with plain 1 KB buffers that split the experts' rows, as
    ``test_device_fill.py`` walks it for dense tensors; with a cast too."""
    from transformers import AutoModelForCausalLM

    import hf_merge
    import hf_merge.load.model as loader
    from hf_merge.load.device_fill import StagerPool

    monkeypatch.setattr(loader, "stages", lambda device: True)
    monkeypatch.setattr(loader, "StagerPool", lambda: StagerPool(slot_bytes=1024))
    ours = hf_merge.from_sharded_pretrained(megatron_moe_root / SOURCES["qwen2_moe"], dtype=dtype, disable_mmap=True)
    ref = AutoModelForCausalLM.from_pretrained(merged["qwen2_moe"], **dtype_kwargs(getattr(torch, dtype)))
    want = ref.state_dict()
    for key, value in ours.state_dict().items():
        assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key


@pytest.mark.skipif(not compat.has_weight_conversions(), reason="transformers 4.x keeps one module per expert")
def test_a_flipped_byte_in_an_expert_stops_the_stacked_load(megatron_moe_root, tmp_path, monkeypatch):
    """The experts read into their slices are CRC-checked like every tensor of the load: a flipped
    bit inside an expert's zip record raises before a model is returned."""
    import os
    import shutil

    import hf_merge
    from hf_merge.readers import record_crc

    src = tmp_path / "actor"
    shutil.copytree(megatron_moe_root / SOURCES["qwen3_moe"], src)
    seen = []
    real = record_crc.check_record
    monkeypatch.setattr(record_crc, "check_record", lambda fd, start, size, crc, where: (
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), start, size, where)), real(fd, start, size, crc, where))[1])
    hf_merge.from_sharded_pretrained(src, dtype="keep")
    path, start, size, where = next(item for item in seen if "linear_fc2" in item[3] and "experts" in item[3])
    raw = bytearray(Path(path).read_bytes())
    raw[start + size // 2] ^= 0x10
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(record_crc.SourceCrcError, match=Path(path).name):
        hf_merge.from_sharded_pretrained(src, dtype="keep")


@pytest.mark.compat
def test_config_written_by_save_pretrained_merges_the_same(megatron_moe_root, merged, tmp_path):
    """config.json as transformers' own ``save_pretrained`` writes it for Qwen3-MoE (transformers 5
    stores the expert count as ``num_local_experts``, its attribute_map's target; the Hub's and
    4.x configs say ``num_experts``): the merge reads the field either way, same bytes."""
    import transformers
    from hf_merge.cli.app import main

    hf = megatron_moe_root / "qwen3_moe" / "actor" / "model" / "huggingface"
    cfg = json.loads((hf / "config.json").read_text())
    transformers.AutoConfig.for_model(**cfg).save_pretrained(tmp_path / "config")
    written = json.loads((tmp_path / "config" / "config.json").read_text())
    assert written.get("num_local_experts", written.get("num_experts")) == mk.EXPERTS
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert "num_experts" not in written  # the rename this test is about
    target = tmp_path / "out"
    args = ["-q", "merge", str(megatron_moe_root / SOURCES["qwen3_moe"]), str(target), "--no-checksums",
            "--config", str(tmp_path / "config")]
    assert main(args) == 0
    a, b = folder_tensors(merged["qwen3_moe"]), folder_tensors(target)
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.compat
def test_bfloat16_merge_keeps_the_tensors_transformers_keeps_in_float32(megatron_moe_root, merged, tmp_path):
    """``merge --dtype bfloat16`` writes every tensor as ``save_pretrained`` of
    ``from_pretrained(float32 merge, dtype=bfloat16)`` does, dtype and bytes: transformers 5 keeps
    DeepSeek-V3's router ``gate.weight`` and ``e_score_correction_bias`` in float32
    (``_keep_in_fp32_modules_strict``), written exact from the float32 source; transformers 4.57 and
    4.51 declare nothing for DeepSeek-V3, so there every tensor is bfloat16. Loading the checkpoint
    with ``from_sharded_pretrained(dtype=bfloat16)`` gives that merge's logits."""
    from transformers import AutoModelForCausalLM

    import hf_merge
    from hf_merge.cli.app import main

    source, fp32 = megatron_moe_root / SOURCES["deepseek_v3"], merged["deepseek_v3"]
    assert main(["-q", "merge", str(source), str(tmp_path / "bf16"), "--dtype", "bfloat16", "--no-checksums"]) == 0
    AutoModelForCausalLM.from_pretrained(fp32, **dtype_kwargs(torch.bfloat16)).save_pretrained(tmp_path / "resaved")
    ours, theirs, exact = folder_tensors(tmp_path / "bf16"), folder_tensors(tmp_path / "resaved"), folder_tensors(fp32)
    assert sorted(ours) == sorted(theirs)
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k], t), k
    kept = {k for k, t in theirs.items() if t.dtype == torch.float32}
    router = {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
    assert kept == (router if compat.has_weight_conversions() else set())
    assert all(torch.equal(ours[k], exact[k]) for k in kept)

    ids = torch.arange(3, 11).unsqueeze(0)
    loaded = hf_merge.from_sharded_pretrained(source, dtype="bfloat16", attn_implementation="eager")
    written = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", attn_implementation="eager",
                                                   **dtype_kwargs(torch.bfloat16))
    assert {k for k, t in loaded.state_dict().items() if t.dtype == torch.float32} == kept
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, written(input_ids=ids).logits)


def test_the_tensors_kept_in_float32_come_from_the_plan_cache(megatron_moe_root, tmp_path, monkeypatch):
    """Which tensors the model keeps in float32 is asked of transformers (its model skeleton) once:
    a later merge of the same model takes the answer from the plan cache, builds no skeleton and
    writes the same bytes."""
    import hf_merge
    from hf_merge.transforms import keep_fp32, skeleton

    monkeypatch.setenv("HF_MERGE_CACHE", str(tmp_path / "cache"))
    source = megatron_moe_root / SOURCES["deepseek_v3"]
    hf_merge.merge(source, tmp_path / "first", dtype="bfloat16")
    want = folder_tensors(tmp_path / "first")
    assert any(t.dtype == torch.float32 for t in want.values()) == compat.has_weight_conversions()
    monkeypatch.setattr(skeleton, "_LAST", None)
    monkeypatch.setattr(skeleton, "_build", lambda *a: pytest.fail("the model skeleton was built again"))
    monkeypatch.setattr(keep_fp32, "_ask_transformers", lambda *a: pytest.fail("transformers was asked again"))
    hf_merge.merge(source, tmp_path / "cached", dtype="bfloat16")
    got = folder_tensors(tmp_path / "cached")
    assert sorted(got) == sorted(want) and all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in want.items())


@pytest.mark.compat
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_only_models_that_keep_tensors_in_float32_are_asked(megatron_moe_root, dtype):
    """Whether a 16-bit merge asks transformers which tensors the model keeps in float32 (and the
    head start declines) is read from transformers' source as text: it is so exactly for the classes
    that declare the list applying to that dtype (DeepSeek-V3 under transformers 5), so the other
    MoE models import nothing for it."""
    import transformers

    from hf_merge.transforms.keep_fp32 import may_declare

    for kind in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"):
        config = json.loads((megatron_moe_root / kind / "actor" / "model" / "huggingface" / "config.json").read_text())
        cls = getattr(transformers, config["architectures"][0])
        lists = [getattr(cls, "_keep_in_fp32_modules_strict", None)] + ([cls._keep_in_fp32_modules] if dtype == "float16" else [])
        assert may_declare(config, dtype) == any(lists), kind


def test_table_schema_checks_placeholders():
    """Placeholders are validated when a table is built; match reads them back."""
    table = find_table("megatron", {"model_type": "qwen3_moe"})
    rule, values = table.match("decoder.layers.5.mlp.experts.local_experts.12.linear_fc2.weight")
    assert rule.source == "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight"
    assert values == {"layer": "5", "expert": "12"}
    rule, values = table.match("decoder.layers.mlp.experts.linear_fc1.weight3")
    assert rule.source == "decoder.layers.mlp.experts.linear_fc1.weight{expert}" and rule.stacked == ("layer",)
    assert isinstance(rule.target, Split) and values == {"expert": "3"}
    assert table.match("decoder.layers.0.mlp.experts.linear_fc1.weightx") is None
    with pytest.raises(ValueError, match="lost"):  # the source names a placeholder, the target does not
        NameRule("mlp.experts.{expert}.w", "mlp.down_proj.weight")
    with pytest.raises(ValueError, match="needs a size"):  # every expert must be there: how many is a config key
        NameTable(table.name, table.source, table.model_types, table.rules, sizes={"layer": "num_hidden_layers"},
                  complete=("expert",))
