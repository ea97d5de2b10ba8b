"""What the PyTorch DCP source formats share (generic DCP, accelerate, torchtitan).

A training framework's DCP folder holds the model among other state (optimizer, lr scheduler,
dataloader, train state) and no Hugging Face config. These helpers pick the model's tensor
entries (dropping a ``model.`` wrapper key where the framework adds one), find the newest step
folder, and find the config: ``--config DIR``, else a config.json beside the checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from ..errors import MissingConfigError, SourceNotFoundError
from . import step_choice
from .dcp_index import METADATA_FILE, is_dcp_dir

if TYPE_CHECKING:  # the probes of the DCP formats import this module; it imports torch only to open one
    from ..checkpoint import CheckpointInfo, LazyCheckpoint
    from .dcp import DcpCheckpoint
    from .dcp_index import DcpIndex

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
    highest step, if ``holds`` accepts it; None when no such folder is accepted.

    Raises:
        IncompleteStepError: the highest step is not accepted (a save cut short) and an older one is.
    """
    if not folder.is_dir():
        return None
    steps = {int(m.group(1)): p for p in folder.iterdir() if (m := pattern.match(p.name)) and p.is_dir()}
    step = step_choice.newest_step(steps, holds)
    return None if step is None else (steps[step], step)


def model_table(names: Iterable[str], *, strip: str | None, skip: Iterable[str] = NOT_MODEL_PREFIXES) -> dict[str, str]:
    """The model's tensors among a DCP folder's keys, as ``{model name: key}``: training state
    dropped, ``strip`` removed from the front of every name that has it (others are not the model's)."""
    table: dict[str, str] = {}
    skip = tuple(skip)
    for name in names:
        if strip is not None:
            if name.startswith(strip):
                table[name[len(strip):]] = name
        elif not is_training_state(name, skip):
            table[name] = name
    return table


def model_entries(dcp: DcpCheckpoint, *, strip: str | None, skip: Iterable[str] = NOT_MODEL_PREFIXES) -> LazyCheckpoint:
    """The model's tensors of a DCP folder (:func:`model_table`). Row and box reads survive."""
    from ..transforms.rename import Renamed

    table = model_table(dcp.specs(), strip=strip, skip=skip)
    if not table:
        raise SourceNotFoundError(
            f"{dcp.path}/{METADATA_FILE} lists no model tensors"
            + (f" (no key starts with {strip!r})" if strip else "")
            + f"; it holds {', '.join(sorted(dcp.specs())[:4]) or 'no tensors'}"
        )
    return Renamed(dcp, table)


def open_index(
    folder: Path, config: Path | None, strip: Callable[[list[str]], str | None], skip: Iterable[str] = NOT_MODEL_PREFIXES,
) -> "tuple[DcpIndex, Path] | None":
    """The model's tensors of the DCP folder ``folder``, read without torch: a
    :class:`~hf_merge.readers.dcp_index.DcpIndex` under the names :func:`model_table` gives with the
    prefix ``strip(keys)`` removes (``skip``: as :func:`model_table`), and the folder of their config.json. None where the reader would
    parse the chunk archives with a process per CPU (:data:`~hf_merge.readers.dcp_index.PARALLEL_CHUNKS`)."""
    from .dcp_index import PARALLEL_CHUNKS, DcpIndex

    config_dir = config_beside(folder, config)
    index = DcpIndex(folder)
    if sum(map(len, index.chunks.values())) >= PARALLEL_CHUNKS:
        index.close()
        return None
    index.select(model_table(index.tensors, strip=strip(list(index.tensors)), skip=skip))
    return index, config_dir


def open_dcp_model(
    path: Path, info: CheckpointInfo, *, strip: str | None, skip: Iterable[str] = NOT_MODEL_PREFIXES,
    opened: DcpCheckpoint | None = None,
) -> LazyCheckpoint:
    """Open the DCP folder ``path`` (``opened``: the caller's open reader of it, taken over) and
    return its model entries under ``info``."""
    from .dcp import DcpCheckpoint

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
    "NOT_MODEL_PREFIXES", "config_beside", "is_dcp_dir", "is_training_state", "model_entries", "model_table", "newest_step", "open_index",
    "open_dcp_model",
]
