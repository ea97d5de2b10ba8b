"""The model loader: a lazy checkpoint straight into a transformers ``PreTrainedModel``.

``from_sharded_pretrained(source)`` does what ``from_pretrained`` does for a merged folder, without
the folder: it opens the source as a lazy checkpoint, takes the same transform stack ``merge``
writes (:func:`hf_merge.transforms.views.model_view`: tied alias dropped, LoRA folded, dtype cast), builds the
model on the meta device and fills it tensor by tensor. Each parameter or buffer is allocated on
its target device in its target dtype and ``read_into`` it, so peak memory is the model plus the
tensors in flight; no state dict, no temporary files.

What is transformers' job stays transformers' job, through its own helpers: choosing the concrete
class from the config (the Auto classes' mapping, remote code), mapping checkpoint names to model
names (``base_model_prefix`` and the conversion mapping, ``rename_source_key``), the meta-device init
context, ``device_map="auto"`` (accelerate), and the finishing steps of ``from_pretrained``
(``_finalize_model_loading``: non-persistent buffers such as rotary ``inv_freq`` recomputed by the
model's ``_init_weights``, weights tied, the loading report). Those of its helpers that are not public API
(``_``-prefixed, ``modeling_utils`` / ``core_model_loading`` / ``integrations.accelerate``
internals) are called only through :mod:`hf_merge.transformers_compat`. A model that stacks tensors the
checkpoint has one by one (transformers 5's fused MoE experts, many-to-one converters made only of
stacking and concatenation) is filled here too: each checkpoint tensor is read into its slice of
the stacked parameter (:mod:`hf_merge.load.stacked`). Loads that need transformers' weight loop
itself — on-the-fly quantization (``quantization_config``), other weight converters (transposes,
splits, permutations...), disk offload — are handed to ``from_pretrained(None, state_dict=...)``
with lazy values, so they still read one tensor at a time.

Unlike ``from_pretrained``, a checkpoint that does not fit the model is an error (missing or
unexpected weights are named), not a warning, unless ``strict=False``. Head weights a base model
does not have (``AutoModel`` on a ``...ForCausalLM`` checkpoint) are skipped, as transformers does.

Under transformers 4.x (no weight conversions, no ``_finalize_model_loading``) every load is
handed to ``from_pretrained(None, state_dict=...)`` with lazy values: still one tensor read at a
time, but neither checked against the model before reading nor mapped from the rank files.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint import LazyCheckpoint, open_checkpoint
from ..errors import LoraError, MappingError, MissingConfigError, QuantizationError, UnsupportedCheckpointError, for_python
from ..hf_files import find_config_dir, load_config, without_stale_quantization
from . import page_mapper
from .page_mapper import Mapper
from .device_fill import StagerPool, stages
from .prefetch import Prefetch
from .stacked import Slot, first_piece, flat_runs, read_slot, slots, tiling
from ..readers import contained, record_crc
from ..readers.formats import reader_options
from ..pipeline import Fill, run_in_process
from ..transforms.views import build_views, model_view
from .. import transformers_compat as compat

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)

LORA_MODES = ("fuse", "adapter")

# Threads that allocate + read tensors concurrently (copies release the GIL). The model is the
# only thing they fill, so more threads cost no extra memory.
LOAD_THREADS = max(1, min(4, os.cpu_count() or 1))

_LIST_LIMIT = 8  # names listed in an error message
#: ``from_pretrained`` arguments that say how it finds and reads a model folder's files (the Hub,
#: safetensors or pickles, a low-memory load): the shards are read here, on the meta device first,
#: so they are accepted and change nothing (``from_pretrained`` drops the first six itself)
_FILE_LOADING_KWARGS = frozenset({
    "low_cpu_mem_usage", "_fast_init", "mirror", "offload_state_dict", "from_tf", "from_flax",
    "use_safetensors", "weights_only", "cache_dir", "force_download", "resume_download", "proxies", "token",
    "use_auth_token", "revision", "local_files_only",
})


@dataclass
class LoadPlan:
    """Which checkpoint tensor fills which model tensor, decided from specs alone (nothing read yet)."""

    assign: dict[str, str] = field(default_factory=dict)  # model key -> view (checkpoint) name
    missing: set[str] = field(default_factory=set)  # model keys nothing fills (tied aliases included)
    unexpected: dict[str, str] = field(default_factory=dict)  # model-side name -> view name, unused
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    skipped_heads: list[str] = field(default_factory=list)  # view names a base model has no place for
    stacked: dict[str, list[Slot]] = field(default_factory=dict)  # model key -> where its view names go
    needs_converters: bool = False  # some names need transformers' many-to-one weight converters


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


@for_python
def from_sharded_pretrained(
    source: "str | os.PathLike",
    *,
    auto_class: "type | str | None" = None,
    backend: str = "auto",
    config: "PretrainedConfig | str | os.PathLike | None" = None,
    dtype: "str | torch.dtype | None" = None,
    device_map: "str | dict | int | torch.device | None" = None,
    max_memory: dict | None = None,
    quantization_config: Any = None,
    trust_remote_code: bool | None = None,
    attn_implementation: str | None = None,
    generation_config: Any = None,
    lora: str = "fuse",
    lora_alpha: float | None = None,
    use_rslora: bool | None = None,
    base_model: "str | os.PathLike | None" = None,
    is_value_model: bool | None = None,
    strict: bool = True,
    offload_folder: "str | os.PathLike | None" = None,
    offload_buffers: bool = False,
    disable_mmap: bool | None = None,
    source_crc: bool = True,
    source_options: "dict[str, Any] | None" = None,
    **kwargs: Any,
) -> "PreTrainedModel":
    """Load a sharded training checkpoint as a transformers model, without merging it to disk first.

    Args:
        source: a checkpoint :func:`hf_merge.open_checkpoint` reads (verl ``actor/`` or
            ``global_step_N`` folder, checkpoints root, Megatron folder, HF folder).
        auto_class: the transformers class to build: an Auto class (``AutoModel`` gives the base
            model, ``AutoModelForCausalLM`` the LM...), its name, or a concrete model class. Default:
            the class named by ``architectures`` in config.json (what the checkpoint was trained as).
        backend: ``auto`` (detected from the files) or a format name: ``fsdp``, ``megatron``,
            ``deepspeed``, ``accelerate``, ``colossalai``, ``torchtitan``, ``dcp`` or ``hf`` (as
            ``merge --backend``; see :func:`hf_merge.open_checkpoint`).
        config: a ``PretrainedConfig`` to build the model from, or a folder with config.json (and
            tokenizer / generation config) to use instead of the checkpoint's ``huggingface/``.
        dtype: ``None`` or ``"auto"``: the config's dtype, as ``merge`` writes it and as
            ``from_pretrained(dtype="auto")`` loads it (the checkpoint's own when the config names
            none); ``"keep"``: the checkpoint's dtypes as trained (``merge --dtype auto``); or a
            dtype such as ``torch.bfloat16`` / ``"bfloat16"``. ``torch_dtype`` is accepted too.
        device_map: as in ``from_pretrained``: ``"cpu"``, ``"cuda:0"``, ``"auto"`` /
            ``"balanced"`` / ``"sequential"`` (accelerate), or ``{module name: device}``. Each tensor
            is allocated on its device and read into place there.
        max_memory: per-device limits for ``device_map="auto"``.
        quantization_config: e.g. ``BitsAndBytesConfig(load_in_4bit=True)``; quantized on load by
            transformers' quantizer, one tensor at a time.
        trust_remote_code: allow the checkpoint's own modeling code (``auto_map``).
        attn_implementation: ``"eager"``, ``"sdpa"``, ``"flash_attention_2"``...
        generation_config: a ``GenerationConfig`` to use instead of the checkpoint's
            generation_config.json.
        lora: ``"fuse"`` (LoRA folded into the base weights, a plain model) or ``"adapter"`` (a
            ``peft.PeftModel`` with the trained adapter attached, unmerged).
        lora_alpha, use_rslora: LoRA settings when the checkpoint does not record them (as
            ``merge``'s ``--lora-alpha`` / ``--use-rslora``).
        base_model: the base model's HF folder, for checkpoints that hold only LoRA weights (its
            config.json is the config when the checkpoint has none, e.g. an HF Trainer PEFT ``checkpoint-N``).
        is_value_model: the checkpoint is a critic (Megatron ``[1, H]`` value head): build the
            token-classification model with ``num_labels=1``; by default the head's shape decides.
        strict: raise :class:`~hf_merge.errors.MappingError` when the checkpoint has weights the
            model lacks or lacks weights the model needs. ``False``: initialise what is missing
            (like ``from_pretrained``, e.g. a new classification head) and skip what is unused.
        offload_folder, offload_buffers: disk offload, as in ``from_pretrained``.
        disable_mmap: as in ``from_pretrained``: ``True`` reads every weight into the process's
            own memory. By default a CPU weight the rank files hold in its load dtype is mapped from
            them (copy-on-write pages, like ``from_pretrained``'s mapping of safetensors), so the
            rank files must not be rewritten in place while the model lives (deleting them is fine).
        source_crc: check the CRC-32 of every zip record of the source before its bytes are loaded
            (as ``merge`` does; see docs/integrity.md); ``False`` skips it.
        source_options, tag, source_weights: the format's reader options, as in ``merge``
            (``source_options={"tag": "global_step100"}``) or as keyword arguments: DeepSpeed's
            ``tag`` (``--tag``: which checkpoint tag to read) and ``source_weights`` (``--source-weights``:
            ``"master"``, the fp32 master weights, or ``"module"``, the 16-bit module weights).
        **kwargs: config attribute overrides (``num_labels=1``, ``use_cache=False``...); what the
            config does not take goes to the model's ``__init__``, as in ``from_pretrained``.
            ``from_pretrained``'s file-loading arguments (``low_cpu_mem_usage``, ``use_safetensors``,
            ``weights_only``, ``revision``, ``cache_dir``, ``token``...) are accepted and change nothing.

    Returns:
        The model in eval mode (a ``peft.PeftModel`` with ``lora="adapter"``); with
        ``output_loading_info=True``, ``(model, info)`` as ``from_pretrained`` gives them
        (``missing_keys``, ``unexpected_keys``, ``mismatched_keys``, ``error_msgs``).

    Raises:
        HfMergeError: a subclass naming what is wrong with the source and what to do, as the CLI does.
    """
    if not source_crc:
        params = dict(locals())
        extra = params.pop("kwargs")
        params.pop("source_crc")
        with record_crc.skipping():
            return from_sharded_pretrained(**params, **extra)
    import transformers

    if lora not in LORA_MODES:
        raise ValueError(f"lora must be one of {LORA_MODES}, not {lora!r}")
    if "torch_dtype" in kwargs:
        torch_dtype = kwargs.pop("torch_dtype")
        dtype = dtype if dtype is not None else torch_dtype
    for name in _FILE_LOADING_KWARGS & kwargs.keys():
        del kwargs[name]  # not config overrides: the model's __init__ would raise TypeError on them
    source_options = dict(source_options or {})
    for name in reader_options() & kwargs.keys():  # the formats' options (DeepSpeed's tag...), not config overrides
        source_options[name] = kwargs.pop(name)
    output_loading_info = bool(kwargs.pop("output_loading_info", False))
    config_obj = config if isinstance(config, transformers.PretrainedConfig) else None
    config_dir_arg = None if config_obj is not None or config is None else Path(config)

    scratch = contextlib.ExitStack()
    try:
        ckpt, written = _open_source(source, backend=backend, config_dir=config_dir_arg, config_obj=config_obj,
                                     is_value_model=is_value_model, scratch=scratch,
                                     options=dict(source_options, base_model=base_model))
    except BaseException:
        scratch.close()
        raise
    opened: list[LazyCheckpoint] = [ckpt]
    prefetch: Prefetch | None = None
    try:
        if config_obj is not None:
            hf_dir = ckpt.info.hf_dir if ckpt.info.hf_dir and (Path(ckpt.info.hf_dir) / "config.json").is_file() else None
            hf_dir = None if hf_dir is not None and written is not None and Path(hf_dir) == written else hf_dir
            config_dict = config_obj.to_dict()
            config_obj = copy.deepcopy(config_obj)
            model_kwargs = kwargs
        else:
            hf_dir = find_config_dir(ckpt.info.hf_dir, ckpt.info.path)
            config_dict = load_config(hf_dir)
            rope = compat.rope_unread(config_dict)  # transformers 4.x reading a transformers 5 config.json
            if rope is not None:
                raise UnsupportedCheckpointError(
                    f"{rope}: load it with transformers>=5 (pip install 'transformers>=5'), or pass config= a folder "
                    "whose config.json sets rope_theta / rope_scaling"
                )
            config_obj, model_kwargs = _load_config(hf_dir, trust_remote_code, kwargs)
        # What the checkpoint itself shows (a critic's value head, ties) wins over config.json, as
        # in merge; what the caller passed wins over both.
        for key, value in ckpt.info.config_overrides.as_dict().items():
            config_dict[key] = value
            if key not in kwargs:
                setattr(config_obj, key, value)

        lora_options = {
            k: v for k, v in dict(lora_alpha=lora_alpha, use_rslora=use_rslora, base_model=base_model).items()
            if v is not None
        }
        base, adapter = ckpt, None
        if lora == "adapter":
            base, adapter = _split_adapter(ckpt, config_dict, lora_options=lora_options)
            opened.append(base)
            lora_options = {}
        view, out_dtype, notes = model_view(base, config_dict, dtype=_merge_dtype(dtype), **lora_options)
        if quantization_config is None:  # a quantized base's config.json over plain weights: as the merge writes it
            config_dict, dropped = without_stale_quantization(config_dict, view.specs())
            if dropped is not None and getattr(config_obj, "quantization_config", None) is not None:
                del config_obj.quantization_config
                notes.append(dropped)
        for note in list(ckpt.info.notes) + notes:
            logger.info(note)
        for warning in ckpt.info.warnings:
            logger.warning(warning)

        load_dtype = out_dtype or _dominant_float_dtype(view) or torch.get_default_dtype()
        if _prefetches(device_map, quantization_config, config_obj, map_weights=not disable_mmap):
            # the big tensors are built on the load threads while the model's code imports (below)
            # (one core left to the import: it is one thread of Python, the prefetch's calls run beside it)
            prefetch = Prefetch(view, load_dtype, threads=max(1, LOAD_THREADS - 1), skip=_stacked_names(view))
        model_class, config_obj = _resolve_model_class(auto_class, config_obj, hf_dir, trust_remote_code)
        _set_config_dtype(config_obj, load_dtype)
        config_obj.name_or_path = str(source)
        if attn_implementation is not None:
            compat.set_attn_implementation(config_obj, attn_implementation)

        model, loading_info = _load_model(
            model_class,
            config_obj,
            view,
            model_kwargs=model_kwargs,
            load_dtype=load_dtype,
            keep_dtype=out_dtype is None,
            device_map=device_map,
            max_memory=max_memory,
            quantization_config=quantization_config,
            strict=strict,
            offload_folder=offload_folder,
            offload_buffers=offload_buffers,
            name=str(source),
            map_weights=not disable_mmap,
            prefetch=prefetch,
        )
        model.eval()
        _set_generation_config(model, hf_dir, generation_config)
        if adapter is not None:
            model = _attach_adapter(model, adapter)
        return (model, loading_info) if output_loading_info else model
    finally:
        if prefetch is not None:
            prefetch.close()  # an error before the fill: the threads are joined, their tensors dropped
        for item in reversed(opened):
            item.close()
        scratch.close()


def _open_source(source, *, backend: str, config_dir: Path | None, config_obj, is_value_model: bool | None,
                 scratch: contextlib.ExitStack, options: dict[str, Any]) -> tuple[LazyCheckpoint, Path | None]:
    """The checkpoint, and the folder holding ``config_obj``'s config.json where its reader needed one.

    A reader that takes the config from a folder (DCP, accelerate, torchtitan and Megatron find
    none beside the checkpoint) is given the object's config.json, written into a temporary folder
    that ``scratch`` removes when the load is done (readers may look at it while they read)."""
    try:
        return open_checkpoint(source, backend=backend, config=config_dir, is_value_model=is_value_model, **options), None
    except MissingConfigError:
        if config_obj is None:
            raise
    folder = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="hf-merge-config-")))
    config_obj.to_json_file(str(folder / "config.json"), use_diff=False)
    return open_checkpoint(source, backend=backend, config=folder, is_value_model=is_value_model, **options), folder


def _prefetches(device_map, quantization_config, config, *, map_weights: bool) -> bool:
    """Whether the fill will map CPU tensors the way :class:`Prefetch` builds them: a CPU load
    without quantization that may map the rank files (transformers >= 5's own fill)."""
    if not map_weights or quantization_config is not None or getattr(config, "quantization_config", None) is not None:
        return False
    if not compat.has_weight_conversions():
        return False
    if isinstance(device_map, dict):
        return set(map(str, device_map.values())) == {"cpu"}
    return device_map is None or str(device_map) == "cpu"


def _stacked_names(view: LazyCheckpoint) -> set[str]:
    """The view's per-expert MoE weights: transformers 5 stacks them into fused parameters, which
    the fill maps or reads slot by slot, so a prefetched copy of one would be read twice."""
    return {name for name in view.specs() if ".experts." in name}


def load_tokenizer(
    source: "str | os.PathLike",
    *,
    backend: str = "auto",
    config: "str | os.PathLike | None" = None,
    **kwargs: Any,
):
    """``AutoTokenizer.from_pretrained`` on the checkpoint's Hugging Face folder (or ``config``).

    ``kwargs`` go to ``AutoTokenizer.from_pretrained`` (``trust_remote_code``, ``use_fast``...).
    """
    from transformers import AutoTokenizer

    if config is not None:
        hf_dir = Path(config)
        if not hf_dir.is_dir():
            raise MissingConfigError(f"{hf_dir} is not a folder; pass the folder holding the tokenizer files")
    else:
        with open_checkpoint(source, backend=backend) as ckpt:
            hf_dir = find_config_dir(ckpt.info.hf_dir, ckpt.info.path)
        for item in Path(hf_dir).iterdir():  # the tokenizer files are read: none may lead out of the checkpoint
            contained.check(item, root=source)
    try:
        return AutoTokenizer.from_pretrained(str(hf_dir), **kwargs)
    except (OSError, ValueError, TypeError) as e:
        raise MissingConfigError(
            f"no usable tokenizer in {hf_dir} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
            "pass config=DIR with the base model's tokenizer files"
        ) from e


# --------------------------------------------------------------------------------------------
# LoRA adapter
# --------------------------------------------------------------------------------------------


@dataclass
class AdapterParts:
    """What ``lora="adapter"`` attaches: adapter_config.json content (``peft_type``, ``r``,
    ``lora_alpha``, ``target_modules``, ``use_rslora``, ``modules_to_save``...) and the adapter
    tensors under the names PEFT saves them (``base_model.model.<hf name>.lora_A.weight``)."""

    config: dict[str, Any]
    view: LazyCheckpoint


def _split_adapter(
    ckpt: LazyCheckpoint, config: dict[str, Any], *, lora_options: dict[str, Any]
) -> tuple[LazyCheckpoint, AdapterParts]:
    """The base model (LoRA not folded in, modules_to_save untrained) and the adapter, from a
    PEFT-wrapped checkpoint; the same views ``merge --lora adapter`` writes."""
    views = build_views(ckpt, config, lora="adapter", **lora_options)
    if views.base is None:
        raise LoraError(
            "this checkpoint holds only LoRA weights (save_lora_only); pass base_model=DIR with the base "
            "model's Hugging Face folder"
        )
    return views.base, AdapterParts(config=views.adapter_config, view=views.adapter)


def _attach_adapter(model: "PreTrainedModel", adapter: AdapterParts):
    """Wrap ``model`` in a ``PeftModel`` with the adapter's settings and fill the adapter tensors."""
    from .._quiet import no_hub_kernels

    with no_hub_kernels():  # peft imports bitsandbytes
        from peft import PeftConfig, PeftModel
        from peft.utils import set_peft_model_state_dict

    settings = dict(adapter.config)
    settings.setdefault("peft_type", "LORA")
    settings.setdefault("base_model_name_or_path", model.config.name_or_path)
    settings["inference_mode"] = True
    try:
        peft_config = PeftConfig.from_peft_type(**settings)
    except (TypeError, ValueError) as e:
        raise LoraError(f"the adapter settings {settings} are not a valid PEFT config ({e})") from None
    # Real (not meta) adapter tensors, on their base layer's device and in PEFT's adapter dtype,
    # as PeftModel.from_pretrained makes them; then the trained values are copied in. Adapters are
    # small: reading them into one dict is fine.
    peft_model = PeftModel(model, peft_config)
    state = {name: adapter.view.read(name) for name in adapter.view.specs()}
    result = set_peft_model_state_dict(peft_model, state)
    unexpected = list(result.unexpected_keys or [])
    missing = [k for k in (result.missing_keys or []) if "lora_" in k]
    if unexpected or missing:
        raise LoraError(
            f"the adapter does not fit the model: unexpected {_names(unexpected)}, missing {_names(missing)}; "
            "check target_modules in the adapter settings"
        )
    peft_model.eval()
    return peft_model


# --------------------------------------------------------------------------------------------
# Config and class
# --------------------------------------------------------------------------------------------


def _load_config(hf_dir: Path, trust_remote_code: bool | None, kwargs: dict[str, Any]):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            str(hf_dir), trust_remote_code=trust_remote_code, return_unused_kwargs=True, **kwargs
        )
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedCheckpointError(
            f"transformers cannot read {hf_dir / 'config.json'}: {first} "
            "(custom code needs trust_remote_code=True; an unknown model_type needs a newer transformers)"
        ) from e


