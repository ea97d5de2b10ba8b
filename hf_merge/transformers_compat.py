"""What differs between the transformers releases hf-merge runs on (4.56 to the newest 5.x), in one place.

transformers 5 keeps some models in memory in another layout than the one it saves (fused MoE
experts, VLM prefixes) and declares the difference as weight conversions
(``transformers.conversion_mapping``, ``transformers.core_model_loading``); its loader is built on
them. transformers 4.x has none of that: a MoE model holds one module per expert, as the Hub
does, so there is no layout to revert. What 4.x does rename is a VLM's prefixes: its
``save_pretrained`` turns the class's ``_checkpoint_conversion_mapping`` around (``model.language_model.*``
saved as ``model.*``, ``model.visual.*`` as ``visual.*``). Ties are a dict ``{alias: source}`` in 5,
a list of alias names in 4.x (tied to the input embeddings by ``tie_weights``).

Everything else in hf-merge asks this module, never the version number itself.

It is also the one place that reaches into transformers' internals (``_``-prefixed functions and
attributes, ``modeling_utils`` / ``core_model_loading`` / ``conversion_mapping`` /
``integrations.accelerate`` helpers): :mod:`hf_merge.load.model` replays ``from_pretrained`` through the
functions below and uses only transformers' public API otherwise, so a release that moves one of
these is fixed here. Nothing here imports transformers until it is called.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .errors import MissingConfigError, UnsupportedCheckpointError

__all__ = [
    "auto_model_class",
    "check_device_map",
    "checkpoint_order",
    "dispatch",
    "dtype_plan",
    "dtype_key",
    "dtype_kwargs",
    "expand_device_map",
    "finish_loading",
    "glob_alternation",
    "has_weight_conversions",
    "infer_device_map",
    "init_contexts",
    "is_auto_class",
    "keep_in_fp32_matcher",
    "legacy_saved_names",
    "major_version",
    "mark_loaded",
    "model_ignores",
    "no_init_weights",
    "progress",
    "rename_checkpoint_key",
    "reverse_conversions",
    "saved_state",
    "rope_unread",
    "set_attn_implementation",
    "Stacking",
    "stacking",
    "tied_weights",
    "version_tuple",
    "weight_mapping",
]


@functools.lru_cache(maxsize=1)
def _installed() -> tuple[int, int] | None:
    """The installed transformers' (major, minor) from its metadata (nothing imported; a missing
    minor is 0), or None when it is not installed or its version has no number."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    head = re.match(r"(\d+)(?:\.(\d+))?", version)
    return (int(head.group(1)), int(head.group(2) or 0)) if head else None


def major_version() -> int | None:
    """The installed transformers' major version, or None when it is not installed."""
    installed = _installed()
    return None if installed is None else installed[0]


def version_tuple() -> tuple[int, int]:
    """The installed transformers' (major, minor); (0, 0) when it is not installed."""
    return _installed() or (0, 0)


def dtype_key() -> str:
    """The name of the model's dtype, as ``from_pretrained`` / ``from_config`` take it and
    ``config.json`` holds it: ``dtype`` since transformers 4.56, ``torch_dtype`` before (4.51-4.55
    pass an unknown ``dtype`` keyword on to the model's ``__init__``, which fails)."""
    return "dtype" if version_tuple() >= (4, 56) else "torch_dtype"


def dtype_kwargs(dtype: Any) -> dict[str, Any]:
    """``{dtype_key(): dtype}``: the keyword argument for ``from_pretrained`` / ``from_config``."""
    return {dtype_key(): dtype}


def has_weight_conversions() -> bool:
    """transformers >= 5: weight conversions (``conversion_mapping``, ``core_model_loading``) and
    the loader built on them exist."""
    major = major_version()
    return major is not None and major >= 5


