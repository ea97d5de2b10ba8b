"""No import circles in hf_merge: the graph of every ``import`` in the package, the ones inside
functions included (a lazy import is still a dependency: it only hides the circle until the call),
must have no cycle. ``if TYPE_CHECKING:`` blocks are left out (they never run)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_merge"


def _modules(package: Path) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(module: str, path: Path, node: ast.AST, known: dict[str, Path]) -> set[str]:
    """The package's modules an import statement loads (``from x import y``: ``x.y`` when it is a module)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if node.level:
        base = module.split(".")[: len(module.split(".")) - (node.level - (path.name == "__init__.py"))]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    found = {f"{name}.{a.name}" if f"{name}.{a.name}" in known else name for a in node.names}
    return found & set(known)


def _statements(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _statements(node.orelse)
            continue
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.stmt, ast.excepthandler)):
                yield from _statements([child] if isinstance(child, ast.stmt) else child.body)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    known = _modules(package)
    graph = {}
    for module, path in known.items():
        deps = set()
        for node in _statements(ast.parse(path.read_text()).body):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _imported(module, path, node, known)
        graph[module] = deps - {module}
    return graph


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "hf_merge.gguf.convert" in graph["hf_merge.merging"]  # the walk sees lazy imports
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' imports '.join(reversed(e.args[1]))}") from None


def test_every_module_compiles_without_a_warning():
    """An invalid escape in a docstring (``\\ s``) is a SyntaxWarning at byte-compile time from Python 3.12
    on, printed to users when pip or the first import compiles the module."""
    import warnings

    for path in sorted(PACKAGE.rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_bytes(), str(path), "exec")