def _resolve_model_class(auto_class, config, hf_dir: Path | None, trust_remote_code: bool | None):
    """The concrete class to build, picked the way the Auto classes' ``from_pretrained`` does.

    Returns ``(model class, config)``; the config may be the text sub-config (composite models
    whose text part is what the class builds).
    """
    import transformers
    from transformers import PreTrainedModel

    if isinstance(auto_class, str):
        resolved = getattr(transformers, auto_class, None)
        if not isinstance(resolved, type):
            raise ValueError(f"auto_class={auto_class!r} is not a transformers class")
        auto_class = resolved
    if auto_class is None:
        auto_class = _class_from_architectures(config)
    if isinstance(auto_class, type) and issubclass(auto_class, PreTrainedModel):
        return auto_class, config
    if not compat.is_auto_class(auto_class):
        raise ValueError(f"auto_class must be a transformers Auto class or model class, not {auto_class!r}")
    return compat.auto_model_class(auto_class, config, hf_dir, trust_remote_code)


def _class_from_architectures(config):
    """``architectures[0]`` as a transformers class, or the Auto class that maps to its custom code."""
    import transformers
    from transformers import PreTrainedModel

    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    auto_map = getattr(config, "auto_map", None) or {}
    for auto_name, ref in auto_map.items():
        ref = ref[-1] if isinstance(ref, (list, tuple)) else ref
        if auto_name.startswith("AutoModel") and isinstance(ref, str) and ref.rsplit(".", 1)[-1] in archs:
            return getattr(transformers, auto_name)
    if not archs:
        raise UnsupportedCheckpointError(
            "config.json has no 'architectures'; pass auto_class= (e.g. AutoModelForCausalLM) to say what to build"
        )
    raise UnsupportedCheckpointError(
        f"config.json names {archs[0]}, which transformers {transformers.__version__} does not have; "
        "pass trust_remote_code=True if the checkpoint ships its modeling code, or auto_class="
    )


