"""Hub-canonical layout: transformers' in-memory names and layout -> what ``save_pretrained`` writes.

transformers 5 keeps many models in memory in another layout than the one it saves (fused MoE
experts ``mlp.experts.gate_up_proj [E, 2F, H]`` saved as one tensor per expert; VLMs'
``model.language_model.*`` saved as ``model.*`` or ``language_model.model.*``), and FSDP rank files
hold the in-memory layout. This transform writes the saved one, with no table of its own: it runs
transformers' own ``revert_weight_conversion`` — the function ``save_pretrained`` calls — over a
skeleton of the model built on the meta device and a state dict of *symbolic* meta tensors. Each
symbolic tensor records the torch calls transformers' reverse operations make on it (``chunk``,
``squeeze``, ``cat``, ``transpose``...), so the result is, per output name, a spec (shape and dtype,
known before any data is read) plus a recipe: which source tensors, which calls.

Reading replays the recipe on the real tensors. A recipe made only of views of one source
(``chunk`` / ``split`` / ``select`` / ``squeeze`` / ``narrow``, the per-expert split of a fused
``[E, 2F, H]`` tensor) that lands on a contiguous range of the source is served by
:meth:`read_rows` as runs of the source's own rows — zero-copy views of a memory-mapped rank file,
so the writer's ``copy_file_range`` path is kept.

An operation outside :data:`KNOWN_OPERATIONS`, or a torch call outside :data:`REPLAYABLE_CALLS`, is
a :class:`~hf_merge.errors.MappingError` naming it and the architecture, never a silent
pass-through. Models transformers does not convert (dense Llama/Qwen..., remote code) pass through
unchanged. Checked with transformers 5.24. Under transformers 4.x (no weight conversions: MoE
experts are held as saved) only a VLM's prefixes are renamed, as 4.x's ``save_pretrained`` does.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..checkpoint import ROW_CHUNK_BYTES, LazyCheckpoint, check_out, row_runs
from ..readers.file_runs import read_into, run_of, values
from ..errors import MappingError
from . import layout_cache
from .skeleton import model_class_for, skeleton
from ..spec import TensorSpec, c_contiguous, dtype_name, parse_dtype
from ..transformers_compat import has_weight_conversions, legacy_saved_names, reverse_conversions

logger = logging.getLogger(__name__)

__all__ = ["HubLayout", "hub_layout", "check_legacy_experts", "KNOWN_OPERATIONS", "REPLAYABLE_CALLS", "model_class_for"]

#: ``transformers.core_model_loading`` operations whose reverse only moves data around (no
#: arithmetic on values, no dependence on anything but shapes and the config), so replaying the
#: torch calls they make gives the bytes ``save_pretrained`` writes.
KNOWN_OPERATIONS = frozenset({
    "Chunk", "Split", "Concatenate", "Interleave", "MergeModulelist", "SplitModulelist", "Transpose",
    "Conv3dToLinear", "LinearToConv3d", "PermuteForRope",
})

#: torch calls a recipe may hold (by name); the views among them are served as file ranges.
REPLAYABLE_CALLS = frozenset({
    "chunk", "split", "squeeze", "select", "narrow", "__getitem__", "unsqueeze", "contiguous", "cat", "concat",
    "concatenate", "stack", "transpose", "permute", "reshape", "view", "flatten", "unflatten", "clone", "t",
})
_METADATA_CALLS = frozenset({"size", "dim", "numel", "shape", "dtype", "ndim", "__get__", "__len__", "is_floating_point"})


# --------------------------------------------------------------------------------------------
# Recipes: what transformers' reverse operations did to each source tensor
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Leaf:
    name: str


@dataclass(frozen=True)
class _Call:
    func: str  # the torch function's name (checked against REPLAYABLE_CALLS)
    fn: Any
    args: tuple
    kwargs: tuple  # sorted (key, value) pairs
    index: int | None  # element of a tuple result (chunk / split), else None


class _Symbolic(torch.Tensor):
    """A meta tensor that records every torch call made on it (the recipe of its data)."""

    _recipe: Any

    @staticmethod
    def __new__(cls, meta: torch.Tensor, recipe: Any) -> "_Symbolic":
        out = torch.Tensor._make_subclass(cls, meta, False)
        out._recipe = recipe
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name in _METADATA_CALLS or not _has_tensor(result):
            return result
        rec_args = _to_recipe(args)
        rec_kwargs = tuple(sorted((k, _to_recipe(v)) for k, v in kwargs.items()))
        if isinstance(result, (tuple, list)):
            return type(result)(
                _Symbolic(r, _Call(name, func, rec_args, rec_kwargs, i)) if isinstance(r, torch.Tensor) else r
                for i, r in enumerate(result)
            )
        return _Symbolic(result, _Call(name, func, rec_args, rec_kwargs, None))


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def _to_recipe(value: Any) -> Any:
    if isinstance(value, _Symbolic):
        return value._recipe
    if isinstance(value, torch.Tensor):
        raise MappingError("a reverse weight conversion made a new tensor from no source; hf_merge cannot replay it")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_recipe(v) for v in value)
    return value


def _nodes(recipe: Any) -> Iterator[Any]:
    """Every node of a recipe: calls and leaves, depth first."""
    if isinstance(recipe, (_Leaf, _Call)):
        yield recipe
    if isinstance(recipe, _Call):
        children: tuple = recipe.args + tuple(v for _, v in recipe.kwargs)
    elif isinstance(recipe, (tuple, list)):
        children = tuple(recipe)
    else:
        return
    for child in children:
        yield from _nodes(child)


def _leaves(recipe: Any) -> Iterator[str]:
    return (node.name for node in _nodes(recipe) if isinstance(node, _Leaf))


def _calls(recipe: Any) -> Iterator[_Call]:
    return (node for node in _nodes(recipe) if isinstance(node, _Call))


def _replay(recipe: Any, leaf: Any) -> Any:
    """Evaluate ``recipe`` with ``leaf(name)`` giving each source tensor."""
    if isinstance(recipe, _Leaf):
        return leaf(recipe.name)
    if isinstance(recipe, _Call):
        args = tuple(_replay(a, leaf) for a in recipe.args)
        kwargs = {k: _replay(v, leaf) for k, v in recipe.kwargs}
        result = recipe.fn(*args, **kwargs)
        return result if recipe.index is None else result[recipe.index]
    if isinstance(recipe, (tuple, list)):
        return type(recipe)(_replay(item, leaf) for item in recipe)
    return recipe


def _storages(recipes: dict[str, Any], base_specs: dict[str, TensorSpec]) -> dict[str, tuple[str, int]]:
    """For each output that is a view: the storage it views (named by the first output viewing it)
    and that storage's elements. Every recipe is replayed on meta tensors in one pass, each recorded
    call once, so siblings (the experts one ``chunk`` / ``unbind`` made) are views of the same tensor,
    as in transformers' reverse conversion; torch's own view rules decide what is a view."""
    leaves: dict[str, torch.Tensor] = {}
    done: dict[int, Any] = {}  # id of a recorded call -> its result (the recipes keep the calls alive)

    def run(recipe: Any) -> Any:
        if isinstance(recipe, _Leaf):
            if recipe.name not in leaves:
                spec = base_specs[recipe.name]
                leaves[recipe.name] = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
            return leaves[recipe.name]
        if isinstance(recipe, _Call):
            if id(recipe) not in done:
                result = recipe.fn(*(run(a) for a in recipe.args), **{k: run(v) for k, v in recipe.kwargs})
                done[id(recipe)] = result if recipe.index is None else result[recipe.index]
            return done[id(recipe)]
        if isinstance(recipe, (tuple, list)):
            return type(recipe)(run(item) for item in recipe)
        return recipe

    owners: dict[int, str] = {}
    found: dict[str, tuple[str, int]] = {}
    for name, recipe in recipes.items():
        tensor = run(recipe)
        if isinstance(tensor, torch.Tensor) and tensor._base is not None:
            found[name] = (owners.setdefault(id(tensor._base), name), tensor._base.numel())
    return found


# --------------------------------------------------------------------------------------------
# The model skeleton and transformers' own reverse conversion
# --------------------------------------------------------------------------------------------


def _may_convert(config: dict[str, Any], arch: str) -> bool:
    """See :func:`hf_merge.transforms.conversion_keys.may_convert` (transformers asked when its source does not say)."""
    from .conversion_keys import may_convert

    return bool(may_convert(config, arch))


def _check_operations(conversions: list, arch: str) -> None:
    for conversion in conversions:
        for op in getattr(conversion, "operations", None) or []:
            for candidate in (op, _reverse_op(op, arch)):
                name = type(candidate).__name__
                if name not in KNOWN_OPERATIONS:
                    raise MappingError(
                        f"{arch}: transformers saves it through the weight operation {name} ({conversion!r}), "
                        "which hf_merge does not know; merge with --dtype as trained and convert with save_pretrained, "
                        "or report it"
                    )


def _reverse_op(op, arch: str):
    try:
        return op.reverse_op
    except NotImplementedError:
        raise MappingError(
            f"{arch}: the weight operation {type(op).__name__} has no reverse in transformers, so save_pretrained "
            "cannot write this model either; report it"
        ) from None


# --------------------------------------------------------------------------------------------
# The lazy view
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Span:
    """An output that is the contiguous elements ``[offset, offset + numel)`` of one source."""

    source: str
    offset: int


class HubLayout(LazyCheckpoint):
    """``base`` (transformers' in-memory names) seen as ``save_pretrained`` would write it.

    Args:
        base: a lazy checkpoint with the model's ``state_dict`` names (tied alias already dropped).
        recipes: ``{output name: recipe}`` from :func:`hub_layout`.
        specs: ``{output name: TensorSpec}``, in the order save_pretrained's state dict has them.
        spans: ``{output name: _Span}`` of the outputs that are a contiguous range of one source;
            computed from the recipes when not given (a plan from the plan cache brings them).
    """

    def __init__(self, base: LazyCheckpoint, recipes: dict[str, Any], specs: dict[str, TensorSpec], *, architecture: str,
                 spans: "dict[str, _Span] | None" = None, storages: "dict[str, tuple[str, int]] | None" = None):
        self.base = base
        self.info = base.info
        self.architecture = architecture
        self._recipes = recipes
        self._specs = specs
        if spans is None:  # computed from the recipes (a stored plan brings its own)
            base_specs = base.specs()
            spans = {}
            for name, recipe in recipes.items():
                span = _span(recipe, base_specs)
                if span is not None:
                    spans[name] = span
        self._spans: dict[str, _Span] = spans
        self._storages = storages  # computed when first asked for (a sharded plan), or from a stored plan
        self._lock = threading.Lock()
        self._cached: tuple[str, torch.Tensor] | None = None  # one source in flight, for non-view recipes

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def source_names(self, name: str) -> list[str]:
        """The base tensors output ``name`` is made from."""
        return sorted(set(_leaves(self._recipes[name])))

    def read_into(self, name: str, out: torch.Tensor) -> None:
        spec = self._specs[name]
        check_out(spec, out)
        recipe = self._recipes[name]
        if isinstance(recipe, _Leaf):
            self.base.read_into(recipe.name, out)
            return
        if name in self._spans:
            runs = self.read_rows(name, out.dtype)
            if runs is not None:
                for first, piece in runs:
                    read_into(piece, out[first : first + len(values(piece))])
                return
        out.copy_(_replay(recipe, self._source))

    def storages(self) -> dict[str, tuple[str, int]]:
        """``{output: (storage, elements)}`` for each output that is, in ``save_pretrained``'s state
        dict, a view of a storage (an expert split out of a fused tensor, or out of a copy
        transformers' reverse made of it), the storage named by the first output that views it.
        The splitter sizes a storage once and keeps its views in one file."""
        if self._storages is None:
            self._storages = _storages(self._recipes, self.base.specs())
        return self._storages

    def _source(self, name: str) -> torch.Tensor:
        """A whole source tensor, kept until another is asked for (siblings share it)."""
        with self._lock:
            if self._cached is None or self._cached[0] != name:
                self._cached = None
                self._cached = (name, self.base.read(name))
            return self._cached[1]

    def read_rows(self, name: str, dtype: torch.dtype, max_bytes: int = ROW_CHUNK_BYTES):
        recipe = self._recipes[name]
        if isinstance(recipe, _Leaf):
            return self.base.read_rows(recipe.name, dtype, max_bytes)
        span = self._spans.get(name)
        spec = self._specs[name]
        if span is None or not spec.shape or spec.numel == 0:
            return None
        source = self.base.specs()[span.source]
        region = getattr(self.base, "read_region_into", None)
        if region is not None:  # only the source rows the span covers (one expert, not all of them)
            row = math.prod(source.shape[1:])
            first, stop = span.offset // row, -(-(span.offset + spec.numel) // row)
            runs = _region_rows(region, span.source, source, first, stop, max_bytes)
        else:
            runs = self.base.read_rows(span.source, source.dtype, max_bytes)
        if runs is None:
            return None
        return _span_runs(runs, span, source, spec, dtype, max_bytes)

    def close(self) -> None:
        self._cached = None
        self.base.close()


def _span(recipe: Any, base_specs: dict[str, TensorSpec]) -> _Span | None:
    """If ``recipe`` is views of one source landing on a contiguous range of it: that range.

    Computed with shape / stride arithmetic (:func:`_view_of`), microseconds per tensor: a
    Qwen3-30B-A3B-sized model has some 18,000 expert tensors.
    """
    if isinstance(recipe, _Leaf):
        return None
    view = _view_of(recipe, base_specs)
    if view is None or not c_contiguous(view[0], view[1]):
        return None
    return _Span(view[3], view[2])


#: parameter names of the view calls, to read recorded positional and keyword arguments alike
_VIEW_PARAMS = {
    "chunk": ("chunks", "dim"), "split": ("split_size", "dim"), "squeeze": ("dim",), "unsqueeze": ("dim",),
    "select": ("dim", "index"), "narrow": ("dim", "start", "length"), "contiguous": (),
}


def _view_of(recipe: Any, base_specs: dict[str, TensorSpec]):
    """``(shape, strides, offset, source)`` of a recipe of view calls on one contiguous source,
    or None when it is something else."""
    if isinstance(recipe, _Leaf):
        shape = list(base_specs[recipe.name].shape)
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        return shape, strides, 0, recipe.name
    if not isinstance(recipe, _Call) or recipe.func not in _VIEW_PARAMS or not recipe.args:
        return None
    inner = _view_of(recipe.args[0], base_specs)
    if inner is None:
        return None
    shape, strides, offset, source = list(inner[0]), list(inner[1]), inner[2], inner[3]
    params = dict(zip(_VIEW_PARAMS[recipe.func], recipe.args[1:]))
    params.update({("split_size" if k == "split_size_or_sections" else k): v for k, v in recipe.kwargs})
    dim = params.get("dim", 0 if recipe.func in ("chunk", "split") else None)
    if isinstance(dim, int) and dim < 0:
        dim += len(shape) + (1 if recipe.func == "unsqueeze" else 0)
    if recipe.func in ("chunk", "split"):
        n, i, size = shape[dim], recipe.index, params["split_size" if recipe.func == "split" else "chunks"]
        if i is None:
            return None
        if recipe.func == "chunk" or isinstance(size, int):
            step = size if recipe.func == "split" else (math.ceil(n / size) if n else 0)
            lo, hi = i * step, min((i + 1) * step, n)
        else:
            lo = sum(size[:i])
            hi = lo + size[i] if i < len(size) else lo
        if lo >= hi:
            return None
        offset += lo * strides[dim]
        shape[dim] = hi - lo
    elif recipe.func == "squeeze":
        drop = {i for i, n in enumerate(shape) if n == 1 and (dim is None or i == dim)}
        shape = [n for i, n in enumerate(shape) if i not in drop]
        strides = [st for i, st in enumerate(strides) if i not in drop]
    elif recipe.func == "unsqueeze":
        strides.insert(dim, strides[dim] * shape[dim] if dim < len(shape) else 1)
        shape.insert(dim, 1)
    elif recipe.func == "select":
        offset += params["index"] % shape[dim] * strides[dim]
        del shape[dim], strides[dim]
    elif recipe.func == "narrow":
        offset += params["start"] * strides[dim]
        shape[dim] = params["length"]
    return shape, strides, offset, source


def _region_rows(region, name: str, source: TensorSpec, first: int, stop: int, max_bytes: int):
    """Rows ``first..stop`` of ``source`` as runs, each read as a box (at most ``max_bytes``)."""
    rest = tuple(source.shape[1:])
    step = max(1, max_bytes // max(1, math.prod(rest) * source.dtype.itemsize))
    buf = torch.empty((min(step, stop - first),) + rest, dtype=source.dtype)
    for at in range(first, stop, step):
        rows = buf[: min(step, stop - at)]
        region(name, (at,) + (0,) * len(rest), rows)
        yield at, rows


def _span_runs(runs, span: _Span, source: TensorSpec, spec: TensorSpec, dtype: torch.dtype, max_bytes: int):
    """The source's row runs cut to ``span``, as whole rows of the output (partial rows joined)."""
    row = math.prod(spec.shape[1:])
    lo, hi = span.offset, span.offset + spec.numel
    source_row = math.prod(source.shape[1:])
    pending: torch.Tensor | None = None  # one output row being assembled across two runs
    filled = 0
    for first, piece in runs:
        rows = values(piece)
        start = first * source_row
        end = start + rows.numel()
        if end <= lo:
            continue
        if start >= hi:
            break
        flat = rows.reshape(-1)[max(lo, start) - start : min(hi, end) - start]
        at = max(lo, start) - lo  # element offset in the output
        if pending is not None:
            take = min(row - filled, flat.numel())
            pending[filled : filled + take].copy_(flat[:take])
            filled += take
            flat, at = flat[take:], at + take
            if filled == row:
                yield at // row - 1, pending.view((1,) + spec.shape[1:])
                pending = None
        whole = (flat.numel() // row) * row
        if whole:
            yield from row_runs(flat[:whole].view((-1,) + spec.shape[1:]), at // row, dtype, max_bytes, run_of(piece))
        if flat.numel() > whole:
            pending = torch.empty(row, dtype=dtype)
            filled = flat.numel() - whole
            pending[:filled].copy_(flat[whole:])
    if pending is not None:
        raise MappingError(f"{spec.name}: the source runs of {span.source} ended inside a row")


def hub_layout(base: LazyCheckpoint, config: dict[str, Any]) -> tuple[LazyCheckpoint, list[str]]:
    """``base`` as ``save_pretrained`` writes it, and notes for the user.

    Returns ``base`` itself when transformers saves the model as it holds it in memory (dense
    models, custom code, no architectures in config.json). The plan is computed once per
    (:func:`hf_merge.transforms.layout_cache.runtime`, config.json, source names / shapes / dtypes) and kept in
    the plan cache (:mod:`hf_merge.transforms.layout_cache`): a cached plan needs neither transformers nor the
    model skeleton, and is used only if it passes :func:`_check_plan` on this model.
    """
    specs = base.specs()
    check_legacy_experts(specs, config)  # before the cache: a stored plan must not skip it
    key = None
    if layout_cache.cache_dir() is not None:
        key = layout_cache.hub_layout_key(config, specs)
        stored = _decode_plan(layout_cache.get("hub_layout", key), specs)
        if stored is not None:
            return _view(base, *stored) if stored is not _PASSTHROUGH else (base, [])
    plan = _plan(specs, config)
    if plan is _PASSTHROUGH:
        if key is not None:
            layout_cache.put("hub_layout", key, layout_cache.PASSTHROUGH_PLAN)
        return base, []
    view, notes = _view(base, *plan)
    if key is not None:
        encoded = _encode_plan(*plan, view._spans, view.storages())
        problem = _check_plan(plan[1], plan[2], view._spans, specs)  # what a stored copy must pass too
        if problem is not None:
            logger.debug("%s: plan not cached (%s)", plan[0], problem)
        elif encoded is not None:
            layout_cache.put("hub_layout", key, encoded)
    return view, notes


def _view(base: LazyCheckpoint, arch: str, recipes: dict[str, Any], out_specs: dict[str, TensorSpec], spans=None,
          storages=None):
    changed = sum(1 for n, r in recipes.items() if not (isinstance(r, _Leaf) and r.name == n))
    note = f"Hub layout: {changed} of {len(recipes)} tensors renamed or split as {arch}.save_pretrained writes them"
    return HubLayout(base, recipes, out_specs, architecture=arch, spans=spans, storages=storages), [note]


_PASSTHROUGH = "passthrough"  # the plan of a model save_pretrained writes as it holds it


def _plan(specs: dict[str, TensorSpec], config: dict[str, Any]):
    """``(architecture, recipes, output specs)`` from transformers itself, or :data:`_PASSTHROUGH`."""
    names = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if not names or not _may_convert(config, names[0]):
        # transformers declares no conversion for this class, its model type or a sub-model:
        # save_pretrained keeps the in-memory names (dense models); no need to build the model
        return _PASSTHROUGH
    if not has_weight_conversions():
        return _legacy_plan(specs, config)
    cls = model_class_for(config)
    if cls is None:
        return _PASSTHROUGH
    arch = cls.__name__
    try:
        model = skeleton(cls, config)
    except MappingError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' own error, re-raised typed with the architecture
        if not _may_convert(config, arch):
            logger.debug("%s: not built (%s); transformers declares no conversion for it", arch, e)
            return _PASSTHROUGH
        raise MappingError(
            f"{arch}: transformers cannot build the model from config.json to find the layout save_pretrained "
            f"writes ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); fix config.json"
        ) from e
    conversions = reverse_conversions(model)  # what revert_weight_conversion reverses for it
    if not conversions:
        return _PASSTHROUGH
    _check_operations(conversions, arch)
    from transformers.core_model_loading import revert_weight_conversion

    symbolic = {
        name: _Symbolic(torch.empty(spec.shape, dtype=spec.dtype, device="meta"), _Leaf(name))
        for name, spec in specs.items()
    }
    try:
        model._weight_conversions = conversions  # exactly these, as for a model built from scratch
        reverted = revert_weight_conversion(model, symbolic)
    except MappingError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' own error, re-raised typed with the architecture
        raise MappingError(f"{arch}: transformers' reverse weight conversion failed on this checkpoint: {e}") from e
    recipes: dict[str, Any] = {}
    out_specs: dict[str, TensorSpec] = {}
    for name, tensor in reverted.items():
        if not isinstance(tensor, _Symbolic):
            raise MappingError(f"{arch}: the reverse conversion of {name} made a tensor hf_merge cannot trace")
        for call in _calls(tensor._recipe):
            if call.func not in REPLAYABLE_CALLS:
                raise MappingError(
                    f"{arch}: saving {name} uses the torch call {call.func}, which hf_merge does not replay; report it"
                )
        recipes[name] = tensor._recipe
        out_specs[name] = TensorSpec(name, tuple(tensor.shape), tensor.dtype)
    if all(isinstance(r, _Leaf) and r.name == n for n, r in recipes.items()) and len(recipes) == len(specs):
        return _PASSTHROUGH
    return arch, recipes, out_specs


def check_legacy_experts(specs: dict[str, TensorSpec], config: dict[str, Any]) -> None:
    """transformers 4.x: refuse expert tensors its model does not have (a checkpoint trained under
    transformers 5, which holds MoE experts fused: ``mlp.experts.gate_up_proj [E, 2F, H]``).

    4.x has no conversion to write them per expert, and its ``from_pretrained`` ignores names it does
    not know, so written as they are they would load as a model whose experts are left random. Only
    3-D tensors under ``.experts.`` are looked at (GPT-OSS holds its experts fused in 4.x too: those
    fit), so dense merges build no skeleton. Nothing to do under transformers 5.
    """
    if has_weight_conversions():
        return
    fused = [n for n, s in specs.items() if ".experts." in n and len(s.shape) == 3]
    if not fused:
        return
    cls = model_class_for(config)
    if cls is None:  # custom code: nothing of transformers' to compare with
        return
    try:
        have = {n: tuple(t.shape) for n, t in skeleton(cls, config).state_dict().items()}
    except MappingError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' own error, re-raised typed with the architecture
        raise MappingError(f"{cls.__name__}: transformers cannot build the model from config.json ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''}); fix config.json") from e
    unknown = [n for n in fused if have.get(n) != tuple(specs[n].shape)]
    if unknown:
        import transformers

        shown = ", ".join(unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        raise MappingError(
            f"{cls.__name__}: the checkpoint holds {len(unknown)} fused expert tensor(s) that transformers "
            f"{transformers.__version__} does not have ({shown}); it was trained under transformers 5, which holds "
            f"MoE experts fused, and {transformers.__version__} cannot write them per expert: merge or load it "
            "with transformers>=5 (pip install 'transformers>=5')"
        )


def _legacy_plan(specs: dict[str, TensorSpec], config: dict[str, Any]):
    """transformers 4.x: MoE experts are held as saved; only a VLM's prefixes are renamed, as that
    release's ``save_pretrained`` does (:func:`hf_merge.transformers_compat.legacy_saved_names`)."""
    cls = model_class_for(config)
    if cls is None:
        return _PASSTHROUGH
    try:
        table = legacy_saved_names(cls, list(specs))
    except ValueError as e:
        raise MappingError(f"{cls.__name__}: save_pretrained's renaming of this checkpoint clashes ({e}); report it") from e
    if not table:
        return _PASSTHROUGH
    recipes = {saved: _Leaf(name) for saved, name in table.items()}
    return cls.__name__, recipes, {saved: specs[name].renamed(saved) for saved, name in table.items()}


# --------------------------------------------------------------------------------------------
# Plans as JSON (the plan cache): recipes are trees of leaves, replayable calls and plain values
# --------------------------------------------------------------------------------------------

_TORCH_NAMESPACE_CALLS = frozenset({"cat", "concat", "concatenate", "stack"})  # the rest are Tensor methods


class _NotEncodable(Exception):
    pass


def _encode(value: Any) -> Any:
    if isinstance(value, _Leaf):
        return {"leaf": value.name}
    if isinstance(value, _Call):
        return {"call": value.func, "args": [_encode(a) for a in value.args],
                "kwargs": [[k, _encode(v)] for k, v in value.kwargs], "index": value.index}
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list": [_encode(v) for v in value]}
    if isinstance(value, slice):
        return {"slice": [_encode(value.start), _encode(value.stop), _encode(value.step)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise _NotEncodable(type(value).__name__)


def _decode(value: Any, specs: dict[str, TensorSpec]) -> Any:
    if not isinstance(value, dict):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise ValueError(f"unexpected {type(value).__name__}")
    if "leaf" in value:
        if value["leaf"] not in specs:
            raise ValueError(f"no source tensor {value['leaf']}")
        return _Leaf(value["leaf"])
    if "call" in value:
        func = value["call"]
        if func not in REPLAYABLE_CALLS:  # only the calls hf_merge replays, by name: nothing else resolves
            raise ValueError(f"call {func!r} is not replayable")
        fn = getattr(torch, func) if func in _TORCH_NAMESPACE_CALLS else getattr(torch.Tensor, func)
        index = value["index"]
        if index is not None and not isinstance(index, int):
            raise ValueError("bad index")
        args = tuple(_decode(a, specs) for a in value["args"])
        kwargs = tuple((str(k), _decode(v, specs)) for k, v in value["kwargs"])
        return _Call(func, fn, args, kwargs, index)
    for kind, make in (("tuple", tuple), ("list", list)):
        if kind in value:
            return make(_decode(v, specs) for v in value[kind])
    if "slice" in value:
        return slice(*(_decode(v, specs) for v in value["slice"]))
    raise ValueError("unknown node")


def _encode_plan(arch: str, recipes: dict[str, Any], out_specs: dict[str, TensorSpec], spans: dict[str, "_Span"],
                 storages: dict[str, tuple[str, int]]) -> Any:
    """The plan as JSON: an output that is a contiguous range of one source (the per-expert
    splits) as just ``{"span": [source, offset]}``, any other as its recipe; then, for a view,
    the storage it views (:meth:`HubLayout.storages`)."""
    outputs = []
    try:
        for name, spec in out_specs.items():
            span = spans.get(name)
            how = {"span": [span.source, span.offset]} if span is not None else _encode(recipes[name])
            storage = [list(storages[name])] if name in storages else []
            outputs.append([name, list(spec.shape), dtype_name(spec.dtype), how, *storage])
    except _NotEncodable as e:
        logger.debug("%s: plan not cached (a recipe holds a %s)", arch, e)
        return None
    return {"architecture": arch, "outputs": outputs}


def _span_recipe(span: "_Span", shape: tuple[int, ...], numel: int) -> _Call:
    """The recipe of a stored span: the flat range of the source, viewed in the output's shape
    (the same bytes as the views it was computed from, which land on exactly that range)."""
    flat = _Call("reshape", torch.Tensor.reshape, (_Leaf(span.source), -1), (), None)
    cut = _Call("narrow", torch.Tensor.narrow, (flat, 0, span.offset, numel), (), None)
    return _Call("view", torch.Tensor.view, (cut, shape), (), None)


def _decode_plan(stored: Any, specs: dict[str, TensorSpec]):
    """A stored plan ``(architecture, recipes, output specs, spans, storages)``, checked (its sources
    exist and hold its spans, its calls are replayable, its storages are outputs' and hold them),
    :data:`_PASSTHROUGH`, or None (a miss)."""
    if not isinstance(stored, dict):
        return None
    if layout_cache.is_passthrough(stored):
        return _PASSTHROUGH
    try:
        arch = str(stored["architecture"])
        recipes: dict[str, Any] = {}
        out_specs: dict[str, TensorSpec] = {}
        spans: dict[str, _Span] = {}
        storages: dict[str, tuple[str, int]] = {}
        for name, shape, dtype, how, *storage in stored["outputs"]:
            spec = TensorSpec(str(name), tuple(int(n) for n in shape), parse_dtype(dtype))
            if storage:
                (owner, numel), = storage
                storages[spec.name] = (str(owner), int(numel))
                if int(numel) < spec.numel:
                    raise ValueError(f"storage of {name} smaller than it")
            if isinstance(how, dict) and "span" in how:
                source, offset = str(how["span"][0]), int(how["span"][1])
                if source not in specs or not 0 <= offset <= specs[source].numel - spec.numel:
                    raise ValueError(f"span of {name} outside {source}")
                spans[name] = _Span(source, offset)
                recipes[name] = _span_recipe(spans[name], spec.shape, spec.numel)
            else:
                recipes[name] = _decode(how, specs)
            out_specs[name] = spec
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        logger.debug("plan cache: stored Hub layout ignored (%s)", e)
        return None
    problem = _check_plan(recipes, out_specs, spans, specs)
    if problem is None and any(owner not in out_specs for owner, _ in storages.values()):
        problem = "a storage named after no output"
    if problem is not None:
        logger.debug("plan cache: stored Hub layout ignored (%s)", problem)
        return None
    return arch, recipes, out_specs, spans, storages


def _check_plan(recipes: dict[str, Any], out_specs: dict[str, TensorSpec], spans: dict[str, "_Span"],
                specs: dict[str, TensorSpec]) -> str | None:
    """Why a plan is not one of the model it is used for, or None. What transformers' reverse
    conversions do (renames and bijective data moves: splits, concatenations, transposes):

    - a renamed tensor keeps its shape and dtype, and a source whose own name is also an output
      keeps it (``lm_head.weight`` is never written as ``model.embed_tokens.weight``);
    - any other output has the shape and dtype its recipe gives on the sources (meta tensors);
    - every source is used, and the outputs hold exactly the sources' elements: the ranges of one
      source (per-expert splits) do not overlap and cover it.
    """
    used: dict[str, list[tuple[int, int]]] = {}  # source -> the element ranges outputs take of it
    mixed: set[str] = set()  # sources an arbitrary recipe reads (cat, transpose...): no ranges to check
    for name, spec in out_specs.items():
        recipe = recipes[name]
        span = spans.get(name)
        if isinstance(recipe, _Leaf):
            source = specs[recipe.name]
            if (source.shape, source.dtype) != (spec.shape, spec.dtype):
                return f"{name}: {spec.shape} {spec.dtype} from {recipe.name} {source.shape} {source.dtype}"
            if recipe.name != name and recipe.name in out_specs:
                return f"{name} is taken from {recipe.name}, which the plan writes under its own name too"
            used.setdefault(recipe.name, []).append((0, spec.numel))
        elif span is not None:
            if specs[span.source].dtype != spec.dtype:
                return f"{name}: {spec.dtype} from {span.source} {specs[span.source].dtype}"
            used.setdefault(span.source, []).append((span.offset, span.offset + spec.numel))
        else:
            try:
                out = _replay(recipe, lambda n: torch.empty(specs[n].shape, dtype=specs[n].dtype, device="meta"))
            except (RuntimeError, TypeError, ValueError, IndexError) as e:
                return f"{name}: its recipe does not run on the sources ({e})"
            if not isinstance(out, torch.Tensor) or (tuple(out.shape), out.dtype) != (spec.shape, spec.dtype):
                return f"{name}: its recipe does not give {spec.shape} {spec.dtype}"
            for leaf in set(_leaves(recipe)):
                used.setdefault(leaf, [])
                mixed.add(leaf)
    if set(used) != set(specs):
        return f"sources not used: {sorted(set(specs) - set(used))[:3]}"
    if sum(s.numel for s in out_specs.values()) != sum(s.numel for s in specs.values()):
        return "the outputs do not hold exactly the sources' elements"
    for source, ranges in used.items():
        if source not in mixed and not _tiles(sorted(ranges), specs[source].numel):
            return f"the outputs of {source} overlap or leave part of it out"
    return None


def _tiles(ranges: list[tuple[int, int]], numel: int) -> bool:
    """Whether sorted ``[start, stop)`` ranges cover ``[0, numel)`` exactly, end to end."""
    at = 0
    for start, stop in ranges:
        if start != at:
            return False
        at = stop
    return at == numel
