"""``hf merge ...``: register hf-merge as a huggingface_hub CLI extension, offline.

huggingface_hub 2.x runs ``hf <name> ARGS`` by executing the ``executable_path`` recorded in
``~/.local/share/hf/extensions/hf-<name>/manifest.json``. ``hf extensions install OWNER/hf-merge``
writes that manifest after fetching the package from GitHub; this module writes the same manifest
for the ``hf-merge`` already installed in this environment, with no network.
"""

from __future__ import annotations

import datetime as _dt
import json
import shutil
import sys
from pathlib import Path

from .version import SUMMARY

SHORT_NAME = "merge"
DESCRIPTION = f"Merge {SUMMARY}"


def extensions_root() -> Path:
    try:
        from huggingface_hub.cli.extensions import EXTENSIONS_ROOT

        return Path(EXTENSIONS_ROOT).expanduser()
    except ImportError:  # older huggingface_hub without extensions: same default location
        return Path("~/.local/share/hf/extensions").expanduser()


def find_executable() -> Path:
    """The ``hf-merge`` script of this environment (next to the running interpreter first)."""
    beside = Path(sys.executable).parent / "hf-merge"
    if beside.is_file():
        return beside
    found = shutil.which("hf-merge")
    if found is None:
        from .errors import HfMergeError

        raise HfMergeError("cannot find the hf-merge executable; install the package with pip first")
    return Path(found)


def install_extension(executable: "str | Path | None" = None) -> Path:
    """Write the manifest that makes ``hf merge`` run ``hf-merge``. Returns the manifest path."""
    exe = Path(executable) if executable else find_executable()
    folder = extensions_root() / f"hf-{SHORT_NAME}"
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {
        "owner": "local",
        "repo": "hf-merge",
        "repo_id": "local/hf-merge",
        "short_name": SHORT_NAME,
        "executable_path": str(exe.absolute()),
        "type": "binary",
        "installed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "description": DESCRIPTION,
        "commit_sha": None,
    }
    path = folder / "manifest.json"
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return path
