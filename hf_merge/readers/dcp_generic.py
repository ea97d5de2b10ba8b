"""Generic PyTorch DCP folders (``torch.distributed.checkpoint.save`` of an HF model's state dict).

Keys are Hugging Face names, either at the top level (``dcp.save(model.state_dict())``) or under a
``model`` key next to other training state (``dcp.save({"model": ..., "optimizer": ...})`` gives
``model.model.embed_tokens.weight``, ``model.lm_head.weight``, ``optimizer.…``). Optimizer,
scheduler, dataloader and train-state entries are skipped; byte entries are never read.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .formats import SourceFormat
from .dcp_index import is_dcp_dir
from .dcp_sources import config_beside, is_training_state, open_dcp_model, open_index as open_dcp_index

if TYPE_CHECKING:  # probing imports this module; torch is imported only to open a checkpoint
    from ..checkpoint import LazyCheckpoint

WRAPPER = "model."


def wrapped_in_model_key(names: list[str]) -> bool:
    """True if every model entry sits under a ``model`` key: all start with ``model.`` and, with
    it removed, HF names appear (``model.…`` / ``lm_head.…``). A plain tied HF state dict (all keys
    ``model.…``, no ``lm_head``) stays as it is: stripped, it would hold no ``model.`` name."""
    names = [n for n in names if not is_training_state(n)] or names
    if not names or not all(n.startswith(WRAPPER) for n in names):
        return False
    inner = [n[len(WRAPPER):] for n in names]
    return any(n.startswith(("model.", "lm_head.")) for n in inner)


def model_prefix(names: list[str]) -> str | None:
    """The prefix the model's names carry in a folder with these keys: :data:`WRAPPER` or none."""
    return WRAPPER if wrapped_in_model_key(names) else None


def open_dcp(path: Path, *, config_dir: Path | None = None) -> LazyCheckpoint:
    from ..checkpoint import CheckpointInfo
    from .dcp import DcpCheckpoint

    path = Path(path)
    hf_dir = config_beside(path, config_dir)
    dcp = DcpCheckpoint(path)  # read once: its .metadata is most of opening a 30,000-tensor folder
    try:
        strip = model_prefix(list(dcp.specs()))
        info = CheckpointInfo(format="dcp", path=path, hf_dir=hf_dir)
        if strip:
            info.notes.append(f"model weights read from the {strip.rstrip('.')!r} entry of the checkpoint")
    except Exception:
        dcp.close()
        raise
    return open_dcp_model(path, info, strip=strip, opened=dcp)


def open_index(path: Path, config: Path | None):
    """The model's tensors read without torch, for the CLI's head start (:func:`~hf_merge.readers.dcp_sources.open_index`)."""
    return open_dcp_index(Path(path), config, model_prefix)


def probe(path: Path) -> bool:
    """A folder with a DCP ``.metadata`` (and no Megatron ``metadata.json``)."""
    path = Path(path)
    return is_dcp_dir(path) and not (path / "metadata.json").is_file()


FORMAT = SourceFormat(
    name="dcp",
    description="a PyTorch DCP folder (.metadata + *.distcp) of a Hugging Face model's state dict",
    probe=probe,
    open=open_dcp,
    priority=60,  # accelerate / torchtitan folders are DCP folders too: their own format wins
    framework="pytorch",
    marks=(".metadata",),
    generic=True,  # names kept as they are: a torchtitan or Megatron folder is refused (formats.open_source)
)
