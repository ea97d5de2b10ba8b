"""PyTorch DCP sources written by the real frameworks on CPU (examples/make_dcp_checkpoints.py):
accelerate FSDP2 ``save_state``, torchtitan's model + FSDP2 + ``CheckpointManager``, and
``torch.distributed.checkpoint.save`` of FSDP2-sharded HF models. Each merge is compared byte for
byte with the trained weights and by logits."""

from __future__ import annotations

import builtins
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import hf_merge
from hf_merge.readers.file_runs import values
from hf_merge.readers import formats
from hf_merge.cli.app import main as cli_main
from hf_merge.errors import IncompleteStepError, MappingError, MissingConfigError
from hf_merge.provenance import Provenance
from hf_merge.transforms.name_table import NameRule, NameTable
from hf_merge.transforms.name_table_view import NameTableView, rope_source_rows

from helpers import (
    incomplete_newest_step,
    dcp_no_dist,
    assert_tensors_equal,
    detections_differing_from_every_probe,
    folder_tensors,
    fresh_merge_imports,
    model_logits,
    read_json,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _merge(*args) -> None:
    assert cli_main(["merge", *map(str, args), "--overwrite"]) == 0


def _check_logits(out: Path, reference: Path, *, exact: bool, dtype: torch.dtype = torch.float32) -> None:
    ref = torch.load(reference / "logits.pt", weights_only=True)
    got = model_logits(out, ref["input_ids"], dtype=dtype)
    if exact:
        assert torch.equal(got, ref["logits"])
    else:
        torch.testing.assert_close(got, ref["logits"], atol=2e-5, rtol=1e-4)


def test_detection_by_marks_equals_every_probe(dcp_root):
    """accelerate, torchtitan and plain DCP folders, every folder of them: detect(), probing only
    the formats whose marks are there, matches what every probe says."""
    assert detections_differing_from_every_probe(dcp_root) == []


# ---- accelerate ---------------------------------------------------------------------------


def test_accelerate_full_training_folder_merges_bit_exact(dcp_root, tmp_path, monkeypatch):
    src = dcp_root / "accelerate" / "ckpt"
    assert {"optimizer_0", "pytorch_model_fsdp_0"} <= {p.name for p in src.iterdir()}
    assert any(p.suffix == ".pkl" for p in src.iterdir())
    det = formats.detect(src)
    assert det.chosen.name == "accelerate" and det.matched == ("accelerate",)

    opened: list[str] = []  # every file the merge opens: never the RNG pickles or the optimizer
    real_open, real_os_open = builtins.open, os.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (opened.append(str(f)), real_open(f, *a, **k))[1])
    monkeypatch.setattr(os, "open", lambda f, *a, **k: (opened.append(str(f)), real_os_open(f, *a, **k))[1])
    out = tmp_path / "out"
    _merge(src, out, "--config", dcp_root / "accelerate" / "config", "--verify")
    monkeypatch.undo()
    assert not [f for f in opened if f.endswith(".pkl") or "optimizer_0" in f], opened
    assert any(f.endswith(".distcp") for f in opened)  # the recorder saw the reads
    assert_tensors_equal(folder_tensors(out), folder_tensors(dcp_root / "accelerate" / "reference"))
    _check_logits(out, dcp_root / "accelerate" / "reference", exact=True)
    prov = read_json(out / "hf_merge.json")["source"]
    assert prov["format"] == "accelerate" and prov["framework"] == "accelerate" and prov["world_size"] == 2