def _merge_dtype(dtype):
    """``from_pretrained``'s dtype spelling -> ``merge``'s (where ``"auto"`` means keep)."""
    if dtype is None or dtype == "auto":
        return None  # the config's
    if dtype == "keep":
        return "auto"
    return dtype


def _dominant_float_dtype(view: LazyCheckpoint) -> torch.dtype | None:
    sizes: dict[torch.dtype, int] = {}
    for spec in view.specs().values():
        if spec.dtype.is_floating_point:
            sizes[spec.dtype] = sizes.get(spec.dtype, 0) + spec.nbytes
    return max(sizes, key=sizes.__getitem__) if sizes else None


def _set_config_dtype(config, dtype: torch.dtype) -> None:
    """What ``from_pretrained`` records: the load dtype on the config and its sub-configs."""
    config.dtype = dtype
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            sub.dtype = dtype


def _set_generation_config(model, hf_dir: Path | None, generation_config) -> None:
    """generation_config.json from the checkpoint's HF folder, as ``from_pretrained`` loads it."""
    if not model.can_generate():
        return
    from transformers import GenerationConfig

    if generation_config is not None:
        model.generation_config = GenerationConfig.from_dict(generation_config.to_dict())
    elif hf_dir is not None and (Path(hf_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(hf_dir))
    # else: the model already built its generation config from its config, as from_pretrained does


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _meta_model(model_class, config, load_dtype: torch.dtype, model_kwargs: dict[str, Any]):
    """The model on the meta device, in the load dtype, weights not tied (``from_pretrained``'s init)."""
    contexts = compat.init_contexts(model_class, load_dtype)
    with contextlib.ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx)
        model = model_class(config, **model_kwargs)
    return model


