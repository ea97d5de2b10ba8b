"""``from_sharded_pretrained``: REAL FSDP2 checkpoints loaded straight into transformers models.

Every expectation is checked against what transformers itself gives for the unsharded model
(the fixture's ``reference/`` folder, saved before sharding, and its ``logits.pt``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hf_merge
import hf_merge.load.auto
from hf_merge.errors import HfMergeError, LoraError, MappingError, MissingConfigError, SourceNotFoundError
from hf_merge.load.model import from_sharded_pretrained, load_tokenizer
from hf_merge.transformers_compat import dtype_kwargs

REPO = Path(__file__).resolve().parents[1]

from transformers import (  # noqa: E402  (`import hf_merge` patched the Auto classes when these load)
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen2Model,
)

from test_hub import hub, inproc  # noqa: E402,F401 - the Hub stand-in fixtures


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _no_meta(model):
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]


@pytest.fixture(scope="module")
def ref(qwen2_fp32_ws2):
    """The unsharded fp32 reference model, as from_pretrained loads it."""
    return AutoModelForCausalLM.from_pretrained(qwen2_fp32_ws2.reference, **dtype_kwargs(torch.float32))


@pytest.fixture(scope="module")
def loaded(qwen2_fp32_ws2):
    return AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor, dtype="float32")


# ---------------------------------------------------------------------------------------------
# the Auto classes
# ---------------------------------------------------------------------------------------------


def test_every_auto_model_class_gets_the_classmethod():
    classes = hf_merge.load.auto.auto_model_classes()
    names = {c.__name__ for c in classes}
    assert {"AutoModel", "AutoModelForCausalLM", "AutoModelForTokenClassification", "AutoModelForImageTextToText"} <= names
    assert len(classes) > 30  # enumerated from transformers, not a hand-made list
    for cls in classes:
        assert isinstance(cls.__dict__.get("from_sharded_pretrained"), classmethod), cls.__name__
    assert hf_merge.load.auto.patch_auto_classes() == []  # idempotent: nothing left to patch
    hf_merge.load.auto.install()
    assert hf_merge.load.auto.patch_auto_classes() == []


def test_patch_applies_when_transformers_auto_loads_later():
    """install() before the Auto module is imported costs nothing and patches it on import."""
    code = textwrap.dedent(
        """
        import sys
        import hf_merge.load.auto as auto
        auto.install(); auto.install()
        assert auto.AUTO_MODULE not in sys.modules, "install imported transformers' Auto module"
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
        assert auto.is_patched()
        assert AutoModelForImageTextToText.from_sharded_pretrained.__self__ is AutoModelForImageTextToText
        assert sum(m is auto._hook for m in sys.meta_path) == 0
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


@pytest.mark.slow  # a fresh interpreter; make test keeps test_patch_applies_when_transformers_auto_loads_later
def test_import_hf_merge_patches_auto_classes():
    code = "import hf_merge\nfrom transformers import AutoModel\nassert callable(AutoModel.from_sharded_pretrained)\n"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# values: equal to the unsharded model
# ---------------------------------------------------------------------------------------------


@pytest.mark.compat
def test_fp32_logits_equal_the_unsharded_model_exactly(qwen2_fp32_ws2, loaded):
    ref = torch.load(qwen2_fp32_ws2.logits)
    assert type(loaded) is Qwen2ForCausalLM
    assert not loaded.training
    assert loaded.dtype == torch.float32
    assert _no_meta(loaded) == []
    assert torch.equal(_logits(loaded, ref["input_ids"]), ref["logits"])


@pytest.mark.compat
def test_every_tensor_equals_from_pretrained(ref, loaded):
    ours = dict(loaded.named_parameters()) | dict(loaded.named_buffers())
    theirs = dict(ref.named_parameters()) | dict(ref.named_buffers())
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name
    # non-persistent buffers (rotary inv_freq) come from the model's own init, as in from_pretrained
    assert "model.rotary_emb.inv_freq" in ours and "model.rotary_emb.inv_freq" not in loaded.state_dict()
    assert all(p.requires_grad for p in loaded.parameters())


