#!/usr/bin/env python
"""How many hf_merge modules a plain merge walks through, the import circles, the write wing's size.

    PYTHONPATH=/work/proof-base python benchmarks/module_trace.py --tree /work/proof-base \\
        --source /work/bench/identity/fsdp_qwen2_fp32_ws2/ckpt/global_step_1/actor

Three reports, each a table:

1. Trace (needs ``--source``, a verl FSDP actor folder): ``hf-merge merge SOURCE OUT`` runs in
   this process (``hf_merge.cli.app``'s parser, then the merge command's ``run(args)`` under
   ``sys.setprofile`` / ``threading.setprofile``; processes it forks are not traced). Counted from
   ``run`` on: the hf_merge modules whose functions are entered (module-level code run by a lazy
   import is listed apart), and the *moves*: calls from a function of one hf_merge module into a
   function of another (the nearest hf_merge caller on the same thread). A move *climbs back up*
   when the module it enters is already on that thread's stack below the caller (a callback into a
   module that is still running). Distinct moves (caller -> callee pairs) and every call are
   counted (calls made by the import system, i.e. an import hook, are not moves); so are the moves against the import direction (the callee's module imports the
   caller's, directly or not, module- or function-level, and not the other way: a call back up).
2. Import circles: the static import graph of ``TREE/hf_merge`` (``ast``; ``from . import x`` of a
   submodule is an edge to it; an import from a package above the importer, e.g. ``from . import
   __version__``, is no edge: that package is always initialised first). Module-level imports (outside functions, not under
   ``if TYPE_CHECKING``) and function-level imports are reported apart: the strongly connected
   components with more than one module, and every simple cycle (up to ``--max-cycles``).
3. Write-wing lines: per file of ``--wing`` (default: the write side's files, missing ones
   skipped), all lines (``wc -l``) and code lines (not blank, not comments, not docstrings).

Run it with ``PYTHONPATH=TREE`` so the tree's hf_merge is the one traced (checked at start).
"""

from __future__ import annotations

import argparse
import ast
import collections
import inspect
import io
import shutil
import sys
import tempfile
import threading
import tokenize
from pathlib import Path

# From the plan to bytes on disk, head start included (issue 27's write wing). Before the redesign
# these were flat modules (writer ... head_start); since, the rooms' files. A tree counts the ones it has.
WING = ["writer", "sequential", "copypool", "following", "filemap", "plan", "head_start",
        "write/plan", "write/shards", "write/engine", "readers/file_runs", "write/head_start"]


# ------------------------------------------------------------------------------------------------
# 1. trace
# ------------------------------------------------------------------------------------------------


class Tracer:
    def __init__(self) -> None:
        self.entered: collections.Counter[str] = collections.Counter()  # module -> function calls
        self.imported: set[str] = set()  # module-level code run during the trace
        self.moves: collections.Counter[tuple[str, str]] = collections.Counter()
        self.climbs: collections.Counter[tuple[str, str]] = collections.Counter()
        self.hooks: collections.Counter[str] = collections.Counter()  # calls made by the import system
        self.local = threading.local()
        self.lock = threading.Lock()

    def profile(self, frame, event, arg) -> None:  # noqa: ARG002
        if event == "call":
            st = getattr(self.local, "stack", None)
            if st is None:
                st = self.local.stack = ([], [])  # per frame: hf module or None; the hf modules only
            flags, mods = st
            mod = frame.f_globals.get("__name__") or ""
            if not (mod == "hf_merge" or mod.startswith("hf_merge.")):
                flags.append(False)
                return
            # code that runs once, at import, not a call into the module: module-level code, class bodies
            # (neither has CO_NEWLOCALS), and the method factory `dataclasses` execs in the module's globals
            # while a class is being defined (``__create_fn__``)
            if not frame.f_code.co_flags & inspect.CO_NEWLOCALS or frame.f_code.co_name == "__create_fn__":
                with self.lock:
                    self.imported.add(mod)
                flags.append(False)
                return
            by_import = frame.f_back is not None and frame.f_back.f_code.co_filename.startswith("<frozen importlib")
            with self.lock:
                self.entered[mod] += 1
                if by_import:  # an import hook (hf_merge.load.auto's finder): called by the import system, not a move
                    self.hooks[mod] += 1
                elif mods and mods[-1] != mod:
                    edge = (mods[-1], mod)
                    self.moves[edge] += 1
                    if mod in mods:
                        self.climbs[edge] += 1
            flags.append(True)
            mods.append(mod)
        elif event == "return":
            st = getattr(self.local, "stack", None)
            if st is None or not st[0]:
                return  # a frame that was running before the trace started
            if st[0].pop():
                st[1].pop()

    def run(self, fn, *args):
        sys.setprofile(self.profile)
        threading.setprofile(self.profile)
        try:
            return fn(*args)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


