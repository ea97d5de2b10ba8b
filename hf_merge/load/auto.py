"""``AutoModel*.from_sharded_pretrained``: hf_merge's loader as a classmethod of every Auto model class.

:func:`install` (called by ``import hf_merge``) adds the classmethod to transformers'
``_BaseAutoModelClass`` and to each Auto model class found in ``transformers.models.auto.modeling_auto``
(``AutoModel``, ``AutoModelForCausalLM``, ``AutoModelForTokenClassification``,
``AutoModelForImageTextToText``, ... — whatever this transformers version defines), so classes
added later or registered by users get it too. It is idempotent, never replaces a
``from_sharded_pretrained`` it did not add, and does not import transformers itself: importing
the Auto classes costs seconds, so when they are not loaded yet the patch is applied the moment
they are (a one-shot import hook), and ``import hf_merge`` stays as fast as before.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from typing import Any

logger = logging.getLogger(__name__)

METHOD = "from_sharded_pretrained"
AUTO_MODULE = "transformers.models.auto.modeling_auto"
_MARK = "__hf_merge__"
_lock = threading.Lock()


def _from_sharded_pretrained(cls, source, **kwargs: Any):
    """Load a sharded training checkpoint (verl FSDP, Megatron, ...) as this Auto class would load
    a merged folder: ``cls.from_sharded_pretrained(path, dtype=..., device_map=...)``.

    See :func:`hf_merge.from_sharded_pretrained` for the arguments.
    """
    from .model import from_sharded_pretrained

    return from_sharded_pretrained(source, auto_class=cls, **kwargs)


setattr(_from_sharded_pretrained, _MARK, True)


def auto_model_classes() -> list[type]:
    """Every Auto model class this transformers defines (imports the Auto module)."""
    import importlib

    module = importlib.import_module(AUTO_MODULE)
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return sorted(
        (
            obj
            for obj in vars(module).values()
            if isinstance(obj, type) and issubclass(obj, _BaseAutoModelClass) and obj is not _BaseAutoModelClass
        ),
        key=lambda c: c.__name__,
    )


def _ours(cls: type) -> bool:
    attr = cls.__dict__.get(METHOD)
    return isinstance(attr, classmethod) and getattr(attr.__func__, _MARK, False)


def patch_auto_classes() -> list[str]:
    """Add ``from_sharded_pretrained`` to the Auto model classes now. Returns the names patched
    by this call (empty when already done)."""
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    patched = []
    with _lock:
        for cls in [_BaseAutoModelClass, *auto_model_classes()]:
            if _ours(cls):
                continue
            if METHOD in cls.__dict__:
                logger.warning("%s.%s exists and is not hf_merge's; left as it is", cls.__name__, METHOD)
                continue
            setattr(cls, METHOD, classmethod(_from_sharded_pretrained))
            patched.append(cls.__name__)
    return patched


def is_patched() -> bool:
    """Whether the Auto classes carry the method (False also when they are not imported yet)."""
    module = sys.modules.get(AUTO_MODULE)
    if module is None:
        return False
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return _ours(_BaseAutoModelClass)


class _PatchWhenImported(importlib.abc.MetaPathFinder):
    """One-shot import hook: lets the real finder load the Auto module, then patches it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != AUTO_MODULE:
            return None
        _remove_hook()
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_patch(module):
            exec_module(module)
            try:
                patch_auto_classes()
            except Exception:  # noqa: BLE001 - never break importing transformers
                logger.warning("could not add from_sharded_pretrained to the Auto classes", exc_info=True)

        loader.exec_module = exec_then_patch  # this spec's own loader instance
        return spec


_hook: _PatchWhenImported | None = None


def _remove_hook() -> None:
    global _hook
    with _lock:
        if _hook is not None and _hook in sys.meta_path:
            sys.meta_path.remove(_hook)
        _hook = None


def install() -> None:
    """Patch the Auto classes now if transformers' Auto module is loaded, else when it loads.

    Idempotent; what ``import hf_merge`` calls.
    """
    global _hook
    if AUTO_MODULE in sys.modules:
        patch_auto_classes()
        return
    with _lock:
        if _hook is None:
            _hook = _PatchWhenImported()
            sys.meta_path.insert(0, _hook)
    if AUTO_MODULE in sys.modules:  # imported by another thread meanwhile
        _remove_hook()
        patch_auto_classes()


__all__ = ["auto_model_classes", "install", "is_patched", "patch_auto_classes"]
