"""The package's import structure, read with `ast` (nothing is imported): no import cycles, no upward
imports, no module reaching into another's private names (`from .x import _name`, `Engine`'s private members).

Imports count wherever they are written (module level, inside a function: a deferred import, and under
`if TYPE_CHECKING:`: a type-only import is the dependency it is, even though it never runs).
``from pkg import name`` is an edge to the submodule ``pkg.name`` when that is a module, else to ``pkg``
(its ``__init__``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvstitch"

# Edges that close a known cycle, each removed by a named piece of work. An entry that no longer exists
# fails `test_allow_lists_are_not_stale`: delete it then.
ALLOWED_CYCLE_EDGES: dict[tuple[str, str], str] = {
}

# `from kvstitch.x import _name` across modules: (importer, imported module, name)
ALLOWED_PRIVATE_IMPORTS: dict[tuple[str, str, str], str] = {}

# (importer prefix, imported prefix): a lower layer must not import a higher one
FORBIDDEN = [
    ("kvstitch.decode", "kvstitch.eval.runner"),   # the sparse-decode library must not depend on the harness
    ("kvstitch.decode", "kvstitch.eval.report"),
    ("kvstitch.decode", "kvstitch.eval.cli"),
    ("kvstitch.viz", "kvstitch.eval.runner"),      # pictures use eval.selection, not the runner's internals
    ("kvstitch.select", "kvstitch.engine"),        # selectors get a context, they do not import the engine
    ("kvstitch.select", "kvstitch.eval"),
    ("kvstitch.store", "kvstitch.engine"),
    ("kvstitch.cache", "kvstitch.engine"),
    ("kvstitch.rope", "kvstitch.engine"),
    ("kvstitch.prompt", "kvstitch.engine"),
    ("kvstitch.attention", "kvstitch.engine"),
]
ALLOWED_FORBIDDEN: dict[tuple[str, str], str] = {}

# Library modules that still define a typer command (move it into kvstitch/cli.py or a `cli` module)
ALLOWED_TYPER: dict[str, str] = {
}

# Calls into Engine's private members from other modules: #16 item 2 (the lead) moves these callers onto
# the public request path (Engine.prefill / GenerationRequest). (module, member) pairs.
ALLOWED_PRIVATE: dict[tuple[str, str], str] = {
}


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _from_module(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` statement of module `name` reads from."""
    if not node.level:
        return node.module or ""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """kvstitch modules `name` imports, wherever the import is written (type-only ones included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(name, path, node)
            for a in node.names:
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
    return {m for m in found if m in known and m != name}


def private_imports(known: dict[str, Path] | None = None) -> set[tuple[str, str, str]]:
    """(importer, module, name) for every ``from <kvstitch module> import _name`` in another module."""
    known = known if known is not None else modules()
    out = set()
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                mod = _from_module(name, path, node)
                out.update((name, mod, a.name) for a in node.names
                           if mod in known and mod != name and a.name.startswith("_") and not a.name.startswith("__"))
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def forbidden_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in graph.items() for b in targets
            for lo, hi in FORBIDDEN if _under(a, lo) and _under(b, hi)}


def engine_private_members() -> set[str]:
    """Engine's private methods and the private attributes it sets on itself."""
    tree = ast.parse((PACKAGE / "engine.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def private_engine_uses() -> set[tuple[str, str]]:
    """(module, member) for every `x._member` outside engine.py with `_member` one of Engine's private
    members and `x` not `self`/`cls` (another class's own private member of the same name is not a use)."""
    private = engine_private_members()
    uses = set()
    for name, path in modules().items():
        if name == "kvstitch.engine":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in private and \
                    not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                uses.add((name, node.attr))
    return uses


# ---- the checker itself (so a passing run means something) -------------------------------------------
def test_the_checker_sees_cycles_function_level_imports_and_type_checking(tmp_path):
    pkg = tmp_path / "kvstitch"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import g\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..d import X\n"
                                      "def g():\n    from kvstitch.a import f\n")
    (pkg / "d.py").write_text("from .sub import c\n")
    known = {"kvstitch": pkg / "__init__.py", "kvstitch.a": pkg / "a.py", "kvstitch.b": pkg / "b.py",
             "kvstitch.sub": pkg / "sub" / "__init__.py", "kvstitch.sub.c": pkg / "sub" / "c.py",
             "kvstitch.d": pkg / "d.py"}
    graph = {n: imports_of(n, p, known) for n, p in known.items()}
    assert graph["kvstitch.a"] == {"kvstitch.b"}
    assert graph["kvstitch.b"] == {"kvstitch.sub.c"}                   # function-level import counts
    assert graph["kvstitch.sub.c"] == {"kvstitch.a", "kvstitch.d"}    # and so does a TYPE_CHECKING one
    assert graph["kvstitch.d"] == {"kvstitch.sub.c"}
    assert cycles(graph) == [["kvstitch.a", "kvstitch.b", "kvstitch.d", "kvstitch.sub.c"]]
    graph["kvstitch.sub.c"] = {"kvstitch.d"}  # c <-> d is a cycle made only by the type-only import
    assert cycles(graph) == [["kvstitch.d", "kvstitch.sub.c"]]
    graph["kvstitch.sub.c"] = set()
    assert cycles(graph) == []


def test_the_checker_sees_upward_imports_and_private_names(tmp_path):
    pkg = tmp_path / "kvstitch"
    (pkg / "select").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("_SECRET = 1\n")
    (pkg / "select" / "__init__.py").write_text("")
    (pkg / "select" / "x.py").write_text("def f():\n    from ..engine import _SECRET\n")
    known = {"kvstitch": pkg / "__init__.py", "kvstitch.engine": pkg / "engine.py",
             "kvstitch.select": pkg / "select" / "__init__.py", "kvstitch.select.x": pkg / "select" / "x.py"}
    graph = {n: imports_of(n, p, known) for n, p in known.items()}
    assert forbidden_edges(graph) == {("kvstitch.select.x", "kvstitch.engine")}  # select must not import engine
    assert private_imports(known) == {("kvstitch.select.x", "kvstitch.engine", "_SECRET")}


# ---- the package ---------------------------------------------------------------------------------------
def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "kvstitch.engine" in graph["kvstitch.cli"] | graph["kvstitch"]  # really walked
    for a, b in ALLOWED_CYCLE_EDGES:
        graph[a].discard(b)
    found = cycles(graph)
    assert not found, f"import cycles: {found}"


def test_no_upward_imports():
    bad = forbidden_edges(import_graph()) - set(ALLOWED_FORBIDDEN)
    assert not bad, f"upward imports (importer, imported): {sorted(bad)}"


def typer_importers() -> set[str]:
    out = set()
    for name, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any((isinstance(n, ast.Import) and any(a.name.split(".")[0] == "typer" for a in n.names))
               or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "typer") for n in ast.walk(tree)):
            out.add(name)
    return out


