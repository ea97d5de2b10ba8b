"""Checkpoints written by each torch release, 2.4 to 2.15, merge bit-exact.

The fixtures under ``tests/data/torch_versions/torch-<version>/`` were written by that torch
(``make_fixtures.py`` there, in a venv with only torch, safetensors and numpy; ``VERSIONS`` says
what and how): FSDP1 with a device mesh, FSDP2, HSDP on (1, 2) and (2, 1) meshes, DCP, each beside
the unsharded ``reference.safetensors``. Each pickles DeviceMesh, placements and DCP metadata as
its torch does; the merge must read them all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_merge.errors import UnsupportedCheckpointError
from hf_merge.readers.rank_records import index_rank_file, load_rank_records

from helpers import assert_tensors_equal, folder_tensors, run_cli

DATA = Path(__file__).parent / "data" / "torch_versions"
def _version(d: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in d.parent.name.removeprefix("torch-").split("."))


CELLS = ("fsdp1", "fsdp2", "hsdp_1x2", "hsdp_2x1", "dcp")
FIXTURES = sorted(
    (d for v in DATA.glob("torch-*") for d in v.iterdir() if d.name in CELLS),
    key=lambda d: (_version(d), d.name),
)


def _id(d: Path) -> str:
    return f"{d.parent.name}/{d.name}"


def test_every_written_cell_is_committed():
    """What VERSIONS says was written is here (a cell lost from the commit fails, not skips)."""
    assert FIXTURES, f"no fixtures under {DATA}"
    for versions in DATA.glob("torch-*/VERSIONS"):
        for line in versions.read_text().splitlines():
            cell, _, status = line.partition(" ")
            if cell in CELLS:
                assert (versions.parent / cell).is_dir() == status.startswith("written"), f"{versions}: {line}"


@pytest.mark.parametrize("fixture", FIXTURES, ids=_id)
def test_merges_bit_exact(fixture, tmp_path):
    out = tmp_path / "out"
    r = run_cli("merge", str(fixture), str(out))
    assert r.returncode == 0, r.stderr
    assert_tensors_equal(folder_tensors(out), load_file(fixture.parent / "reference.safetensors"))
    r = run_cli("inspect", str(fixture))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("fixture", [f for f in FIXTURES if f.name != "dcp"], ids=_id)
def test_torch_free_index_agrees_with_the_torch_reader(fixture):
    """The head start's index reads each rank file's mesh as the torch reader does."""
    for path in sorted(fixture.glob("model_world_size_*_rank_*.pt")):
        records, index = load_rank_records(path), index_rank_file(path)
        assert list(records) == list(index)
        for key, rec in records.items():
            assert index[key].mesh_shape == tuple(rec.mesh.shape)
            assert index[key].mesh == tuple(rec.mesh.reshape(-1).tolist())


def _newest(cell: str) -> Path:
    """The newest fixture of ``cell`` that the installed torch can unpickle itself."""
    mine = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:3])
    return [f for f in FIXTURES if f.name == cell and _version(f) <= mine][-1]


def test_an_unknown_mesh_layout_is_an_honest_error(tmp_path):
    """A real rank file whose DeviceMesh layout carries a field no torch read here writes (as a
    future torch may): one line saying it is not understood, that the file does not record the torch
    that wrote it, and what to do; never "damaged"."""
    src = sorted(_newest("fsdp2").glob("model_world_size_*_rank_0.pt"))[0]
    state = torch.load(src, weights_only=False)
    mesh = next(v for v in state.values() if hasattr(v, "device_mesh")).device_mesh
    layout = getattr(mesh, "_layout", None)
    if layout is None:
        pytest.skip("the newest fixture's torch pickles no mesh layout")
    renamed = object.__new__(type(layout))
    object.__setattr__(renamed, "__dict__", {"modes": tuple(vars(layout).values())})
    object.__setattr__(mesh, "_layout", renamed)
    folder = tmp_path / "actor"
    folder.mkdir()
    for rank in (0, 1):
        torch.save(state, folder / f"model_world_size_2_rank_{rank}.pt")

    for read in (load_rank_records, index_rank_file):
        with pytest.raises(UnsupportedCheckpointError) as e:
            read(folder / "model_world_size_2_rank_0.pt")
        message = str(e.value)
        assert "does not know" in message and "does not record which" in message and "torch 2.4 to 2.15" in message
        assert "damaged" not in message and "\n" not in message
    r = run_cli("merge", str(folder), str(tmp_path / "out"))
    assert r.returncode != 0
    line = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "does not know" in line[0] and "damaged" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_dcp_tensor_properties_are_an_honest_error(tmp_path, monkeypatch):
    """A real DCP folder whose ``TensorProperties`` pickle a field more than torch 2.15's six (as a
    future torch may): one line naming the DCP format version the file records, never "damaged"."""
    import pickle
    import shutil

    from torch.distributed.checkpoint.metadata import TensorProperties

    folder = tmp_path / "dcp"
    shutil.copytree(_newest("dcp"), folder)
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)  # the suite's own fixture, read with the installed torch's classes
    real = TensorProperties.__getstate__
    monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: (*real(self)[:5], None, "future"))
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    monkeypatch.undo()

    r = run_cli("merge", str(folder), str(tmp_path / "out"))
    assert r.returncode != 0
    line = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    # the version the fixture records (torch 2.6's DCP records none; newer ones 1.0.0)
    version = getattr(md, "version", None)
    fmt = f"records DCP format version {version}" if version else "records no DCP format version"
    assert len(line) == 1 and "7 fields" in line[0] and fmt in line[0], r.stderr
    assert "damaged" not in r.stderr and "re-copy" not in r.stderr
