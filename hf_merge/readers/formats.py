"""The registry of source formats: one module per format, found in one place.

A format is a module under :mod:`hf_merge.readers` that defines a module-level ``FORMAT``
(:class:`SourceFormat`). Adding a format means adding that one file: ``open_checkpoint``,
auto-detection, ``inspect``, the CLI's ``--backend`` choices and help, the CLI's reader options,
and the provenance label all read this registry.

A format has one name (``SourceFormat.name``): what users type after ``--backend``, and what
``CheckpointInfo.format``, ``hf_merge.json``'s ``source.format``, the model card, ``inspect`` and
error messages say. Older spellings are ``aliases``, accepted on input (``--backend``,
``open_checkpoint(backend=...)``, an old ``hf_merge.json`` read by the card) and turned into the name
by :func:`canonical`. docs/formats.md lists them.

Contract of a format:

- ``probe(path) -> bool`` is cheap and safe: it looks at file names and small JSON / text files
  only, never unpickles or reads tensor data, and never raises for an ordinary folder (it answers
  True for a folder that is clearly of its format but broken, so that ``open`` can say what is
  wrong).
- ``marks`` are the names without which the probe cannot answer True: paths relative to the folder
  given, ``/``-separated, each part a name or an ``fnmatch`` pattern (``*/model_world_size_*.pt``).
  :func:`detect` imports and probes a format only when one of its marks names something there (or
  a folder could not be listed, or it declares none), so a plain verl FSDP folder imports one
  reader, not all. A mark may match more than the probe accepts, never less: a test walks every
  fixture folder and checks that no probe answers True where the marks say no.
- ``open(path, *, config_dir=None, **options) -> LazyCheckpoint`` opens it; ``options`` are the
  names listed in ``SourceFormat.options`` (others are not passed).
- ``priority`` breaks ties when several probes match (lower wins); the others are reported in a
  note so the user can pick one with ``--backend``. A ``generic`` format is the exception: named
  by ``--backend``, it still refuses a folder that a more specific format opens (it would keep
  that framework's names, which no Hugging Face model loads).
- ``cli`` declares the command-line options of the format's reader options (:class:`CliOption`);
  merge and inspect add them (:mod:`hf_merge.cli._formats`), so a format's options are written
  in its own module only.
- ``name``, ``description``, ``priority``, ``aliases``, ``cli``, ``hf_folder`` and ``marks`` are
  written as literals in the ``FORMAT = SourceFormat(...)`` statement:
  :func:`declared` reads them from the module's source without importing it (readers import
  torch, ~1.5 s), so ``--help``, the ``--backend`` choices and argument checks cost nothing.
  A test keeps :func:`declared` and :func:`registry` equal. :func:`get_format` imports only the
  module of the format asked for; :func:`registry` imports them all (tests, listings).
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib
import os
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..checkpoint import LazyCheckpoint
    from ..errors import HfMergeError


@dataclass(frozen=True)
class CliOption:
    """A command-line option for one of a format's reader options: ``flag`` sets ``open(dest=...)``."""

    flag: str  # "--tag"
    dest: str  # the open() keyword, one of SourceFormat.options
    help: str
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class SourceFormat:
    """A checkpoint format hf_merge reads (see the module docstring for the contract)."""

    name: str  # the one name: --backend value, CheckpointInfo.format, provenance source.format
    description: str  # one line, for --help and inspect
    probe: Callable[[Path], bool]
    open: Callable[..., "LazyCheckpoint"]
    options: frozenset[str] = field(default_factory=frozenset)  # keyword options open() accepts
    priority: int = 100
    framework: str | None = None  # "verl", "deepspeed", ... for the model card's tags
    aliases: tuple[str, ...] = ()  # older spellings, accepted on input
    cli: tuple[CliOption, ...] = ()  # the CLI options of some of ``options``
    hf_folder: bool = False  # the source is a Hugging Face model folder already: nothing is un-sharded
    marks: tuple[str, ...] = ()  # what makes a folder a candidate for the probe (see the module docstring)
    # reads any folder of its container format under the names it holds (generic DCP): named by
    # --backend, it refuses a folder that a more specific format reads (see open_source)
    generic: bool = False

    def __post_init__(self) -> None:
        stray = [o.dest for o in self.cli if o.dest not in self.options]
        if stray:
            raise ValueError(f"format {self.name!r}: CLI options {stray} set no option open() accepts")


