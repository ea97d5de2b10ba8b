"""Which files a merge copies from a config folder beside the weights, and a bound on what the
side files of a merge take on disk, known before anything is written (torch is not imported here:
the head start's child plans with it)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Collection

from .write.atomic import WEIGHT_INDEXES, WEIGHT_SUFFIXES

logger = logging.getLogger(__name__)


def side_files(config_dir: Path, *, skip: tuple[str, ...] = (), report: bool = False) -> list[Path]:
    """The files :func:`copy_side_files` copies from ``config_dir``, in name order (``report``: say
    which symlinks are left behind)."""
    chosen = []
    code = _remote_code_modules(Path(config_dir))
    for item in sorted(Path(config_dir).iterdir()):
        name = item.name
        if name == "config.json" or name in skip or name in WEIGHT_INDEXES or name.endswith(WEIGHT_SUFFIXES) or name.startswith("."):
            continue
        if name in TRAINING_STATE_FILES or name.endswith(RANK_FILE_SUFFIXES):
            continue  # a config folder that is the checkpoint folder itself: its training files stay behind
        if name.endswith(".py") and name.removesuffix(".py") not in code:
            continue  # only the modeling code auto_map names (not e.g. DeepSpeed's zero_to_fp32.py)
        if item.is_symlink():
            if report:
                logger.warning("not copied: %s is a symlink (to %s); side files are copied only as regular files", item, os.path.realpath(item))
            continue
        if item.is_file():
            chosen.append(item)
    return chosen


#: bytes beyond the side files' own sizes that a merge may write: model card, hf_merge.json,
#: adapter_config.json, and a file system block per file
SIDE_FILES_MARGIN = 64 << 10
_BLOCK = 4096


def side_files_bytes(config_dirs: Collection[Path], weight_map: dict[str, str] | None = None, *, scale: int = 1) -> int:
    """A bound, known before anything is written, on the bytes a merge writes besides its weight
    files: the side files copied from each of ``config_dirs`` (``scale`` times: a GGUF file holds
    the tokenizer again), config.json as rewritten, the index of ``weight_map``, and
    :data:`SIDE_FILES_MARGIN`."""
    total = SIDE_FILES_MARGIN
    for folder in config_dirs:
        config = Path(folder) / "config.json"
        if config.is_file():
            total += 2 * config.stat().st_size + _BLOCK  # indented again, a dtype / quantization_config added
        total += sum(scale * p.stat().st_size + _BLOCK for p in side_files(folder))
    if weight_map:  # "name": "model-00001-of-00002.safetensors", on a line of its own
        total += _BLOCK + sum(len(json.dumps(k)) + len(v) + 12 for k, v in weight_map.items())
    return total


#: files a training run keeps beside its config that are not part of a model folder
TRAINING_STATE_FILES = frozenset({"latest", "latest_checkpointed_iteration.txt", "trainer_state.json"})
#: rank files of DCP / Megatron torch_dist / DeepSpeed folders (weights, but not under WEIGHT_SUFFIXES)
RANK_FILE_SUFFIXES = (".distcp",)


def _remote_code_modules(config_dir: Path) -> set[str]:
    """Module names the folder's ``auto_map`` entries point at (config.json, tokenizer_config.json,
    processor configs): ``"modeling_x.XForCausalLM"`` -> ``modeling_x``."""
    modules: set[str] = set()
    for name in ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json"):
        path = config_dir / name
        if not path.is_file() or path.is_symlink():
            continue
        try:
            auto_map = json.loads(path.read_text()).get("auto_map") or {}
        except (ValueError, OSError, AttributeError):
            continue
        refs = auto_map.values() if isinstance(auto_map, dict) else auto_map
        for ref in refs:
            for one in ref if isinstance(ref, (list, tuple)) else [ref]:
                if isinstance(one, str) and "." in one:
                    modules.add(one.split("--")[-1].rsplit(".", 1)[0])
    return modules
