"""Which tensor goes to which shard file, and the index's counts, as ``save_pretrained`` decides them.

``save_pretrained`` hands huggingface_hub's splitter (greedy, in the order it is given, each
storage sized once) the model's state dict after its save-time steps:

- transformers 5.x: tied aliases removed, then ``revert_weight_conversion``, which sorts the names
  (``dot_natural_key``: ``layers.2`` before ``layers.10``) for every model ``from_pretrained``
  loaded — a trained model — and then writes each converter's outputs where its first source
  was. The per-expert tensors it splits out of one fused ``[E, 2F, H]`` tensor are views of that
  tensor's storage (or of a copy the reverse made of part of it, Mixtral's ``w1`` / ``w3``): the
  splitter sizes them as that storage and keeps them in one file.
- transformers 4.x: ``model.state_dict()`` order, a VLM's prefixes renamed in place.

:func:`plan_like_save_pretrained` feeds :func:`~hf_merge.write.plan.plan_shards` the same: the Hub
layout's own order and storages (it ran the very ``revert_weight_conversion``); for a source
already in the saved layout, the order and storages of the model's own saved state dict on a meta
skeleton (:func:`~hf_merge.transformers_compat.saved_state`; 4.x: ``state_dict``'s order); where
transformers cannot build the model, the names sorted by :func:`natural_key` (5.x) or as read
(4.x); and ``total_parameters`` as ``model.num_parameters()`` counts it (:func:`total_parameters`). A single-file plan needs none of this (inside a file the
order is safetensors' own), so none of it runs unless the output is sharded; what the skeleton
says is kept in the plan cache, so a sharded merge imports transformers once per model.
"""

from __future__ import annotations

import logging
from typing import Any

from ..spec import TensorSpec
from .plan import ShardPlan, plan_shards
from .shard_size import index_counts_parameters

logger = logging.getLogger(__name__)

__all__ = ["natural_key", "plan_like_save_pretrained", "saved_order", "total_parameters"]


def plan_like_save_pretrained(view: Any, config: dict[str, Any], *, max_shard_size: "int | str | None",
                              quantized: Any = None) -> ShardPlan:
    """The files ``save_pretrained(max_shard_size=...)`` of the trained model would write, planned
    from ``view`` (the output's lazy checkpoint; ``quantized`` the bitsandbytes view in it, if any)."""
    group = quantized.group if quantized is not None else None
    plan = plan_shards(view.specs(), max_shard_size=max_shard_size, group=group)
    if plan.index is None:
        return plan
    from ..transforms.hub_layout import HubLayout

    hub = _inner(view, HubLayout)
    counts = index_counts_parameters()
    # the meta skeleton's facts, read once: the order and storages where hf-merge replays no reverse
    # conversion, the persistent buffers wherever the index counts parameters
    facts = _model_facts(config) if hub is None or counts else None
    storage = None
    if quantized is None:  # quantized parts are new tensors, grouped by module instead
        if hub is not None:  # the storages of the reverse conversion hf-merge replays
            shared = hub.storages()
        else:  # a source already in the saved layout (Megatron, DeepSpeed...): those of the model's own
            shared = facts["storages"] if facts is not None and set(view.specs()) <= set(facts["keys"]) else {}

        def storage(spec: TensorSpec) -> "tuple[str, int] | None":
            viewed = shared.get(spec.name)
            return None if viewed is None else (viewed[0], viewed[1] * spec.dtype.itemsize)
    return plan_shards(
        saved_order(view.specs(), facts, reverted=hub is not None), max_shard_size=max_shard_size,
        group=group, storage=storage,
        total_parameters=total_parameters(view, facts, hub=hub, quantized=quantized) if counts else None,
    )


def saved_order(specs: dict[str, TensorSpec], facts: "dict[str, Any] | None", *, reverted: bool) -> list[TensorSpec]:
    """``specs`` in the order ``save_pretrained`` gives the splitter (``reverted``: they come from
    transformers' own ``revert_weight_conversion``, already in its order; ``facts``: the model's,
    :func:`_model_facts`, None where transformers cannot build it)."""
    from ..transformers_compat import has_weight_conversions

    if reverted:
        return list(specs.values())
    keys = {k: i for i, k in enumerate(facts["keys"])} if facts is not None else {}
    if keys and set(specs) <= keys.keys():
        return sorted(specs.values(), key=lambda s: keys[s.name])
    if has_weight_conversions():  # names the model does not have (e.g. quantized parts): sorted all the same
        return sorted(specs.values(), key=lambda s: natural_key(s.name))
    return list(specs.values())


