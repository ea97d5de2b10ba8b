"""``from_sharded_pretrained`` on every source format equals ``from_pretrained`` of the merged folder.

One real checkpoint per format (FSDP2 written here, the DCP family by accelerate / torchtitan /
torch.distributed.checkpoint, Megatron-Core, and the committed DeepSpeed, DeepSpeed universal and
ColossalAI fixtures): merged with ``hf_merge.merge``, loaded back with ``from_pretrained``, and
loaded straight from the shards; every tensor and the logits must be equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hf_merge
from hf_merge.transformers_compat import dtype_kwargs

DATA = Path(__file__).parent / "data"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _deepspeed(name: str, universal: bool = False) -> tuple[Path, Path | None]:
    config = DATA / "deepspeed" / name / "reference" / "step2" / "config"
    if universal:
        return DATA / "deepspeed_universal" / name / "global_step2_universal", config
    return DATA / "deepspeed" / name, None if (DATA / "deepspeed" / name / "checkpoint-2").is_dir() else config


SOURCES = {  # format -> (source, config folder or None) given the session fixtures
    "fsdp": lambda fx: (fx("qwen2_fp32_ws2").actor, None),
    "deepspeed-zero2-trainer": lambda fx: _deepspeed("z2_bf16_trainer_ws2"),
    "deepspeed-zero3": lambda fx: _deepspeed("z3_fp32_ws3"),
    "deepspeed-universal": lambda fx: _deepspeed("z3_bf16_tied_ws2", universal=True),
    "colossalai-dist-tp2": lambda fx: (DATA / "colossalai" / "dist_tp2_ws2", DATA / "colossalai" / "dist_tp2_ws2" / "reference" / "config"),
    "colossalai-hybrid-tp2-pp2": lambda fx: (DATA / "colossalai" / "hybrid_tp2_pp2_ws4", None),
    "accelerate": lambda fx: (fx.dcp / "accelerate" / "ckpt", fx.dcp / "accelerate" / "config"),
    "torchtitan": lambda fx: (fx.dcp / "torchtitan" / "dump", fx.dcp / "torchtitan" / "config"),
    "dcp": lambda fx: (fx.dcp / "dcp_nested" / "ckpt", fx.dcp / "dcp_nested" / "config"),
    "megatron": lambda fx: (fx.megatron / "qwen2_v1" / "actor", None),
}


class _Fixtures:
    def __init__(self, request):
        self._request = request

    def __call__(self, name):
        return self._request.getfixturevalue("checkpoint")(name)

    @property
    def dcp(self) -> Path:
        return self._request.getfixturevalue("dcp_root")

    @property
    def megatron(self) -> Path:
        return self._request.getfixturevalue("megatron_root")


@pytest.mark.parametrize("fmt", sorted(SOURCES))
def test_load_equals_from_pretrained_of_the_merge(fmt, request, tmp_path):
    assert_load_equals_the_merge(*SOURCES[fmt](_Fixtures(request)), tmp_path)


@pytest.mark.parametrize("fmt", ["accelerate", "dcp", "torchtitan"])
def test_a_config_object_loads_as_its_folder_does(fmt, request, tmp_path):
    """config= a PretrainedConfig for a format whose reader needs a config.json (no config beside
    the checkpoint): the same model as the merge with the config folder, not MissingConfigError."""
    assert_load_equals_the_merge(*SOURCES[fmt](_Fixtures(request)), tmp_path, config_object=True)


def assert_load_equals_the_merge(source: Path, config: Path | None, tmp_path: Path, *, config_object: bool = False) -> None:
    """Every tensor and the logits of ``from_sharded_pretrained(source)`` equal ``from_pretrained``
    of its fp32 merge (``config_object``: the config is given to the load as a ``PretrainedConfig``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    merged = tmp_path / "merged"
    hf_merge.merge(source, merged, config=config, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(merged, **dtype_kwargs(torch.float32))
    given = AutoConfig.from_pretrained(config) if config_object else config
    ours = AutoModelForCausalLM.from_sharded_pretrained(source, config=given, dtype="float32")
    want = ref.state_dict()
    got = ours.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in got.items():
        assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key
    ids = torch.arange(3, 11).unsqueeze(0) % ref.config.vocab_size
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, ref(input_ids=ids).logits)