def trace_merge(source: Path, extra: list[str]) -> Tracer:
    import hf_merge.cli.app as app

    out = Path(tempfile.mkdtemp(prefix="hf-merge-trace-")) / "out"
    argv = ["merge", str(source), str(out), *extra]
    args = app.build_parser().parse_args(argv) if hasattr(app, "build_parser") else None
    tracer = Tracer()
    try:
        # the merge command's run(args), as app.main calls it; else app.main itself (its parsing traced too)
        rc = tracer.run(args.run, args) if getattr(args, "run", None) else tracer.run(app.main, argv)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    if rc not in (0, None):
        raise SystemExit(f"the merge failed (exit {rc})")
    return tracer


def reach(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """module -> every module it imports, directly or not."""
    out: dict[str, set[str]] = {}
    for start in edges:
        seen, todo = set(), list(edges[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(edges.get(m, ()))
        out[start] = seen
    return out


def area(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] + "/" if len(parts) > 2 else "(package root)"


def print_trace(t: Tracer, imports: dict[str, set[str]], wing: list[str]) -> None:
    distinct = len(t.moves)
    climbing = len(t.climbs)
    r = reach(imports)
    upward = [(a, b) for a, b in t.moves if a in r.get(b, ()) and b not in r.get(a, ())]
    circular = [(a, b) for a, b in t.moves if a in r.get(b, ()) and b in r.get(a, ())]
    print("## trace of `merge` from cli/merge.py:run (this process; forked processes not traced)\n")
    print(f"| {'module':40} | function calls |")
    print(f"|{'-' * 42}|---------------:|")
    for mod, n in sorted(t.entered.items()):
        print(f"| {mod:40} | {n:14} |")
    only_imported = sorted(t.imported - set(t.entered))
    only_hooks = sorted(m for m, n in t.entered.items() if t.hooks.get(m, 0) == n)
    if only_hooks:
        print(f"\nentered only by the import system (import hooks): {', '.join(only_hooks)}")
    print(f"\nmodules entered: {len(t.entered) - len(only_hooks)}" + (f" (plus {len(only_imported)} only imported during the run: "
                                                  f"{', '.join(only_imported)})" if only_imported else ""))
    if t.hooks:
        print("calls by the import system (import hooks; not moves): " + ", ".join(f"{m} {n}" for m, n in sorted(t.hooks.items())))
    print(f"moves (distinct caller -> callee module pairs): {distinct}, of which climb back up: {climbing}")
    print(f"moves (every call): {sum(t.moves.values())}, of which climb back up: {sum(t.climbs.values())}")
    print(f"moves against the import direction (the callee imports the caller, not the other way): {len(upward)}; "
          f"between modules importing each other: {len(circular)}")
    wing_mods = {"hf_merge." + f.removesuffix(".py").replace("/", ".") for f in wing}
    in_wing = sorted(m for m in t.entered if m in wing_mods)
    print(f"write-wing modules entered (--wing): {len(in_wing)}: {', '.join(m.removeprefix('hf_merge.') for m in in_wing)}")
    areas = collections.Counter(area(m) for m in t.entered if m not in only_hooks)
    print("modules entered per folder: " + ", ".join(f"{a} {n}" for a, n in sorted(areas.items())) + "\n")
    print(f"| {'caller -> callee':70} | calls | climbs | against imports |")
    print(f"|{'-' * 72}|------:|-------:|:---:|")
    for (a, b), n in sorted(t.moves.items()):
        up = "yes" if (a, b) in upward else ("circle" if (a, b) in circular else "")
        print(f"| {a + ' -> ' + b:70} | {n:5} | {t.climbs.get((a, b), 0):6} | {up} |")
    print()


# ------------------------------------------------------------------------------------------------
# 2. import circles
# ------------------------------------------------------------------------------------------------


def module_names(pkg: Path) -> dict[str, Path]:
    root = pkg.parent
    names = {}
    for p in sorted(pkg.rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = p
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """``(target module, "module" | "function" | "type-checking")`` per hf_merge import in ``path``."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found: list[tuple[str, str]] = []

    def resolve(node: ast.ImportFrom) -> list[str]:
        if node.level:
            base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        targets = []
        for alias in node.names:
            sub = f"{mod}.{alias.name}"
            targets.append(sub if sub in modules else mod)
        return targets

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            k = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                k = "function"
            elif isinstance(child, ast.If) and _is_type_checking(child.test) and kind == "module":
                for sub in child.body:
                    visit_one(sub, "type-checking")
                for sub in child.orelse:
                    visit_one(sub, kind)
                continue
            visit_one(child, k)

    def visit_one(child: ast.AST, k: str) -> None:
        if isinstance(child, ast.Import):
            found.extend((a.name, k) for a in child.names if a.name.split(".")[0] == "hf_merge")
        elif isinstance(child, ast.ImportFrom):
            found.extend((t, k) for t in resolve(child) if t.split(".")[0] == "hf_merge")
        visit(child, k)

    visit(ast.parse(path.read_text(), str(path)), "module")
    # a package above the importer is always initialised before it: importing from it closes no circle
    return [(t, k) for t, k in found if t in modules and t != name and not name.startswith(t + ".")]


def import_graph(pkg: Path) -> dict[str, dict[str, set[str]]]:
    modules = module_names(pkg)
    graph: dict[str, dict[str, set[str]]] = {"module": {}, "function": {}, "type-checking": {}}
    for name, path in modules.items():
        for target, kind in imports_of(name, path, modules):
            graph[kind].setdefault(name, set()).add(target)
    return graph


def sccs(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []
    counter = 0
    nodes = set(edges) | {t for ts in edges.values() for t in ts}
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter
                counter += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(edges.get(w, ())))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return sorted(out)


def simple_cycles(edges: dict[str, set[str]], limit: int) -> list[list[str]]:
    """Elementary cycles, each once (started at its smallest module), at most ``limit``."""
    cycles: list[list[str]] = []
    for start in sorted(edges):
        path, todo = [start], [iter(sorted(edges.get(start, ())))]
        while todo and len(cycles) < limit:
            w = next(todo[-1], None)
            if w is None:
                todo.pop()
                path.pop()
            elif w == start:
                cycles.append(list(path))
            elif w > start and w not in path:
                path.append(w)
                todo.append(iter(sorted(edges.get(w, ()))))
    return cycles


def print_cycles(pkg: Path, limit: int) -> None:
    g = import_graph(pkg)
    both = {k: set(g["module"].get(k, ())) | g["function"].get(k, set()) for k in set(g["module"]) | set(g["function"])}
    print("## import circles among hf_merge modules (static, ast)\n")
    print("| imports counted | edges | circles (SCCs > 1) | simple cycles |")
    print("|---|---:|---:|---:|")
    rows = [("module level", g["module"]), ("module + function level", both)]
    for label, edges in rows:
        print(f"| {label} | {sum(map(len, edges.values()))} | {len(sccs(edges))} | {len(simple_cycles(edges, limit))} |")
    print()
    for label, edges in rows:
        for comp in sccs(edges):
            print(f"- {label} SCC ({len(comp)}): {', '.join(comp)}")
        for cyc in simple_cycles(edges, limit):
            print(f"  - {label} cycle: {' -> '.join(cyc + cyc[:1])}")
    fn_only = [(a, b) for a, ts in sorted(g["function"].items()) for b in sorted(ts) if b not in g["module"].get(a, ())]
    print(f"\nfunction-level imports (not also at module level): {len(fn_only)}")
    print(f"TYPE_CHECKING imports (not counted): {sum(map(len, g['type-checking'].values()))}\n")


# ------------------------------------------------------------------------------------------------
# 3. write-wing lines
# ------------------------------------------------------------------------------------------------


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    src = path.read_text()
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                doc_lines.update(range(first.lineno, first.end_lineno + 1))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - doc_lines)


def print_wing(pkg: Path, files: list[str]) -> None:
    print("## write wing (lines)\n")
    print(f"| {'file':36} | lines | code |")
    print(f"|{'-' * 38}|------:|-----:|")
    total = total_code = 0
    missing = []
    for f in files:
        p = pkg / (f if f.endswith(".py") else f + ".py")
        if not p.is_file():
            missing.append(f)
            continue
        n, c = len(p.read_text().splitlines()), code_lines(p)
        total, total_code = total + n, total_code + c
        print(f"| {str(p.relative_to(pkg.parent)):36} | {n:5} | {c:4} |")
    print(f"| {'total':36} | {total:5} | {total_code:4} |")
    if missing:
        print(f"\nmissing (skipped): {', '.join(missing)}")
    print()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=Path.cwd(), help="source tree holding hf_merge/ (default: .)")
    ap.add_argument("--source", type=Path, help="a verl FSDP actor folder to merge under the trace (omit: no trace)")
    ap.add_argument("--merge-args", default="", help="extra merge arguments, one string (e.g. '--workers 1')")
    ap.add_argument("--wing", nargs="*", default=WING, help="files under hf_merge/ counted as the write wing")
    ap.add_argument("--max-cycles", type=int, default=200, help="stop listing simple cycles after this many")
    ns = ap.parse_args()
    tree = ns.tree.resolve()
    pkg = tree / "hf_merge"
    if ns.source is not None:
        sys.path.insert(0, str(tree))
        import hf_merge

        if Path(hf_merge.__file__).resolve().parent != pkg:
            raise SystemExit(f"hf_merge comes from {hf_merge.__file__}, not {pkg}: run with PYTHONPATH={tree}")
        g = import_graph(pkg)
        both = {k: g["module"].get(k, set()) | g["function"].get(k, set()) for k in set(g["module"]) | set(g["function"])}
        print_trace(trace_merge(ns.source, ns.merge_args.split()), both, ns.wing)
    print_cycles(pkg, ns.max_cycles)
    print_wing(pkg, ns.wing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
