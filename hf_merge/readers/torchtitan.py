"""torchtitan checkpoints: ``<dump>/checkpoint/step-<N>/`` DCP folders, in torchtitan's names.

``CheckpointManager`` flattens the model's state dict to the top level (``tok_embeddings.weight``,
``layers.0.attention.qkv_linear.wq.weight`` ...) beside ``optimizer.…``, ``lr_scheduler.…``,
``dataloader.…`` and ``train_state`` entries, which are skipped. Names become Hugging Face names
through a name table chosen by the config's ``model_type`` (:mod:`hf_merge.transforms.name_tables.torchtitan`;
Llama 3's q/k rotary permutation is undone there). The config comes from ``--config`` (torchtitan's
``hf_assets_path``), else a config.json beside the step folder. Given ``checkpoint/`` or the dump
folder, the highest step is used (an incomplete one is an error naming the step to pass).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import IncompleteStepError
from .formats import SourceFormat
from .dcp_index import is_dcp_dir
from .dcp_sources import config_beside, newest_step, open_dcp_model, open_index as open_dcp_index

if TYPE_CHECKING:  # probing imports this module; torch is imported only to open a checkpoint
    from ..checkpoint import LazyCheckpoint

_STEP_DIR = re.compile(r"^step-(\d+)$")


def resolve(path: Path) -> tuple[Path, int | None, list[str]]:
    """``(step folder, step, notes)``: ``path`` itself when it is a step folder or has none."""
    path = Path(path)
    m = _STEP_DIR.match(path.name)
    if m and is_dcp_dir(path):
        return path, int(m.group(1)), []
    for root in (path, path / "checkpoint"):
        found = newest_step(root, _STEP_DIR, is_dcp_dir)
        if found is not None:
            folder, step = found
            return folder, step, [f"using {folder.name} (the newest torchtitan step in {root})"]
    return path, None, []


def open_torchtitan(path: Path, *, config_dir: Path | None = None) -> LazyCheckpoint:
    from ..checkpoint import CheckpointInfo
    from ..hf_files import load_config
    from ..transforms.name_table import find_table
    from ..transforms.name_table_view import NameTableView

    folder, step, notes = resolve(Path(path))
    hf_dir = config_beside(folder, config_dir)
    config = load_config(hf_dir)
    table = find_table("torchtitan", config)
    info = CheckpointInfo(format="torchtitan", path=folder, hf_dir=hf_dir, step=step, notes=notes)
    info.details["name_table"] = table.name
    source = open_dcp_model(folder, info, strip=None, skip=())
    view = NameTableView(source, table, config)
    if view.dropped:
        info.details["skipped_entries"] = len(view.dropped)
    return view


def open_index(path: Path, config: Path | None):
    """The model's tensors under Hugging Face names, read without torch, for the CLI's head start:
    the name table :func:`open_torchtitan` applies, over a :class:`~hf_merge.readers.dcp_index.DcpIndex`
    (q/k rows un-permuted: each head a ``RowGather`` of its source rows), and the folder of config.json."""
    from ..hf_files import load_config
    from ..transforms.name_table import find_table
    from ..transforms.name_table_view import NameTableView

    folder, _, _ = resolve(Path(path))
    opened = open_dcp_index(folder, config, lambda names: None, skip=())
    if opened is None:
        return None
    index, hf_dir = opened
    try:
        hf_config = load_config(hf_dir)
        return NameTableView(index, find_table("torchtitan", hf_config), hf_config), hf_dir
    except BaseException:
        index.close()
        raise


def probe(path: Path) -> bool:
    """A ``step-<N>`` DCP folder, a folder of them, or a folder with ``checkpoint/step-<N>``."""
    try:
        folder, step, _ = resolve(Path(path))
    except IncompleteStepError:
        return True  # a torchtitan root whose newest step is incomplete: open() names the step to pass
    return step is not None


FORMAT = SourceFormat(
    name="torchtitan",
    aliases=("torchtitan-dcp",),
    description="torchtitan checkpoint/step-N DCP folders (Llama 3, Qwen3; names mapped by a table)",
    probe=probe,
    open=open_torchtitan,
    priority=40,
    framework="torchtitan",
    marks=(".metadata", "step-*/.metadata", "checkpoint/step-*/.metadata"),
)
