"""LoRA in PEFT checkpoints: find the adapter, settle its settings, describe it.

A PEFT-wrapped model's state dict (verl saves it as is) names tensors ``base_model.model.<hf
name>``; a wrapped linear ``m`` becomes ``m.base_layer.weight`` (+ ``.bias``) plus
``m.lora_A.<adapter>.weight`` ``[r, in]`` and ``m.lora_B.<adapter>.weight`` ``[out, r]``; a module
in ``modules_to_save`` becomes ``m.original_module.*`` plus the trained ``m.modules_to_save.<adapter>.*``.
``save_lora_only`` checkpoints hold only the LoRA (and modules_to_save) tensors.

LoRA on a parameter (``LoraConfig(target_parameters=[...])``, PEFT's ``ParamWrapper``): the fused
3-D expert tensors of transformers 5 MoE models (``mlp.experts.gate_up_proj [E, out, in]``). Each
targeted parameter gets one wrapper; several on one module are nested, so the module's tensors
move under ``base_layer`` once per wrapper (``experts.base_layer.base_layer.gate_up_proj``) and
each wrapper's ``lora_A [r * E, in]`` / ``lora_B [out, r * E]`` sit at its depth
(``experts.lora_A``, ``experts.base_layer.lora_A``). Which parameter a wrapper adapts is read
from the shapes (the one parameter of the module whose ``[E, out, in]`` fits); expert ``e``'s
delta is ``lora_B[:, e::E] @ lora_A[e * r:(e + 1) * r]`` (PEFT's ``get_delta_weight``).

Settings are never guessed: r comes from the tensor shapes; ``lora_alpha`` from verl's
``lora_train_meta.json``, an older ``lora_adapter/adapter_config.json``, or the caller, and
nothing else (an adapter with a made-up alpha silently does the wrong thing).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from ..errors import LoraError
from .lora_targets import meta_module_names, owner_modules, shortest_suffixes
from ..spec import TensorSpec

PEFT_PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")
_SAVED = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<param>.+)$")
_ORIGINAL = re.compile(r"^(?P<module>.+)\.original_module\.(?P<param>.+)$")
_BASE_LAYER = re.compile(r"\.base_layer(?=\.|$)")  # one per wrapper (nested ParamWrappers: several)
_LAYER_PREFIX = re.compile(r"^(?:.*\.)?\d+\.")
_UNSUPPORTED = {
    "lora_magnitude_vector": "DoRA (use_dora) magnitude vectors",
    "lora_embedding_A": "LoRA on embeddings (lora_embedding_A/B)",
    "lora_embedding_B": "LoRA on embeddings (lora_embedding_A/B)",
}


@dataclass(frozen=True)
class LoraModule:
    """One LoRA-wrapped linear: ``name`` is its HF module path (``model.layers.0.self_attn.q_proj``).

    LoRA on a parameter (``target_parameters``): ``name`` is the wrapper's path as PEFT saves it
    (``model.layers.0.mlp.experts.base_layer``), ``param`` the HF name of the 3-D tensor it adapts,
    ``experts`` its first dimension and ``transposed`` true when it is stored ``[E, in, out]``.
    """

    name: str
    a_key: str
    b_key: str
    r: int
    in_features: int
    out_features: int
    param: str | None = None
    experts: int = 0
    transposed: bool = False

    @property
    def weight(self) -> str:
        """The HF name of the tensor this LoRA is folded into."""
        return self.param or f"{self.name}.weight"

    @property
    def pattern_key(self) -> str:
        """The name PEFT matches ``rank_pattern`` / ``alpha_pattern`` against: the module's path, or
        for LoRA on a parameter the parameter's (``model.layers.0.mlp.experts.gate_up_proj``)."""
        return self.param or self.name


