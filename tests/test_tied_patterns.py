"""Tied weights that a model declares as patterns, not plain names: written once, as
``save_pretrained`` writes them.

- Bark's fine acoustics model fills ``_tied_weights_keys`` in ``__init__`` (``lm_heads.{i}.weight ->
  input_embeds_layers.{i + 1}.weight``): the class attribute alone says nothing.
- RT-DETR v2 declares regular expressions and module prefixes (``bbox_embed.(?![0])\\d+``,
  ``class_embed -> model.decoder.class_embed``).

Each source is a real ``torch.distributed.checkpoint`` folder of the model's own ``state_dict()``
(which holds every tied tensor under both names), merged and compared byte for byte with
``save_pretrained`` of the same model.
"""

from __future__ import annotations

import pytest
import torch
from helpers import dcp_no_dist, folder_tensors

import hf_merge
from hf_merge.hf_files import load_config, tied_pairs


def _bark():
    from transformers import BarkFineConfig, BarkFineModel

    cfg = BarkFineConfig(block_size=16, input_vocab_size=32, output_vocab_size=32, num_layers=1, num_heads=2,
                         hidden_size=8, n_codes_total=4, n_codes_given=1)
    return BarkFineModel(cfg)


def _rt_detr_v2():
    from transformers import RTDetrResNetConfig, RTDetrV2Config, RTDetrV2ForObjectDetection

    backbone = RTDetrResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1],
                                  out_features=["stage2", "stage3", "stage4"])
    cfg = RTDetrV2Config(backbone_config=backbone, d_model=16, encoder_hidden_dim=16, encoder_in_channels=[8, 8, 8],
                         encoder_ffn_dim=16, decoder_ffn_dim=16, decoder_layers=2, decoder_attention_heads=2,
                         encoder_attention_heads=2, encoder_layers=1, num_queries=4, num_labels=3,
                         decoder_in_channels=[16, 16, 16], num_feature_levels=3, decoder_n_points=2)
    return RTDetrV2ForObjectDetection(cfg)


MODELS = {"bark_fine": (_bark, "lm_heads.0.weight"), "rt_detr_v2": (_rt_detr_v2, "bbox_embed.1.layers.0.weight")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def tied_source(request, tmp_path_factory):
    """``(name, dcp folder, save_pretrained folder)`` of a seeded tiny model."""
    import torch.distributed.checkpoint as dcp

    build, _ = MODELS[request.param]
    torch.manual_seed(0)
    model = build().eval()
    root = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(root / "reference")
    state = model.state_dict()
    dcp.save(state, checkpoint_id=str(root / "ckpt"), **dcp_no_dist())
    return request.param, root / "ckpt", root / "reference", state


def test_tied_patterns_are_expanded(tied_source):
    name, src, ref, state = tied_source
    alias = MODELS[name][1]
    assert alias in state  # the source holds the tied alias ...
    pairs = tied_pairs(load_config(ref), set(state))
    assert alias in pairs and pairs[alias] in state
    assert torch.equal(state[alias], state[pairs[alias]])


def test_merge_writes_each_tied_weight_once(tied_source, tmp_path):
    name, src, ref, state = tied_source
    hf_merge.merge(src, tmp_path / "out", config=ref, dtype="auto")
    got, want = folder_tensors(tmp_path / "out"), folder_tensors(ref)
    assert MODELS[name][1] not in got  # ... the output does not, like save_pretrained's
    assert sorted(got) == sorted(want), (sorted(set(got) - set(want))[:5], sorted(set(want) - set(got))[:5])
    for key, w in want.items():
        g = got[key]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), key
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), key
