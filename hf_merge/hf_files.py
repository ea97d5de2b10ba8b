"""The Hugging Face side files of a checkpoint: config.json, tokenizer, generation config, code.

config.json is read as JSON (never by executing remote code). It decides the default output dtype
and which weights are tied; the output copy gets the written dtype. Everything else in the
``huggingface/`` folder that is not a weight file is copied byte for byte.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection

from .errors import MissingConfigError, UnsafeCheckpointError
from .side_files import side_files
from .spec import config_dtype_name, dtype_name, output_dtype_name, parse_dtype
from . import config_fields
from .transformers_compat import dtype_key, tied_weights

if TYPE_CHECKING:  # reading a config needs no torch (the head start reads Megatron's without it)
    import torch

DEFAULT_TIED = {"lm_head.weight": "model.embed_tokens.weight"}

logger = logging.getLogger(__name__)


def _inside(path: Path, root: Path) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def checkpoint_side_dir(hf_dir: Path, root: Path) -> Path:
    """``hf_dir`` (the checkpoint's own ``huggingface/`` folder), refused when it or its
    ``config.json`` is a symlink that leaves the checkpoint ``root``: side files come only from
    inside the checkpoint, or from a folder the user names with ``--config``."""
    for p in (Path(hf_dir), Path(hf_dir) / "config.json"):
        if os.path.lexists(p) and not _inside(p, root):
            raise UnsafeCheckpointError(
                f"{p} is a symlink to {os.path.realpath(p)}, outside the checkpoint {root}; side files are only taken "
                "from inside it. Pass --config DIR to use that folder on purpose"
            )
    return Path(hf_dir)


def find_config_dir(hf_dir: Path | None, source: Path) -> Path:
    if hf_dir is not None and (Path(hf_dir) / "config.json").is_file():
        return Path(hf_dir)
    where = f" in {hf_dir}" if hf_dir else f" next to {source} (looked for huggingface/config.json)"
    raise MissingConfigError(
        f"no config.json{where}; pass --config DIR (alias --hf_model_path) with the base model's "
        "config.json and tokenizer"
    )


def load_config(config_dir: Path) -> dict[str, Any]:
    path = Path(config_dir) / "config.json"
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise MissingConfigError(f"{path} is not readable JSON ({str(e)[:120]}); fix it or pass --config DIR") from None
    if not isinstance(config, dict):
        raise MissingConfigError(f"{path} holds a JSON {type(config).__name__}, not an object; fix it or pass --config DIR")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise MissingConfigError(f"{path}: \"architectures\" must be a list of class names; fix it or pass --config DIR")
    if config.get("model_type") is not None and not isinstance(config["model_type"], str):
        raise MissingConfigError(f"{path}: \"model_type\" must be a string (e.g. \"llama\"); fix it or pass --config DIR")
    for key in ("text_config", "quantization_config"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise MissingConfigError(f"{path}: \"{key}\" must be an object; fix it or pass --config DIR")
    return config


def checkpoint_config(info) -> tuple[Path, dict[str, Any]]:
    """``(config folder, config.json content)`` for a checkpoint, with what the checkpoint itself
    shows (``info.config_overrides``: a critic's value head, ties) applied on top."""
    config_dir = find_config_dir(info.hf_dir, info.path)
    config = load_config(config_dir)
    info.config_overrides.apply(config)
    return config_dir, config


def config_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The dtype the model is meant to be in (``dtype``, older ``torch_dtype``, or the text config's)."""
    name = config_dtype_name(config)
    return parse_dtype(name) if name is not None else None


def resolve_dtype(requested: "str | torch.dtype | None", config: dict[str, Any]) -> torch.dtype | None:
    """Output dtype: None means keep each tensor's own dtype (``auto``)."""
    import torch

    if isinstance(requested, torch.dtype):
        return requested
    name = output_dtype_name(requested, config)
    return parse_dtype(name) if name is not None else None


ties_word_embeddings = config_fields.ties_word_embeddings


def tied_pairs(config: dict[str, Any], names: "Collection[str] | None" = None) -> dict[str, str]:
    """``{alias: source}`` weight pairs that the architecture ties when the config says so.

    From transformers: the class attribute ``_tied_weights_keys`` when it lists plain tensor
    names (every source among ``names``, the checkpoint's tensors, when given), else the pairs the
    model object computes (``all_tied_weights_keys``, what ``tie_weights`` and ``save_pretrained``
    use): regular expressions (``bbox_embed.(?![0])\\d+``), module prefixes, ties filled in
    ``__init__`` (Bark's ``lm_heads.{i}``) and sub-models' own ties, expanded on a meta-device
    skeleton of the model. Falls back to ``lm_head.weight -> model.embed_tokens.weight`` when
    transformers does not know the class.

    The answer is kept in the plan cache (:mod:`hf_merge.transforms.layout_cache`, keyed by its
    ``runtime()``, config.json and ``names``): asking transformers imports it and the model's code (seconds of
    CPU, on every merge of a tied model otherwise); a cached answer imports neither.
    """
    if not ties_word_embeddings(config):
        return {}
    from .transforms import layout_cache

    key = None
    if layout_cache.cache_dir() is not None:
        key = layout_cache.digest({"plan": "tied", "format": 1, "versions": layout_cache.runtime(), "config": config,
                                 "names": sorted(names) if names is not None else None})
        stored = layout_cache.get("tied", key)
        if isinstance(stored, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in stored.items()):
            return stored
    pairs = _ask_transformers(config, names)
    if key is not None:
        layout_cache.put("tied", key, pairs)
    return pairs


def _ask_transformers(config: dict[str, Any], names: "Collection[str] | None") -> dict[str, str]:
    """:func:`tied_pairs`, computed: the class's declaration, else its meta-device skeleton."""
    try:
        from .transforms.skeleton import model_class_for, skeleton

        cls = model_class_for(config)
    except ImportError:
        cls = None
    if cls is None:
        return dict(DEFAULT_TIED)
    keys = getattr(cls, "_tied_weights_keys", None)
    declared = {str(k): str(v) for k, v in keys.items()} if isinstance(keys, dict) else {}
    nested = any(isinstance(v, dict) and "model_type" in v for v in config.values())
    plain = all(_PLAIN_NAME.match(n) for pair in declared.items() for n in pair)
    if declared and plain and not nested and (names is None or all(v in names for v in declared.values())):
        return declared
    try:
        model = skeleton(cls, config)
    except Exception as e:  # noqa: BLE001 - transformers' own error: keep the plain pairs it declares
        logger.debug("%s not built to expand its tied weights (%s)", cls.__name__, e)
        return {k: v for k, v in declared.items() if plain}
    return tied_weights(model)


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")


def without_stale_quantization(config: dict[str, Any], specs) -> tuple[dict[str, Any], str | None]:
    """``(config, note)``: config.json less a ``quantization_config`` that the weights do not have.

    A base model published quantized (fp8, MXFP4, GPTQ...) is dequantized for training, and
    transformers then drops ``quantization_config`` from the model's config, so ``save_pretrained``
    of the trained model writes none. A config.json taken from the Hub folder (``--config``) still
    names it, which makes loaders expect quantized tensors (scales, blocks). It is left out when every
    tensor written is a plain float of 16 bits or more; kept (with no note) otherwise.
    """
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict):
        return config, None
    kinds = {spec.dtype for spec in specs.values()}
    if not kinds or any(not d.is_floating_point or d.itemsize < 2 for d in kinds):
        return config, None
    method = quantization.get("quant_method", "unnamed")
    note = (f"config.json's quantization_config ({method}) left out: the weights are plain "
            f"{', '.join(sorted(dtype_name(d) for d in kinds))}, as save_pretrained of the dequantized model writes them")
    return {k: v for k, v in config.items() if k != "quantization_config"}, note


def config_text(config: dict[str, Any], dtype: "torch.dtype | None") -> str:
    """The output's config.json: ``config`` naming ``dtype`` as the weights' dtype."""
    out = dict(config)
    if dtype is not None:  # under the key the installed transformers writes, and any other already there
        for key in {dtype_key()} | ({"dtype", "torch_dtype"} & set(out)):
            out[key] = dtype_name(dtype)
    return json.dumps(out, indent=2, sort_keys=True) + "\n"


def write_config(config: dict[str, Any], folder: Path, *, dtype: torch.dtype | None) -> None:
    (Path(folder) / "config.json").write_text(config_text(config, dtype))


def copy_side_files(config_dir: Path, folder: Path, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy the top-level tokenizer / processor / generation config / remote-code files.

    Weights, weight indexes, config.json (written separately), hidden files, folders and symlinks
    are not copied (a skipped symlink is reported: it may point anywhere, e.g. at a key file).
    """
    copied = []
    for item in side_files(config_dir, skip=skip, report=True):
        shutil.copyfile(item, Path(folder) / item.name)
        copied.append(item.name)
    return copied


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
GENERATION_CONFIG = "generation_config.json"
# Architectures that generate text: their folders normally carry a generation_config.json.
_GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def written_dtype(specs, *, skip=None) -> tuple[torch.dtype | None, dict[torch.dtype, int]]:
    """The dtype config.json must name for these output tensors: the floating dtype holding the
    most elements (``skip(spec)`` true: left out, e.g. quantized parts), and the element count per
    floating dtype. ``(None, {})`` when no floating tensor is written."""
    counts: dict[torch.dtype, int] = {}
    for spec in specs.values():
        if spec.dtype.is_floating_point and not (skip is not None and skip(spec)):
            counts[spec.dtype] = counts.get(spec.dtype, 0) + spec.numel
    if not counts:
        return None, {}
    return max(counts, key=lambda d: (counts[d], d.itemsize)), counts


def derive_generation_config(config: dict[str, Any], folder: Path) -> bool:
    """Write the ``generation_config.json`` that ``save_pretrained`` writes for a model whose config
    folder has none: transformers' ``from_model_config`` of the ``config.json`` already written in
    ``folder`` (its bos / eos / pad tokens; no sampling settings), as ``PreTrainedModel.__init__``
    builds it. False, and nothing written, when the class does not generate or transformers does
    not know it (custom code). Deriving it imports transformers (about 0.8 s after torch): the
    merge starts that import while the weights are written (:func:`generation_config_warm_up`),
    and the file is kept in the plan cache, keyed by the written config.json and the library
    versions, as the Hub layout is."""
    key = _generation_config_key((folder / "config.json").read_text())
    stored = _stored_generation_config(key)
    if stored is None:
        try:
            stored = {"file": _generation_config_text(config, folder)}
        except Exception as e:  # noqa: BLE001 - the weights are written: a config transformers rejects is a warning
            logger.debug("generation_config.json not derived: %s", e)
            return False
        from .transforms import layout_cache

        layout_cache.put("generation_config", key, stored)
    if stored["file"] is None:
        return False
    (folder / GENERATION_CONFIG).write_text(stored["file"])
    return True


def generation_config_warm_up(config: dict[str, Any], written: str) -> "Callable[[], None] | None":
    """What :func:`derive_generation_config` will import for the output's config.json ``written``,
    as a function to run while the weights are written; None when the plan cache holds the file."""
    if _stored_generation_config(_generation_config_key(written)) is not None:
        return None

    def warm_up() -> None:
        import transformers

        for name in ("AutoConfig", "GenerationConfig"):  # transformers' lazy module imports them
            getattr(transformers, name)

    return warm_up


def _generation_config_key(written: str) -> str:
    from .transforms import layout_cache

    return layout_cache.digest({"versions": layout_cache.runtime(), "config": written})


def _stored_generation_config(key: str) -> "dict[str, str | None] | None":
    from .transforms import layout_cache

    stored = layout_cache.get("generation_config", key)
    return stored if isinstance(stored, dict) and isinstance(stored.get("file"), (str, type(None))) else None


def _generation_config_text(config: dict[str, Any], folder: Path) -> str | None:
    """What ``save_pretrained`` writes as ``generation_config.json`` for the config.json in ``folder``.

    The model's class is not imported to ask ``can_generate()`` (its modeling code costs ~1.3 s
    more than the config's): the class generates when its name says so (:data:`_GENERATIVE_SUFFIXES`,
    which also decides that the file is missing). Checked on every such class transformers exports:
    4.51.1, 219 of 219; 5.25.0, 336 of 340 (not PI0 / PI05 ``ForConditionalGeneration`` and two
    abstract Omni bases). None of them sets its own ``generation_config_class``."""
    if not _generates(config):
        return None
    from transformers import AutoConfig, GenerationConfig

    generation_config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))
    generation_config.save_pretrained(folder)
    return (folder / GENERATION_CONFIG).read_text()


def missing_side_files(config: dict[str, Any], files: list[str]) -> list[str]:
    """What a user loading the output would miss: ``tokenizer`` when no tokenizer file is among
    ``files``, ``generation_config.json`` when the architecture generates text and has none."""
    missing = []
    if not any(name in files for name in TOKENIZER_FILES):
        missing.append("tokenizer")
    if GENERATION_CONFIG not in files and _generates(config):
        missing.append(GENERATION_CONFIG)
    return missing


def _generates(config: dict[str, Any]) -> bool:
    """Whether config.json's architecture generates text, read from its class name
    (:data:`_GENERATIVE_SUFFIXES`; see :func:`_generation_config_text` for how well that agrees
    with transformers' ``can_generate()``)."""
    return any(str(a).endswith(_GENERATIVE_SUFFIXES) for a in config.get("architectures") or [])


