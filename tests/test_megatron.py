"""verl Megatron checkpoints: real megatron-core saves (TP=2, PP=2) against Megatron's own logits.

The session fixture runs ``examples/make_megatron_checkpoint.py`` once (4 gloo ranks on CPU): it
writes every variant with Megatron's ``dist_checkpointing`` (and legacy per-rank files), reloads
each at TP=1 through Megatron and records the logits for fixed input ids. The HF model built from
our reader must give the same logits. Tests that need no megatron-core (synthetic DCP folders with
Megatron names) run without it.

``HF_MERGE_FIXTURE_CACHE=/dir`` keeps the generated checkpoints between sessions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import dcp_no_dist, detections_differing_from_every_probe, run_cli
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from hf_merge.readers import file_runs
from hf_merge.readers.config_overrides import ConfigOverrides
from hf_merge.errors import (
    CorruptCheckpointError,
    MappingError,
    MissingConfigError,
    UnsupportedCheckpointError,
)
from hf_merge.readers import record_crc
from hf_merge.readers.dcp import DcpCheckpoint
from hf_merge.readers.megatron import open_megatron, probe
from hf_merge.transforms.fused import split_gate_up, split_qkv
from hf_merge.transformers_compat import dtype_kwargs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

REPO = Path(__file__).resolve().parents[1]
GENERATOR = REPO / "examples" / "make_megatron_checkpoint.py"
sys.path.insert(0, str(GENERATOR.parent))
import make_megatron_checkpoint as mk  # noqa: E402  (imports torch only; megatron inside workers)

VARIANTS = {v.name: v for v in mk.DEFAULT_VARIANTS}
MERGED = [v.name for v in mk.DEFAULT_VARIANTS if not v.mbridge]
MBRIDGE = [v.name for v in mk.DEFAULT_VARIANTS if v.mbridge]


# Real megatron-core fixtures: ``megatron_root`` in conftest.py.


def role_dir(root: Path, name: str) -> Path:
    return root / name / VARIANTS[name].role


def hf_model_from(ckpt):
    """Build the HF model the writer would describe (config.json + config_overrides) and load it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    cfg = json.loads((ckpt.info.hf_dir / "config.json").read_text())
    ckpt.info.config_overrides.apply(cfg)
    config = AutoConfig.for_model(**cfg)
    cls = AutoModelForTokenClassification if ckpt.info.details["value_model"] else AutoModelForCausalLM
    model = cls.from_config(config, attn_implementation="eager", **dtype_kwargs(torch.float32))
    state = {k: ckpt.read(k, dtype=torch.float32) for k in ckpt.keys()}
    result = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if ckpt.info.details["tied"] else set()
    assert set(result.missing_keys) <= allowed_missing, result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    return model.eval(), config


@pytest.mark.parametrize("name", MERGED)
def test_logits_equal_megatron(megatron_root, name):
    var = VARIANTS[name]
    ckpt = open_megatron(role_dir(megatron_root, name))
    d = ckpt.info.details
    assert ckpt.info.format == "megatron"
    assert d["layout"] == var.layout and d["tp"] == 2 and d["pp"] == 2
    assert d["num_layers"] == mk.FAMILIES[var.family].layers and d["family"] == var.family
    assert d["value_model"] is var.value and d["tied"] is (var.tied and not var.value)
    model, config = hf_model_from(ckpt)
    if var.value:
        assert config.num_labels == 1 and config.architectures[0].endswith("ForTokenClassification")
        assert model.score.bias is None  # verl's value head has no bias
    ref = torch.load(megatron_root / name / "reference.pt")
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"], attention_mask=torch.ones_like(ref["input_ids"])).logits
    assert logits.shape == ref["logits"].shape
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-4)