@dataclass
class LoraLayout:
    """Where everything of a PEFT checkpoint lives, by source key."""

    adapter_name: str
    modules: dict[str, LoraModule]
    base: dict[str, str]  # HF tensor name -> source key, for every base (non-LoRA) tensor present
    saved: dict[str, str]  # HF tensor name -> source key of the trained modules_to_save copy
    lora_only: bool  # save_lora_only: the base weights are not in the checkpoint
    original: dict[str, str] = field(default_factory=dict)  # HF name -> untrained modules_to_save copy
    #: every module name of the base model the adapter goes onto, when known (the model built from
    #: config.json on the meta device); else the checkpoint's own tensors tell
    model_modules: "set[str] | None" = None

    @property
    def unfused_base(self) -> dict[str, str]:
        """HF name -> source key of the base model the adapter goes onto (untrained modules_to_save)."""
        return {**self.base, **self.original}

    @cached_property
    def target_modules(self) -> list[str]:
        """``LoraConfig.target_modules`` as PEFT writes it: each wrapped linear's shortest name
        suffix that matches no other module of the model (see :mod:`hf_merge.transforms.lora_targets`)."""
        return self.peft_target_modules(strict=False)

    def peft_target_modules(self, *, strict: bool = True) -> list[str]:
        """:attr:`target_modules`; ``strict``: a LoraError when a wrapped module cannot be named
        apart from another one (an adapter config PEFT could not load)."""
        wrapped = {n for n, m in self.modules.items() if m.param is None}
        if not wrapped:
            return []
        others = owner_modules([*self.base, *self.saved, *self.original, *(m.weight for m in self.modules.values())])
        return shortest_suffixes(wrapped, others | (self.model_modules or set()),
                                 complete=self.model_modules is not None, strict=strict)

    @property
    def target_parameters(self) -> list[str]:
        """LoRA on parameters, as ``LoraConfig.target_parameters`` names them (the path below the
        layer index: ``mlp.experts.gate_up_proj``)."""
        return sorted({_LAYER_PREFIX.sub("", m.param) for m in self.modules.values() if m.param is not None})

    @property
    def modules_to_save(self) -> list[str]:
        return sorted({n.rsplit(".", 2)[-2] for n in self.saved})


@dataclass
class LoraSettings:
    r: int
    lora_alpha: float
    alpha_source: str
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    task_type: str | None = None
    base_model_name_or_path: str | None = None
    fused_alphas: dict[str, float] = field(default_factory=dict)  # the alpha_pattern entries derived, not recorded
    overridden_alpha: tuple[float, str] | None = None  # (recorded alpha, where) that --lora-alpha replaced
    rslora_recorded: bool = True  # False: no file records use_rslora and none was given (assumed off)

    def scale(self, module: LoraModule) -> float:
        """PEFT's scaling for ``module``: alpha / r, or alpha / sqrt(r) with rsLoRA (r from its shapes)."""
        alpha = _pattern_value(self.alpha_pattern, module.pattern_key, self.lora_alpha)
        return alpha / math.sqrt(module.r) if self.use_rslora else alpha / module.r


