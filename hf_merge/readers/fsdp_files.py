"""verl FSDP rank-file folders: names, world size and step, found from the file names alone.

Torch-free (used before torch is imported: :mod:`hf_merge.write.head_start`, the CLI's checks);
:mod:`hf_merge.readers.fsdp` reads the files.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ..errors import CorruptCheckpointError, SourceNotFoundError
from . import contained

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def rank_file_name(world_size: int, rank: int) -> str:
    return f"model_world_size_{world_size}_rank_{rank}.pt"


def has_rank_files(folder: Path) -> bool:
    return folder.is_dir() and any(RANK_FILE.match(p.name) for p in folder.iterdir())


def probe(path: Path) -> bool:
    """True if ``path`` is (or holds, as ``global_step_N/actor`` or a checkpoints root) a folder of
    verl FSDP rank files. Reads file names only."""
    try:
        resolve_fsdp_dir(Path(path))
    except SourceNotFoundError:
        return False
    return True


def resolve_fsdp_dir(path: Path) -> tuple[Path, int | None, list[str]]:
    """Find the folder holding rank files under what the user gave.

    Accepts the ``actor/`` (or ``critic/``) folder itself, a ``global_step_N`` folder, or a
    checkpoints root holding ``global_step_*`` folders (the one named by
    ``latest_checkpointed_iteration.txt``, else the highest step). Returns
    ``(folder, step, notes)``.
    """
    path = Path(path)
    notes: list[str] = []
    if not path.exists():
        raise SourceNotFoundError(f"{path} does not exist; pass the checkpoint's actor/ or global_step_N folder")
    if not path.is_dir():
        raise SourceNotFoundError(f"{path} is a file; pass the folder that holds the model_world_size_*_rank_*.pt files")
    if not any(path.iterdir()):
        raise SourceNotFoundError(f"{path} is empty; pass the folder that holds the model_world_size_*_rank_*.pt files")
    if not has_rank_files(path):
        chosen = choose_step(path)
        if chosen is not None:
            path, note = chosen
            notes.append(note)
        if has_rank_files(path / "actor"):
            if has_rank_files(path / "critic"):
                notes.append(f"{path.name} also has critic/; merging actor/ (pass the critic/ folder for the critic)")
            path = path / "actor"
        elif has_rank_files(path / "critic"):
            path = path / "critic"
    if not has_rank_files(path):
        raise SourceNotFoundError(
            f"no model_world_size_*_rank_*.pt files in {path}; pass a verl FSDP actor/ folder "
            "(or use --backend megatron for Megatron checkpoints)"
        )
    step = None
    for part in reversed(path.parts):
        if m := STEP_DIR.match(part):
            step = int(m.group(1))
            break
    return path, step, notes


def choose_step(root: Path) -> tuple[Path, str] | None:
    """The ``global_step_N`` folder of a verl checkpoints ``root`` (either backend) to read, and a
    note saying why: the step ``latest_checkpointed_iteration.txt`` names when that folder exists,
    else the highest. None when ``root`` has no step folders."""
    steps = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))}
    if not steps:
        return None
    latest_file = root / "latest_checkpointed_iteration.txt"
    if contained.check(latest_file).is_file():
        text = latest_file.read_bytes()[:64].decode("ascii", "replace").strip()
        if re.fullmatch(r"[0-9]{1,18}", text) and int(text) in steps:
            return steps[int(text)], f"using global_step_{int(text)} (from latest_checkpointed_iteration.txt)"
    chosen = max(steps)
    return steps[chosen], f"using global_step_{chosen} (the highest of {len(steps)} steps)"


def detect_world_size(folder: Path) -> tuple[int, list[str]]:
    """World size from ``fsdp_config.json``, checked against the rank file names.

    Returns ``(world size, warnings)``.
    """
    notes: list[str] = []
    sizes = {int(m.group(1)) for p in folder.iterdir() if (m := RANK_FILE.match(p.name))}
    config_path = folder / "fsdp_config.json"
    if contained.check(config_path).is_file():
        try:
            declared = json.loads(config_path.read_bytes())["world_size"]
            if not isinstance(declared, int) or isinstance(declared, bool) or declared < 1:
                raise ValueError(f"world_size is a {type(declared).__name__}, not a positive integer")
        except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError is a ValueError
            raise CorruptCheckpointError(f"{config_path} is not valid ({str(e)[:120]}); fix or delete it") from None
        if sizes != {declared}:
            found = ", ".join(str(s) for s in sorted(sizes))
            raise CorruptCheckpointError(
                f"fsdp_config.json says world_size {declared} but the rank files are for world size {found}; "
                "the folder mixes runs or the config is stale: keep only one run's files"
            )
        return declared, notes
    if len(sizes) != 1:
        found = ", ".join(str(s) for s in sorted(sizes))
        raise CorruptCheckpointError(f"rank files for several world sizes ({found}) in {folder}; keep one run's files")
    (size,) = sizes
    notes.append(f"no fsdp_config.json: world size {size} read from the rank file names")
    return size, notes


def check_rank_files_present(folder: Path, world_size: int) -> None:
    """Every rank's file must be there; the world size a file name claims is bounded by the files
    present (a name saying 1000000 ranks costs one directory listing, not a million look-ups)."""
    present = {int(m.group(2)) for p in folder.iterdir() if (m := RANK_FILE.match(p.name)) and int(m.group(1)) == world_size}
    present = {r for r in present if r < world_size}
    if len(present) == world_size:
        return
    n_missing = world_size - len(present)
    shown = []
    for r in range(world_size):
        if r not in present:
            shown.append(rank_file_name(world_size, r))
            if len(shown) == 3:
                break
    more = f" and {n_missing - len(shown)} more" if n_missing > len(shown) else ""
    raise CorruptCheckpointError(
        f"missing rank file{'s' if n_missing > 1 else ''} {', '.join(shown)}{more} in {folder} "
        f"({len(present)} of {world_size} present); copy every rank's file of the checkpoint"
    )


def chunk_range(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    """Sub-range ``index`` of ``[lo, hi)`` split like ``torch.chunk`` (ceil-sized, trailing empties)."""
    size = hi - lo
    step = math.ceil(size / parts) if size else 0
    start = min(lo + index * step, hi)
    return start, min(start + step, hi)