@dataclass(frozen=True)
class Declared:
    """A format's literal fields, read from its module's source (no import)."""

    name: str
    description: str
    priority: int
    module: str
    aliases: tuple[str, ...] = ()
    cli: tuple[CliOption, ...] = ()
    hf_folder: bool = False
    marks: tuple[str, ...] = ()


_LITERAL_DEFAULTS = {
    "priority": 100, "aliases": (), "cli": (), "hf_folder": False, "marks": (),
}


def _literal(node: ast.AST) -> Any:
    """A literal, or a tuple of ``CliOption(...)`` calls with literal arguments."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "CliOption":
        return CliOption(*map(_literal, node.args), **{kw.arg: _literal(kw.value) for kw in node.keywords})
    if isinstance(node, ast.Tuple):
        return tuple(_literal(e) for e in node.elts)
    return ast.literal_eval(node)


_FORMAT_LINE = re.compile(r"^FORMAT\s*=", re.MULTILINE)


def _top_level_from_format(text: str) -> list[ast.stmt]:
    """The module's top-level statements from its last line ``FORMAT = ...`` on (none without one):
    parsing a reader's tail, not its ~700 lines, keeps ``--help`` at a few milliseconds."""
    starts = [m.start() for m in _FORMAT_LINE.finditer(text)]
    if not starts:
        return []
    try:
        return ast.parse(text[starts[-1]:]).body
    except SyntaxError:  # the tail is not a statement on its own (a string holding the line): the whole file
        return ast.parse(text).body


@functools.cache
def declared() -> tuple[Declared, ...]:
    """Every reader module's ``FORMAT`` literals, in priority order, without importing a reader."""
    from .. import readers

    found = []
    for mod in pkgutil.iter_modules(readers.__path__):
        path = Path(readers.__path__[0]) / f"{mod.name}.py"
        if not path.is_file():
            continue
        for node in _top_level_from_format(path.read_text(encoding="utf-8")):
            if not (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["FORMAT"]):
                continue
            fields = {kw.arg: kw.value for kw in getattr(node.value, "keywords", [])}
            literals = {k: _literal(fields[k]) if k in fields else default for k, default in _LITERAL_DEFAULTS.items()}
            found.append(Declared(
                name=ast.literal_eval(fields["name"]),
                description=ast.literal_eval(fields["description"]),
                module=f"{readers.__name__}.{mod.name}",
                **literals,
            ))
    names = [d.name for d in found]
    if len(set(names)) != len(names):
        raise RuntimeError(f"two source formats share a name: {sorted(names)}")
    return tuple(sorted(found, key=lambda d: (d.priority, d.name)))


def load(found: Declared) -> SourceFormat:
    """The format ``found`` declares: imports its reader module (once)."""
    fmt = getattr(importlib.import_module(found.module), "FORMAT", None)
    if not isinstance(fmt, SourceFormat) or fmt.name != found.name:
        raise RuntimeError(f"{found.module}.FORMAT is not the SourceFormat {found.name!r} its source declares")
    return fmt


def registry() -> dict[str, SourceFormat]:
    """Every format, by name, in priority order. Imports every reader module: to open or probe one
    format, :func:`get_format` and :func:`detect` import only what they need."""
    return {d.name: load(d) for d in declared()}


def reader_options() -> frozenset[str]:
    """Every keyword option some format's ``open()`` accepts (DeepSpeed's ``tag``, ...); imports every reader."""
    return frozenset().union(*(fmt.options for fmt in registry().values()))


