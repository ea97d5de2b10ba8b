"""The default ``max_shard_size``: the one of the installed transformers' ``save_pretrained``.

``PreTrainedModel.save_pretrained`` shards at "50GB" in transformers 5.x and at "5GB" in 4.57, and
verl's merger calls it with that default. A merge given no ``--max-shard-size`` / ``max_shard_size=``
cuts its files where the installed transformers would, so the value is read from
``save_pretrained``'s signature, never from a table of versions:

- when ``transformers.modeling_utils`` is already imported: :func:`inspect.signature`;
- otherwise from its source (the syntax tree of the ``def`` line and its parameters, nothing
  executed): importing it costs about 1.5 s of CPU, and a dense merge imports no transformers
  (nor does the CLI's torch-free head start, :mod:`hf_merge.write.head_start`);
- a source of another shape: the import and :func:`inspect.signature` after all.

The same source says whether ``save_pretrained`` writes ``total_parameters`` into the index's
metadata (:func:`index_counts_parameters`: 4.57 and 5.x do, 4.51 does not).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path

__all__ = ["default_from_source", "default_from_transformers_source", "default_max_shard_size", "index_counts_parameters"]

_PARAMETER = "max_shard_size"


@functools.lru_cache(maxsize=1)
def default_max_shard_size() -> "int | str":
    """``save_pretrained``'s default ``max_shard_size`` in the installed transformers (``"50GB"`` in 5.x)."""
    loaded = sys.modules.get("transformers.modeling_utils")
    if loaded is None:
        found = default_from_transformers_source()
        if found is not None:
            return found
        import transformers.modeling_utils as loaded
    return inspect.signature(loaded.PreTrainedModel.save_pretrained).parameters[_PARAMETER].default


@functools.lru_cache(maxsize=1)
def _modeling_source() -> "str | None":
    """The installed transformers' ``modeling_utils.py`` (read, nothing imported), or None."""
    spec = importlib.util.find_spec("transformers")  # the package's location; nothing is imported
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return (Path(next(iter(spec.submodule_search_locations))) / "modeling_utils.py").read_text(encoding="utf-8")
    except OSError:
        return None


def default_from_transformers_source() -> "int | str | None":
    """The default read from the installed transformers' ``modeling_utils.py`` (nothing imported), or None."""
    text = _modeling_source()
    return None if text is None else default_from_source(text)


def index_counts_parameters() -> bool:
    """Whether the installed ``save_pretrained`` writes ``"total_parameters"`` into a sharded
    index's metadata (the key appears in its module's source; True where the source is unreadable)."""
    text = _modeling_source()
    return text is None or '"total_parameters"' in text


def default_from_source(text: str) -> "int | str | None":
    """The literal default of ``max_shard_size`` in ``PreTrainedModel.save_pretrained`` of the
    module source ``text``, or None when it is not found there as a literal."""
    cls = text.find("\nclass PreTrainedModel(")
    start = text.find("\n    def save_pretrained(", cls) if cls >= 0 else -1
    if start < 0:
        return None
    lines = text[start + 1 :].splitlines()
    for n in range(1, min(len(lines), 100) + 1):  # the signature ends at the first prefix that parses
        try:
            tree = ast.parse(textwrap.dedent("\n".join(lines[:n])) + "\n    pass\n")
        except SyntaxError:
            continue
        func = tree.body[0]
        if not isinstance(func, ast.FunctionDef):
            return None
        args = func.args
        positional = args.posonlyargs + args.args
        defaults = dict(zip([a.arg for a in positional[len(positional) - len(args.defaults) :]], args.defaults))
        defaults.update((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None)
        node = defaults.get(_PARAMETER)
        try:
            value = ast.literal_eval(node) if node is not None else None
        except ValueError:
            return None
        return value if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    return None
