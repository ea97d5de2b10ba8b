"""Sharded outputs are the files ``save_pretrained`` of the trained model writes (docs/sharding.md).

The reference model is the fixture's ``reference/`` folder loaded with ``from_pretrained``, as a
trained model is, and saved with the same ``max_shard_size``. Every file is compared: the index
and every shard byte for byte (hf-merge's provenance is in ``hf_merge.json``, not in the weight files).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_merge
from hf_merge.options import MergeOptions
from hf_merge.sizes import parse_size
from hf_merge.write.save_order import natural_key
from hf_merge.write.shard_size import default_from_source, default_from_transformers_source, index_counts_parameters
from hf_merge.transformers_compat import dtype_kwargs

SMALL = "30KB"  # 4 to 16 files for the fixtures' tiny models (at 40KB Mixtral's experts fall in the same files grouped or not)


def comparable(path: Path) -> str:
    """sha256 of a file's bytes (safetensors included: header, metadata ``{"format": "pt"}`` and data)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def weight_files(folder: Path) -> dict[str, str]:
    return {p.name: comparable(p) for p in sorted(folder.iterdir()) if p.name.startswith("model") and "safetensors" in p.name}


def save_pretrained_of(reference: Path, target: Path, dtype=None, **save) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference, **dtype_kwargs(dtype or "auto"))
    model.save_pretrained(target, **save)


def case_source(name: str, request) -> tuple[Path, Path]:
    """(merge source, reference folder) of a fixture."""
    if name.startswith("hub:"):
        root = request.getfixturevalue("hub_root") / name[4:]
        return root, root / "reference"
    if name.startswith("dcp:"):
        root = request.getfixturevalue("dcp_root") / name[4:]
        return root / "ckpt", root / "reference"
    checkpoint = request.getfixturevalue("checkpoint")
    ck = checkpoint(name)
    return ck.actor, ck.root / "reference"


CASES = {  # id: (fixture, merge options)
    "qwen2_fp32": ("qwen2_fp32_ws2", {"dtype": "auto"}),
    "tied_bf16": ("llama_tied_bf16_ws4", {}),
    "bf16_cast": ("qwen2_fp32_ws2", {"dtype": "bfloat16"}),
    "lora_fused": ("lora_ckpt", {"lora": "fuse", "dtype": "auto"}),
    "moe_hub_layout": ("hub:qwen3_moe", {}),
    "moe_copied_halves": ("hub:mixtral", {}),  # w1 / w3: views of copies the reverse conversion makes
    "moe_persistent_buffer": ("hub:deepseek_v3", {}),
    "dcp": ("dcp:dcp_plain", {"dtype": "auto"}),
}


@pytest.mark.compat
@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_merge_equals_save_pretrained(case, request, tmp_path):
    fixture, options = CASES[case]
    source, reference = case_source(fixture, request)
    hf_merge.merge(source, tmp_path / "merged", max_shard_size=SMALL, **options)
    dtype = torch.bfloat16 if options.get("dtype") == "bfloat16" else None
    save_pretrained_of(reference, tmp_path / "saved", dtype=dtype, max_shard_size=SMALL)
    got, want = weight_files(tmp_path / "merged"), weight_files(tmp_path / "saved")
    assert len(want) >= 4 and "model.safetensors.index.json" in want  # 3+ shards and the index
    assert got == want
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    # transformers >= 4.57 counts the parameters in the index; 4.51 writes total_size alone
    assert list(index["metadata"]) == (["total_parameters", "total_size"] if index_counts_parameters() else ["total_size"])


@pytest.mark.compat
def test_default_shard_size_is_save_pretrained_default(qwen2_fp32_ws2, tmp_path):
    from transformers import PreTrainedModel

    default = inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    assert default_from_transformers_source() == default  # the torch-free read, from the source
    assert MergeOptions().shard_bytes() == parse_size(default)
    hf_merge.merge(qwen2_fp32_ws2.actor, tmp_path / "merged", dtype="auto")
    save_pretrained_of(qwen2_fp32_ws2.root / "reference", tmp_path / "saved")
    assert weight_files(tmp_path / "merged") == weight_files(tmp_path / "saved")


def test_cli_help_names_the_default(run_cli):
    proc = run_cli("merge", "--help")
    assert proc.returncode == 0
    assert f"save_pretrained default ({default_from_transformers_source()})" in " ".join(proc.stdout.split())


def test_default_read_from_a_signature():
    src = "x = 1\nclass PreTrainedModel(Base):\n    def save_pretrained(\n        self,\n        save_directory,\n" \
          "        max_shard_size: int | str = \"7GB\",\n        *,\n        token=None,\n    ) -> None:\n        pass\n"
    assert default_from_source(src) == "7GB"
    assert default_from_source(src.replace('"7GB"', "2 ** 30")) is None  # not a literal: import and ask
    assert default_from_source(src.replace("max_shard_size", "shard_size")) is None
    kw_only = src.replace("        *,\n", "").replace("        save_directory,\n", "        save_directory,\n        *,\n")
    assert default_from_source(kw_only) == "7GB"
    assert default_from_source("class Other:\n    def save_pretrained(self, max_shard_size='1GB'): pass\n") is None


def test_natural_key_is_transformers_own():
    core = pytest.importorskip("transformers.core_model_loading")
    names = ["model.layers.10.mlp.weight", "model.layers.2.mlp.weight", "model.layers.2.input_layernorm.weight",
             "lm_head.weight", "model.norm.weight", "a.shard_11.w", "a.shard_2.w", "a.b2", "a.b", "x.0.y", "x.y"]
    assert sorted(names, key=natural_key) == sorted(names, key=core.dot_natural_key)


