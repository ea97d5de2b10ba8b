"""accelerate ``save_state`` folders of FSDP (SHARDED_STATE_DICT) training: the model's DCP folder.

``Accelerator.save_state(output_dir)`` with FSDP2 writes ``output_dir/pytorch_model_fsdp_0/``
(``.metadata`` + ``__<rank>_0.distcp``, keys ``model.<HF name>``: ``save_fsdp_model`` saves
``{"model": state_dict}``), ``optimizer_0/`` (another DCP folder), ``random_states_<rank>.pkl``,
``scheduler.bin`` ... Only the model folder is read: the ``.pkl`` / ``.bin`` files are never
opened. With ``automatic_checkpoint_naming`` the folders are ``checkpoints/checkpoint_<i>``: the
highest ``i`` is used (an incomplete one is an error naming the one to pass). The model is
taken from ``pytorch_model_fsdp_0`` (the first prepared model); ``pytorch_model_fsdp_<k>``
itself may be given for another one. The HF config comes from
``--config``, else a config.json beside the folder.
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

_MODEL_DIR = re.compile(r"^pytorch_model_fsdp_(\d+)$")
_CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d+)$")
WRAPPER = "model."


def _model_dirs(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    return {
        int(m.group(1)): p for p in folder.iterdir() if (m := _MODEL_DIR.match(p.name)) and is_dcp_dir(p)
    }


def resolve(path: Path) -> tuple[Path, list[str], int | None]:
    """``(model DCP folder, notes, checkpoint index)`` for what the user gave, or the path itself."""
    path = Path(path)
    if _MODEL_DIR.match(path.name) and is_dcp_dir(path):
        return path, [], None
    notes: list[str] = []
    index = None
    for root in (path, path / "checkpoints"):
        found = newest_step(root, _CHECKPOINT_DIR, lambda p: bool(_model_dirs(p)))
        if found is not None and not _model_dirs(path):
            path, index = found
            notes.append(f"using {path.name} (the newest of the accelerate checkpoints in {root})")
            break
    models = _model_dirs(path)
    if not models:
        return path, notes, index
    if len(models) > 1:
        notes.append(
            f"{path} holds {len(models)} models ({', '.join(p.name for _, p in sorted(models.items()))}); "
            f"read {models[min(models)].name}; pass another pytorch_model_fsdp_<k> folder to read that one"
        )
    return models[min(models)], notes, index


def open_accelerate(path: Path, *, config_dir: Path | None = None) -> LazyCheckpoint:
    from ..checkpoint import CheckpointInfo
    from .dcp import DcpCheckpoint
    from .dcp_generic import wrapped_in_model_key

    model_dir, notes, index = resolve(Path(path))
    if not is_dcp_dir(model_dir):
        from ..errors import SourceNotFoundError

        raise SourceNotFoundError(
            f"{path}: no pytorch_model_fsdp_0/.metadata (accelerate FSDP SHARDED_STATE_DICT save_state); "
            "a FULL_STATE_DICT save is a plain pytorch_model_fsdp.bin, not read here"
        )
    hf_dir = config_beside(model_dir, config_dir)
    info = CheckpointInfo(format="accelerate", path=model_dir, hf_dir=hf_dir, step=index, notes=notes)
    dcp = DcpCheckpoint(model_dir)
    if not _MODEL_DIR.match(model_dir.name) and not wrapped_in_model_key(list(dcp.specs())):
        # a DCP folder by another name: save_state's only if its names sit under the "model" key
        # (stripping "model." off a plain state dict would drop the HF names' own "model.")
        dcp.close()
        from ..errors import UnsupportedCheckpointError

        raise UnsupportedCheckpointError(
            "not an accelerate save_state folder: no pytorch_model_fsdp_<k>/, and its tensors are not "
            "under the 'model' key save_state writes"
        )
    return open_dcp_model(model_dir, info, strip=WRAPPER, opened=dcp)


def open_index(path: Path, config: Path | None):
    """The model's tensors read without torch, for the CLI's head start (:func:`~hf_merge.readers.dcp_sources.open_index`)."""
    return open_dcp_index(resolve(Path(path))[0], config, lambda names: WRAPPER)


def probe(path: Path) -> bool:
    """An accelerate save_state folder with an FSDP model DCP folder (or that folder itself, or a
    folder of ``checkpoint_<i>`` save_state folders)."""
    try:
        model_dir, _, _ = resolve(Path(path))
    except IncompleteStepError:
        return True  # a root whose newest checkpoint_<i> is incomplete: open() names the one to pass
    return _MODEL_DIR.match(model_dir.name) is not None and is_dcp_dir(model_dir)


FORMAT = SourceFormat(
    name="accelerate",
    aliases=("accelerate-fsdp",),
    description="accelerate FSDP save_state folders (pytorch_model_fsdp_0/ DCP; optimizer and RNG files skipped)",
    probe=probe,
    open=open_accelerate,
    priority=40,
    framework="accelerate",
    # the model's DCP folder itself, in the save_state folder, or in checkpoint_<i>/ (or checkpoints/checkpoint_<i>/)
    marks=(
        ".metadata", "pytorch_model_fsdp_*/.metadata", "checkpoint_*/pytorch_model_fsdp_*/.metadata",
        "checkpoints/checkpoint_*/pytorch_model_fsdp_*/.metadata",
    ),
)
