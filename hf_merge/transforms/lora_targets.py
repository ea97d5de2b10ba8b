"""``target_modules`` for adapter_config.json: the names PEFT itself writes.

PEFT targets a module when its name equals an entry or ends with ``"." + entry``
(``check_target_module_exists``), and refuses to wrap a matched module it has no LoRA layer for
(``Target module Qwen2_5_VLVisionBlock(...) is not supported``). So an entry must match the
LoRA-wrapped modules and nothing else in the base model. When PEFT resolves ``all-linear`` (or any
list of 20 or more names) it keeps, for each wrapped module, its shortest dotted suffix that no
other module's name ends with (``_find_minimal_target_modules``): ``q_proj``, ``mlp.0`` (``0``
alone would also be vision block 0 and text layer 0), ``attn.proj`` (``proj`` alone is also the
Conv3d patch embedding). We write the same, decided from

- the checkpoint: every module that owns a tensor (the wrapped ones, the base weights' owners and
  all their parents), and
- when transformers can build the model from config.json on the meta device, its
  ``named_modules()``, which also lists the modules without weights (activations such as the
  merger's ``mlp.1`` GELU, rotary embeddings) that the checkpoint cannot show. It is used only
  when its names are the checkpoint's (every wrapped module is one of its ``nn.Linear``).
"""

from __future__ import annotations

from typing import Any, Iterable

from ..errors import LoraError

__all__ = ["meta_module_names", "owner_modules", "shortest_suffixes"]


def _suffixes(name: str) -> list[str]:
    """``a.b.c`` -> ``["c", "b.c", "a.b.c"]``: what an entry ending at ``name`` can be, shortest first."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts) - 1, -1, -1)]


def owner_modules(tensor_names: Iterable[str]) -> set[str]:
    """Every module that holds one of ``tensor_names`` or is a parent of one that does."""
    modules: set[str] = set()
    for name in tensor_names:
        parts = name.split(".")[:-1]
        modules.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return modules


def shortest_suffixes(targets: Iterable[str], others: Iterable[str], *, complete: bool = True, strict: bool = True) -> list[str]:
    """For each target, its shortest dotted suffix that is no other module's name or suffix:
    entries that make PEFT wrap exactly ``targets``. A target that cannot be named apart (its full
    name is the tail of another module's name) is a LoraError, or (``strict=False``, for
    describing the adapter) its full name.

    ``complete=False``: ``others`` may lack modules without weights; a bare index (``2`` for
    ``mlp.2``) is then not enough, as an activation of another ``nn.Sequential`` may have it.
    """
    targets = set(targets)
    taken = {s for name in set(others) - targets for s in _suffixes(name)}
    chosen: set[str] = set()
    for target in sorted(targets):
        suffix = next((s for s in _suffixes(target) if s not in taken and (complete or not s.isdigit())), None)
        if suffix is None and not strict:
            suffix = target
        elif suffix is None:
            clash = sorted(n for n in set(others) - targets if n.endswith("." + target))[0]
            raise LoraError(f"{target} cannot be named in target_modules without also matching {clash}; "
                            "write the fused model instead (--lora fuse)")
        chosen.add(suffix)
    return sorted(chosen)


def meta_module_names(config: dict[str, Any], targets: set[str]) -> set[str] | None:
    """The names of every module of the model config.json describes (built on the meta device),
    or None when transformers cannot build it or its names are not the checkpoint's (a wrapped
    module missing or not a linear, as for a checkpoint saved by another transformers
    major)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    from .skeleton import model_class_for, skeleton

    try:
        cls = model_class_for(config)
        model = skeleton(cls, config) if cls is not None else None
    except Exception:  # noqa: BLE001  custom code, a config this transformers cannot build: use the checkpoint's names
        return None
    if model is None:
        return None
    modules = dict(model.named_modules())
    if not all(isinstance(modules.get(t), (torch.nn.Linear, Conv1D)) for t in targets):  # PEFT's all-linear types
        return None
    return set(modules)