def plan_load(model, view: LazyCheckpoint) -> tuple[LoadPlan, list]:
    """Match the view's names to the model's keys with transformers' own renaming rules.

    Returns the plan and the weight conversion mapping used (kept on the model for saving).
    """
    weight_mapping = compat.weight_mapping(model)
    prefix = model.base_model_prefix
    meta = model.state_dict()
    specs = view.specs()
    plan = LoadPlan()
    stripped_prefix = False
    converted: dict[str, list[tuple[str, str]]] = {}  # model key -> (converter source pattern, view name)
    for name in compat.checkpoint_order(specs):
        key, pattern = compat.rename_checkpoint_key(name, weight_mapping, prefix, meta)
        if key not in meta and name in meta:
            key, pattern = compat.rename_checkpoint_key(name, [], prefix, meta)
        if pattern is not None and key in meta:
            converted.setdefault(key, []).append((pattern, name))
            continue
        if key not in meta:
            plan.unexpected[key] = name
            continue
        if key in plan.assign:
            raise MappingError(f"{plan.assign[key]} and {name} both map to the model's {key}; the checkpoint has duplicates")
        if prefix and name == f"{prefix}.{key}":
            stripped_prefix = True
        plan.assign[key] = name
        want, have = tuple(meta[key].shape), tuple(specs[name].shape)
        if want != have:
            plan.mismatched.append((name, have, want))
    for key, sources in converted.items():
        stacking = compat.stacking(weight_mapping, sources[0][0])
        places = None if stacking is None else slots(
            stacking, sources, {n: tuple(specs[n].shape) for _, n in sources}, tuple(meta[key].shape)
        )
        if places is None:  # another converter, or experts that do not make the model's tensor
            plan.needs_converters = True
        else:
            plan.stacked[key] = places
    plan.missing = set(meta) - set(plan.assign) - set(plan.stacked)
    if stripped_prefix:
        # A base model loaded from a checkpoint with a head: the head's weights have no place in it.
        for key, name in list(plan.unexpected.items()):
            if not name.startswith(f"{prefix}."):
                plan.skipped_heads.append(name)
                del plan.unexpected[key]
    return plan, weight_mapping