def _pattern_value(pattern: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first key that matches the end of ``name`` as a regular
    expression (``.*\\.gate_up_proj`` as PEFT writes it, or a module path)."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _strip(name: str) -> str:
    return name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name


def find_lora(
    specs: dict[str, TensorSpec],
    *,
    experts_transposed: "Callable[[str], bool] | None" = None,
    config: "dict[str, Any] | None" = None,
) -> LoraLayout | None:
    """The LoRA layout of a state dict's specs, or None when it holds no LoRA tensors.

    ``config``: the model's config.json; its meta-device model's module names (when transformers
    builds it and its names are the checkpoint's) settle ``target_modules`` exactly, modules
    without weights included.

    ``experts_transposed(module)``: whether that experts module stores its 3-D parameters as
    ``[E, in, out]`` (transformers' ``is_transposed``, which PEFT reads too), for LoRA on
    parameters; without it a square parameter is taken as ``[E, out, in]`` (transformers' default),
    good enough for describing the adapter but not for fusing it.
    """
    if not any(".lora_" in n for n in specs):
        return None
    for key in specs:
        for marker, what in _UNSUPPORTED.items():
            if f".{marker}." in key or key.endswith(f".{marker}"):
                raise LoraError(
                    f"{what} found ({key}); hf-merge does not merge these yet and will not write a wrong model. "
                    "Merge this adapter with PEFT's merge_and_unload instead"
                )
    pieces: dict[str, dict[str, str]] = {}
    adapters: set[str] = set()
    base: dict[str, str] = {}
    saved: dict[str, str] = {}
    original: dict[str, str] = {}
    for key in specs:
        name = _strip(key)
        if m := _LORA.match(name):
            adapters.add(m["adapter"])
            pieces.setdefault(m["module"], {})[m["ab"]] = key
        elif m := _SAVED.match(name):
            adapters.add(m["adapter"])
            saved[f"{m['module']}.{m['param']}"] = key
        elif m := _ORIGINAL.match(name):
            original[f"{m['module']}.{m['param']}"] = key  # untrained copy: the adapter's base, not the fused model
        else:
            base[_BASE_LAYER.sub("", name)] = key
    if len(adapters) > 1:
        raise LoraError(f"the checkpoint holds several adapters ({', '.join(sorted(adapters))}); hf-merge merges one")
    modules = {}
    for module, ab in sorted(pieces.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{module} has lora_{'A' if 'A' in ab else 'B'} but not its pair; the checkpoint is incomplete")
        a, b = specs[ab["A"]], specs[ab["B"]]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"{module}: lora_A {a.shape} and lora_B {b.shape} do not form a rank-r pair")
        modules[module] = LoraModule(module, ab["A"], ab["B"], a.shape[0], a.shape[1], b.shape[0])
        if _BASE_LAYER.search(module) or f"{module}.weight" not in base:
            modules[module] = _on_parameter(modules[module], base, specs, experts_transposed) or modules[module]
    adapted = Counter(m.param for m in modules.values() if m.param is not None)
    for param, count in adapted.items():
        if count > 1:
            raise LoraError(f"{count} LoRA wrappers fit {param}; hf-merge cannot tell which parameter each adapts")
    lora_only = not any(m.weight in base for m in modules.values())
    for module in modules.values():
        weight = module.weight
        if module.param is None and weight in base and specs[base[weight]].shape != (module.out_features, module.in_features):
            raise LoraError(
                f"{module.name}: base weight {specs[base[weight]].shape} does not match lora_B@lora_A "
                f"({module.out_features}, {module.in_features}); fan_in_fan_out (Conv1D) layers are not supported"
            )
    wrapped = {m.name for m in modules.values() if m.param is None}
    known = meta_module_names(config, wrapped) if config and wrapped else None
    return LoraLayout(next(iter(adapters)), modules, base, saved, lora_only, original, known)


def _on_parameter(module: LoraModule, base: dict[str, str], specs: dict[str, TensorSpec], experts_transposed) -> LoraModule | None:
    """``module`` as LoRA on one 3-D parameter of its owner (PEFT's ParamWrapper), found by shape:
    ``[E, out, in]`` (or ``[E, in, out]`` for experts stored transposed) with ``lora_A`` of
    ``r * E`` rows. None when the owner has no such parameter (a plain save_lora_only linear)."""
    owner = _BASE_LAYER.sub("", module.name)
    candidates = [(name, specs[key].shape) for name, key in base.items() if name.rsplit(".", 1)[0] == owner]
    candidates = [(name, shape) for name, shape in candidates if len(shape) == 3 and shape[0] and not module.r % shape[0]]
    # asked only when there is a 3-D parameter to adapt (it builds the model's meta skeleton)
    known = experts_transposed(owner) if experts_transposed is not None and candidates else None
    fits = []
    for name, shape in candidates:
        for transposed, (d_out, d_in) in ((False, shape[1:]), (True, shape[:0:-1])):
            if (d_out, d_in) == (module.out_features, module.in_features) and known in (None, transposed):
                fits.append((name, shape[0], transposed))
                break  # a square parameter fits both ways: transformers' default (not transposed) unless known
    if not fits:
        if _BASE_LAYER.search(module.name):
            raise LoraError(f"{module.name}: no 3-D parameter of {owner} fits lora_A / lora_B "
                            f"[{module.r}, {module.in_features}] / [{module.out_features}, {module.r}]")
        return None
    if len(fits) > 1:
        raise LoraError(f"{module.name}: lora_A / lora_B fit several parameters or orientations of {owner} "
                        f"({', '.join(f[0] for f in fits)}); hf-merge cannot tell which one it adapts")
    param, experts, transposed = fits[0]
    return LoraModule(module.name, module.a_key, module.b_key, module.r // experts, module.in_features,
                      module.out_features, param=param, experts=experts, transposed=transposed)


def _read_json(path: Path) -> dict[str, Any] | None:
    """The file's object, its LoRA fields type-checked (``r`` a positive int, ``lora_alpha`` a
    finite number, ``use_rslora`` a bool, ``task_type`` a string)."""
    try:
        data = json.loads(path.read_bytes()) if path.is_file() else None
    except ValueError:  # also UnicodeDecodeError
        raise LoraError(f"{path} is not valid JSON; fix it or delete it and pass --lora-alpha") from None
    if data is None:
        return None
    if not isinstance(data, dict):
        raise LoraError(f"{path} holds a JSON {type(data).__name__}, not an object; fix it or delete it and pass --lora-alpha")
    checks = {
        "r": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
        "lora_alpha": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
        "use_rslora": lambda v: isinstance(v, bool),
        "task_type": lambda v: v is None or isinstance(v, str),
    }
    for key, ok in checks.items():
        if key in data and not ok(data[key]):
            raise LoraError(f"{path}: {key} is {str(data[key])[:40]!r}, which is not valid; fix it, or delete the file and pass --lora-alpha")
    return data


def resolve_settings(
    layout: LoraLayout,
    folder: Path,
    config: dict[str, Any],
    *,
    lora_alpha: float | None = None,
    use_rslora: bool | None = None,
    base_model_name: str | None = None,
) -> LoraSettings:
    """Settle r / alpha / rsLoRA / patterns from the checkpoint's files and the caller's options."""
    meta = _read_json(Path(folder) / "lora_train_meta.json")
    # an adapter folder beside the weights: older verl's lora_adapter/, or PEFT's own save in the
    # checkpoint folder itself (HF Trainer checkpoint-N/ of a PEFT run)
    old_name = "lora_adapter/adapter_config.json"
    old = _read_json(Path(folder) / old_name)
    if old is None and (Path(folder) / "adapter_config.json").is_file():
        old_name, old = "adapter_config.json", _read_json(Path(folder) / "adapter_config.json")
    ranks = Counter(m.r for m in layout.modules.values())
    r = ranks.most_common(1)[0][0]
    for source_name, source in (("lora_train_meta.json", meta), (old_name, old)):
        if source and "r" in source and int(source["r"]) != r and int(source["r"]) in ranks:
            r = int(source["r"])
    rank_pattern = {m.pattern_key: m.r for m in layout.modules.values() if m.r != r}
    recorded = [(float(src["lora_alpha"]), name) for name, src in (("lora_train_meta.json", meta), (old_name, old))
                if src and src.get("lora_alpha") is not None]
    overridden = None
    if lora_alpha is not None:
        alpha, alpha_source = float(lora_alpha), "--lora-alpha"
        if recorded and recorded[0][0] != alpha:
            value = recorded[0][0]
            overridden = (int(value) if value == int(value) else value, recorded[0][1])
    elif meta and meta.get("lora_alpha") is not None:
        alpha, alpha_source = float(meta["lora_alpha"]), "lora_train_meta.json"
    elif old and old.get("lora_alpha") is not None:
        alpha, alpha_source = float(old["lora_alpha"]), old_name
    else:
        raise LoraError(
            "this checkpoint has LoRA weights but no lora_alpha is recorded (no lora_train_meta.json or "
            "lora_adapter/adapter_config.json); pass --lora-alpha with the value used in training"
        )
    if alpha == int(alpha):
        alpha = int(alpha)
    rslora_recorded = use_rslora is not None or "use_rslora" in (meta or {}) or "use_rslora" in (old or {})
    if use_rslora is None:
        use_rslora = bool((meta or {}).get("use_rslora", (old or {}).get("use_rslora", False)))
    alpha_pattern = dict((old or {}).get("alpha_pattern") or {})
    fused_alphas = {} if alpha_pattern else _fused_alphas(layout, r, alpha)
    alpha_pattern = alpha_pattern or fused_alphas
    task_type = (meta or {}).get("task_type") or (old or {}).get("task_type")
    if task_type is None and any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or []):
        task_type = "CAUSAL_LM"
    return LoraSettings(
        r=r,
        lora_alpha=alpha,
        alpha_source=alpha_source,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        task_type=task_type,
        base_model_name_or_path=base_model_name or config.get("_name_or_path") or (old or {}).get("base_model_name_or_path"),
        fused_alphas=fused_alphas,
        overridden_alpha=overridden,
        rslora_recorded=rslora_recorded,
    )