def test_each_tensor_is_read_once_straight_into_the_model(qwen2_fp32_ws2, monkeypatch):
    """No state dict, no second copy: every parameter IS the buffer read_into filled, in its
    final dtype; the from_pretrained fallback is not used for a plain load."""
    import hf_merge.load.model as loader
    from hf_merge.checkpoint import LazyCheckpoint

    calls = []

    class Recorder(LazyCheckpoint):
        def __init__(self, base):
            self.base, self.info = base, base.info

        def specs(self):
            return self.base.specs()

        def read_into(self, name, out):
            calls.append((name, out.dtype, out.data_ptr()))
            self.base.read_into(name, out)

    real_view = loader.model_view
    monkeypatch.setattr(loader, "model_view", lambda *a, **k: (lambda v, d, n: (Recorder(v), d, n))(*real_view(*a, **k)))
    monkeypatch.setattr(loader, "_load_with_transformers", lambda *a, **k: pytest.fail("took the fallback path"))
    model = AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor)  # bf16 from fp32 shards
    names = [c[0] for c in calls]
    assert len(names) == len(set(names)) == len(model.state_dict())
    filled = {ptr: dtype for _, dtype, ptr in calls}
    for name, tensor in model.state_dict().items():
        assert filled.get(tensor.data_ptr()) == tensor.dtype == torch.bfloat16, name