def tied_weights(model: Any) -> dict[str, str]:
    """``{alias: source}``: the weights ``tie_weights`` ties and ``save_pretrained`` writes once.

    transformers 5 computes them on the model (``all_tied_weights_keys``). transformers 4.x ties
    the output embeddings to the input embeddings when ``tie_word_embeddings`` is set and lists the
    alias names in ``_tied_weights_keys``; the pair is found from the modules themselves.
    """
    if has_weight_conversions():
        return {str(k): str(v) for k, v in (getattr(model, "all_tied_weights_keys", None) or {}).items()}
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return {}
    try:
        output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return {}
    if output is None or inputs is None:
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    out_name, in_name = names.get(id(output)), names.get(id(inputs))
    if out_name is None or in_name is None or out_name == in_name:
        return {}
    return {f"{out_name}.weight": f"{in_name}.weight"}


def rope_unread(config: dict[str, Any]) -> str | None:
    """transformers 4.x: what a config.json written by transformers 5 says of RoPE that this release
    does not read, as a sentence; None when it reads the same (or under transformers 5).

    transformers 5 keeps ``rope_theta`` and the scaling in ``rope_parameters``; 4.x reads only the
    top-level ``rope_theta`` / ``rope_scaling`` and builds the class's defaults otherwise (a Llama 3.2
    gets rope_theta 10000 and no llama3 scaling). The config is built as 4.x builds it and compared.
    """
    text = config.get("text_config")
    where = {"": config, "text_config.": text if isinstance(text, dict) else {}}  # a VLM's language model: its own
    where = {at: sub for at, sub in where.items() if isinstance(sub.get("rope_parameters"), dict)}
    if has_weight_conversions() or not where:
        return None
    from transformers import AutoConfig, __version__

    from .config_fields import rope_settings

    try:
        built = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    except Exception:  # noqa: BLE001 - a config 4.x cannot build fails where it is loaded, with its own error
        return None
    unread = []
    for at, sub in where.items():
        want, read = rope_settings(sub), getattr(built, at.rstrip("."), None) if at else built
        read_theta, read_scaling = getattr(read, "rope_theta", None), getattr(read, "rope_scaling", None)
        rope_type = str(want.get("rope_type", "default"))
        if want.get("rope_theta") is not None and read_theta is not None and float(read_theta) != float(want["rope_theta"]):
            unread.append(f"{at}rope_theta {want['rope_theta']} (read as {read_theta})")
        if rope_type != "default" and not read_scaling:
            unread.append(f"{at}{rope_type} scaling (read as none)")
        if "mrope_section" in want and not (read_scaling or {}).get("mrope_section"):  # Qwen2-VL's multimodal RoPE
            unread.append(f"{at}mrope_section {want['mrope_section']} (read as none)")
    if not unread:
        return None
    return (f"config.json keeps RoPE in rope_parameters (transformers 5's field): {', '.join(unread)}; transformers "
            f"{__version__} does not read that field, so its model does not compute the trained logits")


def legacy_saved_names(model_class: Any, names: list[str]) -> dict[str, str]:
    """transformers 4.x: ``{saved name: in-memory name}`` as that release's ``save_pretrained``
    renames a VLM (the reverse of its ``_checkpoint_conversion_mapping``, first match wins); empty
    when nothing is renamed. Only for 4.x: transformers 5 declares this as a weight conversion."""
    if has_weight_conversions():
        raise RuntimeError("legacy_saved_names is transformers 4.x's rule; transformers 5 has weight conversions")
    try:
        from transformers.modeling_utils import VLMS
    except ImportError:  # before 4.52 a VLM's in-memory names were its saved ones: nothing renamed
        return {}

    is_vlm = any(vlm in klass.__name__.lower() for klass in model_class.__mro__[:-1] for vlm in VLMS)
    mapping = getattr(model_class, "_checkpoint_conversion_mapping", None) or {}
    if not is_vlm or not mapping:
        return {}
    reverse = [(pattern, re.sub(r"\(.*\)", "", replacement.lstrip("^"))) for replacement, pattern in mapping.items()]
    out: dict[str, str] = {}
    for name in names:
        saved = name
        for pattern, replacement in reverse:
            saved, count = re.subn(pattern, replacement, saved)
            if count:
                break
        out[saved] = name
    if len(out) != len(names):
        raise ValueError("two tensors would be saved under one name")
    return out if any(k != v for k, v in out.items()) else {}


