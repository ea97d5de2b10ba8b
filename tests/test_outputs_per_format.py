"""Every output from every source format: GGUF, bitsandbytes and a torchrun merge of each format's
real checkpoint equal the same output made from its merged Hugging Face folder (or, for torchrun,
the one-process merge).

The outputs are written by one pipeline over a format's model view, so the reference is the route
every other test pins down: the format's safetensors merge (``test_load_formats``: equal to the
trained weights and logits), then GGUF / bitsandbytes of that folder (``test_gguf``,
``test_quantize``: equal to llama.cpp's reference quantization and to transformers' own).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from hf_merge import merge
from test_load_formats import SOURCES, _Fixtures

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FORMATS = sorted(f for f in SOURCES if f != "fsdp")  # verl FSDP: test_gguf, test_quantize, test_distributed


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """A 64-token byte-level BPE tokenizer trained here by the tokenizers package, saved by transformers:
    smaller than every fixture's vocabulary (GGUF needs a tokenizer; the fixtures' configs have none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    lines = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny tokenizer"]
    tokenizer.train_from_iterator(lines * 10, trainers.BpeTrainer(vocab_size=64, special_tokens=["<|endoftext|>"], show_progress=False))
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


@pytest.fixture
def routes(request, tiny_tokenizer, tmp_path):
    """``(source, config, merged)``: a format's checkpoint, a config folder with a tokenizer and the
    float32 merge of it, tokenizer included."""

    def make(fmt: str) -> tuple[Path, Path, Path]:
        source, config = SOURCES[fmt](_Fixtures(request))
        merged = tmp_path / "merged"
        merge(source, merged, config=config, dtype="float32")
        cfg = tmp_path / "config"
        cfg.mkdir()
        for name in ("config.json", "generation_config.json"):
            shutil.copy2(merged / name, cfg / name)
        for path in tiny_tokenizer.glob("tokenizer*"):  # into both: what a merge with cfg would copy
            shutil.copy2(path, cfg / path.name)
            shutil.copy2(path, merged / path.name)
        return source, cfg, merged

    return make


def _gguf(folder: Path):
    import gguf

    (path,) = folder.glob("*.gguf")
    return gguf.GGUFReader(path)


def _gguf_contents(folder: Path) -> tuple[dict, dict]:
    """Metadata (but the folder-derived ``general.name``) and tensors by name: type, shape, bytes."""
    reader = _gguf(folder)
    fields = {k: [bytes(p) for p in f.parts] for k, f in reader.fields.items() if k != "general.name"}
    tensors = {t.name: (int(t.tensor_type), [int(n) for n in t.shape], bytes(t.data)) for t in reader.tensors}
    return fields, tensors


@pytest.mark.compat  # GGUF from every format under transformers 4.x too (there: no torchtitan, the DCP family skips)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gguf_of_every_format_equals_gguf_of_its_merge(fmt, routes, tmp_path):
    pytest.importorskip("gguf", reason="GGUF output needs pip install 'hf-merge[gguf]'")
    source, cfg, merged = routes(fmt)
    merge(source, tmp_path / "direct", config=cfg, gguf="q8_0", gguf_pre_tokenizer="gpt-2")
    merge(merged, tmp_path / "via-hf", backend="hf", gguf="q8_0", gguf_pre_tokenizer="gpt-2")
    direct, via_hf = _gguf_contents(tmp_path / "direct"), _gguf_contents(tmp_path / "via-hf")
    assert direct[0] == via_hf[0]
    assert sorted(direct[1]) == sorted(via_hf[1])
    for name, (kind, shape, data) in via_hf[1].items():
        assert direct[1][name] == (kind, shape, data), name
    if any(len(shape) == 2 and shape[0] % 32 == 0 for _, shape, _ in direct[1].values()):  # rows of whole Q8_0 blocks
        assert any(kind == 8 for kind, _, _ in direct[1].values())  # GGML_TYPE_Q8_0: really quantized


# bitsandbytes' CPU 4-bit kernel needs in / out features divisible by 64 / 32: these fixtures have no such layer
NO_4BIT = {"colossalai-dist-tp2", "colossalai-hybrid-tp2-pp2", "deepspeed-universal", "deepspeed-zero2-trainer", "deepspeed-zero3"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_bitsandbytes_of_every_format_equals_quantizing_its_merge(fmt, routes, tmp_path):
    pytest.importorskip("bitsandbytes", reason="needs pip install bitsandbytes")
    mode = "int8" if fmt in NO_4BIT else "nf4"
    source, cfg, merged = routes(fmt)
    merge(source, tmp_path / "direct", config=cfg, quantize=mode)
    merge(merged, tmp_path / "via-hf", backend="hf", quantize=mode)
    weights = sorted(p.name for p in (tmp_path / "via-hf").glob("*.safetensors"))
    assert weights and sorted(p.name for p in (tmp_path / "direct").glob("*.safetensors")) == weights
    for name in weights + ["config.json"]:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "via-hf" / name).read_bytes(), name
    with safe_open(tmp_path / "direct" / weights[0], "pt") as f:  # really quantized: packed / int8 weights
        assert any(f.get_slice(k).get_dtype() in ("U8", "I8") for k in f.keys())
    assert json.loads((tmp_path / "direct" / "config.json").read_text())["quantization_config"]["load_in_4bit"] == (mode == "nf4")


@pytest.mark.slow  # one torchrun job: a launcher and 2 ranks, each importing torch
def test_torchrun_merge_of_every_format_equals_one_process(request, tmp_path):
    """One `torchrun --nproc-per-node 2` job merges every format (and a Hugging Face folder) with
    `--dist-writers rank`, each rank writing its share of the files: byte-identical to the
    one-process merge of the same source, the generation_config.json derived where the source has
    none included."""
    from test_distributed import _run_jobs, assert_same_folder

    sources = {fmt: SOURCES[fmt](_Fixtures(request)) for fmt in FORMATS}
    sources["hf"] = (tmp_path / "single" / "dcp", None)  # the DCP merge, written first below
    jobs, singles = [], {}
    for fmt, (source, config) in sources.items():
        single = tmp_path / "single" / fmt
        result = merge(source, tmp_path / "probe" / fmt, config=config)  # the model's size, to cut it in >= 3 files
        shard = str(max(1024, result.total_bytes // 4))
        merge(source, single, config=config, max_shard_size=shard)
        singles[fmt] = single
        argv = ["merge", str(source), str(tmp_path / "dist" / fmt), "--max-shard-size", shard, "--dist-writers", "rank"]
        jobs.append({"argv": argv + (["--config", str(config)] if config else [])})
    outcome = _run_jobs(jobs, tmp_path, ranks=2)
    for i, fmt in enumerate(sources):
        assert [outcome[i, r]["code"] for r in range(2)] == [0, 0], (fmt, outcome[i, 0], outcome[i, 1])
        assert_same_folder(tmp_path / "dist" / fmt, singles[fmt])
        shared = json.loads((tmp_path / "dist" / fmt / "hf_merge.json").read_text())["distributed"]
        assert shared["writers"] == "rank" and all(n > 0 for n in shared["files_per_rank"]), (fmt, shared)
    derived = [fmt for fmt in sources if json.loads((singles[fmt] / "hf_merge.json").read_text()).get("derived_files")]
    assert "accelerate" in derived, derived  # its config folder has no generation_config.json