def _check_plan(model, plan: LoadPlan, *, strict: bool) -> dict[str, list]:
    """Raise MappingError naming what does not fit (before any tensor is read); else
    ``from_pretrained``'s loading info: the model's weights not in the checkpoint, the checkpoint's
    tensors not used."""
    if plan.skipped_heads:
        logger.info(
            "%s has no place for %s; skipped (as from_pretrained does for a base model)",
            type(model).__name__,
            _names(plan.skipped_heads),
        )
    if plan.mismatched:
        shown = ", ".join(f"{n} {list(h)} vs {list(w)}" for n, h, w in plan.mismatched[:_LIST_LIMIT])
        raise MappingError(
            f"{len(plan.mismatched)} tensor(s) have another shape in the checkpoint than in {type(model).__name__} "
            f"(checkpoint vs model): {shown}; the config.json does not describe this checkpoint: pass config= with the "
            "training model's config"
        )
    # Tied aliases are filled by tying, from whichever side the checkpoint has.
    tied = compat.tied_weights(model)
    missing = set(plan.missing)
    for target, source in tied.items():
        if target in missing and source in plan.assign:
            missing.discard(target)
        elif source in missing and target in plan.assign:
            missing.discard(source)
    missing, unexpected_keys = compat.model_ignores(model, missing, set(plan.unexpected))
    unexpected = sorted(plan.unexpected[k] for k in unexpected_keys)
    missing = sorted(missing)
    info = _loading_info(missing, unexpected, [])
    if not (missing or unexpected):
        return info
    if strict:
        parts = []
        if missing:
            parts.append(f"{len(missing)} weight(s) of {type(model).__name__} are not in the checkpoint: {_names(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} checkpoint tensor(s) have no place in it: {_names(unexpected)}")
        raise MappingError(
            "; ".join(parts) + "; pick the class that matches the checkpoint (auto_class=), check config.json, "
            "or pass strict=False to initialise missing weights and skip unused ones"
        )
    if missing:
        logger.warning("not in the checkpoint, initialised: %s", _names(missing))
    if unexpected:
        logger.warning("not used by %s: %s", type(model).__name__, _names(unexpected))
    return info


