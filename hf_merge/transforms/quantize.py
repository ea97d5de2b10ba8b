"""bitsandbytes 4-bit (nf4 / fp4) and 8-bit (LLM.int8) output, as transformers writes and reads it.

:class:`Quantized` wraps any lazy checkpoint already in Hugging Face names and dtypes (a plain
merge, a LoRA-fused view, ...). Each weight of a layer that transformers' bitsandbytes integration
loads as ``bnb.nn.Linear4bit`` / ``bnb.nn.Linear8bitLt`` becomes the tensors
``Linear4bit._save_to_state_dict`` / ``Linear8bitLt._save_to_state_dict`` write (bitsandbytes 0.50,
transformers 5.24)::

    4-bit  <m>.weight                                   U8  [ceil(n/2), 1]   two codes a byte
           <m>.weight.absmax                            F32 [ceil(n/64)]     (U8 with double quant)
           <m>.weight.quant_map                         F32 [16]
           <m>.weight.nested_absmax                     F32 [ceil(ceil(n/64)/256)]  double quant
           <m>.weight.nested_quant_map                  F32 [256]                   double quant
           <m>.weight.quant_state.bitsandbytes__<nf4|fp4>  U8 [len]  JSON of the non-tensor state
    8-bit  <m>.weight  I8 [out, in];  <m>.SCB  F32 [out];  <m>.weight_format  U8 []  (0 = "row")

Every size follows from the input spec (n = out * in, blocksize 64 as ``Params4bit`` uses, 256 for
the nested absmax), so shards are planned before anything is quantized. The one value-dependent
size is the JSON blob under double quant: it holds ``nested_offset`` (the mean absmax) as a
shortest-repr float. Its length is reserved for the longest float repr and the JSON is padded with
trailing spaces, which ``json.loads`` (bitsandbytes' ``unpack_tensor_to_dict``) ignores; every
other byte equals what bitsandbytes' ``QuantState.as_dict(packed=True)`` produces.

Which layers are quantized is asked of transformers itself: the model is built on the meta device
and transformers' bitsandbytes quantizer replaces its modules exactly as ``from_pretrained`` will
when it loads the output (default skips: the output embedding, tied and last modules, and
``_keep_in_fp32_modules``). A layer the bitsandbytes CPU kernels cannot run is left in the plain
dtype and named in ``llm_int8_skip_modules``, so that transformers loads it as ``nn.Linear``:
bitsandbytes' AVX512-BF16 CPU path for 4-bit (``_convert_weight_packed_for_cpu``) needs
``out_features % 32 == 0`` and ``in_features % 64 == 0`` (the blocksize); int8 has no such limit.

Memory: one input weight gives several output tensors. They form one plan group (``plan.py``), so
they lie next to each other in one file; a module is quantized once, its parts are held until
each has been copied out (at most two modules, LRU, for other read orders), and the quantization
runs in chunks of
``CHUNK_ELEMENTS`` values (blockwise and row-wise quantization are exact under chunking).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from .._quiet import no_hub_kernels
from ..checkpoint import ROW_CHUNK_BYTES, LazyCheckpoint
from ..errors import QuantizationError
from ..spec import TensorSpec, dtype_name, parse_dtype

logger = logging.getLogger(__name__)

MODES = ("nf4", "fp4", "int8")
BLOCKSIZE = 64  # bitsandbytes.nn.Params4bit's default; transformers' Linear4bit does not set it
NESTED_BLOCKSIZE = 256  # bitsandbytes.functional.quantize_4bit(compress_statistics=True)
QUANT_MAP_SIZE = 16
NESTED_QUANT_MAP_SIZE = 256  # create_dynamic_map()
CHUNK_ELEMENTS = 1 << 22  # a multiple of every 4-bit blocksize, and even
LRU_MODULES = 2
# Longest repr of a float32 value as a Python float, e.g. "-1.1754943508222875e-38" (23 chars).
OFFSET_REPR_RESERVE = 24
CPU_4BIT_OUT_MULTIPLE = 32  # block_n of bitsandbytes.functional._convert_weight_packed_for_cpu
INSTALL_HINT = "pip install bitsandbytes (or, in a clone of hf-merge: pip install '.[quantize]')"


@dataclass(frozen=True)
class QuantizeOptions:
    """What ``--quantize`` asks for.

    Args:
        mode: ``nf4``, ``fp4`` or ``int8``.
        double_quant: quantize the 4-bit absmax again (``bnb_4bit_use_double_quant``).
        compute_dtype: ``bnb_4bit_compute_dtype``; default: the dtype the weights are written in.
        skip_modules: extra module names or patterns to leave unquantized, with transformers'
            ``llm_int8_skip_modules`` matching (prefix at a module boundary, regex, or suffix). The
            defaults (output embedding, tied weights) are always kept unquantized too.
    """

    mode: str
    double_quant: bool = False
    compute_dtype: str | None = None
    skip_modules: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise QuantizationError(f"unknown quantization {self.mode!r}; use one of {', '.join(MODES)}")
        if self.mode == "int8" and self.double_quant:
            raise QuantizationError("--double-quant applies to 4-bit output only; use it with --quantize nf4 or fp4")
        if self.mode == "int8" and self.compute_dtype is not None:
            raise QuantizationError("--quant-compute-dtype applies to 4-bit output only; drop it or use --quantize nf4/fp4")
        if self.compute_dtype is not None:
            try:
                object.__setattr__(self, "compute_dtype", dtype_name(parse_dtype(self.compute_dtype)))
            except ValueError as e:
                raise QuantizationError(f"--quant-compute-dtype: {e}") from None
        object.__setattr__(self, "skip_modules", tuple(str(s) for s in self.skip_modules if str(s)))

    @property
    def is_4bit(self) -> bool:
        return self.mode != "int8"

    @classmethod
    def coerce(cls, value: "str | dict[str, Any] | QuantizeOptions | None") -> "QuantizeOptions | None":
        """``"nf4"``, a dict of fields, or options -> options (None stays None)."""
        if value is None or isinstance(value, QuantizeOptions):
            return value
        if isinstance(value, str):
            return cls(mode=value)
        if isinstance(value, dict):
            return cls(**value)
        raise QuantizationError(f"quantize must be one of {', '.join(MODES)} or QuantizeOptions, not {value!r}")


# --------------------------------------------------------------------------------------------
# bitsandbytes import
# --------------------------------------------------------------------------------------------


def require_bitsandbytes():
    """Import bitsandbytes or raise a one-line :class:`QuantizationError` saying what to install."""
    try:
        with no_hub_kernels():  # no Hub request for bitsandbytes' optional CPU kernel
            import bitsandbytes
            import bitsandbytes.functional  # noqa: F401
    except ImportError:
        raise QuantizationError(f"--quantize needs bitsandbytes, which is not installed: {INSTALL_HINT}") from None
    except Exception as e:  # noqa: BLE001 - a broken install; say which and what to do
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise QuantizationError(f"bitsandbytes failed to import ({first}); reinstall it: {INSTALL_HINT}") from None
    return bitsandbytes


# --------------------------------------------------------------------------------------------
# Sizes and the quant-state blob, from specs alone
# --------------------------------------------------------------------------------------------


def _bnb_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).strip("torch.")  # exactly QuantState.as_dict's spelling


def quant_state_dict(quant_type: str, dtype: torch.dtype, shape: tuple[int, ...], nested_offset: float | None) -> dict:
    """The non-tensor quant state, keys in ``QuantState.as_dict`` order."""
    d: dict[str, Any] = {
        "quant_type": quant_type,
        "blocksize": BLOCKSIZE,
        "dtype": _bnb_dtype_name(dtype),
        "shape": list(shape),
    }
    if nested_offset is not None:
        d.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32", nested_offset=nested_offset)
    return d


def quant_state_blob_size(quant_type: str, dtype: torch.dtype, shape: tuple[int, ...], nested: bool) -> int:
    """Bytes of ``quant_state.bitsandbytes__<type>`` (with double quant: the reserved length)."""
    if not nested:
        return len(json.dumps(quant_state_dict(quant_type, dtype, shape, None)).encode())
    text = json.dumps(quant_state_dict(quant_type, dtype, shape, 0.0))
    return len(text.encode()) - len("0.0") + OFFSET_REPR_RESERVE


def part_specs(module: str, spec: TensorSpec, opts: QuantizeOptions, shape: tuple[int, int]) -> list[TensorSpec]:
    """Specs of the tensors ``<module>.weight`` becomes. ``shape`` is the quantized (out, in)."""
    n = shape[0] * shape[1]
    w = f"{module}.weight"
    if not opts.is_4bit:
        return [
            TensorSpec(w, shape, torch.int8),
            TensorSpec(f"{module}.SCB", (shape[0],), torch.float32),
            TensorSpec(f"{module}.weight_format", (), torch.uint8),
        ]
    blocks = -(-n // BLOCKSIZE)
    parts = [
        TensorSpec(w, ((n + 1) // 2, 1), torch.uint8),
        TensorSpec(f"{w}.absmax", (blocks,), torch.uint8 if opts.double_quant else torch.float32),
        TensorSpec(f"{w}.quant_map", (QUANT_MAP_SIZE,), torch.float32),
    ]
    if opts.double_quant:
        parts += [
            TensorSpec(f"{w}.nested_absmax", (-(-blocks // NESTED_BLOCKSIZE),), torch.float32),
            TensorSpec(f"{w}.nested_quant_map", (NESTED_QUANT_MAP_SIZE,), torch.float32),
        ]
    size = quant_state_blob_size(opts.mode, spec.dtype, shape, opts.double_quant)
    parts.append(TensorSpec(f"{w}.quant_state.bitsandbytes__{opts.mode}", (size,), torch.uint8))
    return parts


def kernel_problem(opts: QuantizeOptions, shape: tuple[int, int]) -> str | None:
    """Why bitsandbytes' CPU kernels cannot run a layer of this (out, in) shape, or None."""
    out_f, in_f = shape
    if opts.is_4bit and (out_f % CPU_4BIT_OUT_MULTIPLE or in_f % BLOCKSIZE):
        return (
            f"shape [{out_f}, {in_f}]: the bitsandbytes CPU 4-bit kernel needs out_features divisible by "
            f"{CPU_4BIT_OUT_MULTIPLE} and in_features by {BLOCKSIZE}"
        )
    return None