def test_accelerate_config_beside_and_newest_checkpoint(dcp_root, tmp_path):
    project = tmp_path / "project" / "checkpoints"
    for i in (0, 3):  # accelerate's automatic_checkpoint_naming layout
        shutil.copytree(dcp_root / "accelerate" / "ckpt", project / f"checkpoint_{i}", ignore=shutil.ignore_patterns("optimizer_0"))
    with pytest.raises(MissingConfigError, match="--config"):
        hf_merge.open_checkpoint(project.parent)
    shutil.copy(dcp_root / "accelerate" / "config" / "config.json", project / "checkpoint_3" / "config.json")
    assert detections_differing_from_every_probe(project.parent) == []
    with hf_merge.open_checkpoint(project.parent) as ckpt:
        assert ckpt.info.reader == "accelerate" and ckpt.info.step == 3
        assert any("checkpoint_3" in n for n in ckpt.info.notes)
        assert "model.embed_tokens.weight" in ckpt.specs() and not any(k.startswith("model.model.") for k in ckpt.specs())
    # a newer checkpoint_<i> that a save cut short: named with the complete one to pass, never replaced by it
    (project / "checkpoint_4" / "pytorch_model_fsdp_0").mkdir(parents=True)
    (project / "logs").mkdir()  # not a checkpoint: ignored
    assert detections_differing_from_every_probe(project.parent) == []
    with pytest.raises(IncompleteStepError, match=re.escape(
            incomplete_newest_step(project / "checkpoint_4", project / "checkpoint_3"))):
        hf_merge.open_checkpoint(project.parent)
    with hf_merge.open_checkpoint(project / "checkpoint_3") as ckpt:
        assert ckpt.info.reader == "accelerate"


# ---- torchtitan ---------------------------------------------------------------------------


@pytest.mark.parametrize("family, table", [("torchtitan", "torchtitan-llama3"), ("torchtitan_qwen3", "torchtitan-qwen3")])
def test_torchtitan_step_folder_merges_to_hf_names(dcp_root, tmp_path, family, table):
    tt = dcp_root / family
    step = tt / "dump" / "checkpoint" / "step-1"
    assert formats.detect(tt / "dump").chosen.name == "torchtitan"
    with pytest.raises(MissingConfigError, match="--config"):
        hf_merge.open_checkpoint(step)
    with hf_merge.open_checkpoint(tt / "dump", config=tt / "config") as ckpt:
        assert ckpt.info.step == 1 and ckpt.info.details["name_table"] == table
        assert any(n.startswith("optimizer.") for n in ckpt.dropped)  # a full training checkpoint
    assert cli_main(["inspect", str(tt / "dump"), "--config", str(tt / "config")]) == 0
    out = tmp_path / "out"
    _merge(tt / "dump", out, "--config", tt / "config", "--verify")
    # the reference is torchtitan's own state-dict adapter's to_hf of the trained weights
    # (Qwen3 is tied: neither has lm_head.weight)
    assert_tensors_equal(folder_tensors(out), folder_tensors(tt / "reference"))
    prov = read_json(out / "hf_merge.json")
    assert prov["verification"]["passed"] and prov["source"]["format"] == "torchtitan"
    record = Provenance.read(out)  # the typed record reads back what merge wrote, key for key
    assert record.source.framework == "torchtitan" and record.source.step == 1 and record.to_dict() == prov
    assert "from a torchtitan training checkpoint" in (out / "README.md").read_text()
    # transformers' model on the merged folder vs torchtitan's own forward (flex attention)
    _check_logits(out, tt / "reference", exact=False)


def test_torchtitan_incomplete_newest_step_is_named_not_replaced(dcp_root, tmp_path, capsys):
    """An empty (or .metadata-less) newer step-<N>, a save cut short: one line names it and the
    complete step to pass, nothing written. Before: a note, and step-1 merged in its place."""
    tt = dcp_root / "torchtitan"
    dump = tmp_path / "dump"
    shutil.copytree(tt / "dump" / "checkpoint" / "step-1", dump / "checkpoint" / "step-1")
    (dump / "checkpoint" / "step-5").mkdir()
    shutil.copy(tt / "dump" / "checkpoint" / "step-1" / "__0_0.distcp", dump / "checkpoint" / "step-5")
    assert formats.detect(dump).chosen.name == "torchtitan"
    want = incomplete_newest_step(dump / "checkpoint" / "step-5", dump / "checkpoint" / "step-1")
    for given in (dump, dump / "checkpoint"):
        assert cli_main(["merge", str(given), str(tmp_path / "out"), "--config", str(tt / "config")]) != 0
        assert capsys.readouterr().err.strip() == f"error: {want}"
        assert not (tmp_path / "out").exists()
    with hf_merge.open_checkpoint(dump / "checkpoint" / "step-1", config=tt / "config") as ckpt:
        assert ckpt.info.step == 1