# --------------------------------------------------------------------------------------------
# from_pretrained's steps, for hf_merge.load.model (transformers >= 5 unless said otherwise)
# --------------------------------------------------------------------------------------------


def set_attn_implementation(config: Any, implementation: str) -> None:
    """What ``from_pretrained(attn_implementation=...)`` sets on the config before building."""
    config._attn_implementation = implementation


def is_auto_class(cls: Any) -> bool:
    """An Auto class (``AutoModelForCausalLM``...): it has a config -> model mapping."""
    return hasattr(cls, "_model_mapping")


def auto_model_class(auto_class: Any, config: Any, hf_dir: Path | None, trust_remote_code: bool | None):
    """The concrete class ``auto_class.from_pretrained`` would build for ``config``: the checkpoint's
    own modeling code when the config maps one and it is trusted, else the library's. Returns
    ``(model class, config)``; the config may be the text sub-config (composite models whose text
    part is what the class builds)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module, resolve_trust_remote_code
    from transformers.models.auto.auto_factory import _get_model_class, add_generation_mixin_to_remote_model

    name = auto_class.__name__
    auto_map = getattr(config, "auto_map", None) or {}
    has_remote_code = name in auto_map
    has_local_code = type(config) in auto_class._model_mapping
    explicit_local_code = has_local_code and not _get_model_class(
        config, auto_class._model_mapping
    ).__module__.startswith("transformers.")
    try:
        trust = resolve_trust_remote_code(trust_remote_code, str(hf_dir), has_local_code, has_remote_code)
    except ValueError as e:
        raise UnsupportedCheckpointError(
            f"{hf_dir} has custom modeling code for {name}; pass trust_remote_code=True to run it ({e})"
        ) from None
    if has_remote_code and trust and not explicit_local_code:
        if hf_dir is None:
            raise MissingConfigError("the config asks for custom modeling code but there is no folder to load it from")
        model_class = get_class_from_dynamic_module(auto_map[name], str(hf_dir))
        if not has_local_code:
            auto_class.register(config.__class__, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_class=auto_class)
        return add_generation_mixin_to_remote_model(model_class), config
    if has_local_code:
        model_class = _get_model_class(config, auto_class._model_mapping)
        text_config_class = config.sub_configs.get("text_config", None)
        if text_config_class is not None and getattr(model_class, "config_class", None) == text_config_class:
            parent = config
            config = config.get_text_config()
            if getattr(parent, "quantization_config", None) is not None:
                config.quantization_config = parent.quantization_config
        return model_class, config
    raise UnsupportedCheckpointError(
        f"{name} has no model for a {type(config).__name__} (model_type {getattr(config, 'model_type', None)!r}); "
        f"use another Auto class, or leave auto_class unset to build {(getattr(config, 'architectures', None) or ['?'])[0]}"
    )


def init_contexts(model_class: Any, dtype: Any) -> list:
    """``from_pretrained``'s init contexts: the meta device, ``dtype``, weights not initialised."""
    return model_class.get_init_context(dtype, False, False, None)


def no_init_weights():
    """A context in which building a model skips weight initialisation (transformers 4.x and 5)."""
    from transformers.modeling_utils import no_init_weights as context

    return context()


def weight_mapping(model: Any) -> list:
    """The model's weight conversions (renamings and converters), as ``from_pretrained`` applies them."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return get_model_conversion_mapping(model, None, None)


def reverse_conversions(model: Any) -> list:
    """What ``revert_weight_conversion`` reverses for a model built from its config: the class's
    conversions (no legacy renames, no prefix changes), as ``from_pretrained`` keeps them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    return [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]


