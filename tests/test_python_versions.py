"""Checkpoints written under another Python merge bit-exact on this one.

``tests/data/python_versions/python-<X.Y>/torch-<version>/`` holds the cells of
``tests/data/torch_versions/make_fixtures.py`` written by that Python (``VERSIONS`` there says
what and how). Python 3.13 pickles ``pathlib.PosixPath`` as ``pathlib._local.PosixPath``, and
every DCP ``.metadata`` holds one (``StorageMeta.checkpoint_id``): a DCP, Megatron ``torch_dist``
or accelerate checkpoint saved under 3.13 must merge on any Python hf_merge runs on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# the torch-version suite's own checks, run on these folders (imported under names pytest does not collect)
from test_torch_versions import CELLS
from test_torch_versions import test_merges_bit_exact as merges_bit_exact

DATA = Path(__file__).parent / "data" / "python_versions"
FIXTURES = sorted(d for v in DATA.glob("python-*/torch-*") for d in v.iterdir() if d.name in CELLS)


def _id(d: Path) -> str:
    return f"{d.parent.parent.name}/{d.parent.name}/{d.name}"


def test_fixtures_are_committed():
    """Each VERSIONS file's written cells are here (one lost from the commit fails, not skips)."""
    versions = sorted(DATA.glob("python-*/torch-*/VERSIONS"))
    assert versions and FIXTURES, f"no fixtures under {DATA}"
    written = {(v.parent, line.split()[0]) for v in versions for line in v.read_text().splitlines()
               if line.split()[0] in CELLS and line.split()[1] == "written:"}
    assert written == {(d.parent, d.name) for d in FIXTURES}


@pytest.mark.parametrize("fixture", FIXTURES, ids=_id)
def test_merges_bit_exact(fixture, tmp_path):
    merges_bit_exact(fixture, tmp_path)