def _loading_info(missing: list[str], unexpected: list[str], mismatched: list[str]) -> dict[str, list]:
    """What ``from_pretrained(..., output_loading_info=True)`` returns beside the model."""
    return {"missing_keys": missing, "unexpected_keys": unexpected, "mismatched_keys": mismatched, "error_msgs": []}


def _load_model(
    model_class,
    config,
    view: LazyCheckpoint,
    *,
    model_kwargs: dict[str, Any],
    load_dtype: torch.dtype,
    keep_dtype: bool,
    device_map,
    max_memory,
    quantization_config,
    strict: bool,
    offload_folder,
    offload_buffers: bool,
    name: str,
    map_weights: bool = True,
    prefetch: Prefetch | None = None,
):
    if not compat.has_weight_conversions():
        return _load_legacy(
            model_class, config, view, model_kwargs=model_kwargs, load_dtype=load_dtype, device_map=device_map,
            max_memory=max_memory, quantization_config=quantization_config, strict=strict,
            offload_folder=offload_folder, offload_buffers=offload_buffers, name=name,
        )
    model = _meta_model(model_class, config, load_dtype, model_kwargs)
    plan, weight_mapping = plan_load(model, view)
    info = _check_plan(model, plan, strict=strict) if not plan.needs_converters else None  # else transformers' loop

    requested_map = device_map
    device_map = compat.check_device_map(device_map)
    on_meta = sorted(k for k, d in device_map.items() if str(d) == "meta") if isinstance(device_map, dict) else []
    if on_meta or str(device_map) == "meta":  # from_pretrained refuses it too ("Unsupported device type 'meta'")
        raise MappingError(f"device_map sends {', '.join(on_meta[:3]) or 'the model'} to 'meta', which holds no "
                           "weights; use 'disk' (with offload_folder=) to keep them out of memory, or 'cpu'")
    quantized = quantization_config is not None or getattr(config, "quantization_config", None) is not None
    resolved_map = None
    if not quantized:
        resolved_map = compat.infer_device_map(model, device_map, max_memory) if device_map is not None else None
    offloads_to_disk = resolved_map is not None and "disk" in {str(d) for d in resolved_map.values()}
    if quantized or plan.needs_converters or offloads_to_disk:
        if prefetch is not None:
            prefetch.close()  # transformers' own loop reads every tensor: nothing prefetched is used
        return _load_with_transformers(
            model_class,
            config,
            view,
            plan,
            model_kwargs=model_kwargs,
            load_dtype=load_dtype,
            device_map=requested_map,
            max_memory=max_memory,
            quantization_config=quantization_config,
            strict=strict,
            offload_folder=offload_folder,
            offload_buffers=offload_buffers,
            name=name,
            aliases=_disk_tied_aliases(model, plan, resolved_map) if offloads_to_disk else None,
        )
    fill = Fill(lambda: _fill(model, view, plan, resolved_map, load_dtype=load_dtype, keep_dtype=keep_dtype,
                              map_weights=map_weights, prefetch=prefetch))
    run_in_process(fill, None)  # the in-memory output of the merge pipeline (hf_merge.pipeline)
    _finalize(model, plan, weight_mapping, resolved_map, load_dtype, name=name)
    if resolved_map is not None and len({str(d) for d in resolved_map.values()}) > 1:
        compat.dispatch(model, resolved_map, offload_folder, offload_buffers)
    return model, info


def _disk_tied_aliases(model, plan: LoadPlan, device_map: dict) -> dict[str, str]:
    """``{tied alias: view name}`` for aliases offloaded to disk with their source.

    ``from_pretrained`` of a folder points such an alias's offload index entry at its source's
    weights; its ``state_dict=`` loop indexes only the tensors it is given, so accelerate's hook
    would find no ``lm_head.weight`` on disk. The alias is given as a second name of its source."""
    tied = compat.tied_weights(model)
    devices = compat.expand_device_map(device_map, list(tied) + list(tied.values()))
    return {
        target: plan.assign[source]
        for target, source in tied.items()
        if target not in plan.assign and source in plan.assign
        and str(devices[target]) == "disk" and str(devices[source]) == "disk"
    }