@pytest.mark.compat
@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_quantized_index_counts_parameters_as_transformers(mode, qwen2_fp32_ws2, tmp_path):
    """A bitsandbytes 4-bit weight counts twice its packed bytes, its quantization state nothing."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    hf_merge.merge(qwen2_fp32_ws2.actor, tmp_path / "plain")
    hf_merge.merge(qwen2_fp32_ws2.actor, tmp_path / mode, quantize=mode, max_shard_size=SMALL)
    config = (BitsAndBytesConfig(load_in_8bit=True) if mode == "int8" else
              BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", quantization_config=config)
    model.save_pretrained(tmp_path / "saved", max_shard_size=SMALL)
    ours = json.loads((tmp_path / mode / "model.safetensors.index.json").read_text())["metadata"]
    theirs = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())["metadata"]
    assert ours == theirs and ours["total_parameters"] == model.num_parameters()


def test_tensors_in_a_file_are_in_safetensors_order(tmp_path):
    """Same-size dtypes side by side (bf16 / f16 / i16, f32 / i32, i64 / f64, i8 / u8 / bool) are
    laid out as safetensors' save_file lays them out, byte for byte."""
    from safetensors.torch import save_file

    from hf_merge.checkpoint import LazyCheckpoint
    from hf_merge.spec import TensorSpec
    from hf_merge.write.plan import SAFETENSORS_DTYPE_ORDER, plan_shards
    from hf_merge.write.shards import write_shards

    dtypes = [torch.float16, torch.bfloat16, torch.int16, torch.float32, torch.int32, torch.float64, torch.int64,
              torch.uint8, torch.int8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
    values = {f"{chr(97 + i)}.weight": torch.arange(6).to(dt) for i, dt in enumerate(dtypes)}
    assert len({str(v.dtype) for v in values.values()}) == len(SAFETENSORS_DTYPE_ORDER)

    class InMemory(LazyCheckpoint):
        def specs(self):
            return {n: TensorSpec(n, tuple(v.shape), v.dtype) for n, v in values.items()}

        def read_into(self, name, out):
            out.copy_(values[name])

    plan = plan_shards(InMemory().specs(), max_shard_size=10**9)
    write_shards(InMemory(), plan, tmp_path)
    save_file(values, tmp_path / "saved.safetensors", metadata={"format": "pt"})
    assert comparable(tmp_path / "model.safetensors") == comparable(tmp_path / "saved.safetensors")


def merge_in_fresh_processes(source: Path, tmp_path: Path, options: str) -> list[str]:
    """Two merges, each in a new interpreter, sharing a plan cache: the transformers modules each imported."""
    code = ("import sys, hf_merge; hf_merge.merge(sys.argv[1], sys.argv[2], max_shard_size='" + SMALL + "'" + options + "); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')[:3])")
    env = dict(os.environ, PYTHONPATH=str(Path(hf_merge.__file__).resolve().parents[1]), HF_MERGE_CACHE=str(tmp_path / "cache"))
    return [subprocess.run([sys.executable, "-c", code, str(source), str(tmp_path / out)], env=env, check=True,
                           capture_output=True, text=True).stdout.strip() for out in ("first", "second")]


@pytest.mark.compat
def test_a_second_sharded_merge_imports_no_transformers(qwen2_fp32_ws2, tmp_path):
    """What the meta skeleton says (state_dict order, persistent buffers) is kept in the plan cache:
    the next sharded merge of a dense model asks transformers nothing, and writes the same files."""
    loaded = merge_in_fresh_processes(qwen2_fp32_ws2.actor, tmp_path, ", dtype='auto'")
    assert loaded[0] != "[]" and loaded[1] == "[]"  # the first built the skeleton, the second read the cache
    assert list((tmp_path / "cache" / "saved_state").glob("*.json"))
    assert weight_files(tmp_path / "first") == weight_files(tmp_path / "second")


def test_a_stored_hub_layout_keeps_the_shared_storages(hub_root, tmp_path):
    """The plan cache stores which experts view one storage (a stored recipe no longer shows it):
    the merge from a stored plan cuts the files as save_pretrained does, as the first merge did."""
    merge_in_fresh_processes(hub_root / "mixtral", tmp_path, "")
    assert list((tmp_path / "cache" / "hub_layout").glob("*.json"))
    save_pretrained_of(hub_root / "mixtral" / "reference", tmp_path / "saved", max_shard_size=SMALL)
    assert weight_files(tmp_path / "first") == weight_files(tmp_path / "second") == weight_files(tmp_path / "saved")


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_megatron_moe_experts_share_their_fused_storage(name, megatron_moe_root, tmp_path):
    """A source already in the saved layout (Megatron's per-expert names): the storages the experts
    view in save_pretrained's state dict come from the model's own reverse conversion (meta skeleton).
    The reference is the single-file merge loaded with from_pretrained and saved sharded."""
    source = megatron_moe_root / name / "actor"
    hf_merge.merge(source, tmp_path / "single", dtype="auto")
    hf_merge.merge(source, tmp_path / "merged", dtype="auto", max_shard_size=SMALL)
    save_pretrained_of(tmp_path / "single", tmp_path / "saved", max_shard_size=SMALL)
    got, want = weight_files(tmp_path / "merged"), weight_files(tmp_path / "saved")
    assert len(want) >= 4 and got == want