def test_tensors_are_exact_splits_of_the_dcp(megatron_root):
    """Bit-exact: each HF tensor equals the pure split of the tensor torch's own DCP loader returns."""
    root = role_dir(megatron_root, "qwen2_v1")
    dist = root / "dist_ckpt"
    ours = DcpCheckpoint(dist)
    official = {k: torch.empty(s.shape, dtype=s.dtype) for k, s in ours.specs().items()}
    dcp.load(official, storage_reader=FileSystemReader(str(dist)), **dcp_no_dist())
    for k, t in official.items():
        assert torch.equal(ours.read(k), t), k
    ckpt = open_megatron(root)
    fam = mk.FAMILIES["qwen2"]
    qkv = official["decoder.layers.self_attention.linear_qkv.weight"]
    fc1 = official["decoder.layers.mlp.linear_fc1.weight"]
    for i in range(fam.layers):
        q, k, v = split_qkv(qkv[i], num_heads=fam.heads, num_kv_heads=fam.kv_heads, head_dim=fam.head_dim)
        gate, up = split_gate_up(fc1[i])
        p = f"model.layers.{i}."
        for name, want in {"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
                           "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up}.items():
            assert torch.equal(ckpt.read(p + name), want), p + name
    names = list(ckpt.specs())
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert not any("_extra_state" in n or n.startswith("optimizer") for n in names)


def test_reader_yields_megatron_names_and_inspect_shows_them(megatron_root, capsys):
    """The reader's own layer holds the dist_ckpt's keys exactly as torch's DCP metadata lists
    them; HF names come from the name table on top, and `inspect --source-names` says which
    Megatron tensor (stacked index, split role) each HF tensor is read from."""
    from hf_merge.cli.app import main
    from hf_merge.transforms.name_table_view import NameTableView

    root = role_dir(megatron_root, "qwen2_v1")
    meta = FileSystemReader(str(root / "dist_ckpt")).read_metadata()
    ckpt = open_megatron(root)
    assert isinstance(ckpt, NameTableView) and ckpt.table.name == "megatron_gpt.qwen2"
    assert set(ckpt.base.specs()) == {k for k, m in meta.state_dict_metadata.items() if hasattr(m, "chunks")}
    assert "decoder.layers.self_attention.linear_qkv.weight" in ckpt.base.specs()
    assert ckpt.describe_source("model.layers.1.self_attn.k_proj.weight") == "decoder.layers.self_attention.linear_qkv.weight[1] (qkv: k)"
    assert ckpt.describe_source("model.embed_tokens.weight") == "embedding.word_embeddings.weight"
    assert main(["inspect", str(root), "--source-names", "--json"]) == 0
    rows = {t["name"]: t["source"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert rows["model.layers.0.mlp.up_proj.weight"] == "decoder.layers.mlp.linear_fc1.weight[0] (gate_up: up)"
    assert len(rows) == len(ckpt.specs())
    legacy = open_megatron(role_dir(megatron_root, "qwen2_legacy_tied"))  # a state_dict(): one key per layer
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in legacy.base.specs()
    assert legacy.describe_source("model.layers.1.self_attn.q_proj.weight") == "decoder.layers.1.self_attention.linear_qkv.weight (qkv: q)"
    assert main(["inspect", str(role_dir(megatron_root, "qwen2_legacy_tied")), "--source-names"]) == 0
    assert "model.layers.1.mlp.down_proj.weight" in capsys.readouterr().out


@pytest.mark.parametrize("name", MBRIDGE)
def test_mbridge_weights_are_served_as_they_are(megatron_root, name):
    from safetensors.torch import load_file

    root = role_dir(megatron_root, name)
    assert probe(root)
    ckpt = open_megatron(root)
    assert ckpt.info.details["layout"] == "mbridge"
    assert any("mbridge" in n and "nothing to merge" in n for n in ckpt.info.notes)
    hf_dir = ckpt.info.hf_dir
    want = load_file(str(hf_dir / "model.safetensors"))
    assert sorted(ckpt.keys()) == sorted(want)
    for k, t in want.items():
        assert torch.equal(ckpt.read(k), t), k


def test_detection_by_marks_equals_every_probe(megatron_root):
    """Every layout megatron-core wrote (v1, v2, mbridge, legacy, torch_dist), every folder of it:
    detect(), probing only the formats whose marks are there, matches what every probe says."""
    assert detections_differing_from_every_probe(megatron_root) == []


def test_value_model_flag_is_checked(megatron_root):
    with pytest.raises(MappingError, match="is_value_model=True"):
        open_megatron(role_dir(megatron_root, "mistral_critic_v2"), is_value_model=False)
    with pytest.raises(MappingError, match="language-model head"):
        open_megatron(role_dir(megatron_root, "qwen2_v1"), is_value_model=True)
    ckpt = open_megatron(role_dir(megatron_root, "mistral_critic_v2"), is_value_model=True)
    assert list(ckpt.specs())[-1] == "score.weight" and ckpt.specs()["score.weight"].shape == (1, 32)


def test_step_and_role_folders_resolve(megatron_root, tmp_path):
    run = tmp_path / "ckpts"
    (run / "global_step_7").mkdir(parents=True)
    (run / "global_step_3").mkdir()
    shutil.copytree(role_dir(megatron_root, "qwen2_v1"), run / "global_step_7" / "actor")  # a symlink out is refused
    (run / "latest_checkpointed_iteration.txt").write_text("7\n")
    assert probe(run)
    assert detections_differing_from_every_probe(run) == []
    ckpt = open_megatron(run)
    assert ckpt.info.step == 7
    assert any("global_step_7" in n for n in ckpt.info.notes)
    import hf_merge

    auto = hf_merge.open_checkpoint(run / "global_step_7")
    assert auto.info.format == "megatron" and auto.keys() == ckpt.keys()


def test_bad_latest_step_file_falls_back_to_the_highest_step(megatron_root, tmp_path):
    """The same step choice as the FSDP reader's: a latest file that is not a small ASCII number
    (binary, a superscript digit, 24 digits) means the highest step, with a note."""
    run = tmp_path / "ckpts"
    (run / "global_step_7").mkdir(parents=True)
    (run / "global_step_3").mkdir()
    shutil.copytree(role_dir(megatron_root, "qwen2_v1"), run / "global_step_7" / "actor")  # a symlink out is refused
    for content in (b"\xff\xfe3", "\u00b2".encode(), b"999999999999999999999999"):
        (run / "latest_checkpointed_iteration.txt").write_bytes(content)
        ckpt = open_megatron(run)
        assert ckpt.info.step == 7
        assert any("the highest of 2 steps" in n for n in ckpt.info.notes), ckpt.info.notes


def test_an_empty_newest_step_names_the_previous_complete_step(megatron_root, tmp_path):
    """The FSDP reader's step choice: an empty newest step (a save cut short) is named with the
    complete step to pass, not read as "not a checkpoint" nor replaced by the older step."""
    from hf_merge.errors import IncompleteStepError

    run = tmp_path / "ckpts"
    (run / "global_step_9" / "actor").mkdir(parents=True)
    shutil.copytree(role_dir(megatron_root, "qwen2_v1"), run / "global_step_7" / "actor")
    from hf_merge import open_checkpoint

    for opener in (open_megatron, open_checkpoint):
        with pytest.raises(IncompleteStepError, match=r"global_step_9 is empty or incomplete .*the newest complete "
                           r"step is global_step_7: pass .*global_step_7 to merge it"):
            opener(run)


def test_a_latest_file_naming_a_missing_step_names_the_complete_step(megatron_root, tmp_path, capsys):
    """latest_checkpointed_iteration.txt naming a step that is not here (the newest not copied, or
    its save cut short): one line names both, nothing written. Before: a note, and the older step
    merged in its place."""
    from hf_merge.cli.app import main
    from hf_merge.errors import IncompleteStepError

    run = tmp_path / "ckpts"
    shutil.copytree(role_dir(megatron_root, "qwen2_v1"), run / "global_step_3" / "actor")
    (run / "latest_checkpointed_iteration.txt").write_text("5\n")
    want = (f"{run / 'latest_checkpointed_iteration.txt'} names step 5, which is not here; the newest complete step "
            f"is global_step_3: pass {run / 'global_step_3'} to merge it")
    with pytest.raises(IncompleteStepError, match=re.escape(want)):
        open_megatron(run)
    assert main(["merge", str(run), str(tmp_path / "out")]) != 0
    assert capsys.readouterr().err.strip() == f"error: {want}"
    assert not (tmp_path / "out").exists()
    assert open_megatron(run / "global_step_3").info.step == 3  # the complete step, named


# --------------------------------------------------------------------------------------------
# Synthetic Megatron-named DCP folders (no megatron-core needed)
# --------------------------------------------------------------------------------------------

H, NQ, NKV, HD, F, L, V = 8, 2, 1, 4, 12, 2, 16


def _config(**kw) -> dict:
    cfg = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=F,
        num_hidden_layers=L, num_attention_heads=NQ, num_key_value_heads=NKV, head_dim=HD,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
    )
    cfg.update(kw)
    return cfg


def _tensors(**extra) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = {
        "embedding.word_embeddings.weight": torch.randn(V, H, generator=g),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.randn(L, H, generator=g),
        "decoder.layers.self_attention.linear_qkv.weight": torch.randn(L, (NQ + 2 * NKV) * HD, H, generator=g),
        "decoder.layers.self_attention.linear_proj.weight": torch.randn(L, H, NQ * HD, generator=g),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": torch.randn(L, H, generator=g),
        "decoder.layers.mlp.linear_fc1.weight": torch.randn(L, 2 * F, H, generator=g),
        "decoder.layers.mlp.linear_fc2.weight": torch.randn(L, H, F, generator=g),
        "decoder.final_layernorm.weight": torch.randn(H, generator=g),
        "output_layer.weight": torch.randn(V, H, generator=g),
    }
    for k, v in extra.items():
        if v is None:
            t.pop(k)
        else:
            t[k] = v
    return t


def synthetic(tmp_path: Path, tensors: dict, config: dict | None, *, name: str = "actor") -> Path:
    role = tmp_path / name
    dist = role / "dist_ckpt"
    dist.mkdir(parents=True)
    if tensors:
        dcp.save(dict(tensors), storage_writer=FileSystemWriter(str(dist)), **dcp_no_dist())
    (dist / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    if config is not None:
        (role / "huggingface").mkdir()
        (role / "huggingface" / "config.json").write_text(json.dumps(config))
    return role


def test_synthetic_llama_maps_and_splits(tmp_path):
    tensors = _tensors(**{"optimizer.state.exp_avg.decoder.final_layernorm.weight": torch.zeros(H),
                          "decoder.layers.mlp.linear_fc2._extra_state": torch.zeros(3)})
    root = synthetic(tmp_path, tensors, _config())
    assert probe(root) and probe(root / "dist_ckpt")
    ckpt = open_megatron(root)
    specs = ckpt.specs()
    assert specs["model.layers.1.self_attn.q_proj.weight"].shape == (NQ * HD, H)
    assert specs["model.layers.0.self_attn.k_proj.weight"].shape == (NKV * HD, H)
    q, k, v = split_qkv(tensors["decoder.layers.self_attention.linear_qkv.weight"][1], num_heads=NQ, num_kv_heads=NKV, head_dim=HD)
    assert torch.equal(ckpt.read("model.layers.1.self_attn.v_proj.weight"), v)
    gate, up = split_gate_up(tensors["decoder.layers.mlp.linear_fc1.weight"][0])
    assert torch.equal(ckpt.read("model.layers.0.mlp.up_proj.weight"), up)
    assert torch.equal(ckpt.read("model.layers.1.post_attention_layernorm.weight"),
                      tensors["decoder.layers.mlp.linear_fc1.layer_norm_weight"][1])
    assert len(specs) == 3 + 9 * L
    assert ckpt.info.details["layout"] == "v1" and ckpt.info.details["tp"] == 1


def test_reading_one_tensor_reads_one_layer_slice(tmp_path, monkeypatch):
    """Peak memory is one layer slice: q_proj of layer 1 reads only its rows of layer 1."""
    root = synthetic(tmp_path, _tensors(), _config())
    ckpt = open_megatron(root)
    ckpt.read("model.embed_tokens.weight")  # parse files once
    sizes = []
    real = os.preadv

    def counting(fd, bufs, off, *a):
        sizes.append(sum(len(b) for b in bufs))
        return real(fd, bufs, off, *a)

    monkeypatch.setattr(os, "preadv", counting)
    with record_crc.skipping():
        ckpt.read("model.layers.1.self_attn.q_proj.weight")
    assert sum(sizes) == NQ * HD * H * 4  # the q rows of layer 1, not the stacked [L, ...] tensor
    # with the source CRC check (the default), the chunk's record is checked once in full (over a
    # mapping of it, no preadv) the first time any of it is used; the slice itself is read as before
    sizes.clear()
    before = record_crc.stats()
    ckpt.read("model.layers.0.self_attn.q_proj.weight")
    assert sum(sizes) == NQ * HD * H * 4 and record_crc.stats()["records"] == before["records"] + 1
    ckpt.read("model.layers.1.self_attn.q_proj.weight")
    assert record_crc.stats()["records"] == before["records"] + 1  # the same record: not checked again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_chunks_equal_whole_reads(tmp_path, dtype):
    """The writer's streaming path: row chunks (region reads, small chunks here) equal read()."""
    ckpt = open_megatron(synthetic(tmp_path, _tensors(), _config()))
    for name, spec in ckpt.specs().items():
        # a run is valid until the next is requested (the reader reuses its buffer): keep copies
        runs, file_backed = [], []
        for first, piece in ckpt.read_rows(name, dtype, max_bytes=3 * H * dtype.itemsize):
            runs.append((first, file_runs.values(piece).clone()))
            file_backed.append(file_runs.run_of(piece) is not None)
        width = spec.shape[1] if len(spec.shape) == 2 else 1
        step = max(1, 3 * H // width)  # chunks of at most max_bytes: [*, H] matrices 3 rows, vectors whole
        firsts = [first for first, _ in runs]
        # a tensor stored whole in dim-0 bands of the file, in the asked dtype, is zero-copy views
        # of the mapped file (checkpoint.row_runs): one run per band, any size; else bounded chunks
        zero_copy = all(file_backed)
        if not zero_copy:
            assert firsts == list(range(0, spec.shape[0], step)), name
        else:
            assert firsts[0] == 0 and firsts == sorted(firsts), name
        assert torch.equal(torch.cat([rows for _, rows in runs]), ckpt.read(name, dtype=dtype)), name


def test_unknown_tensor_is_an_error_naming_it(tmp_path):
    root = synthetic(tmp_path, _tensors(**{"decoder.layers.mlp.router.weight": torch.zeros(L, 4, H)}), _config())
    with pytest.raises(MappingError, match=r"decoder\.layers\.mlp\.router\.weight.*Nothing was dropped"):
        open_megatron(root)
    with pytest.raises(MappingError, match=r"megatron_gpt\.llama' \(model_type 'llama'\)"):  # the table and the model
        open_megatron(root)


def test_tied_embeddings_follow_the_checkpoint(tmp_path):
    ckpt = open_megatron(synthetic(tmp_path / "a", _tensors(**{"output_layer.weight": None}), _config()))
    assert ckpt.info.details["tied"] and "lm_head.weight" not in ckpt.specs()
    assert ckpt.info.config_overrides == ConfigOverrides(tie_word_embeddings=True)
    assert ckpt.info.warnings
    ckpt = open_megatron(synthetic(tmp_path / "b", _tensors(), _config(tie_word_embeddings=True)))
    assert not ckpt.info.details["tied"] and "lm_head.weight" in ckpt.specs()
    assert ckpt.info.config_overrides.as_dict() == {"tie_word_embeddings": False}


def test_config_problems_are_named(tmp_path):
    """Before: "pass config_dir= (CLI: --hf_model_config_path)", an option no command has and a
    keyword no function takes. The CLI's message names --config; hf_merge.merge's names config=."""
    import hf_merge

    with pytest.raises(MissingConfigError, match=r"pass --config DIR \(alias --hf_model_path\)"):
        open_megatron(synthetic(tmp_path / "a", _tensors(), None))
    with pytest.raises(MissingConfigError, match=r"pass config=DIR with the base model's config.json"):
        hf_merge.merge(tmp_path / "a", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps(_config()))
    assert open_megatron(tmp_path / "a" / "actor", config_dir=cfg_dir).info.hf_dir == cfg_dir
    with pytest.raises(MappingError, match="num_hidden_layers=3"):
        open_megatron(synthetic(tmp_path / "b", _tensors(), _config(num_hidden_layers=3)))
    with pytest.raises(MappingError, match="head_dim"):
        open_megatron(synthetic(tmp_path / "c", _tensors(), _config(head_dim=2)))
    with pytest.raises(MappingError, match="supported: .*qwen2"):
        open_megatron(synthetic(tmp_path / "d", _tensors(), _config(model_type="gpt_neox")))
    bias = torch.zeros(L, (NQ + 2 * NKV) * HD)
    with pytest.raises(MappingError, match="attention_bias: true"):
        open_megatron(synthetic(tmp_path / "e", _tensors(**{"decoder.layers.self_attention.linear_qkv.bias": bias}), _config()))
    ok = open_megatron(synthetic(tmp_path / "f", _tensors(**{"decoder.layers.self_attention.linear_qkv.bias": bias}),
                                 _config(attention_bias=True)))
    assert ok.specs()["model.layers.0.self_attn.q_proj.bias"].shape == (NQ * HD,)
    with pytest.raises(MappingError, match=r"requires .*linear_qkv\.bias"):
        open_megatron(synthetic(tmp_path / "g", _tensors(), _config(model_type="qwen2")))


def test_two_spellings_of_one_tensor_are_rejected(tmp_path):
    extra = {"decoder.layers.input_layernorm.weight": torch.zeros(L, H)}
    with pytest.raises(MappingError, match="two spellings"):
        open_megatron(synthetic(tmp_path, _tensors(**extra), _config()))


def test_no_model_tensors_says_so_without_listing_optimizer_keys(tmp_path):
    opt = {f"optimizer.state.exp_avg.{k}": v for k, v in _tensors().items()}
    with pytest.raises(UnsupportedCheckpointError, match="no model tensors") as e:
        open_megatron(synthetic(tmp_path, opt, _config()))
    assert "exp_avg" not in str(e.value)


def test_unfinished_dist_ckpt_and_foreign_folders(tmp_path):
    root = synthetic(tmp_path / "a", {}, _config())  # metadata.json but no .metadata
    with pytest.raises(CorruptCheckpointError, match="no .metadata"):
        open_megatron(root)
    (tmp_path / "b").mkdir()
    assert not probe(tmp_path / "b")
    with pytest.raises(UnsupportedCheckpointError):
        open_megatron(tmp_path / "b")


def test_v2_manifest_paths_must_stay_inside(tmp_path):
    from hf_merge.errors import UnsafeCheckpointError

    role = tmp_path / "actor"
    role.mkdir()
    (role / "ckpt_contents.json").write_text(json.dumps(
        {"schema_version": 2, "framework": "megatron",
         "contents": {"model": {"path": "../../elsewhere", "format": "megatron_dist_checkpoint"}}}))
    with pytest.raises(UnsafeCheckpointError):
        open_megatron(role)


def test_mapping_tables_are_validated():
    from hf_merge.transforms.name_table import NameRule, NameTable, Split, find_table

    tables = {mt: find_table("megatron", {"model_type": mt}) for mt in ("llama", "mistral", "qwen2", "qwen3")}
    for mt, table in tables.items():
        assert table.model_types == (mt,) and table.order == "table"
    assert "split qkv" in tables["qwen2"].describe()
    good = tables["qwen2"]
    with pytest.raises(TypeError, match="head_split"):  # a field no code reads is an error, not silently ignored
        NameTable(**{f: getattr(good, f) for f in ("name", "source", "model_types", "rules")}, head_split=True)
    with pytest.raises(ValueError, match="exactly the roles"):
        Split("qkv", (("q", "a"), ("k", "b")))
    with pytest.raises(ValueError, match="not a rule's source"):
        NameTable(good.name, good.source, good.model_types, good.rules, required=("nope.weight",))
    with pytest.raises(ValueError, match="lost"):
        NameRule("decoder.layers.{layer}.x.weight", "model.layers.x.weight")


def test_legacy_rank_files_tp_vpp_and_value_head(tmp_path):
    """Legacy per-rank files (TP=2, PP=2, 2 virtual stages): TP shards joined along the table's
    dims (gate/up interleaved per rank), layers placed by virtual-stage order, [1, H] head kept."""
    nq, nkv, hd, f, layers, tp, pp, vpp = 4, 2, 2, 6, 4, 2, 2, 2
    g = torch.Generator().manual_seed(1)
    glob = {
        "embedding.word_embeddings.weight": torch.randn(V, H, generator=g),
        "decoder.final_layernorm.weight": torch.randn(H, generator=g),
        "output_layer.weight": torch.randn(1, H, generator=g),
    }
    per = [
        {
            "input_layernorm.weight": torch.randn(H, generator=g),
            "self_attention.linear_qkv.weight": torch.randn((nq + 2 * nkv) * hd, H, generator=g),
            "self_attention.linear_proj.weight": torch.randn(H, nq * hd, generator=g),
            "pre_mlp_layernorm.weight": torch.randn(H, generator=g),
            "mlp.linear_fc1.weight": torch.randn(2 * f, H, generator=g),
            "mlp.linear_fc2.weight": torch.randn(H, f, generator=g),
        }
        for _ in range(layers)
    ]

    def shard(suffix: str, t: torch.Tensor, r: int) -> torch.Tensor:
        if suffix in ("self_attention.linear_qkv.weight",):
            return t.chunk(tp, 0)[r]
        if suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
            return t.chunk(tp, 1)[r]
        if suffix == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2, 0)
            return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]])
        return t

    role = tmp_path / "critic"
    stage_order = [(v, p) for v in range(vpp) for p in range(pp)]  # global layer i = stage_order[i]
    for r in range(tp):
        for p in range(pp):
            sds = []
            for v in range(vpp):
                i = stage_order.index((v, p))
                sd = {f"decoder.layers.0.{k}": shard(k, t, r) for k, t in per[i].items()}
                sd["decoder.layers.0.mlp.linear_fc1._extra_state"] = None
                if (v, p) == stage_order[0]:
                    sd["embedding.word_embeddings.weight"] = glob["embedding.word_embeddings.weight"].chunk(tp, 0)[r]
                if (v, p) == stage_order[-1]:
                    sd["decoder.final_layernorm.weight"] = glob["decoder.final_layernorm.weight"]
                    sd["output_layer.weight"] = glob["output_layer.weight"]  # replicated value head
                sds.append(sd)
            d = role / "model" / f"mp_rank_{r:02d}_{p:03d}"
            d.mkdir(parents=True)
            torch.save(sds, d / "model.pt")
    (role / "huggingface").mkdir()
    cfg = _config(num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd, intermediate_size=f, num_hidden_layers=layers)
    (role / "huggingface" / "config.json").write_text(json.dumps(cfg))

    assert probe(role)
    ckpt = open_megatron(role)
    d = ckpt.info.details
    assert (d["layout"], d["tp"], d["pp"], d["vpp"], d["value_model"]) == ("legacy", 2, 2, 2, True)
    assert ckpt.info.config_overrides.as_dict()["architectures"] == ["LlamaForTokenClassification"]
    assert torch.equal(ckpt.read("model.embed_tokens.weight"), glob["embedding.word_embeddings.weight"])
    assert torch.equal(ckpt.read("score.weight"), glob["output_layer.weight"])
    for i in range(layers):
        q, k, v = split_qkv(per[i]["self_attention.linear_qkv.weight"], num_heads=nq, num_kv_heads=nkv, head_dim=hd)
        gate, up = split_gate_up(per[i]["mlp.linear_fc1.weight"])
        p = f"model.layers.{i}."
        want = {
            "input_layernorm.weight": per[i]["input_layernorm.weight"],
            "post_attention_layernorm.weight": per[i]["pre_mlp_layernorm.weight"],
            "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
            "self_attn.o_proj.weight": per[i]["self_attention.linear_proj.weight"],
            "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
            "mlp.down_proj.weight": per[i]["mlp.linear_fc2.weight"],
        }
        for name, t in want.items():
            assert torch.equal(ckpt.read(p + name), t), p + name
    assert len(ckpt.specs()) == 3 + 9 * layers

    # A missing rank file is named.
    (role / "model" / "mp_rank_01_001" / "model.pt").unlink()
    (role / "model" / "mp_rank_01_001").rmdir()
    with pytest.raises(CorruptCheckpointError, match="mp_rank_01_001"):
        open_megatron(role)
    # The last pipeline stage gone, then the last TP rank: the names alone cannot tell, so the shape
    # or layer-count error says which folders were found (before: only "check config.json").
    (role / "model" / "mp_rank_00_001" / "model.pt").unlink()
    (role / "model" / "mp_rank_00_001").rmdir()
    with pytest.raises(MappingError, match=r"hold 2 layers but .*num_hidden_layers=4.* \(or rank folders are missing: "
                                           r".* holds mp_rank_00_000, mp_rank_01_000 only, TP=2 x PP=1\)"):
        open_megatron(role)
    shutil.rmtree(role / "model" / "mp_rank_01_000")
    with pytest.raises(MappingError, match=r"\(or rank folders are missing: .* holds mp_rank_00_000 only, TP=1 x PP=1\)"):
        open_megatron(role)


