"""The tensors ``from_sharded_pretrained`` builds while transformers' model code imports
(:mod:`hf_merge.load.prefetch`): the same model as ``from_pretrained`` of the merge, a damaged
record still raises, and an error during the import leaves no prefetch thread behind.

The fixtures are tiny, so :data:`~hf_merge.load.prefetch.MIN_BYTES` and the mapper's
``MIN_MAPPED_PAGES`` are lowered for these tests: every tensor the view holds in the load dtype is
prefetched and mapped, as the big ones are on real models.
"""

from __future__ import annotations

import gc
import shutil
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_merge
from hf_merge.load import model as load_model
from hf_merge.load import page_mapper
from hf_merge.load import prefetch as prefetch_mod
from hf_merge.readers import record_crc
from test_load_formats import SOURCES, _Fixtures, assert_load_equals_the_merge
from hf_merge.transformers_compat import dtype_kwargs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _Seen(prefetch_mod.Prefetch):
    """A Prefetch that records itself, and signals when its first build starts."""

    made: list["_Seen"] = []
    started = threading.Event()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _Seen.made.append(self)

    def _build(self, *args):
        _Seen.started.set()
        return super()._build(*args)


@pytest.fixture
def seen(monkeypatch):
    monkeypatch.setattr(prefetch_mod, "MIN_BYTES", 0)
    monkeypatch.setattr(page_mapper, "MIN_MAPPED_PAGES", 0)  # the fixtures' tensors are KBs
    monkeypatch.setattr(load_model, "Prefetch", _Seen)
    _Seen.made = []
    _Seen.started = threading.Event()
    yield _Seen
    assert not _prefetch_threads()


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefetch_mod.THREAD_PREFIX)]


PREFETCHED = ["deepspeed-zero3", "dcp", "fsdp", "megatron"]  # formats whose fixtures have file runs in fp32


@pytest.mark.parametrize("fmt", PREFETCHED)
def test_prefetched_tensors_load_the_same_model_as_from_pretrained_of_the_merge(fmt, request, tmp_path, seen):
    assert_load_equals_the_merge(*SOURCES[fmt](_Fixtures(request)), tmp_path)
    assert len(seen.made) == 1 and seen.made[0].taken > 0, "nothing was prefetched: the test proves nothing"


def test_megatron_row_parallel_weights_are_read_by_the_prefetch(request, tmp_path, seen):
    """A TP > 1 row-parallel weight (o_proj, down_proj: each row is cut across the TP chunks) is not
    file bytes throughout: the prefetch reads it with ``read_into``, and what it built equals the
    reader's tensor; a load with the prefetch equals from_pretrained of the merge."""
    from concurrent.futures import wait

    from hf_merge.readers.file_runs import run_of

    source, config = SOURCES["megatron"](_Fixtures(request))
    with hf_merge.open_checkpoint(source) as ckpt:
        specs = ckpt.specs()
        cut = [n for n in specs if n.endswith(("o_proj.weight", "down_proj.weight"))
               and not all(run_of(p) is not None for _, p in ckpt.read_rows(n, specs[n].dtype))]
        assert cut, "the fixture has no row-parallel weight cut across TP chunks: the test proves nothing"
        prefetch = prefetch_mod.Prefetch(ckpt, specs[cut[0]].dtype, threads=1)
        try:
            assert set(cut) <= set(prefetch._futures)
            wait(list(prefetch._futures.values()))  # every build done: none is left to a fill
            for name in cut:
                built = prefetch.take(name, tuple(specs[name].shape), specs[name].dtype)
                assert built is not None and torch.equal(built, ckpt.read(name)), name
            assert prefetch.read >= len(cut)
        finally:
            prefetch.close()
    assert_load_equals_the_merge(source, config, tmp_path)


def test_a_cast_load_takes_nothing_prefetched_and_loads_the_cast_weights(request, tmp_path, seen):
    """A bfloat16 load of a float32 checkpoint: nothing is in the load dtype, nothing is prefetched."""
    source, _ = SOURCES["fsdp"](_Fixtures(request))
    ours = AutoModelForCausalLM.from_sharded_pretrained(source, dtype="bfloat16")
    assert seen.made and seen.made[0].taken == 0
    hf_merge.merge(source, tmp_path / "merged", dtype="bfloat16")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", **dtype_kwargs(torch.bfloat16))
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


def _flip_record_of(path: Path, tensor_name: str) -> None:
    """Flip one bit in the data of the zip record that holds ``tensor_name`` of a verl rank file."""
    from hf_merge.readers.rank_records import index_rank_file

    offset, _ = index_rank_file(path)[tensor_name].span
    raw = bytearray(path.read_bytes())
    raw[offset + 1] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_damaged_record_of_a_prefetched_tensor_still_raises(request, tmp_path, seen):
    source, _ = SOURCES["fsdp"](_Fixtures(request))
    ckpt = Path(shutil.copytree(source, tmp_path / "actor"))
    rank1 = ckpt / "model_world_size_2_rank_1.pt"
    _flip_record_of(rank1, "model.embed_tokens.weight")
    with pytest.raises(record_crc.SourceCrcError, match=rank1.name):
        AutoModelForCausalLM.from_sharded_pretrained(ckpt, dtype="float32")
    assert seen.made and seen.made[0].taken > 0  # the damaged tensor went through the prefetch
    assert not _prefetch_threads()


def test_an_error_while_importing_the_model_class_leaves_no_prefetch_thread(request, monkeypatch, seen):
    source, _ = SOURCES["fsdp"](_Fixtures(request))

    def failing_import(*args, **kwargs):
        assert seen.started.wait(60), "the prefetch never started"  # an event, not a sleep
        raise ImportError("the model's modeling module failed to import")

    monkeypatch.setattr(load_model, "_resolve_model_class", failing_import)
    with pytest.raises(ImportError, match="modeling module"):
        AutoModelForCausalLM.from_sharded_pretrained(source, dtype="float32")
    assert seen.made and seen.made[0]._futures == {} and not _prefetch_threads()
    # what the prefetch built was dropped: its finalizers unmapped the rank files' pages
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    rank_files = [str(f.resolve()) for f in Path(source).glob("*.pt")]
    assert rank_files and not any(f in maps for f in rank_files), "a rank file is still mapped after the failed load"


def test_a_tensor_whose_build_has_not_started_is_left_to_the_fill(request, seen):
    """Once the import is done the fill asks for each tensor: one the prefetch's thread has not
    started is not waited for (the fill's threads build it, both cores then copy); one it has
    started is waited for and taken."""
    source, _ = SOURCES["fsdp"](_Fixtures(request))
    release, holding = threading.Event(), threading.Event()

    class Held(prefetch_mod.Prefetch):
        def _build(self, *args):
            holding.set()
            assert release.wait(60), "never released"  # an event, not a sleep
            return super()._build(*args)

    with hf_merge.open_checkpoint(source) as ckpt:
        specs = ckpt.specs()
        prefetch = Held(ckpt, torch.float32, threads=1)
        try:
            names = list(prefetch._futures)  # largest first: the first is built, the others wait
            assert len(names) >= 2 and holding.wait(60)
            assert prefetch.take(names[-1], tuple(specs[names[-1]].shape), torch.float32) is None
            release.set()
            built = prefetch.take(names[0], tuple(specs[names[0]].shape), torch.float32)
            assert built is not None and torch.equal(built, ckpt.read(names[0], dtype=torch.float32))
        finally:
            release.set()
            prefetch.close()