def natural_key(name: str) -> list[tuple]:
    """Sort key of state-dict names with numbers compared as numbers (``layers.2`` before
    ``layers.10``, ``shard_2`` before ``shard_11``): the key transformers 5's
    ``revert_weight_conversion`` sorts by (``dot_natural_key``), written here so that neither the
    merge nor the CLI's torch-free head start imports transformers for it (tests/test_sharding.py
    compares the two keys, and the merged shards with ``save_pretrained``'s)."""
    parts: list[tuple] = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
            continue
        text = part.rstrip("0123456789")
        digits = part[len(text):]
        parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


def total_parameters(view: Any, facts: "dict[str, Any] | None", *, hub: Any = None, quantized: Any = None) -> int:
    """``model.num_parameters()`` of the model the output is, from specs alone.

    Every parameter once (a tied alias is not in the output), no buffers, and for a bitsandbytes
    4-bit weight twice the elements of its packed ``uint8`` storage, as transformers counts it.
    The output tensors that are persistent buffers (DeepSeek-V3's ``e_score_correction_bias``) are
    known from the model's meta skeleton; where transformers cannot build it (no known class), every
    tensor counts (``facts``: the model's, :func:`_model_facts`, or None).
    """
    specs = view.specs()
    count = sum(quantized.parameters(s) if quantized is not None else s.numel for s in specs.values())
    buffers = set() if facts is None else set(facts["buffers"])
    inner = hub.base.specs() if hub is not None else specs  # the model's own names
    return count - sum(inner[b].numel for b in buffers if b in inner)


def _inner(view: Any, kind: type) -> Any:
    while view is not None and not isinstance(view, kind):
        view = getattr(view, "base", None)
    return view


def _skeleton(config: dict[str, Any]) -> Any:
    from ..transforms.skeleton import model_class_for, skeleton

    try:
        cls = model_class_for(config)
        return None if cls is None else skeleton(cls, config)
    except Exception as e:  # noqa: BLE001 - transformers cannot build it: the counts say so in the docs
        logger.debug("no meta skeleton for the shard order / parameter count (%s: %s)", type(e).__name__, e)
        return None


def _model_facts(config: dict[str, Any]) -> "dict[str, Any] | None":
    """What ``save_pretrained`` of the model hands the splitter, from its meta skeleton, or None
    (transformers cannot build it): ``keys``, the names in that order (transformers 5: after
    ``revert_weight_conversion``; 4.x: ``state_dict``'s; tied aliases included), ``storages``, the
    saved tensors that view one storage (``{name: [first name viewing it, its elements]}``: the
    experts of a fused parameter), and ``buffers``, the persistent buffers. Kept in the plan cache
    (:mod:`hf_merge.transforms.layout_cache`): building the skeleton imports transformers and the
    model's code (2.4 s of CPU for a Qwen2-7B-sized config), once per model and transformers."""
    from ..transforms import layout_cache

    key = None
    if layout_cache.cache_dir() is not None:
        key = layout_cache.digest({"plan": "saved_state", "format": 2, "versions": layout_cache.runtime(), "config": config})
        stored = layout_cache.get("saved_state", key)
        if _facts_valid(stored):
            return stored
    model = _skeleton(config)
    if model is None:
        return None
    import torch

    from ..transformers_compat import has_weight_conversions, saved_state

    try:
        state = saved_state(model) if has_weight_conversions() else model.state_dict()
    except Exception as e:  # noqa: BLE001 - the reverse does not run on meta tensors: the names' own order then
        logger.debug("no saved state dict for the shard order (%s: %s)", type(e).__name__, e)
        return None
    owners: dict[int, str] = {}
    storages = {name: [owners.setdefault(id(t._base), name), t._base.numel()]
                for name, t in state.items() if isinstance(t, torch.Tensor) and t._base is not None}
    facts = {"keys": list(state), "storages": storages,
             "buffers": sorted({n for n, _ in model.named_buffers()} & set(model.state_dict()))}
    if key is not None:
        layout_cache.put("saved_state", key, facts)
    return facts


def _facts_valid(stored: Any) -> bool:
    return (isinstance(stored, dict) and set(stored) == {"keys", "storages", "buffers"}
            and all(isinstance(stored[k], list) and all(isinstance(n, str) for n in stored[k]) for k in ("keys", "buffers"))
            and isinstance(stored["storages"], dict)
            and all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], int)
                    for v in stored["storages"].values()))