# --------------------------------------------------------------------------------------------
# Quantization (bit-identical to bitsandbytes.functional, in chunks)
# --------------------------------------------------------------------------------------------


def quantize_4bit(bnb, weight: torch.Tensor, quant_type: str, double_quant: bool) -> dict[str, torch.Tensor]:
    """``Params4bit._quantize`` of ``weight`` ([out, in]), as state-dict parts relative to the module.

    Same result as ``bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=
    double_quant, quant_type=quant_type)`` followed by ``QuantState.as_dict(packed=True)``; the
    blockwise quantization runs ``CHUNK_ELEMENTS`` values at a time (chunk edges fall on block and
    byte edges, so every block and every packed byte is the same).
    """
    F = bnb.functional
    weight = weight.contiguous()
    flat = weight.reshape(-1)
    n = flat.numel()
    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8)
    absmax = torch.empty((-(-n // BLOCKSIZE),), dtype=torch.float32)
    code = None
    for start in range(0, n, CHUNK_ELEMENTS):
        q, state = F.quantize_4bit(
            flat[start : start + CHUNK_ELEMENTS],
            blocksize=BLOCKSIZE,
            compress_statistics=False,
            quant_type=quant_type,
            quant_storage=torch.uint8,
        )
        packed[start // 2 : start // 2 + q.shape[0]] = q.view(-1, 1)
        absmax[start // BLOCKSIZE : start // BLOCKSIZE + state.absmax.numel()] = state.absmax
        code = state.code
    if double_quant:
        offset = absmax.mean()
        qabsmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=NESTED_BLOCKSIZE)
        state = F.QuantState(
            absmax=qabsmax,
            shape=weight.shape,
            dtype=weight.dtype,
            blocksize=BLOCKSIZE,
            code=code,
            quant_type=quant_type,
            offset=offset,
            state2=state2,
        )
    else:
        state = F.QuantState(
            absmax=absmax, shape=weight.shape, dtype=weight.dtype, blocksize=BLOCKSIZE, code=code, quant_type=quant_type
        )
    parts = {"weight": packed}
    parts.update({f"weight.{k}": v for k, v in state.as_dict(packed=True).items()})
    return parts


def quantize_int8(bnb, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``Int8Params._quantize`` of ``weight`` ([out, in]): fp16 cast, then row-wise absmax int8.

    Same result as ``bnb.functional.int8_vectorwise_quant(weight.half())``, rows in chunks.
    """
    out_f, in_f = weight.shape
    cb = torch.empty((out_f, in_f), dtype=torch.int8)
    scb = torch.empty((out_f,), dtype=torch.float32)
    rows = max(1, CHUNK_ELEMENTS // max(1, in_f))
    for r in range(0, out_f, rows):
        c, s, _ = bnb.functional.int8_vectorwise_quant(weight[r : r + rows].contiguous().to(torch.float16))
        cb[r : r + rows] = c
        scb[r : r + rows] = s
    return {"weight": cb, "SCB": scb, "weight_format": torch.tensor(0, dtype=torch.uint8)}


# --------------------------------------------------------------------------------------------
# Which layers: ask transformers' bitsandbytes quantizer on a meta-device model
# --------------------------------------------------------------------------------------------


def bnb_config(opts: QuantizeOptions, compute_dtype: str, skip_modules: list[str] | None):
    from transformers import BitsAndBytesConfig

    kw: dict[str, Any] = {"llm_int8_skip_modules": skip_modules}
    if opts.is_4bit:
        kw.update(
            load_in_4bit=True,
            bnb_4bit_quant_type=opts.mode,
            bnb_4bit_use_double_quant=opts.double_quant,
            bnb_4bit_compute_dtype=parse_dtype(compute_dtype),
        )
    else:
        kw.update(load_in_8bit=True)
    return BitsAndBytesConfig(**kw)


def config_dict(bnb_cfg) -> dict[str, Any]:
    """``quantization_config`` as transformers' ``save_pretrained`` writes it into config.json."""
    out = bnb_cfg.to_dict()
    out["quant_method"] = getattr(out["quant_method"], "value", out["quant_method"])
    return json.loads(json.dumps(out))


def _meta_model(config: dict[str, Any]):
    """The config's model class, built on the meta device (no memory, no remote code)."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = cfg.get("model_type")
    try:
        conf = CONFIG_MAPPING[model_type].from_dict(cfg)
    except Exception as e:  # noqa: BLE001
        raise QuantizationError(
            f"cannot read config.json as a transformers config (model_type {model_type!r}: {e}); "
            "quantized output needs an architecture built into transformers"
        ) from None
    classes = [getattr(transformers, a, None) for a in cfg.get("architectures") or []]
    cls = next((c for c in classes if c is not None), None)
    if cls is None:
        try:
            cls = AutoModelForCausalLM._model_mapping[type(conf)]
        except Exception:  # noqa: BLE001
            names = ", ".join(cfg.get("architectures") or []) or model_type
            raise QuantizationError(
                f"transformers has no class for {names}; quantized output needs an architecture built into "
                "transformers (remote-code models are not supported): merge without --quantize"
            ) from None
    with torch.device("meta"):
        return cls(conf)


def _converted_modules(config: dict[str, Any], bnb_cfg) -> tuple[dict[str, dict[str, Any]], list[str], set[str]]:
    """Run transformers' bitsandbytes quantizer (as ``from_pretrained`` does) on a meta model.

    Returns ``({module: {"shape": (out, in), "conv1d": bool}} it turns into bitsandbytes layers,
    the quantizer's modules_to_not_convert, every Linear / Conv1D module name)``.
    """
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.auto import AutoHfQuantizer

    model = _meta_model(config)
    linear = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear or isinstance(m, Conv1D)}
    quantizer = AutoHfQuantizer.from_config(bnb_cfg, pre_quantized=True)
    quantizer.preprocess_model(model=model, dtype=None, device_map={"": "cpu"}, checkpoint_files=None, use_kernels=False)
    converted = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            conv1d = issubclass(getattr(mod, "source_cls", torch.nn.Linear), Conv1D)
            converted[name] = {"shape": (mod.out_features, mod.in_features), "conv1d": conv1d}
    return converted, sorted(getattr(quantizer, "modules_to_not_convert", None) or []), linear


# --------------------------------------------------------------------------------------------
# The transform
# --------------------------------------------------------------------------------------------


class Quantized(LazyCheckpoint):
    """``base`` with the weights of bitsandbytes-loaded layers quantized; everything else as is.

    Args:
        base: a lazy checkpoint in Hugging Face names and the output dtype.
        config: the model's config.json content (decides the layers, as transformers will).
        options: :class:`QuantizeOptions`.

    Attributes:
        quantized: module names whose weight is written quantized.
        skipped: Linear modules written unquantized (defaults, user skips, kernel limits, unmatched).
        notes: what was left unquantized and why (also logged at INFO).
        quantization_config: the ``quantization_config`` entry for config.json.
    """

    def __init__(self, base: LazyCheckpoint, config: dict[str, Any], options: "QuantizeOptions | str"):
        self.base = base
        self.info = base.info
        self.options = opts = QuantizeOptions.coerce(options)
        self._bnb = require_bitsandbytes()
        base_specs = base.specs()
        self.notes: list[str] = []

        # Pass 1: what transformers converts with the defaults (+ the user's skips).
        compute = opts.compute_dtype or self._default_compute_dtype(base_specs)
        first_skips = None
        if opts.skip_modules:
            # An explicit list replaces transformers' defaults; add them back (lm_head, tied).
            by_default, defaults, _ = _converted_modules(config, bnb_config(opts, compute, None))
            first_skips = sorted(set(defaults) | set(opts.skip_modules))
        candidates, not_convert, linear = _converted_modules(config, bnb_config(opts, compute, first_skips))
        if opts.skip_modules and by_default and set(by_default) <= set(candidates):  # a typo: nothing kept plain
            logger.warning(
                f"--quant-skip-modules {','.join(opts.skip_modules)} matches no layer that would be quantized (layers are "
                f"named like {min(by_default)}: give a name, a suffix such as mlp.down_proj, or a regex); every layer is quantized"
            )

        # Drop what cannot be written or run; those are named in llm_int8_skip_modules.
        extra: dict[str, str] = {}
        for module, info in candidates.items():
            spec = base_specs.get(f"{module}.weight")
            want = tuple(reversed(info["shape"])) if info["conv1d"] else info["shape"]
            if spec is None:
                extra[module] = "no tensor of that name in the output (renamed on load?)"
            elif spec.shape != want:
                extra[module] = f"tensor shape {list(spec.shape)} is not the layer's {list(want)}"
            elif not spec.dtype.is_floating_point:
                extra[module] = f"dtype {dtype_name(spec.dtype)} is not a float"
            elif problem := kernel_problem(opts, info["shape"]):
                extra[module] = problem
        skip_list = first_skips
        final = candidates
        if extra:
            skip_list = sorted(set(not_convert) | set(opts.skip_modules) | set(extra))
            final, _, _ = _converted_modules(config, bnb_config(opts, compute, skip_list))
            bad = [m for m in final if m in extra or m not in candidates]
            if bad:  # a pattern in the list did not exclude its own module: never write that
                raise QuantizationError(f"cannot exclude {bad[0]} from quantization by name; report this with the model's config.json")
        for module, reason in sorted(extra.items()):
            note = f"quantization: left {module} unquantized ({reason}); it is listed in llm_int8_skip_modules"
            self.notes.append(note)
            logger.info(note)
        if not final:
            first = sorted(extra.items())[:1]
            why = f" ({first[0][0]}: {first[0][1]}, ...)" if first else ""
            shapes = opts.is_4bit and any(kernel_problem(opts, info["shape"]) for info in candidates.values())
            fix = "merge with --quantize int8 (no such shape limit) or without --quantize" if shapes else "merge without --quantize"
            raise QuantizationError(f"no layer of this model can be quantized with bitsandbytes{why}; {fix}")

        self.quantized = sorted(final)
        self.skipped = sorted(linear - set(final))
        self.compute_dtype = compute
        self._conv1d = {m for m in final if candidates[m]["conv1d"]}
        self._bnb_config = bnb_config(opts, compute, skip_list)
        self.quantization_config = config_dict(self._bnb_config)

        # Output specs: base order, each quantized weight replaced by its parts in place.
        self._specs: dict[str, TensorSpec] = {}
        self._part: dict[str, tuple[str, str]] = {}  # output name -> (module, key relative to module)
        for name, spec in base_specs.items():
            module = name.removesuffix(".weight")
            quantize = name.endswith(".weight") and module in final
            for p in part_specs(module, spec, opts, candidates[module]["shape"]) if quantize else [spec]:
                if p.name in self._specs:
                    raise QuantizationError(f"{p.name} is both a checkpoint tensor and a quantized part; cannot write both")
                self._specs[p.name] = p
                if quantize:
                    self._part[p.name] = (module, p.name[len(module) + 1 :])
        self._cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._unread: dict[str, set[str]] = {}  # cached module -> parts not handed out yet
        self.quantize_calls = 0  # modules quantized so far (tests: each module once)

    @staticmethod
    def _default_compute_dtype(specs: dict[str, TensorSpec]) -> str:
        floats = [s.dtype for s in specs.values() if s.dtype.is_floating_point]
        return dtype_name(max(set(floats), key=floats.count)) if floats else "float32"

    # -- LazyCheckpoint ---------------------------------------------------------------------

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def read_into(self, name: str, out: torch.Tensor) -> None:
        if name not in self._part:
            self.base.read_into(name, out)
            return
        module, key = self._part[name]
        value = self._module_parts(module)[key]
        spec = self._specs[name]
        if key.startswith("weight.quant_state.") and self.options.double_quant:
            value = self._pad_blob(name, value, spec.numel)
        out.copy_(value.view(spec.shape))
        unread = self._unread.get(module)
        if unread is not None:
            unread.discard(key)
            if not unread:  # every part written once: release now (a later read recomputes)
                del self._cache[module], self._unread[module]

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        """Tensors written as they are keep the base's fast row path; quantized parts have none."""
        if name in self._part:
            return None
        return self.base.read_rows(name, dtype, max_bytes)

    def close(self) -> None:
        self._cache.clear()
        self._unread.clear()
        self.base.close()

    # -- plan grouping ----------------------------------------------------------------------

    def group(self, spec: TensorSpec) -> str | None:
        """Plan group of an output tensor: its module for quantized parts, else None."""
        part = self._part.get(spec.name)
        return part[0] if part else None

    def parameters(self, spec: TensorSpec) -> int:
        """What transformers' ``num_parameters`` counts for output tensor ``spec``: a 4-bit weight
        as twice the elements of its packed ``uint8`` storage, its quantization state as nothing,
        any other tensor as its elements."""
        part = self._part.get(spec.name)
        if part is None:
            return spec.numel
        if part[1] != "weight":
            return 0
        return spec.numel * 2 * spec.dtype.itemsize if self.options.is_4bit else spec.numel

    # -- records ----------------------------------------------------------------------------

    def provenance(self) -> dict[str, Any]:
        return {
            "method": "bitsandbytes",
            "mode": self.options.mode,
            "double_quant": self.options.double_quant,
            "compute_dtype": self.compute_dtype if self.options.is_4bit else None,
            "skipped": list(self.skipped),
            "skip_modules": list(self.options.skip_modules),
            "quantized_modules": len(self.quantized),
            "blocksize": BLOCKSIZE if self.options.is_4bit else None,
            "bitsandbytes_version": getattr(self._bnb, "__version__", None),
        }

    def output_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with ``quantization_config`` set (a new dict)."""
        return {**config, "quantization_config": dict(self.quantization_config)}

    # -- internals --------------------------------------------------------------------------

    def _module_parts(self, module: str) -> dict[str, torch.Tensor]:
        parts = self._cache.get(module)
        if parts is not None:
            self._cache.move_to_end(module)
            return parts
        weight = self.base.read(f"{module}.weight")
        if module in self._conv1d:
            weight = weight.t().contiguous()  # transformers' Bnb*Quantize transposes Conv1D weights
        if self.options.is_4bit:
            parts = quantize_4bit(self._bnb, weight, self.options.mode, self.options.double_quant)
            stats = parts["weight.absmax"] if not self.options.double_quant else parts["weight.nested_absmax"]
        else:
            parts = quantize_int8(self._bnb, weight)
            stats = parts["SCB"]
        del weight
        if not bool(torch.isfinite(stats).all()):
            raise QuantizationError(
                f"{module}: its weight has inf/nan (or values beyond float16 for int8) so its quantization "
                f"scales are not finite; pass --quant-skip-modules {module} to keep it unquantized"
            )
        self.quantize_calls += 1
        self._cache[module] = parts
        self._unread[module] = set(parts)
        while len(self._cache) > LRU_MODULES:
            old, _ = self._cache.popitem(last=False)
            self._unread.pop(old, None)
        return parts

    @staticmethod
    def _pad_blob(name: str, blob: torch.Tensor, size: int) -> torch.Tensor:
        if blob.numel() > size:
            raise QuantizationError(f"{name}: quant-state JSON is {blob.numel()} bytes, over the {size} reserved; report this")
        pad = torch.full((size - blob.numel(),), ord(" "), dtype=torch.uint8)
        return torch.cat([blob.reshape(-1), pad])

