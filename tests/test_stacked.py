"""The places :mod:`hf_merge.load.stacked` gives per-expert tensors in a stacked parameter are
where transformers' own converters put them, for every stacking converter the installed
transformers declares (the loads themselves are tested on real Megatron-Core MoE checkpoints in
``test_megatron_moe.py``)."""

from __future__ import annotations

import pytest
import torch

from hf_merge import transformers_compat as compat
from hf_merge.load.stacked import slots
from hf_merge.transformers_compat import dtype_kwargs

pytestmark = pytest.mark.skipif(not compat.has_weight_conversions(), reason="transformers 4.x has no weight converters")

EXPERTS = 3
SHAPE = (5, 7)  # one expert's tensor


def _converters():
    from transformers.conversion_mapping import _build_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    seen = {}
    for model_type, entries in _build_checkpoint_conversion_mapping().items():
        for entry in entries:
            if isinstance(entry, WeightConverter):
                key = (tuple(entry.source_patterns), tuple(entry.target_patterns), repr(entry.operations))
                seen.setdefault(key, (model_type, entry))
    return list(seen.values())


def _theirs(converter, inputs: dict[str, list[torch.Tensor]]) -> torch.Tensor:
    """transformers' converter run on ``inputs`` (source pattern -> tensors in checkpoint order)."""
    collected = {p: list(ts) for p, ts in inputs.items()}
    for op in converter.operations:
        collected = op.convert(collected, source_patterns=converter.source_patterns,
                               target_patterns=converter.target_patterns, full_layer_name="x", model=None, config=None)
    (value,) = collected.values()
    return value[0] if isinstance(value, list) else value


def test_every_stacking_converter_places_each_tensor_where_transformers_does():
    converters = _converters()
    stacking = [(t, c, compat.stacking([c], c.source_patterns[0])) for t, c in converters]
    stacking = [item for item in stacking if item[2] is not None]
    assert len(stacking) >= 3, "transformers declares no stacking converters any more"
    g = torch.Generator().manual_seed(0)
    for model_type, converter, how in stacking:
        count = EXPERTS if how.stack_dim is not None else 1
        inputs = {p: [torch.randn(SHAPE, generator=g) for _ in range(count)] for p in converter.source_patterns}
        want = _theirs(converter, inputs)
        names = {f"{p}#{i}": t for p, ts in inputs.items() for i, t in enumerate(ts)}
        sources = [(p, f"{p}#{i}") for p, ts in inputs.items() for i in range(len(ts))]
        places = slots(how, sources, {n: tuple(t.shape) for n, t in names.items()}, tuple(want.shape))
        assert places is not None, (model_type, converter)
        got = torch.full(want.shape, float("nan"))
        for slot in places:
            slot.of(got).copy_(names[slot.name])
        assert torch.equal(got, want), (model_type, converter)