def _fill(model, view: LazyCheckpoint, plan: LoadPlan, device_map, *, load_dtype, keep_dtype: bool,
          map_weights: bool = True, prefetch: Prefetch | None = None) -> None:
    """Allocate every planned tensor on its device, in its dtype, and read it into place; a CPU
    tensor the checkpoint holds as memory-mapped pieces in that dtype is mapped instead
    (:mod:`hf_merge.load.page_mapper`: the rank files' pages, no copy), or taken from
    ``prefetch`` where it built that tensor already (:mod:`hf_merge.load.prefetch`)."""
    meta = model.state_dict()
    specs = view.specs()
    keys = list(plan.assign) + list(plan.stacked)
    devices = compat.expand_device_map(device_map, keys) if device_map is not None else dict.fromkeys(keys, "cpu")
    dtype_plan = compat.dtype_plan(model, load_dtype)
    dtype_pattern, group_to_glob, _ = compat.glob_alternation(list(dtype_plan)) if dtype_plan else (None, {}, {})

    def target_dtype(key: str) -> torch.dtype:
        if dtype_pattern is not None and (m := dtype_pattern.search(key)) is not None:
            return dtype_plan[group_to_glob[m.lastgroup]]
        source = plan.assign[key] if key in plan.assign else plan.stacked[key][0].name
        have, want = specs[source].dtype, meta[key].dtype
        if keep_dtype and have.is_floating_point and want.is_floating_point:
            return have
        return want

    if prefetch is not None and map_weights:  # one account of mappings and of the records' pieces
        mapper, placed = prefetch.mapper, prefetch.placed
    else:
        mapper = Mapper() if map_weights else None
        placed = record_crc.Placed()  # the records' CRC-32 over the bytes as the model holds them
    stagers = StagerPool()

    def maps(key: str, name: str, nbytes: int) -> bool:
        """Whether CPU tensor ``key`` is built by the mapper from checkpoint tensor ``name``'s file runs."""
        dtype = target_dtype(key)
        if mapper is None or str(devices[key]) != "cpu" or specs[name].dtype != dtype or not mapper.worth(nbytes):
            return False
        # a run that is cast or computed (LoRA) comes one row long here: cheap to drop, and such
        # a tensor is read_into its buffer in one pass, as before
        first = first_piece(view, name, dtype)
        return first is not None and mapper.maps(first)

    # Stacked tensors (fused experts): mapped whole where their experts' file runs tile them in
    # the load dtype, else allocated here and filled slice by slice by the threads.
    whole: dict[str, list[tuple[int, Slot]]] = {}
    with record_crc.deferred(check_at_end=False, pending=placed.pending):  # the probes' records: noted
        for key, places in plan.stacked.items():
            tiles = tiling(places, tuple(meta[key].shape))
            nbytes = meta[key].numel() * target_dtype(key).itemsize
            same = all(specs[s.name].dtype == specs[places[0].name].dtype for s in places)
            if tiles is not None and same and maps(key, tiles[0][1].name, nbytes):
                whole[key] = tiles
    stacked = {
        key: torch.empty(tuple(meta[key].shape), dtype=target_dtype(key), device=devices[key])
        for key in plan.stacked if key not in whole
    }
    jobs: list[tuple[str, Slot | None]] = [(key, None) for key in list(plan.assign) + list(whole)]
    jobs += [(key, slot) for key in stacked for slot in plan.stacked[key]]

    def read(job: tuple[str, Slot | None]) -> tuple[str, torch.Tensor | None]:
        key, slot = job
        with record_crc.deferred(check_at_end=False, pending=placed.pending):
            if slot is None and key in whole:
                shape, dtype = tuple(meta[key].shape), target_dtype(key)
                flat = mapper.tensor((meta[key].numel(),), dtype, flat_runs(view, whole[key], dtype), placed.place)
                return key, flat.view(shape)
            if slot is None:
                return read_one(key)
            dst = slot.of(stacked[key])
            if stages(dst.device):
                stagers.fill(view, slot.name, dst, placed.place)
            else:
                read_slot(view, slot.name, dst, placed.place)
            return key, None

    def read_one(key: str) -> tuple[str, torch.Tensor]:
        name, shape, dtype = plan.assign[key], tuple(meta[key].shape), target_dtype(key)
        # the prefetch built only tensors the mapper maps: taken without probing their first row again
        built = prefetch.take(name, shape, dtype) if prefetch is not None and str(devices[key]) == "cpu" else None
        if built is not None:
            return key, built
        if maps(key, name, specs[name].nbytes):
            return key, mapper.tensor(shape, dtype, view.read_rows(name, dtype), placed.place)
        out = page_mapper.empty(shape, dtype) if str(devices[key]) == "cpu" else torch.empty(shape, dtype=dtype, device=devices[key])
        if stages(out.device):
            stagers.fill(view, name, out, placed.place)  # pinned buffers, transfers overlapped with reads
        else:
            view.read_into(name, out)
        return key, out

    with ThreadPoolExecutor(max_workers=LOAD_THREADS) as pool:
        # largest first: the big tensors (embedding, output layer) start together on their own threads
        # and the small ones fill in after, instead of one big tensor read last while the others idle
        def size(job: tuple[str, Slot | None]) -> int:
            key, slot = job
            if slot is not None:
                return specs[slot.name].nbytes
            return specs[plan.assign[key]].nbytes if key in plan.assign else meta[key].numel() * target_dtype(key).itemsize

        largest_first = sorted(jobs, key=lambda job: -size(job))
        for key, tensor in compat.progress(pool.map(read, largest_first), total=len(jobs), desc="Loading weights"):
            if tensor is not None:
                _assign(model, key, tensor)
        for key, tensor in stacked.items():
            _assign(model, key, tensor)
        if prefetch is not None:
            prefetch.close()  # its threads joined: no record is noted while they are checked
        placed.finish(pool)  # a damaged record raises here, before the model is returned