# --------------------------------------------------------------------------------------------
# End to end: the CLI merge of real Megatron checkpoints, loaded by transformers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MERGED + MBRIDGE)
def test_cli_merge_loads_in_transformers_with_megatron_logits(megatron_root, name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    var = VARIANTS[name]
    target = tmp_path / "merged"
    proc = run_cli(  # in this process: the CLI's parsing and output are tested, not the interpreter
        "merge", "--backend", "megatron", "--local_dir", role_dir(megatron_root, name), "--target_dir", target,
        "--dtype", "float32", "--verify", *(["--is-value-model"] if var.value else []),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((target / "hf_merge.json").read_text())["verification"]["passed"] is True
    cls = AutoModelForTokenClassification if var.value else AutoModelForCausalLM
    model = cls.from_pretrained(target, **dtype_kwargs(torch.float32), attn_implementation="eager").eval()
    if var.value:
        cfg = json.loads((target / "config.json").read_text())
        assert cfg["num_labels"] == 1 and cfg["architectures"][0].endswith("ForTokenClassification")
    ref_path = megatron_root / name / "reference.pt"
    if not ref_path.is_file():  # mbridge: the HF weights are the reference
        assert "huggingface" in proc.stderr or "mbridge" in proc.stderr, proc.stderr
        return
    ref = torch.load(ref_path)
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"], attention_mask=torch.ones_like(ref["input_ids"])).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-4)
