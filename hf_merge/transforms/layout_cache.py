"""A small on-disk cache of computed plans (JSON), keyed by a digest of everything they depend on.

The Hub layout of a checkpoint (:mod:`hf_merge.transforms.hub_layout`) is a pure function of the
transformers version, config.json and the source's tensor names, shapes and dtypes, but computing
it means importing transformers and building the model on the meta device (seconds). The result
is stored here as JSON, so that the next merge of a checkpoint of the same model skips all that.

Where: ``$HF_MERGE_CACHE`` (a folder; ``off`` disables the cache), else
``$XDG_CACHE_HOME/hf_merge`` or ``~/.cache/hf_merge``. Entries are plain JSON (never pickles, never
code); a missing, unreadable or malformed entry is a miss, and writes are atomic (temporary file,
then rename). Deleting the folder is always safe.

An entry is never trusted as it stands:

- the key covers everything the decision reads (:func:`runtime`): the library versions, the
  installed transformers' source files (a dev build keeps its version string while its code
  changes) and the conversions registered with transformers in this process;
- an entry holds its own kind, key and a sha256 of its value: an edited, damaged or moved
  (swapped) file is a miss;
- its user re-validates the value against the model it is used for (names, shapes, the
  conversion it implies; :mod:`hf_merge.transforms.hub_layout`) and treats a mismatch as a miss.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import settings

logger = logging.getLogger(__name__)

__all__ = ["cache_dir", "digest", "get", "hub_layout_key", "is_passthrough", "put", "runtime", "source_fingerprint", "stored_passthrough"]

ENV = settings.CACHE_VAR


def cache_dir() -> Path | None:
    """The cache folder, or None when ``HF_MERGE_CACHE=off`` (see :mod:`hf_merge.settings`)."""
    return settings.cache_dir()


def library_versions() -> dict[str, str | None]:
    """Versions a plan depends on, read from package metadata (no import of the packages)."""
    from ..version import __version__

    out: dict[str, str | None] = {"hf_merge": __version__}
    for name in ("transformers", "torch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def runtime() -> dict[str, Any]:
    """Everything besides its own inputs that a plan depends on (part of every key): hf_merge,
    torch and transformers versions, transformers' source files (:func:`source_fingerprint`) and
    the conversions registered with ``transformers.conversion_mapping`` in this process. Nothing
    is imported."""
    out: dict[str, Any] = dict(library_versions())
    spec = importlib.util.find_spec("transformers")  # where it is installed; not imported
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    out["transformers_files"] = source_fingerprint(locations[0]) if locations else None
    out["registered_conversions"] = registered_conversions()
    return out


@functools.lru_cache(maxsize=4)
def source_fingerprint(package_dir: str) -> str:
    """sha256 over every ``.py`` file of a package folder: relative path, size and mtime (a
    stat each, about 40 ms for transformers' 3,000 files; once per process). An edited source
    of an editable or dev install changes it; its version string may not."""
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                h.update(f"{os.path.relpath(path, package_dir)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def registered_conversions() -> dict[str, list[str]] | None:
    """The weight conversions a user registered with transformers in this process
    (``register_checkpoint_conversion_mapping``), described by their reprs; None when there are
    none (then transformers' own, covered by :func:`source_fingerprint`, apply)."""
    module = sys.modules.get("transformers.conversion_mapping")
    names = sorted(getattr(module, "USER_REGISTERED_MAPPINGS", None) or [])
    table = getattr(module, "_checkpoint_conversion_mapping_cache", None) or {}
    if not names:
        return None
    # an object without its own repr shows its address: a different key per process, never a stale hit
    return {name: [f"{t!r} {[repr(op) for op in getattr(t, 'operations', None) or []]}" for t in table.get(name) or []]
            for name in names}


def digest(material: Any) -> str:
    """sha256 of ``material`` as canonical JSON."""
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _path(kind: str, key: str) -> Path | None:
    root = cache_dir()
    return None if root is None else root / kind / f"{key}.json"


def _seal(kind: str, key: str, value: Any) -> str:
    return digest(["hf_merge plan cache entry", kind, key, value])


def get(kind: str, key: str) -> Any | None:
    """The stored value, or None (no cache, no entry, or an entry that does not parse, is not
    this kind and key's, or whose value does not match its sha256)."""
    path = _path(kind, key)
    if path is None or not path.is_file():
        return None
    try:
        entry = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        logger.debug("plan cache: ignoring %s (%s)", path, e)
        return None
    if not isinstance(entry, dict) or entry.get("kind") != kind or entry.get("key") != key or "value" not in entry:
        logger.debug("plan cache: ignoring %s (not an entry for this key)", path)
        return None
    if entry.get("sha256") != _seal(kind, key, entry["value"]):
        logger.debug("plan cache: ignoring %s (its value does not match its sha256)", path)
        return None
    return entry["value"]


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
            json.dump({"kind": kind, "key": key, "sha256": _seal(kind, key, value), "value": value}, f, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("plan cache: not written to %s (%s)", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


#: the meaning of a stored Hub-layout plan (:mod:`hf_merge.transforms.hub_layout`); bump when it
#: changes (2: checked entries, keys with runtime(); 3: storages)
HUB_LAYOUT_PLAN = 3
#: the stored plan of a model ``save_pretrained`` writes under the source's own names
PASSTHROUGH_PLAN = {"passthrough": True}


def is_passthrough(stored: Any) -> bool:
    """Whether a stored Hub-layout plan is :data:`PASSTHROUGH_PLAN`."""
    return isinstance(stored, dict) and stored.get("passthrough") is True


def hub_layout_key(config: dict[str, Any], specs: dict[str, Any]) -> str:
    """The key of a Hub-layout plan: the plan format, :func:`runtime`, config.json and the source's
    tensor names, shapes and dtype names in order (``specs``: name -> a spec with ``shape`` and a
    ``dtype``, a torch dtype or a :class:`~hf_merge.spec.DTypeName`; nothing is imported)."""
    from ..spec import dtype_name

    return digest({
        "plan": HUB_LAYOUT_PLAN, "versions": runtime(), "config": config,
        "specs": [[n, list(s.shape), dtype_name(s.dtype)] for n, s in specs.items()],
    })


def stored_passthrough(config: dict[str, Any], specs: dict[str, Any]) -> bool:
    """Whether a merge of the same model stored its Hub layout as the source's own names: what the
    head start's child (no torch, no transformers) asks before it writes a model whose tensors
    ``save_pretrained`` might rename (a miss: it declines)."""
    return cache_dir() is not None and is_passthrough(get("hub_layout", hub_layout_key(config, specs)))