def test_torchtitan_row_path_equals_full_reads(dcp_root):
    tt = dcp_root / "torchtitan"
    with hf_merge.open_checkpoint(tt / "dump", config=tt / "config") as ckpt:
        name = "model.layers.1.self_attn.k_proj.weight"
        full = ckpt.read(name)
        got = torch.empty(full.shape, dtype=torch.float64)
        runs = 0
        for first, piece in ckpt.read_rows(name, torch.float64, max_bytes=3 * full.shape[1] * 8):
            rows = values(piece)
            got[first : first + len(rows)] = rows  # a run is valid until the next one is asked for
            runs += 1
        assert runs > 2 and torch.equal(got, full.double())


@pytest.mark.parametrize("cut", [False, True], ids=["heads whole", "a chunk boundary inside heads"])
def test_torchtitan_qk_rows_are_file_bytes_in_head_order(dcp_root, monkeypatch, cut):
    """A q/k projection's un-permuted rows come as the source files' bytes: a head whose rows one
    run holds is one RowGather (read once, rows copied in order), a head a chunk boundary cuts is a
    run per row; either way the tensor equals the region-read un-permutation."""
    from hf_merge.readers.dcp import DcpCheckpoint
    from hf_merge.readers.file_runs import FileRun, RowGather

    if cut:  # every run split after its third row: a boundary inside the first head of each band
        real = DcpCheckpoint.file_rows

        def cut_rows(self, name, index, first, rows):
            runs = real(self, name, index, first, rows)
            out = []
            for row, run in runs or ():
                row_bytes = run.nbytes // len(run.tensor)
                out += [(row, run.rows(0, 3, row_bytes)), (row + 3, run.rows(3, len(run.tensor) - 3, row_bytes))]
            return out if runs is not None else None

        monkeypatch.setattr(DcpCheckpoint, "file_rows", cut_rows)
    tt = dcp_root / "torchtitan"
    with hf_merge.open_checkpoint(tt / "dump", config=tt / "config") as ckpt:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
            spec = ckpt.specs()[name]
            got = torch.empty(spec.shape, dtype=spec.dtype)
            kinds = set()
            for first, piece in ckpt.read_rows(name, spec.dtype):
                assert isinstance(piece, (FileRun, RowGather))
                kinds.add(type(piece).__name__)
                got[first : first + len(values(piece))] = values(piece)
            assert kinds == ({"RowGather", "FileRun"} if cut else {"RowGather"})
            view = ckpt
            while not hasattr(view, "_rope_rows"):
                view = view.base
            want = torch.empty_like(got)
            for first, rows in view._rope_rows(view._targets[name], spec.dtype, 1 << 20):
                want[first : first + len(rows)] = rows
            assert torch.equal(got, want)


def test_rope_permutation_is_torchtitans():
    pytest.importorskip("torchtitan")
    import make_dcp_checkpoints as mk

    mk._torchtitan_stand_ins()
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    for rows, heads, dim in ((64, 4, 64), (32, 2, 64), (48, 3, 8)):
        w = torch.randn(rows, dim)
        want = Llama3StateDictAdapter._permute(None, w, heads, rows, dim)
        assert torch.equal(w[rope_source_rows(rows, heads)], want)


# ---- generic DCP --------------------------------------------------------------------------