def is_cli_module(name: str) -> bool:
    """A command-line module: ``cli`` (``kvstitch.cli``, ``kvstitch.eval.cli``) or ``<topic>_cli``
    (``kvstitch.serve_cli`` next to ``kvstitch.server``)."""
    last = name.rsplit(".", 1)[-1]
    return last == "cli" or last.endswith("_cli")


def test_no_library_module_imports_typer():
    """Command-line code lives in the `cli` modules; library modules stay free of typer."""
    assert is_cli_module("kvstitch.eval.cli") and is_cli_module("kvstitch.serve_cli")
    assert not is_cli_module("kvstitch.server") and not is_cli_module("kvstitch.public")
    bad = {m for m in typer_importers() if not is_cli_module(m)} - set(ALLOWED_TYPER)
    assert "kvstitch.cli" in typer_importers()  # the scan sees typer imports
    assert not bad, f"library modules importing typer (move the command into a cli module): {sorted(bad)}"


def test_no_private_engine_calls_outside_engine():
    private = engine_private_members()
    assert {"_prefill", "_check_request"} <= private  # the scan sees Engine's private members
    bad = private_engine_uses() - set(ALLOWED_PRIVATE)
    assert not bad, f"Engine private members used outside engine.py (module, member): {sorted(bad)}"


def test_no_private_names_imported_across_modules():
    bad = private_imports() - set(ALLOWED_PRIVATE_IMPORTS)
    assert not bad, f"private names imported from another module (importer, module, name): {sorted(bad)}"


def test_allow_lists_are_not_stale():
    """Each allow-list entry names work in progress; once that work lands, the entry must go."""
    graph = import_graph()
    edges = {(a, b) for a, targets in graph.items() for b in targets}
    stale = [e for e in [*ALLOWED_CYCLE_EDGES, *ALLOWED_FORBIDDEN] if e not in edges]
    stale += [e for e in ALLOWED_PRIVATE if e not in private_engine_uses()]
    stale += [m for m in ALLOWED_TYPER if m not in typer_importers()]
    stale += [e for e in ALLOWED_PRIVATE_IMPORTS if e not in private_imports()]
    assert not stale, f"allow-list entries that no longer occur (delete them): {stale}"