def saved_state(model: Any) -> dict[str, Any]:
    """``model.state_dict()`` as ``save_pretrained`` of it, loaded by ``from_pretrained``, hands it
    to the splitter: after ``revert_weight_conversion`` (its order; per-expert tensors as views of
    their fused parameter), tied aliases kept. On a meta-device model, meta tensors."""
    from transformers.core_model_loading import revert_weight_conversion

    missing = object()
    before = model.__dict__.get("_weight_conversions", missing)
    model._weight_conversions = reverse_conversions(model)
    try:
        return revert_weight_conversion(model, model.state_dict())
    finally:
        if before is missing:
            del model._weight_conversions
        else:
            model._weight_conversions = before


def checkpoint_order(names: Iterable[str]) -> list[str]:
    """``names`` in the order transformers' loader visits checkpoint keys (``layers.2`` before ``layers.10``)."""
    from transformers.core_model_loading import dot_natural_key

    return sorted(names, key=dot_natural_key)


def rename_checkpoint_key(name: str, mapping: list, prefix: str, meta: dict) -> tuple[str, str | None]:
    """The model key a checkpoint ``name`` loads into under ``mapping`` (:func:`weight_mapping`; an
    empty list for the plain prefix rule), and the converter pattern when a many-to-one converter
    takes it (None otherwise)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return rename_source_key(name, renamings, converters, base_model_prefix=prefix, meta_state_dict=meta)


@dataclass(frozen=True)
class Stacking:
    """A many-to-one weight converter made only of stacking and concatenation (transformers 5's
    fused MoE experts): each source pattern's tensors (in checkpoint order) stacked along
    ``stack_dim``, then the patterns' results concatenated along ``cat_dim`` in ``sources`` order;
    either step may be absent (None)."""

    sources: tuple[str, ...]
    stack_dim: int | None
    cat_dim: int | None


def stacking(mapping: list, pattern: str) -> Stacking | None:
    """What the converter of ``mapping`` that takes source ``pattern`` (as :func:`rename_checkpoint_key`
    returns it) does, when it is only ``MergeModulelist`` (stack) and/or ``Concatenate`` along
    non-negative dims into one target; None for any other converter."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    found = None
    for entry in mapping:  # the last converter declaring the pattern wins, as in transformers' loader
        if isinstance(entry, WeightConverter) and pattern in entry.source_patterns:
            found = entry
    if found is None or len(found.target_patterns) != 1 or found.quantization_operation is not None:
        return None
    kinds = [type(op) for op in found.operations]  # exact types: a subclass may convert otherwise
    dims = [getattr(op, "dim", None) for op in found.operations]
    if any(not isinstance(d, int) or d < 0 for d in dims):
        return None
    sources = tuple(found.source_patterns)
    if kinds == [MergeModulelist] and len(sources) == 1:
        return Stacking(sources, dims[0], None)
    if kinds == [MergeModulelist, Concatenate]:
        return Stacking(sources, dims[0], dims[1])
    if kinds == [Concatenate]:
        return Stacking(sources, None, dims[0])
    return None


def _load_info(missing: set[str], unexpected: set[str]):
    from transformers.utils.loading_report import LoadStateDictInfo

    return LoadStateDictInfo(
        missing_keys=set(missing),
        unexpected_keys=set(unexpected),
        mismatched_keys=set(),
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    )


def model_ignores(model: Any, missing: set[str], unexpected: set[str]) -> tuple[set[str], set[str]]:
    """``(missing, unexpected)`` less what the model's own ignore patterns allow (old ``inv_freq``
    buffers...), as ``from_pretrained``'s loading report drops them."""
    info = _load_info(missing, unexpected)
    model._adjust_missing_and_unexpected_keys(info)
    return set(info.missing_keys), set(info.unexpected_keys)