def test_generic_dcp_top_level_hf_names_tied_bf16(dcp_root, tmp_path):
    src = dcp_root / "dcp_plain" / "ckpt"
    assert formats.detect(src).chosen.name == "dcp"
    out = tmp_path / "out"
    (src / "zero_to_fp32.py").write_text("raise SystemExit('a training script, not modeling code')\n")
    (src / "latest").write_text("global_step1\n")
    try:
        _merge(src, out)  # config.json beside the .metadata (and the training run's own files)
    finally:
        (src / "zero_to_fp32.py").unlink()
        (src / "latest").unlink()
    # the config folder is the checkpoint itself: its rank files and training files stay behind
    assert not [f.name for f in out.iterdir() if f.suffix in (".distcp", ".py") or f.name in ("latest", ".metadata")]
    got = folder_tensors(out)
    assert "lm_head.weight" not in got and got["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert_tensors_equal(got, folder_tensors(dcp_root / "dcp_plain" / "reference"))
    _check_logits(out, dcp_root / "dcp_plain" / "reference", exact=True, dtype=torch.bfloat16)


def test_generic_dcp_model_beside_optimizer(dcp_root, tmp_path):
    src = dcp_root / "dcp_nested" / "ckpt"
    with hf_merge.open_checkpoint(src, config=dcp_root / "dcp_nested" / "config") as ckpt:
        assert ckpt.info.reader == "dcp" and not any("optimizer" in k or k.startswith("model.model.") for k in ckpt.specs())
    out = tmp_path / "out"
    _merge(src, out, "--config", dcp_root / "dcp_nested" / "config", "--dtype", "auto")
    assert_tensors_equal(folder_tensors(out), folder_tensors(dcp_root / "dcp_nested" / "reference"))


# ---- the name table itself ----------------------------------------------------------------


def test_name_rules_are_validated():
    with pytest.raises(ValueError, match="lost"):
        NameRule("layers.{layer}.w", "model.w")
    with pytest.raises(ValueError, match="unknown op"):
        NameRule("a.{layer}", "b.{layer}", op="transpose")
    with pytest.raises(ValueError, match="twice"):
        NameTable("t", "s", ("llama",), (NameRule("a", "x"), NameRule("a", "y")))
    with pytest.raises(ValueError, match="two rules write"):
        NameTable("t", "s", ("llama",), (NameRule("a", "x"), NameRule("b", "x")))
    rule = NameRule("layers.{layer}.experts.w1", "model.layers.{layer}.experts.{expert}.gate.weight")
    assert rule.stacked == ("expert",) and rule.pattern.match("layers.12.experts.w1")["layer"] == "12"


def test_unknown_source_tensor_is_named(dcp_root):
    tt = dcp_root / "torchtitan"
    with hf_merge.open_checkpoint(dcp_root / "dcp_nested" / "ckpt", config=tt / "config") as ckpt:
        from hf_merge.transforms.name_tables.torchtitan import TABLES

        with pytest.raises(MappingError, match=r"model\.embed_tokens\.weight.*no rule of name table 'torchtitan-llama3'"):
            NameTableView(ckpt, TABLES[0], read_json(tt / "config" / "config.json"))


def test_unstacking_reads_one_expert_at_a_time(tmp_path):
    """``{expert}`` only in the HF name: dim 0 of a grouped tensor, read as a box (DCP file)."""
    import torch.distributed.checkpoint as dcp

    from hf_merge.readers.dcp import DcpCheckpoint

    grouped = torch.randn(3, 5, 4)
    dcp.save({"layers.0.moe.w1_EFD": grouped}, checkpoint_id=str(tmp_path / "c"), **dcp_no_dist())
    table = NameTable("t", "s", ("x",), (NameRule("layers.{layer}.moe.w1_EFD", "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight"),))
    with NameTableView(DcpCheckpoint(tmp_path / "c"), table, {}) as view:
        assert list(view.specs()) == [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(3)]
        for e in range(3):
            assert torch.equal(view.read(f"model.layers.0.mlp.experts.{e}.gate_proj.weight"), grouped[e])


# ---- transforms that pass a tensor through keep the row path ------------------------------


def _rows(ckpt, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    runs = ckpt.read_rows(name, dtype)
    if runs is None:
        return None
    out = torch.empty(ckpt.specs()[name].shape, dtype=dtype)
    for first, piece in runs:
        rows = values(piece)
        out[first : first + len(rows)] = rows
    return out


def test_quantized_passes_the_row_path_through(dcp_root):
    pytest.importorskip("bitsandbytes")
    from hf_merge.transforms.quantize import Quantized

    cfg = read_json(dcp_root / "dcp_nested" / "config" / "config.json")
    with hf_merge.open_checkpoint(dcp_root / "dcp_nested" / "ckpt", config=dcp_root / "dcp_nested" / "config") as ckpt:
        q = Quantized(ckpt, cfg, "int8")
        plain = "model.embed_tokens.weight"
        assert plain in q.specs() and q.quantized
        assert torch.equal(_rows(q, plain, torch.float32), ckpt.read(plain))
        assert q.read_rows(f"{q.quantized[0]}.weight", torch.int8) is None  # computed: no row path


def test_lora_adapter_passes_the_row_path_through(lora_ckpt):
    from hf_merge.transforms.lora_layout import find_lora
    from hf_merge.transforms.lora import LoraAdapter

    with hf_merge.open_checkpoint(lora_ckpt.root) as ckpt:
        adapter = LoraAdapter(ckpt, find_lora(ckpt.specs()))
        for name in list(adapter.specs())[:4]:
            want = adapter.read(name)
            assert ckpt.read_rows(adapter._table[name], want.dtype) is not None
            assert torch.equal(_rows(adapter, name, want.dtype), want)


# --------------------------------------------------------------------------------------------
# .metadata through stand-ins (readers/dcp_metadata.py) == through torch's own classes
# --------------------------------------------------------------------------------------------


def _torch_metadata(path: Path):
    import torch.distributed.checkpoint  # noqa: F401  (torch's classes, as before the stand-ins)

    from hf_merge.readers.safe_pickle import DCP_METADATA, load_pickle

    return load_pickle((Path(path) / ".metadata").read_bytes(), DCP_METADATA, ".metadata")


def _dcp_view(path: Path):
    from hf_merge.readers.dcp import DcpCheckpoint

    ck = DcpCheckpoint(path)
    try:
        return ck.specs(), ck._chunks, ck.byte_keys()
    finally:
        ck.close()


def test_metadata_stand_ins_equal_torchs_objects(dcp_root, megatron_root, monkeypatch):
    """Every real .metadata (accelerate, torchtitan, torch DCP, Megatron-Core dist checkpoints with
    planner data and byte entries) gives the same specs, chunks and byte keys both ways."""
    from hf_merge.readers import dcp

    dirs = sorted({p.parent for root in (dcp_root, megatron_root) for p in root.rglob(".metadata")})
    assert len(dirs) >= 8
    ours = {d: _dcp_view(d) for d in dirs}
    monkeypatch.setattr(dcp, "load_dcp_metadata", _torch_metadata)
    for d in dirs:
        specs, chunks, byte_keys = _dcp_view(d)
        assert (specs, chunks, byte_keys) == ours[d], d
        assert specs or byte_keys


@pytest.mark.slow  # a fresh interpreter; make test keeps the verl FSDP merge's import checks (test_formats.py)
def test_dcp_merge_does_not_import_torch_distributed_checkpoint(dcp_root, tmp_path):
    src = dcp_root / "accelerate" / "ckpt"
    argv = ["merge", src, tmp_path / "out", "--config", dcp_root / "accelerate" / "config"]
    mods = ["torch.distributed.checkpoint", "torch.distributed.tensor"]
    assert fresh_merge_imports(argv, mods) == {"code": 0, **dict.fromkeys(mods, False)}


def test_generic_dcp_metadata_is_read_once_per_open(dcp_root, monkeypatch):
    """Opening a plain DCP folder parses its ``.metadata`` once (it was twice: a probe for the
    ``model.`` wrapper, then the reader), and the reader it keeps reads the same tensors."""
    from hf_merge.readers import dcp_index

    src = dcp_root / "dcp_plain" / "ckpt"
    calls = []
    real = dcp_index.load_dcp_metadata
    monkeypatch.setattr(dcp_index, "load_dcp_metadata", lambda path, **kw: calls.append(path) or real(path, **kw))
    want = folder_tensors(dcp_root / "dcp_plain" / "reference")  # tied: the reader also names lm_head
    with hf_merge.open_checkpoint(src) as ckpt:
        assert calls == [src] and ckpt.info.reader == "dcp"
        got = {name: ckpt.read(name) for name in want}
    assert_tensors_equal(got, want)
