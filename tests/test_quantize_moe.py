"""``--quantize`` on a MoE model: what transformers 5 + bitsandbytes write for it.

Checked with transformers 5.25 / bitsandbytes 0.50 on CPU: transformers' bitsandbytes quantizer
replaces ``nn.Linear`` modules only. A Qwen3-MoE's experts are fused 3-D parameters
(``Qwen3MoeExperts.gate_up_proj [E, 2F, H]``) and its router a ``Qwen3MoeTopKRouter``, so neither is
quantized: ``save_pretrained`` of the quantized model writes attention as bitsandbytes parts and
every expert as a plain per-expert tensor in the Hub layout (``mlp.experts.{e}.gate_proj.weight``).
The merge must write exactly that.

Source: a real ``torch.distributed.checkpoint`` folder of a tiny Qwen3-MoE's ``state_dict()``
(hidden 64 so that bitsandbytes' CPU 4-bit kernel can run every attention projection); reference:
``from_pretrained(save_pretrained folder, quantization_config=...)`` then ``save_pretrained``.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import dcp_no_dist, folder_tensors
from test_quantize import MODES, assert_same_as_transformers, bnb_config, load, logits, needs_bnb

import hf_merge

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    """``(dcp folder, save_pretrained folder)`` of a seeded tiny Qwen3-MoE (fp32)."""
    import torch.distributed.checkpoint as dcp
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
                         architectures=["Qwen3MoeForCausalLM"], dtype="float32")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("moe_quant")
    model.save_pretrained(root / "reference")
    dcp.save(model.state_dict(), checkpoint_id=str(root / "ckpt"), **dcp_no_dist())
    return root / "ckpt", root / "reference"


@needs_bnb
@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_quantized_moe_is_what_transformers_saves(moe_source, tmp_path, mode):
    src, ref = moe_source
    out = tmp_path / "out"
    hf_merge.merge(src, out, config=ref, quantize=MODES[mode])
    theirs_model = load(ref, quantization_config=bnb_config(MODES[mode], compute_dtype=torch.float32), device_map="cpu")
    theirs_model.save_pretrained(tmp_path / "theirs")
    ours, theirs = folder_tensors(out), folder_tensors(tmp_path / "theirs")
    assert_same_as_transformers(ours, theirs, MODES[mode].double_quant)
    # the experts: one plain tensor per expert, as save_pretrained writes them; attention quantized
    assert ours["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.float32
    assert ours["model.layers.0.self_attn.q_proj.weight"].dtype in (torch.uint8, torch.int8)
    assert not any(n.endswith("gate_up_proj") for n in ours)
    ours_cfg, theirs_cfg = (json.loads((d / "config.json").read_text()) for d in (out, tmp_path / "theirs"))
    assert ours_cfg["quantization_config"] == theirs_cfg["quantization_config"]

    loaded = load(out, device_map="cpu")  # config.json says it all
    assert type(loaded.model.layers[0].self_attn.q_proj).__name__ == ("Linear8bitLt" if mode == "int8" else "Linear4bit")
    ref_sd = load(ref).state_dict()
    assert torch.equal(loaded.state_dict()["model.layers.1.mlp.experts.gate_up_proj"], ref_sd["model.layers.1.mlp.experts.gate_up_proj"])
    ids = torch.arange(16).view(2, 8) % 128
    torch.testing.assert_close(logits(loaded, ids), logits(theirs_model, ids), rtol=0, atol=0)
