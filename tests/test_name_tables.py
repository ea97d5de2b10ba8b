"""Name tables: typed data found in hf_merge/transforms/name_tables/, applied by the one interpreter
(hf_merge/transforms/name_table.py, name_table_view.py) for every format that renames (Megatron, torchtitan)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_merge.readers.file_runs import values
from hf_merge.transforms import name_tables
from hf_merge.errors import MappingError, MissingConfigError
from hf_merge.readers.dcp import DcpCheckpoint
from hf_merge.transforms import Renamed
from hf_merge.transforms.name_table import NameRule, NameTable, all_tables, find_table, gate_up
from hf_merge.transforms.name_table_view import NameTableView
from helpers import dcp_no_dist


def test_every_table_file_is_found_and_valid():
    """Each module of hf_merge/transforms/name_tables/ declares TABLES; all of them are discovered, every
    (source, model_type) has exactly one table, and each is reachable through find_table."""
    modules = [m.name for m in pkgutil.iter_modules(name_tables.__path__)]
    assert {"megatron_gpt", "megatron_moe", "torchtitan"} <= set(modules)
    declared = []
    for name in modules:
        tables = importlib.import_module(f"hf_merge.transforms.name_tables.{name}").TABLES
        assert tables and all(isinstance(t, NameTable) for t in tables), name
        declared += tables
    assert [t.name for t in all_tables()] == [t.name for t in declared]
    for table in declared:
        for model_type in table.model_types:
            assert find_table(table.source, {"model_type": model_type}) is table
        assert all(isinstance(r, NameRule) for r in table.rules)
    megatron = {m for t in declared if t.source == "megatron" for m in t.model_types}
    assert megatron == {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"}
    with pytest.raises(MappingError, match=r"no megatron name table for model_type 'gpt2'.*supported: deepseek_v3, llama"):
        find_table("megatron", {"model_type": "gpt2"})


def test_two_rules_writing_one_name_must_say_they_are_spellings():
    with pytest.raises(ValueError, match="two rules write"):
        NameTable("t", "s", ("x",), (NameRule("a.{layer}", "b.{layer}"), NameRule("c.{layer}", "b.{layer}")))
    table = NameTable("t", "s", ("x",), (NameRule("a.{layer}", "b.{layer}"), NameRule("c.{layer}", "b.{layer}", alt=True)))
    with pytest.raises(ValueError, match="no earlier rule writes"):
        NameTable("t", "s", ("x",), (NameRule("c.{layer}", "b.{layer}", alt=True),))
    assert table.match("c.7")[0].alt


L, E, F, H = 3, 4, 2, 5


@pytest.fixture(scope="module")
def stacked_dcp(tmp_path_factory):
    """A torch DCP folder (written by torch's own dcp.save) with two placeholders in every spelling:
    both stacked ``[L, E, 2F, H]``, layer named and experts stacked ``[E, ...]``, both named."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "blocks.experts.fc1": torch.randn(L, E, 2 * F, H, generator=g),
        "blocks.0.experts.fc2": torch.randn(E, H, F, generator=g),
        "blocks.1.experts.fc2": torch.randn(E, H, F, generator=g),
        **{f"blocks.2.experts.{e}.fc2": torch.randn(H, F, generator=g) for e in range(E)},
        "blocks.router": torch.randn(L, E, H, generator=g),
    }
    path = tmp_path_factory.mktemp("stacked") / "dcp"
    dcp.save(dict(tensors), checkpoint_id=str(path), **dcp_no_dist())
    return path, tensors


def _table(**kw) -> NameTable:
    hf = "model.layers.{layer}.mlp."
    rules = (
        NameRule("blocks.router", hf + "gate.weight"),
        NameRule("blocks.{layer}.experts.fc2", hf + "experts.{expert}.down_proj.weight"),
        NameRule("blocks.{layer}.experts.{expert}.fc2", hf + "experts.{expert}.down_proj.weight", alt=True),
        NameRule("blocks.experts.fc1", gate_up(hf + "experts.{expert}.gate_proj.weight", hf + "experts.{expert}.up_proj.weight")),
    )
    return NameTable("test-moe", "test", ("x",), rules, **kw)