def format_names() -> list[str]:
    """The format names (``--backend`` values), in priority order; imports no reader."""
    return [d.name for d in declared()]


def find_declared(name: str) -> Declared | None:
    """The format called ``name`` or one of its aliases, None if none is; imports no reader."""
    for d in declared():
        if name == d.name or name in d.aliases:
            return d
    return None


def canonical(name: str) -> str:
    """The format's name for ``name`` (itself, or the name it is an alias of; ``auto`` stays).
    Refuses an unknown name with the list of known ones; imports no reader."""
    from ..errors import UnsupportedCheckpointError

    if name == "auto":
        return name
    found = find_declared(name)
    if found is None:
        raise UnsupportedCheckpointError(f"unknown format {name!r}; use one of: auto, {', '.join(format_names())}")
    return found.name


def check_name(name: str) -> None:
    """Refuse an unknown format name (``auto`` and aliases are fine); imports no reader."""
    canonical(name)


def get_format(name: str) -> SourceFormat:
    """The format called ``name`` (or an alias of it); imports its reader module only."""
    fmt = find_format(canonical(name))
    if fmt is None:  # "auto" names no format
        raise KeyError(name)
    return fmt


def find_format(name: str | None) -> SourceFormat | None:
    """The format called ``name`` (or an alias of it), None if none is; imports its reader module only."""
    found = find_declared(name) if name else None
    return load(found) if found is not None else None


def is_hf_folder(name: str | None) -> bool:
    """Whether format ``name`` (a name or alias; None or unknown: no) reads Hugging Face folders as they are."""
    found = find_declared(name) if name else None
    return found is not None and found.hf_folder


@dataclass(frozen=True)
class Detection:
    """What auto-detection saw: the chosen format and every format whose probe matched."""

    chosen: SourceFormat
    matched: tuple[str, ...]

    @property
    def note(self) -> str | None:
        others = [m for m in self.matched if m != self.chosen.name]
        if not others:
            return None
        return (
            f"this folder also looks like {', '.join(others)}; read as {self.chosen.name} "
            f"(pass --backend {others[0]} to read it as {others[0]})"
        )


def detect(path: "str | Path") -> Detection:
    """Which format reads ``path``: every format whose marks are there is probed, the best match wins.

    Raises:
        SourceNotFoundError: ``path`` does not exist.
        UnsupportedCheckpointError: no format matches; the message says what the folder holds.
    """
    return _detect(Path(path), hint=True)


def candidates(path: Path) -> list[Declared]:
    """The formats whose marks are at ``path``, in priority order: those :func:`detect` probes
    (imports no reader)."""
    listings = _Listings()
    return [d for d in declared() if listings.marked(path, d.marks)]


def _detect(path: Path, *, hint: bool) -> Detection:
    from ..errors import SourceNotFoundError, UnsupportedCheckpointError

    if not path.exists():
        raise SourceNotFoundError(f"{path} does not exist; pass the checkpoint folder")
    matched = [fmt for fmt in map(load, candidates(path)) if _probe(fmt, path)]
    if matched:
        return Detection(chosen=matched[0], matched=tuple(f.name for f in matched))
    empty = path.is_dir() and not any(path.iterdir())
    instead = _saved_before(path) if hint else ""
    if instead:  # a verl step folder that a save cut short: which step to pass
        error = SourceNotFoundError if empty else UnsupportedCheckpointError
        raise error(f"{path} {'is empty' if empty else f'is not a checkpoint ({_what_is_there(path)})'}; {instead}")
    if empty:
        raise SourceNotFoundError(f"{path} is empty; pass the checkpoint folder (it reads: {', '.join(format_names())})")
    raise UnsupportedCheckpointError(
        f"{path} is not a checkpoint hf-merge recognises ({_what_is_there(path)}); "
        f"it reads: {', '.join(format_names())} (see `hf-merge merge --help`)"
    )