def _fused_alphas(layout: LoraLayout, r: int, alpha: float) -> dict[str, float]:
    """alpha for LoRA on a fused expert parameter at ``k * r``: ``k * alpha``, when only one r and one
    alpha are recorded (verl's lora_train_meta.json, --lora-alpha).

    PEFT 0.21 under transformers 5 maps LoRA targets named per projection (``gate_proj``, ``up_proj``,
    or ``all-linear``) onto the fused ``gate_up_proj`` at rank ``2r`` and alpha ``2 alpha``
    (``rank_pattern`` / ``alpha_pattern``: alpha / r kept); a fused parameter has no other way to a
    multiple of the one r. Its adapter_config.json says so, and wins when it is there.
    """
    return {m.pattern_key: alpha * (m.r // r) for m in layout.modules.values()
            if m.param is not None and m.r != r and m.r % r == 0}


def adapter_config(layout: LoraLayout, settings: LoraSettings) -> dict[str, Any]:
    """adapter_config.json content, produced by PEFT's own LoraConfig."""
    from .._quiet import no_hub_kernels

    with no_hub_kernels():  # peft imports bitsandbytes
        from peft import LoraConfig

    cfg = LoraConfig(
        r=settings.r,
        lora_alpha=settings.lora_alpha,
        target_modules=layout.peft_target_modules() or None,
        target_parameters=layout.target_parameters or None,
        lora_dropout=0.0,
        bias="none",
        use_rslora=settings.use_rslora,
        use_dora=False,
        modules_to_save=layout.modules_to_save or None,
        rank_pattern=settings.rank_pattern,
        alpha_pattern=settings.alpha_pattern,
        task_type=settings.task_type,
        base_model_name_or_path=settings.base_model_name_or_path,
        fan_in_fan_out=False,
        inference_mode=True,
    )
    out = cfg.to_dict()
    if out.get("target_modules") is not None:
        out["target_modules"] = sorted(out["target_modules"])
    for key, value in list(out.items()):
        if isinstance(value, set):
            out[key] = sorted(value)
    return out


def describe_lora(ckpt) -> dict[str, Any] | None:
    """For ``inspect``: r, alpha (and where it came from), targets (from the checkpoint's names
    alone: no transformers import), adapter size. No data read."""
    specs = ckpt.specs()
    layout = find_lora(specs)
    if layout is None:
        return None
    info: dict[str, Any] = {
        "adapter_name": layout.adapter_name,
        "modules": len(layout.modules),
        "target_modules": layout.target_modules,
        "target_parameters": layout.target_parameters,
        "modules_to_save": layout.modules_to_save,
        "lora_only": layout.lora_only,
        "adapter_bytes": sum(specs[m.a_key].nbytes + specs[m.b_key].nbytes for m in layout.modules.values())
        + sum(specs[k].nbytes for k in layout.saved.values()),
    }
    try:
        settings = resolve_settings(layout, ckpt.info.path, {})
        info.update(r=settings.r, lora_alpha=settings.lora_alpha, alpha_source=settings.alpha_source,
                    use_rslora=settings.use_rslora, rank_pattern=settings.rank_pattern)
    except LoraError:
        info.update(r=Counter(m.r for m in layout.modules.values()).most_common(1)[0][0],
                    lora_alpha=None, alpha_source="not recorded: pass --lora-alpha")
    return info
