"""A small on-disk cache of computed plans (JSON), keyed by a digest of everything they depend on.

The Hub layout of a checkpoint (:mod:`hf_merge.transforms.hub_layout`) is a pure function of the
transformers version, config.json and the source's tensor names, shapes and dtypes, but computing
it means importing transformers and building the model on the meta device (seconds). The result
is stored here as JSON, so that the next merge of a checkpoint of the same model skips all that.

Where: ``$HF_MERGE_CACHE`` (a folder; ``off`` disables the cache), else
``$XDG_CACHE_HOME/hf_merge`` or ``~/.cache/hf_merge``. Entries are plain JSON (never pickles, never
code); a missing, unreadable or malformed entry is a miss, and writes are atomic (temporary file,
then rename). Deleting the folder is always safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["cache_dir", "digest", "get", "put"]

ENV = "HF_MERGE_CACHE"


def cache_dir() -> Path | None:
    """The cache folder, or None when ``HF_MERGE_CACHE=off``."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in ("off", "0", "false", "no", "") else Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_merge"


def library_versions() -> dict[str, str | None]:
    """Versions a plan depends on, read from package metadata (no import of the packages)."""
    from . import __version__

    out: dict[str, str | None] = {"hf_merge": __version__}
    for name in ("transformers", "torch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def digest(material: Any) -> str:
    """sha256 of ``material`` as canonical JSON."""
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _path(kind: str, key: str) -> Path | None:
    root = cache_dir()
    return None if root is None else root / kind / f"{key}.json"


def get(kind: str, key: str) -> Any | None:
    """The stored value, or None (no cache, no entry, or an entry that does not parse)."""
    path = _path(kind, key)
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        logger.debug("plan cache: ignoring %s (%s)", path, e)
        return None


def put(kind: str, key: str, value: Any) -> None:
    """Store ``value`` (JSON-serialisable); a cache that cannot be written is skipped, not an error."""
    path = _path(kind, key)
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("plan cache: not written to %s (%s)", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
