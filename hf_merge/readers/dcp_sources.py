"""What the PyTorch DCP source formats share (generic DCP, accelerate, torchtitan).

A training framework's DCP folder holds the model among other state (optimizer, lr scheduler,
dataloader, train state) and no Hugging Face config. These helpers pick the model's tensor
entries (dropping a ``model.`` wrapper key where the framework adds one), find the newest step
folder, and find the config: ``--config DIR``, else a config.json beside the checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable

from ..checkpoint import CheckpointInfo, LazyCheckpoint
from ..errors import MissingConfigError, SourceNotFoundError
from ..transforms.rename import Renamed
from .dcp import METADATA_FILE, DcpCheckpoint, is_dcp_dir

# Top-level keys of training state that are not model weights (accelerate, torchtitan, and what
# people pass to dcp.save next to the model).
NOT_MODEL_PREFIXES = (
    "optimizer", "optim", "lr_scheduler", "scheduler", "dataloader", "train_state", "rng", "random_states",
    "scaler", "step", "epoch",
)


def is_training_state(name: str, prefixes: Iterable[str] = NOT_MODEL_PREFIXES) -> bool:
    first = name.split(".", 1)[0]
    return first in prefixes


def config_beside(folder: Path, config_dir: Path | None, *, levels: int = 2) -> Path:
    """The folder holding config.json: ``config_dir`` if given, else ``folder`` or one of its
    ``levels`` parents. Raises MissingConfigError naming ``--config`` when there is none."""
    if config_dir is not None:
        if not (Path(config_dir) / "config.json").is_file():
            raise MissingConfigError(f"{config_dir} has no config.json; pass --config DIR with the model's Hugging Face config.json")
        return Path(config_dir)
    looked = [Path(folder), *list(Path(folder).parents)[:levels]]
    for cand in looked:
        if (cand / "config.json").is_file():
            return cand
    raise MissingConfigError(
        f"{folder} holds no Hugging Face config (looked for config.json in {', '.join(str(p) for p in looked)}); "
        "pass --config DIR with the model's config.json and tokenizer"
    )


def newest_step(folder: Path, pattern: re.Pattern[str], holds: Callable[[Path], bool]) -> tuple[Path, int] | None:
    """The sub-folder of ``folder`` whose name matches ``pattern`` (group 1: the step) with the
    highest step among those ``holds`` accepts; None when there is none."""
    if not folder.is_dir():
        return None
    steps = {}
    for p in folder.iterdir():
        m = pattern.match(p.name)
        if m and p.is_dir() and holds(p):
            steps[int(m.group(1))] = p
    if not steps:
        return None
    step = max(steps)
    return steps[step], step


def model_entries(dcp: DcpCheckpoint, *, strip: str | None, skip: Iterable[str] = NOT_MODEL_PREFIXES) -> LazyCheckpoint:
    """The model's tensors of a DCP folder: training state dropped, ``strip`` removed from the
    front of every name that has it (others are not the model's). Row and box reads survive."""
    table: dict[str, str] = {}
    skip = tuple(skip)
    for name in dcp.specs():
        if strip is not None:
            if name.startswith(strip):
                table[name[len(strip):]] = name
        elif not is_training_state(name, skip):
            table[name] = name
    if not table:
        raise SourceNotFoundError(
            f"{dcp.path}/{METADATA_FILE} lists no model tensors"
            + (f" (no key starts with {strip!r})" if strip else "")
            + f"; it holds {', '.join(sorted(dcp.specs())[:4]) or 'no tensors'}"
        )
    return Renamed(dcp, table)


def open_dcp_model(
    path: Path, info: CheckpointInfo, *, strip: str | None, skip: Iterable[str] = NOT_MODEL_PREFIXES,
    opened: DcpCheckpoint | None = None,
) -> LazyCheckpoint:
    """Open the DCP folder ``path`` (``opened``: the caller's open reader of it, taken over) and
    return its model entries under ``info``."""
    dcp = opened if opened is not None else DcpCheckpoint(path)
    if info.world_size is None:
        info.world_size = dcp.info.world_size
    # the folder's counts (not "tensors": inspect reports the model's tensors under that key)
    info.details.update({k: dcp.info.details[k] for k in ("files", "byte_entries") if k in dcp.info.details})
    dcp.info = info
    try:
        return model_entries(dcp, strip=strip, skip=skip)
    except Exception:
        dcp.close()
        raise


__all__ = [
    "NOT_MODEL_PREFIXES", "config_beside", "is_dcp_dir", "is_training_state", "model_entries", "newest_step",
    "open_dcp_model",
]