def _mapped_files(tensor) -> set[str]:
    """The files whose pages back ``tensor``'s bytes (from /proc/self/maps)."""
    lo, hi = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start < hi and lo < end and len(parts) == 6:
            found.add(parts[5])
    return found


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="mapping rank files needs Linux")
@pytest.mark.parametrize("min_pages", [None, 1])
def test_weights_are_the_rank_files_pages_not_copies(qwen2_vocab2k_ws2, min_pages, monkeypatch, tmp_path):
    """A sharded tensor in its stored dtype is mapped from the rank files (copy-on-write pages of
    the page cache, as from_pretrained maps a safetensors file), not copied: every weight equals
    the unsharded model's, the logits are exact, writing a weight leaves the rank file alone, and
    the mappings go with the model. The fixture's embeddings and head are 512 KB (rank pieces of
    whole pages); with the size threshold lowered to one page, the small tensors go through the
    mapper too, and the partial pages and pieces whose file offset does not line up are read."""
    import gc

    import hf_merge.load.page_mapper

    ck = qwen2_vocab2k_ws2
    if min_pages is not None:
        monkeypatch.setattr(hf_merge.load.page_mapper, "MIN_MAPPED_PAGES", min_pages)
    mappers = []
    real_init = hf_merge.load.page_mapper.Mapper.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        mappers.append(self)

    monkeypatch.setattr(hf_merge.load.page_mapper.Mapper, "__init__", init)
    before = [f.read_bytes() for f in ck.rank_files]
    model = AutoModelForCausalLM.from_sharded_pretrained(ck.actor, dtype="keep")  # fp32, as trained
    assert mappers and mappers[0].mapped_bytes > 0
    assert 0 < mappers[0].read_bytes < mappers[0].mapped_bytes  # the partial pages at the pieces' ends are read
    ref = AutoModelForCausalLM.from_pretrained(ck.reference, **dtype_kwargs("auto"))
    ours, theirs = model.state_dict(), ref.state_dict()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    logits = torch.load(ck.logits)
    assert torch.equal(_logits(model, logits["input_ids"]), logits["logits"])
    saved = tmp_path / "saved"
    model.save_pretrained(saved)  # safetensors reads the mapped pages like any tensor
    again = AutoModelForCausalLM.from_pretrained(saved, **dtype_kwargs("auto")).state_dict()
    assert all(torch.equal(again[n], t) for n, t in theirs.items())
    rank_files = {str(f.resolve()) for f in ck.rank_files}
    backed = [n for n, t in ours.items() if _mapped_files(t) & rank_files]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(backed)
    weight = dict(model.named_parameters())[backed[0]]
    with torch.no_grad():
        weight.add_(1)
    assert not torch.equal(weight, theirs[backed[0]])
    assert [f.read_bytes() for f in ck.rank_files] == before  # private: the files are untouched
    del model, ours, weight, again
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert not any(f in maps for f in rank_files), "a rank file is still mapped after the model was freed"


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="mapping rank files needs Linux")
def test_a_piece_the_kernel_refuses_to_map_is_read(qwen2_vocab2k_ws2, monkeypatch):
    """mmap of a rank file failing (ENOMEM: the process's mapping limit) leaves those pages
    anonymous and reads them: same weights, none backed by the file."""
    import errno

    import hf_merge.load.page_mapper

    real = hf_merge.load.page_mapper._mmap

    def refuse_files(addr, length, flags, fd=-1, offset=0):
        if fd != -1:
            raise OSError(errno.ENOMEM, "refused by the test")
        return real(addr, length, flags, fd, offset)

    monkeypatch.setattr(hf_merge.load.page_mapper, "_mmap", refuse_files)
    ck = qwen2_vocab2k_ws2
    ours = AutoModelForCausalLM.from_sharded_pretrained(ck.actor, dtype="keep").state_dict()
    rank_files = {str(f.resolve()) for f in ck.rank_files}
    assert not [n for n, t in ours.items() if _mapped_files(t) & rank_files]
    theirs = AutoModelForCausalLM.from_pretrained(ck.reference, **dtype_kwargs("auto")).state_dict()
    assert all(ours[n].dtype == t.dtype and torch.equal(ours[n], t) for n, t in theirs.items())


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) whole pages of ``t``'s memory, from mincore(2)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    lo = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    n = (t.data_ptr() + t.numel() * t.element_size() - lo) // mmap.PAGESIZE
    flags = ctypes.create_string_buffer(n)
    assert libc.mincore(lo, n * mmap.PAGESIZE, flags) == 0, ctypes.get_errno()
    return sum(b & 1 for b in flags.raw), n


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="MADV_POPULATE_WRITE is Linux's")
def test_buffers_read_into_have_their_pages_before_the_read(monkeypatch):
    """A tensor the load reads into (a TP column piece per row) is allocated with its pages faulted
    in, in chunks of at most POPULATE_CHUNK (each call holds the process's mmap lock)."""
    import hf_merge.load.page_mapper as page_mapper

    calls = []
    real = page_mapper._LIBC.madvise

    class Libc:
        def __getattr__(self, name):
            return getattr(page_mapper._LIBC, name)

        def madvise(self, addr, length, advice):
            calls.append(length)
            return real(addr, length, advice)

    monkeypatch.setattr(page_mapper, "_LIBC", Libc())
    plain = torch.empty((64 << 20) // 2, dtype=torch.bfloat16)  # above glibc's mmap threshold: fresh pages
    resident, total = _resident_pages(plain)
    assert resident < total // 2
    out = page_mapper.empty(((64 << 20) // 4096, 2048), torch.bfloat16)
    assert out.shape == ((64 << 20) // 4096, 2048) and out.dtype == torch.bfloat16
    if not page_mapper._populates:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert _resident_pages(out)[0] == _resident_pages(out)[1]
    assert calls and max(calls) <= page_mapper.POPULATE_CHUNK and sum(calls) >= (64 << 20) - 4096


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="mapping rank files needs Linux")
@pytest.mark.parametrize("kwargs", [dict(dtype="keep", disable_mmap=True), dict(dtype="bfloat16")])
def test_weights_read_into_own_memory_when_disabled_or_cast(qwen2_vocab2k_ws2, kwargs):
    """``disable_mmap=True`` (from_pretrained's flag), and a load that casts (fp32 shards as bf16),
    read every weight into the process's own memory: none is backed by a rank file."""
    ck = qwen2_vocab2k_ws2
    model = AutoModelForCausalLM.from_sharded_pretrained(ck.actor, **kwargs)
    rank_files = {str(f.resolve()) for f in ck.rank_files}
    ours = model.state_dict()
    assert not [n for n, t in ours.items() if _mapped_files(t) & rank_files]
    dtype = "auto" if kwargs["dtype"] == "keep" else kwargs["dtype"]
    theirs = AutoModelForCausalLM.from_pretrained(ck.reference, **dtype_kwargs(dtype)).state_dict()
    assert all(ours[n].dtype == t.dtype and torch.equal(ours[n], t) for n, t in theirs.items())


@pytest.mark.compat
def test_default_dtype_is_the_configs_and_bf16_equals_the_reference_cast(qwen2_fp32_ws2):
    assert json.loads((qwen2_fp32_ws2.hf_dir / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor)  # dtype: the config's
    assert model.dtype == torch.bfloat16 and model.config.dtype == torch.bfloat16
    ref = AutoModelForCausalLM.from_pretrained(qwen2_fp32_ws2.reference, **dtype_kwargs(torch.bfloat16))
    ids = torch.load(qwen2_fp32_ws2.logits)["input_ids"]
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    auto = from_sharded_pretrained(qwen2_fp32_ws2.actor, dtype="auto")  # from_pretrained's "auto": the config's
    assert auto.dtype == torch.bfloat16
    keep = from_sharded_pretrained(qwen2_fp32_ws2.actor, dtype="keep")  # the training dtype
    assert keep.dtype == torch.float32 and keep.config.dtype == torch.float32


@pytest.mark.compat
def test_auto_model_builds_the_base_model(qwen2_fp32_ws2):
    model = AutoModel.from_sharded_pretrained(qwen2_fp32_ws2.actor, dtype=torch.float32)
    assert type(model) is Qwen2Model  # the `model.` prefix stripped, lm_head skipped
    ref = AutoModel.from_pretrained(qwen2_fp32_ws2.reference, **dtype_kwargs(torch.float32))
    ids = torch.load(qwen2_fp32_ws2.logits)["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state)


@pytest.mark.compat
def test_default_class_is_the_configs_architecture(qwen2_fp32_ws2):
    model = hf_merge.load.model.from_sharded_pretrained(qwen2_fp32_ws2.actor, dtype="float32")
    assert type(model) is Qwen2ForCausalLM
    assert type(from_sharded_pretrained(qwen2_fp32_ws2.actor, auto_class="AutoModel")) is Qwen2Model


@pytest.mark.compat
@pytest.mark.parametrize("device_map", ["cpu", "auto", {"": "cpu"}, "dict"])
def test_device_map(qwen2_fp32_ws2, device_map):
    if device_map == "dict":
        device_map = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu",
                      "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor, dtype="float32", device_map=device_map)
    ref = torch.load(qwen2_fp32_ws2.logits)
    assert _no_meta(model) == []
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert torch.equal(_logits(model, ref["input_ids"]), ref["logits"])


def test_device_map_with_disk_offload(qwen2_fp32_ws2, tmp_path):
    """'disk' in the map: transformers' own loop (offloading is its business), still lazily fed."""
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_sharded_pretrained(
        qwen2_fp32_ws2.actor, dtype="float32", device_map=device_map, offload_folder=tmp_path
    )
    ref = torch.load(qwen2_fp32_ws2.logits)
    assert any(p.name.startswith("model.layers.1.") for p in tmp_path.iterdir())
    assert torch.equal(_logits(model, ref["input_ids"]), ref["logits"])


def test_meta_in_the_device_map_is_refused_in_words(qwen2_fp32_ws2):
    """Before: "model.layers.1.self_attn.q_proj.weight, ... were not filled by the checkpoint nor by the
    model's initialisation". from_pretrained refuses the device too ("Unsupported device type 'meta'")."""
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "meta",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    with pytest.raises(MappingError, match=r"device_map sends model\.layers\.1 to 'meta', which holds no weights; "
                                           r"use 'disk' \(with offload_folder=\) to keep them out of memory, or 'cpu'"):
        AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor, dtype="float32", device_map=device_map)


@pytest.mark.parametrize("placement", ["all_disk", "auto"])
def test_tied_embeddings_offloaded_to_disk(llama_tied_bf16_ws4, tmp_path, placement):
    """The tied lm_head offloaded with its embedding: accelerate's hook finds it on disk (as
    from_pretrained of the merged folder indexes it), not a KeyError at forward."""
    where = dict(device_map={"": "disk"}) if placement == "all_disk" else dict(device_map="auto", max_memory={"cpu": "10KB"})
    model = AutoModelForCausalLM.from_sharded_pretrained(llama_tied_bf16_ws4.actor, offload_folder=tmp_path, **where)
    assert model.hf_device_map.get("lm_head", model.hf_device_map.get("")) == "disk"
    ref = torch.load(llama_tied_bf16_ws4.logits)
    assert torch.equal(_logits(model, ref["input_ids"]), ref["logits"])


def test_concrete_model_class(qwen2_fp32_ws2):
    model = hf_merge.load.model.from_sharded_pretrained(qwen2_fp32_ws2.actor, auto_class=Qwen2ForCausalLM, dtype="float32")
    ref = torch.load(qwen2_fp32_ws2.logits)
    assert type(model) is Qwen2ForCausalLM
    assert torch.equal(_logits(model, ref["input_ids"]), ref["logits"])


def test_a_plain_hf_folder_loads_too(qwen2_fp32_ws2):
    model = AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.reference, dtype="float32")
    ref = torch.load(qwen2_fp32_ws2.logits)
    assert torch.equal(_logits(model, ref["input_ids"]), ref["logits"])


@pytest.mark.compat
def test_tied_embeddings_are_tied(llama_tied_bf16_ws4):
    model = AutoModelForCausalLM.from_sharded_pretrained(llama_tied_bf16_ws4.actor)
    assert type(model) is LlamaForCausalLM and model.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = torch.load(llama_tied_bf16_ws4.logits)
    assert torch.equal(_logits(model, ref["input_ids"]), ref["logits"])


def test_persistent_buffer_in_rank_files_is_skipped_like_transformers(mixed_buffers_ckpt):
    """rank files holding a plain `rotary_emb.inv_freq` copy: transformers ignores it; so do we."""
    model = AutoModelForCausalLM.from_sharded_pretrained(mixed_buffers_ckpt.actor, dtype="float32")
    ref = torch.load(mixed_buffers_ckpt.logits)
    assert torch.equal(_logits(model, ref["input_ids"]), ref["logits"])


# ---------------------------------------------------------------------------------------------
# behaves like from_pretrained's model
# ---------------------------------------------------------------------------------------------


@pytest.mark.compat
def test_config_name_and_generation_config(qwen2_fp32_ws2, loaded):
    assert loaded.config.name_or_path == str(qwen2_fp32_ws2.actor)
    assert loaded.name_or_path == str(qwen2_fp32_ws2.actor)
    saved = json.loads((qwen2_fp32_ws2.hf_dir / "generation_config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(loaded.generation_config, key) == saved[key]


@pytest.mark.compat
def test_generate_equals_the_reference(qwen2_fp32_ws2, ref, loaded):
    ids = torch.load(qwen2_fp32_ws2.logits)["input_ids"][:1]
    kw = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(loaded.generate(ids, **kw), ref.generate(ids, **kw))


def test_save_pretrained_reloads_with_from_pretrained(qwen2_fp32_ws2, loaded, tmp_path):
    loaded.save_pretrained(tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ref = torch.load(qwen2_fp32_ws2.logits)
    assert again.dtype == torch.float32
    assert torch.equal(_logits(again, ref["input_ids"]), ref["logits"])


def test_push_to_hub_uploads_the_model(inproc, qwen2_fp32_ws2):  # noqa: F811
    """push_to_hub against the loopback Hub stand-in (tests/hub_server.py), in this process: the
    ``inproc`` fixture points huggingface_hub at the stand-in (test_hub.py runs the CLI's push as a
    subprocess)."""
    model = AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor, dtype="float32")
    model.push_to_hub("tester/tiny-merged")
    assert {"config.json", "model.safetensors"} <= set(inproc.repos["tester/tiny-merged"].files)


def test_attn_implementation_and_config_object(qwen2_fp32_ws2):
    from transformers import AutoConfig

    model = AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor, dtype="float32", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    config = AutoConfig.from_pretrained(qwen2_fp32_ws2.hf_dir)
    config.use_cache = False
    model = AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor, config=config, dtype="float32")
    assert model.config.use_cache is False and config.name_or_path != model.config.name_or_path
    ref = torch.load(qwen2_fp32_ws2.logits)
    assert torch.equal(_logits(model, ref["input_ids"]), ref["logits"])


@pytest.mark.parametrize("with_config_object", [False, True])
def test_from_pretrained_file_loading_arguments_are_accepted(qwen2_fp32_ws2, with_config_object, tmp_path):
    """What a user passes to from_pretrained by habit (low_cpu_mem_usage, use_safetensors, a revision...)
    changes nothing here; it used to reach the model's __init__ and raise TypeError."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(qwen2_fp32_ws2.hf_dir) if with_config_object else None
    override = {} if with_config_object else {"use_cache": False}  # as from_pretrained: with a config object, none
    model = AutoModelForCausalLM.from_sharded_pretrained(
        qwen2_fp32_ws2.actor, config=config, dtype="float32", low_cpu_mem_usage=True, use_safetensors=True,
        weights_only=True, revision="main", cache_dir=str(tmp_path), token=None, local_files_only=True,
        force_download=False, **override,
    )
    assert model.config.use_cache is not bool(override)  # a config override among them still applies
    ref = torch.load(qwen2_fp32_ws2.logits)
    assert torch.equal(_logits(model, ref["input_ids"]), ref["logits"])


@pytest.mark.parametrize("auto_class", ["AutoModelForCausalLM", "AutoModelForSequenceClassification"])
def test_output_loading_info_is_from_pretrained_s(qwen2_fp32_ws2, auto_class):
    """output_loading_info=True: (model, info), the same lists as from_pretrained of the unsharded model
    (a new classification head: score.weight missing, lm_head.weight unused)."""
    import transformers

    cls = getattr(transformers, auto_class)
    kwargs = {"num_labels": 3} if auto_class.endswith("Classification") else {}
    model, info = cls.from_sharded_pretrained(qwen2_fp32_ws2.actor, strict=False, output_loading_info=True, **kwargs)
    ref, want = cls.from_pretrained(qwen2_fp32_ws2.reference, output_loading_info=True, **kwargs)
    assert type(model) is type(ref)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert sorted(info[key]) == sorted(want[key]), key
    assert bool(info["missing_keys"]) == bool(kwargs)


def test_load_tokenizer(qwen2_fp32_ws2):
    tok = hf_merge.load.model.load_tokenizer(qwen2_fp32_ws2.actor)
    ref = load_tokenizer(qwen2_fp32_ws2.root, config=qwen2_fp32_ws2.reference)
    assert tok("the water was good")["input_ids"] == ref("the water was good")["input_ids"]


# ---------------------------------------------------------------------------------------------
# errors: typed, naming the offender
# ---------------------------------------------------------------------------------------------


def test_bad_path_raises_the_typed_error(tmp_path):
    with pytest.raises(SourceNotFoundError):
        AutoModelForCausalLM.from_sharded_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HfMergeError):
        AutoModelForCausalLM.from_sharded_pretrained(tmp_path / "empty")
    with pytest.raises(HfMergeError):
        load_tokenizer(tmp_path / "nope")


def test_missing_config_raises_the_typed_error(qwen2_fp32_ws2, tmp_path):
    actor = tmp_path / "actor"
    actor.mkdir()
    for f in qwen2_fp32_ws2.rank_files + [qwen2_fp32_ws2.actor / "fsdp_config.json"]:
        os.link(f, actor / f.name)  # a symlink leaving the checkpoint would be refused
    with pytest.raises(MissingConfigError, match="config"):
        AutoModelForCausalLM.from_sharded_pretrained(actor)
    model = AutoModelForCausalLM.from_sharded_pretrained(actor, config=qwen2_fp32_ws2.hf_dir, dtype="float32")
    assert torch.equal(_logits(model, torch.load(qwen2_fp32_ws2.logits)["input_ids"]), torch.load(qwen2_fp32_ws2.logits)["logits"])


@pytest.mark.compat
def test_missing_and_unexpected_weights_are_named(qwen2_fp32_ws2):
    with pytest.raises(MappingError, match=r"score\.weight"):
        AutoModelForTokenClassification.from_sharded_pretrained(qwen2_fp32_ws2.actor, num_labels=1)
    # strict=False: initialised like from_pretrained would (a new head), everything else loaded
    model = AutoModelForTokenClassification.from_sharded_pretrained(
        qwen2_fp32_ws2.actor, num_labels=1, strict=False, dtype="float32"
    )
    assert model.score.weight.shape == (1, 64) and _no_meta(model) == []


@pytest.mark.compat
def test_wrong_shapes_are_named(qwen2_fp32_ws2, tmp_path):
    cfg = json.loads((qwen2_fp32_ws2.hf_dir / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MappingError, match=r"mlp\.(gate|up|down)_proj\.weight"):
        AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor, config=tmp_path)


@pytest.mark.compat
def test_a_quantized_base_models_config_loads_the_plain_weights(qwen2_fp32_ws2, tmp_path):
    """config= the base model's Hub folder, whose config.json says fp8: the rank files hold plain
    weights, loaded as they are (transformers 4.57 refused on CPU: "A GPU or XPU is needed for FP8
    quantization"), as from_pretrained of the merged folder (no quantization_config) loads them."""
    from helpers import quantized_base_config, reference_logits

    config = quantized_base_config(qwen2_fp32_ws2, tmp_path / "base")
    model = AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor, config=config, dtype="float32")
    assert getattr(model.config, "quantization_config", None) is None
    input_ids, want = reference_logits(qwen2_fp32_ws2)
    torch.testing.assert_close(_logits(model, input_ids), want, rtol=0, atol=1e-6)


def test_auto_class_without_a_model_for_the_config(qwen2_fp32_ws2):
    from transformers import AutoModelForImageTextToText

    with pytest.raises(HfMergeError, match="AutoModelForImageTextToText"):
        AutoModelForImageTextToText.from_sharded_pretrained(qwen2_fp32_ws2.actor)


# ---------------------------------------------------------------------------------------------
# quantization and LoRA
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_bitsandbytes_equals_from_pretrained_quantized(qwen2_fp32_ws2, bits):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    if bits == 4:
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_type="nf4")
    else:
        qc = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_sharded_pretrained(
        qwen2_fp32_ws2.actor, dtype="float32", quantization_config=qc, device_map="cpu"
    )
    ref = AutoModelForCausalLM.from_pretrained(qwen2_fp32_ws2.reference, **dtype_kwargs(torch.float32), quantization_config=qc, device_map="cpu")
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == ref.model.layers[0].self_attn.q_proj.weight.dtype
    assert model.model.layers[0].self_attn.q_proj.weight.dtype in (torch.uint8, torch.int8)
    assert _no_meta(model) == []
    ids = torch.load(qwen2_fp32_ws2.logits)["input_ids"]
    assert torch.equal(_logits(model, ids), _logits(ref, ids))


@pytest.mark.compat
def test_lora_fuse_is_the_default(lora_ckpt):
    model = AutoModelForCausalLM.from_sharded_pretrained(lora_ckpt.actor, dtype="float32")
    ref = torch.load(lora_ckpt.logits)
    torch.testing.assert_close(_logits(model, ref["input_ids"]), ref["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.compat
@pytest.mark.parametrize("name", ["lora_ckpt", "lora_modules_to_save_ckpt"])
def test_lora_adapter_gives_a_peft_model(checkpoint, name):
    from peft import PeftModel

    ck = checkpoint(name)
    model = AutoModelForCausalLM.from_sharded_pretrained(ck.actor, dtype="float32", lora="adapter")
    assert isinstance(model, PeftModel) and not model.training
    base = AutoModelForCausalLM.from_pretrained(ck.reference_base, **dtype_kwargs(torch.float32))
    ref = PeftModel.from_pretrained(base, ck.reference_adapter)
    ids = torch.load(ck.logits)["input_ids"]
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    assert model.peft_config["default"].r == ref.peft_config["default"].r
    assert model.peft_config["default"].lora_alpha == ref.peft_config["default"].lora_alpha


@pytest.mark.compat
def test_lora_only_checkpoint_with_base_model(lora_only_ckpt):
    from peft import PeftModel

    ck = lora_only_ckpt
    with pytest.raises(LoraError, match="base"):
        AutoModelForCausalLM.from_sharded_pretrained(ck.actor, dtype="float32")
    ids = torch.load(ck.logits)["input_ids"]
    fused = AutoModelForCausalLM.from_sharded_pretrained(ck.actor, dtype="float32", base_model=ck.base_model)
    torch.testing.assert_close(_logits(fused, ids), torch.load(ck.logits)["logits"], rtol=1e-5, atol=1e-5)
    model = AutoModelForCausalLM.from_sharded_pretrained(ck.actor, dtype="float32", lora="adapter", base_model=ck.base_model)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ck.base_model, **dtype_kwargs(torch.float32)), ck.reference_adapter)
    assert torch.equal(_logits(model, ids), _logits(ref, ids))


def test_lora_adapter_on_a_plain_checkpoint_is_an_error(qwen2_fp32_ws2):
    with pytest.raises(LoraError):
        AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor, lora="adapter")


# ---------------------------------------------------------------------------------------------
# Megatron: real megatron-core checkpoints (TP=2, PP=2) against Megatron's own logits
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, role", [("qwen3_tied_v2", "actor"), ("mistral_critic_v2", "critic")])
def test_megatron_checkpoint_gives_megatrons_logits(megatron_root, name, role):
    model = hf_merge.from_sharded_pretrained(megatron_root / name / role, dtype="float32", attn_implementation="eager")
    ref = torch.load(megatron_root / name / "reference.pt")
    if role == "critic":  # the [1, H] value head becomes a token-classification model, num_labels=1
        assert type(model).__name__.endswith("ForTokenClassification") and model.config.num_labels == 1
    else:
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert not any(p.is_meta for p in model.parameters())
    torch.testing.assert_close(_logits(model, ref["input_ids"]), ref["logits"], rtol=0, atol=1e-4)


def test_no_temporary_folder_and_source_untouched(qwen2_fp32_ws2, tmp_path, monkeypatch):
    before = sorted(p.name for p in qwen2_fp32_ws2.actor.iterdir())
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    AutoModelForCausalLM.from_sharded_pretrained(qwen2_fp32_ws2.actor, dtype="float32")
    assert list(tmp_path.iterdir()) == []
    assert sorted(p.name for p in qwen2_fp32_ws2.actor.iterdir()) == before
    shutil.rmtree(tmp_path, ignore_errors=True)