def test_experts_that_do_not_make_the_parameter_are_left_to_transformers():
    """A missing expert or another shape: no places (the load goes through transformers' loop)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    gate_up = next(c for c in get_checkpoint_conversion_mapping("qwen2_moe") if len(c.source_patterns) == 2)
    how = compat.stacking([gate_up], gate_up.source_patterns[0])
    gate, up = gate_up.source_patterns
    sources = [(p, f"{p}{i}") for p in (gate, up) for i in range(4)]
    shapes = {n: (8, 16) for _, n in sources}
    assert slots(how, sources, shapes, (4, 16, 16)) is not None
    assert slots(how, sources[:-1], shapes, (4, 16, 16)) is None  # the last up_proj missing
    assert slots(how, sources, {**shapes, f"{up}3": (8, 15)}, (4, 16, 16)) is None
    assert slots(how, sources, shapes, (4, 16, 17)) is None
    transpose = next(c for t, c in _converters() if "Transpose" in repr(c.operations))
    assert compat.stacking([transpose], transpose.source_patterns[0]) is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_dcp_checkpoint_with_one_tensor_per_expert(tmp_path, monkeypatch):
    """A Qwen3-MoE state dict in the Hub layout (one tensor per expert, as transformers 4.x holds
    it) saved by ``torch.distributed.checkpoint``: its experts are file runs. A stacked parameter
    worth mapping (gate_up_proj, 64 KiB) is built whole by the page mapper from its experts' runs,
    a smaller one (down_proj) is read slot by slot; every expert's bytes go to the CRC-32 check
    where the model holds them; no transformers weight loop; equal to the saved model."""
    import torch.distributed.checkpoint as dcp
    import transformers.modeling_utils as mu
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_merge
    import hf_merge.load.model as loader
    from hf_merge.load.page_mapper import Mapper
    from hf_merge.readers import record_crc

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, architectures=["Qwen3MoeForCausalLM"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch.float32)).eval()
    model.save_pretrained(tmp_path / "hf")
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in state
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))  # no process group: one process (torch >= 2.6)

    built, slots_read, placed, loops = [], [], [], []
    real_tensor, real_slot, real_place = Mapper.tensor, loader.read_slot, record_crc.Placed.place
    monkeypatch.setattr(Mapper, "tensor", lambda self, shape, *a: built.append(shape) or real_tensor(self, shape, *a))
    monkeypatch.setattr(loader, "read_slot", lambda view, name, *a: slots_read.append(name) or real_slot(view, name, *a))
    monkeypatch.setattr(record_crc.Placed, "place", lambda self, fd, at, data: placed.append(len(data)) or real_place(self, fd, at, data))
    weight_loop = mu.convert_and_load_state_dict_in_model
    monkeypatch.setattr(mu, "convert_and_load_state_dict_in_model", lambda *a, **k: loops.append(1) or weight_loop(*a, **k))

    ours = hf_merge.from_sharded_pretrained(tmp_path / "ckpt", config=tmp_path / "hf", dtype="float32")
    assert loops == []
    assert built.count((4 * 64 * 64,)) == 2  # each layer's gate_up_proj, whole
    assert sorted(slots_read) == sorted(k for k in state if ".experts." in k and "down_proj" in k)
    experts = sum(t.numel() * 4 for k, t in state.items() if ".experts." in k)
    assert sum(placed) >= experts
    want, got = model.state_dict(), ours.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in got.items():
        assert torch.equal(value, want[key]), key


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_slot_on_a_device_numpy_cannot_view_is_read_and_still_checked(tmp_path):
    """A stacked parameter on a device that is neither the CPU nor staged (``mps``, ``xpu``; the
    meta device stands in for them here): the expert's file run cannot be handed to the CRC-32 as
    the bytes the model holds (no numpy view of them), so it is read and copied there, its record
    checked in full at the end. Before: ``TypeError`` from ``numpy()`` on the device tensor."""
    import torch.distributed.checkpoint as dcp

    from hf_merge.load.stacked import read_slot
    from hf_merge.readers import record_crc
    from hf_merge.readers.dcp import DcpCheckpoint

    for name in ("good", "bad"):
        dcp.save({"w": torch.randn(64, 32)}, checkpoint_id=str(tmp_path / name))
    with DcpCheckpoint(tmp_path / "bad") as view:  # one byte of the expert's record flipped
        chunk = view._chunks["w"][0]
        at = view._layout("w", chunk).data_start + 100
    path = tmp_path / "bad" / chunk.file
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    for name in ("good", "bad"):
        placed = record_crc.Placed()
        with DcpCheckpoint(tmp_path / name) as view:
            with record_crc.deferred(check_at_end=False, pending=placed.pending):
                read_slot(view, "w", torch.empty(64, 32, device="meta"), placed.place)
            assert placed.pending
            if name == "good":
                placed.finish()
            else:
                with pytest.raises(record_crc.SourceCrcError):
                    placed.finish()