def check_device_map(device_map: Any) -> Any:
    """``device_map`` in the form ``from_pretrained`` accepts (a str, dict or device), checked."""
    from transformers.integrations.accelerate import check_and_set_device_map

    return check_and_set_device_map(device_map)


def infer_device_map(model: Any, device_map: Any, max_memory: Any) -> dict | None:
    """``{module: device}`` for a checked ``device_map`` (``"auto"`` planned by accelerate)."""
    from transformers.integrations.accelerate import _get_device_map

    return _get_device_map(model, device_map, max_memory, None)


def expand_device_map(device_map: dict, keys: list[str]) -> dict:
    """``{key: device}`` for every parameter / buffer key under a module-level device map."""
    from transformers.integrations.accelerate import expand_device_map as expand

    return expand(device_map, keys)


def dispatch(model: Any, device_map: dict, offload_folder: Any, offload_buffers: bool) -> None:
    """accelerate's hooks for a model spread over several devices, as ``from_pretrained`` adds them."""
    from transformers.integrations.accelerate import accelerate_dispatch

    accelerate_dispatch(model, None, device_map, offload_folder, None, offload_buffers)


def dtype_plan(model: Any, dtype: Any) -> dict:
    """``{glob: dtype}``: the weights the model keeps in another dtype than the load dtype."""
    return model._get_dtype_plan(dtype)


def keep_in_fp32_matcher(model: Any, dtype: Any):
    """``match(name)``: whether ``from_pretrained(dtype=dtype)`` loads the in-memory tensor ``name``
    in float32 (``_keep_in_fp32_modules_strict`` for float16 / bfloat16, ``_keep_in_fp32_modules``
    for float16 only), by this release's rule: transformers 5 searches the name for each module
    as a glob (a substring, ``*`` any text), 4.x for it as whole ``.``-separated segments. None
    when no tensor is kept."""
    import torch

    if has_weight_conversions():
        globs = [g for g, d in dtype_plan(model, dtype).items() if d == torch.float32]
        pattern = glob_alternation(globs)[0] if globs else None
    else:
        modules = list(model._keep_in_fp32_modules or []) if dtype == torch.float16 else []
        if dtype in (torch.float16, torch.bfloat16):  # 4.51 has no strict list
            modules += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        pattern = re.compile("|".join(rf"((^|\.){m}($|\.))" for m in modules)) if modules else None
    return None if pattern is None else (lambda name: pattern.search(name) is not None)


def glob_alternation(globs: list[str]):
    """One regex over ``globs`` and ``{group name: glob}`` (transformers' own matcher)."""
    from transformers.core_model_loading import build_glob_alternation

    return build_glob_alternation(globs)


def progress(iterable: Iterable, *, total: int, desc: str):
    """transformers' progress bar (silenced with its logging)."""
    from transformers.utils.logging import tqdm

    return tqdm(iterable, total=total, desc=desc)


def mark_loaded(tensor: Any) -> None:
    """``from_pretrained``'s flag on a loaded tensor: the model's ``_init_weights`` leaves it alone."""
    tensor._is_hf_initialized = True


def finish_loading(
    model: Any, *, name: str, device_map: Any, dtype: Any, mapping: list, missing: set[str], unexpected: set[str]
) -> None:
    """``from_pretrained``'s last steps (``_finalize_model_loading``): non-persistent buffers, missing
    keys initialised, weights tied, the loading report; ``mapping``'s used conversions are kept on
    the model for ``save_pretrained``."""
    from transformers.modeling_utils import LoadStateDictConfig

    config = LoadStateDictConfig(
        pretrained_model_name_or_path=name,
        device_map=device_map,
        dtype=dtype,
        dtype_plan=model._get_dtype_plan(dtype),
        weight_mapping=mapping,
    )
    model._weight_conversions = [m for m in mapping if m.was_used()]
    type(model)._finalize_model_loading(model, config, _load_info(missing, unexpected))