_STEP_DIR = re.compile(r"^global_step_([0-9]{1,18})$")


def _saved_before(path: Path) -> str:
    """For a verl ``global_step_N`` folder (or its ``actor/`` / ``critic/``) that no format reads, most
    likely a save cut short: the newest earlier step that one reads, as what to pass ("" if none)."""
    step = path if _STEP_DIR.match(path.name) else path.parent
    if not ((m := _STEP_DIR.match(step.name)) and (step == path or path.name in ("actor", "critic"))):
        return ""
    try:
        earlier = sorted(((int(k.group(1)), p) for p in step.parent.iterdir()
                          if (k := _STEP_DIR.match(p.name)) and int(k.group(1)) < int(m.group(1)) and p.is_dir()), reverse=True)
    except OSError:
        return ""
    for n, p in earlier:
        try:
            _detect(p, hint=False)
        except Exception:  # noqa: BLE001 - not a checkpoint, or a broken one: not what to pass instead
            continue
        return (f"{step.name} looks empty or incomplete (a run stopped while saving it?); the newest step before it "
                f"that is a checkpoint is global_step_{n}: pass {p} to merge it")
    return ""


def _probe(fmt: SourceFormat, path: Path) -> bool:
    try:
        return bool(fmt.probe(path))
    except (OSError, ValueError):  # unreadable or undecodable files: not this format (its open() would say why)
        return False


class _Listings:
    """Whether a folder holds any of a format's marks; each folder listed once per detection."""

    def __init__(self) -> None:
        self._names: dict[str, list[tuple[str, bool]]] = {}

    def marked(self, path: Path, marks: tuple[str, ...]) -> bool:
        if not marks:
            return True  # a format that declares no marks is always probed
        try:
            return any(self._holds(str(path), mark.split("/")) for mark in marks)
        except OSError:  # a folder that cannot be listed: the probe decides (it may call it broken)
            return True

    def _holds(self, folder: str, parts: list[str]) -> bool:
        first, rest = parts[0], parts[1:]
        for name, is_dir in self._entries(folder):
            if fnmatch.fnmatchcase(name, first) and (not rest or (is_dir and self._holds(os.path.join(folder, name), rest))):
                return True
        return False

    def _entries(self, folder: str) -> list[tuple[str, bool]]:
        if folder not in self._names:
            try:
                with os.scandir(folder) as it:
                    self._names[folder] = [(e.name, e.is_dir()) for e in it]
            except (FileNotFoundError, NotADirectoryError):  # other errors: marked() says "probe it"
                self._names[folder] = []
        return self._names[folder]


def _what_is_there(path: Path, limit: int = 6) -> str:
    if not path.is_dir():
        return "a file" if path.is_file() else "not a folder"
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    except OSError as e:
        return f"unreadable: {e.strerror}"
    if not names:
        return "empty folder"
    shown = ", ".join(names[:limit])
    return f"holds {shown}{f' and {len(names) - limit} more' if len(names) > limit else ''}"


def open_source(path: Path, name: str, config_dir: Path | None, options: dict[str, Any]) -> "LazyCheckpoint":
    """Open ``path`` with format ``name`` (``auto``: detect), passing only the options it takes."""
    from ..errors import HfMergeError
    from .contained import reading

    notes: list[str] = []
    with reading(path):  # files leaving the checkpoint through a symlink are refused
        if name == "auto":
            detection = detect(path)
            fmt = detection.chosen
            if detection.note:
                notes.append(detection.note)
        else:
            fmt = get_format(name)
        given = {k: v for k, v in options.items() if v is not None}
        try:
            ckpt = fmt.open(path, config_dir=config_dir, **{k: v for k, v in given.items() if k in fmt.options})
        except HfMergeError as e:
            hinted = _with_others(e, detection) if name == "auto" else _with_detected(e, path, fmt.name)
            if hinted is e:
                raise
            raise hinted from e
        if name != "auto" and fmt.generic:
            _refuse_claimed(ckpt, path, fmt, config_dir, given)
    ckpt.info.reader = fmt.name
    ckpt.info.notes[:0] = notes + _unused_option_notes(fmt, given)
    return ckpt


