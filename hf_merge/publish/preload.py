"""Imports taken off a merge's critical path: run in a background thread while the weights are written.

Besides the card's, an output's own (:meth:`hf_merge.merging.HfFolder.warm_up`: transformers'
config code when a ``generation_config.json`` must be derived, about 0.8 s) run there first.

The model card is rendered last, with huggingface_hub's ``ModelCard`` (``huggingface_hub.repocard``
pulls in ``hf_api``), jinja2 and yaml: about 0.3 s of imports that nothing before the card needs.
:func:`preload` starts importing them when the weights start streaming, so on any merge that
takes longer than that the card no longer waits for them. An import that fails here is ignored:
the real import, where the module is used, raises it.
"""

from __future__ import annotations

import importlib
import threading
from typing import Callable, Iterable

CARD_MODULES = ("yaml", "jinja2", "huggingface_hub.repocard")


def preload(modules: Iterable[str] = CARD_MODULES, first: Callable[[], None] | None = None) -> threading.Thread:
    """Import ``modules`` in a daemon thread, after running ``first`` there (an output's own
    warm-up, e.g. :func:`hf_merge.hf_files.generation_config_warm_up`; its errors are ignored too);
    join the returned thread before relying on it."""
    names = tuple(modules)

    def run() -> None:
        if first is not None:
            try:
                first()
            except Exception:  # noqa: BLE001  (raised again where the work is done for real)
                pass
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001  (raised again by the real import)
                pass

    thread = threading.Thread(target=run, name="hf-merge-preload", daemon=True)
    thread.start()
    return thread