def test_several_placeholders_round_trip(stacked_dcp):
    """{layer} and {expert}, named or stacked (in the HF name's order), with a gate/up split: every
    HF tensor is exactly its slice of the source, and HF name -> (source, values) -> HF name."""
    path, src = stacked_dcp
    sizes = {"layer": "num_hidden_layers", "expert": "num_experts"}
    config = {"num_hidden_layers": L, "num_experts": E}
    with NameTableView(DcpCheckpoint(path), _table(sizes=sizes, complete=("expert",), order="table"), config) as view:
        assert len(view.specs()) == L * (1 + 3 * E)
        names = list(view.specs())
        assert names[:3] == ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.0.down_proj.weight",
                             "model.layers.0.mlp.experts.1.down_proj.weight"]  # table order, layer by layer
        for r in view.resolved():
            layer, expert = r.values["layer"], r.values["expert"] if "expert" in r.values else None
            pattern = dict(r.rule.targets)[r.role]
            assert pattern.format(**r.values) == r.name  # the values give the name back
            named = {k: str(v) for k, v in r.values.items() if "{" + k + "}" in r.rule.source}
            assert view.table.match(r.source) == (r.rule, named)  # and the source name gives the values
            got = view.read(r.name)
            if r.source == "blocks.router":
                want = src[r.source][layer]
            elif r.source == "blocks.experts.fc1":
                want = src[r.source][layer, expert, : F] if r.role == "gate" else src[r.source][layer, expert, F:]
            elif "{expert}" in r.rule.source:
                want = src[r.source]
            else:
                want = src[r.source][expert]
            assert torch.equal(got, want), r.name
            runs = view.read_rows(r.name, torch.float32, max_bytes=H * 4)
            assert torch.equal(torch.cat([values(rows).clone() for _, rows in runs]), want), r.name
        assert view.describe_source("model.layers.2.mlp.experts.3.up_proj.weight") == "blocks.experts.fc1[2][3] (gate_up: up)"


def test_sizes_and_completeness_come_from_the_config(stacked_dcp):
    path, _ = stacked_dcp
    sizes = {"layer": "num_hidden_layers", "expert": "num_experts"}
    with pytest.raises(MappingError, match=r"blocks\.experts\.fc1 has shape \[3, 4, 4, 5\]; its leading stacked axes should be "
                                           r"num_hidden_layers=2, num_experts=4"):
        NameTableView(DcpCheckpoint(path), _table(sizes=sizes), {"num_hidden_layers": 2, "num_experts": E})
    with pytest.raises(MissingConfigError, match="num_experts"):
        NameTableView(DcpCheckpoint(path), _table(sizes=sizes), {"num_hidden_layers": L})
    config = {"num_hidden_layers": L, "num_experts": E}
    table = _table(sizes=sizes, complete=("expert",), required=("blocks.{layer}.experts.fc2",))
    assert len(NameTableView(DcpCheckpoint(path), table, config).specs()) == L * (1 + 3 * E)
    full = DcpCheckpoint(path)
    without = lambda name: Renamed(full, {k: k for k in full.specs() if k != name})  # noqa: E731
    named = Renamed(full, {k: k for k in full.specs() if k.startswith("blocks.2.")})
    with pytest.raises(MappingError, match=r"blocks\.2\.experts\.3\.fc2 is expert 3, but config.json has num_experts=3"):
        NameTableView(named, _table(sizes={"expert": "num_experts"}), {"num_experts": 3})
    with pytest.raises(MappingError, match=r"blocks\.2\.experts\.\{expert\}\.fc2 lacks experts \[1\] of num_experts=4"):
        NameTableView(without("blocks.2.experts.1.fc2"), _table(sizes=sizes, complete=("expert",)), config)
    with pytest.raises(MappingError, match=r"table requires tensors this checkpoint lacks: blocks\.\{layer\}\.experts\.fc2 "
                                           r"\(layer/expert \[\(1, 0\), \(1, 1\)"):
        NameTableView(without("blocks.1.experts.fc2"), table, config)


def test_unknown_source_name_names_it_the_table_and_the_model_type(stacked_dcp):
    path, _ = stacked_dcp
    table = NameTable("partial", "test", ("x",), (NameRule("blocks.router", "model.layers.{layer}.mlp.gate.weight"),))
    with pytest.raises(MappingError, match=r"blocks\.0\.experts\.fc2, .*no rule of name table 'partial' \(model_type 'x'\).*Nothing was dropped"):
        NameTableView(DcpCheckpoint(path), table, {"model_type": "x"})