def _unused_option_notes(fmt: SourceFormat, given: dict[str, Any]) -> list[str]:
    """One note per reader option given that ``fmt`` does not take (``--tag`` on a DCP folder)."""
    notes = []
    for option in sorted(set(given) - set(fmt.options)):
        if option == "is_value_model" and given[option] is False:
            continue
        flag = "--" + option.replace("_", "-")
        if option == "is_value_model":
            notes.append(f"{flag} changes nothing here: {fmt.name} checkpoints hold a critic's tensors under their "
                         "Hugging Face names already")
            continue
        owners = [d.name for d in declared() if any(o.dest == option for o in d.cli)]
        notes.append(f"{flag} changes nothing here: the {fmt.name} reader takes no such option"
                     + (f" ({', '.join(owners)} does)" if owners else ""))
    return notes


def _refuse_claimed(ckpt: "LazyCheckpoint", path: Path, asked: SourceFormat, config_dir: Path | None,
                    options: dict[str, Any]) -> None:
    """Close ``ckpt`` and refuse when a more specific format than the generic ``asked`` reads ``path``
    (as ``--backend auto`` would: its probe matches first, or ``asked``'s does not match at all) and
    opens it: that format's names are not Hugging Face names. One that fails to open (a plain DCP
    folder in a ``step-N`` folder is no torchtitan step) leaves ``asked`` to read it."""
    from ..errors import UnsupportedCheckpointError

    own = _probe(asked, path)
    for other in map(load, candidates(path)):
        if other.generic or (own and other.priority >= asked.priority) or not _probe(other, path):
            continue
        try:
            other.open(path, config_dir=config_dir, **{k: v for k, v in options.items() if k in other.options}).close()
        except Exception:  # noqa: BLE001 - it does not read this folder, whatever the reason: asked reads it
            continue
        ckpt.close()
        raise UnsupportedCheckpointError(
            f"{path} is in the {other.name} format, not {asked.name}: pass --backend {other.name} or leave --backend out "
            f"({asked.name} would keep its {other.name} tensor names, which no Hugging Face model loads)"
        )


def _with_others(error: "HfMergeError", detection: Detection) -> "HfMergeError":
    """``error`` of the format detection chose, when the folder's names or layout are not that
    format's and another format's probe matched too: the same error, naming the other format (a
    plain DCP folder saved as ``step-N`` looks like a torchtitan step)."""
    from ..errors import MappingError, UnsupportedCheckpointError

    others = [m for m in detection.matched if m != detection.chosen.name]
    if not others or type(error) not in (MappingError, UnsupportedCheckpointError):
        return error
    return type(error)(f"{error} (this folder also looks like {', '.join(others)}: pass --backend {others[0]} if it "
                       f"is not a {detection.chosen.name} checkpoint)")


def _with_detected(error: "HfMergeError", path: Path, asked: str) -> "HfMergeError":
    """``error`` of a format named by ``--backend``; where detection finds another format in ``path``,
    the same error with what to pass instead (a reader knows only what it missed)."""
    from ..errors import HfMergeError

    try:
        found = detect(path).chosen.name
    except (HfMergeError, OSError):
        return error
    if found == asked:
        return error
    said = re.split(r"\. (?=[A-Z])", str(error), maxsplit=1)[0]  # what it missed; not its advice, which is for its own format
    hint = f"{path} is in the {found} format, not {asked}: pass --backend {found} or leave --backend out ({asked}: {said})"
    try:
        return type(error)(hint)
    except TypeError:  # an error class that takes other arguments: left as it is
        return error