def _assign(model, key: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in the model as parameter or buffer ``key``, marked as loaded."""
    module_path, _, attr = key.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if attr in module._parameters:
        old = module._parameters[attr]
        requires_grad = tensor.is_floating_point() and (old is None or old.requires_grad)
        tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    compat.mark_loaded(tensor)  # from_pretrained's flag: _init_weights leaves it alone
    setattr(module, attr, tensor)


def _finalize(model, plan: LoadPlan, weight_mapping: list, device_map, load_dtype, *, name: str) -> None:
    """from_pretrained's last steps: non-persistent buffers, missing-key init, tying, report."""
    compat.finish_loading(
        model, name=name, device_map=device_map, dtype=load_dtype, mapping=weight_mapping,
        missing=set(plan.missing), unexpected=set(plan.unexpected),
    )
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if leftover:
        raise MappingError(f"{_names(leftover)} were not filled by the checkpoint nor by the model's initialisation")


class _LazyTensor:
    """A view tensor that reads itself when indexed: the value type of a safetensors slice.

    ``from_pretrained(None, state_dict=...)`` materializes values with ``value[...]`` one at a time
    (then casts / quantizes / places them), so a dict of these loads without a full state dict.
    """

    __slots__ = ("_view", "_name", "shape", "dtype")

    def __init__(self, view: LazyCheckpoint, name: str):
        spec = view.specs()[name]
        self._view, self._name, self.shape, self.dtype = view, name, torch.Size(spec.shape), spec.dtype

    def __getitem__(self, index):
        tensor = self._view.read(self._name)
        return tensor if index is Ellipsis else tensor[index]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def to(self, *args: Any, **kwargs: Any) -> "_LazyTensor":
        """transformers 4.x's loop moves each value first (``value.to(device)``) and places what
        ``value[...]`` reads afterwards: the move is deferred to that read."""
        return self

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


def _load_with_transformers(
    model_class,
    config,
    view: LazyCheckpoint,
    plan: LoadPlan,
    *,
    model_kwargs,
    load_dtype,
    device_map,
    max_memory,
    quantization_config,
    strict: bool,
    offload_folder,
    offload_buffers: bool,
    name: str,
    aliases: dict[str, str] | None = None,
):
    """transformers' own weight loop over lazy values, for what only it implements (quantization...).
    ``aliases``: ``{model key: view name}`` given as extra lazy values (:func:`_disk_tied_aliases`)."""
    skipped = set(plan.skipped_heads)
    state = {n: _LazyTensor(view, n) for n in view.specs() if n not in skipped}
    for key, source in (aliases or {}).items():
        state.setdefault(key, _LazyTensor(view, source))
    kwargs: dict[str, Any] = dict(model_kwargs)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if offload_folder is not None:
        kwargs["offload_folder"] = str(offload_folder)
    try:
        model, info = model_class.from_pretrained(
            None,
            config=config,
            state_dict=state,
            **compat.dtype_kwargs(load_dtype),
            device_map=device_map,
            max_memory=max_memory,
            offload_buffers=offload_buffers,
            output_loading_info=True,
            **kwargs,
        )
    except ImportError as e:  # a quantization backend that is not installed
        raise QuantizationError(f"{e}") from e
    model.config.name_or_path = name
    model.name_or_path = name
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    mismatched = sorted(m if isinstance(m, str) else m[0] for m in info["mismatched_keys"])  # 4.x: names
    if strict and (missing or unexpected or mismatched):
        raise MappingError(
            f"the checkpoint does not fit {model_class.__name__}: missing {_names(missing)}, unexpected "
            f"{_names(unexpected)}, other shape {_names(mismatched)}; check config.json and auto_class, "
            "or pass strict=False"
        )
    return model, _loading_info(missing, unexpected, mismatched)


def _load_legacy(model_class, config, view: LazyCheckpoint, *, offload_folder, **options):
    """transformers 4.x: its own loop over lazy values (it has no weight conversions nor
    ``_finalize_model_loading`` to fill a model ourselves). Head weights a base model has no place
    for are skipped, as in the transformers 5 path; a shape that differs is named, not a crash."""
    if offload_folder is not None:
        raise UnsupportedCheckpointError(
            "disk offload of a sharded checkpoint needs transformers >= 5; merge with `hf-merge merge` and "
            "use from_pretrained, or load without offload_folder"
        )
    prefix = getattr(model_class, "base_model_prefix", "") or ""
    names = list(view.specs())
    skipped: list[str] = []
    if prefix and not _holds_base_model(model_class, config, prefix) and any(n.startswith(f"{prefix}.") for n in names):
        skipped = [n for n in names if not n.startswith(f"{prefix}.")]
        if skipped:
            logger.info("%s has no place for %s; skipped (as from_pretrained does for a base model)",
                        model_class.__name__, _names(skipped))
    plan = LoadPlan(skipped_heads=skipped)
    options["model_kwargs"] = {"ignore_mismatched_sizes": True, **options["model_kwargs"]}  # named below, not a crash
    return _load_with_transformers(model_class, config, view, plan, offload_folder=None, **options)


def _holds_base_model(model_class, config, prefix: str) -> bool:
    """Whether ``model_class`` wraps its base model under ``prefix`` (a task model), as
    transformers 4.x decides it: the attribute on the model, built here on the meta device."""
    with torch.device("meta"), compat.no_init_weights():
        return hasattr(model_class(copy.deepcopy(config)), prefix)


def _names(names) -> str:
    names = list(names)
    shown = ", ".join(names[:_LIST_LIMIT])
    return shown + (f" and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else "") if names else "none"


__all__ = ["AdapterParts", "LoadPlan", "from_sharded_pretrained", "load_tokenizer", "plan_load"]
