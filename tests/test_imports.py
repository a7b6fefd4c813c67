"""The package's import structure, read with `ast` (nothing is imported): every module in one layer
folder (`LAYERS`), no import cycles, no upward imports, no module reaching into another's private names
(`from .x import _name`, `Engine`'s private members).

Imports count wherever they are written (module level, inside a function: a deferred import, and under
`if TYPE_CHECKING:`: a type-only import is the dependency it is, even though it never runs).
``from pkg import name`` is an edge to the submodule ``pkg.name`` when that is a module, else to ``pkg``
(its ``__init__``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvstitch"

# Edges that close a known cycle, each removed by a named piece of work. An entry that no longer exists
# fails `test_allow_lists_are_not_stale`: delete it then.
ALLOWED_CYCLE_EDGES: dict[tuple[str, str], str] = {
}

# `from kvstitch.x import _name` across modules: (importer, imported module, name)
ALLOWED_PRIVATE_IMPORTS: dict[tuple[str, str, str], str] = {}

# The layers, lowest first, each a list of folders (docs/design.md "Layers"). Every module under kvstitch/
# belongs to exactly one (the package root, `kvstitch/__init__.py`, is the public facade over all of them);
# a module may import its own layer and the layers below, never one above.
LAYERS: list[tuple[str, list[str]]] = [
    ("foundations", ["kvstitch.core", "kvstitch.models", "kvstitch.store", "kvstitch.tasks", "kvstitch.text"]),
    ("methods", ["kvstitch.select", "kvstitch.decode"]),
    ("engine", ["kvstitch.engine"]),
    ("applications", ["kvstitch.eval", "kvstitch.corpus", "kvstitch.serve", "kvstitch.bench", "kvstitch.adapt",
                      "kvstitch.route"]),
    ("command line", ["kvstitch.cli"]),
]
FACADE = "kvstitch"
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

# Folders of one layer that import each other: only these directions (a new one, e.g. corpus -> serve,
# fails `test_no_new_dependencies_between_sibling_folders`; the methods select and decode do not import
# each other at all). (importer folder, imported folder): why.
SIBLING_DEPENDENCIES: dict[tuple[str, str], str] = {
    ("kvstitch.core", "kvstitch.models"): "rope's self-check runs the model (cache_kwargs)",
    ("kvstitch.models", "kvstitch.core"): "the loader registers kvstitch's attention; errors",
    ("kvstitch.store", "kvstitch.core"): "stores hold ChunkKV and raise StoreError",
    ("kvstitch.tasks", "kvstitch.core"): "datasets raise InputError",
    ("kvstitch.text", "kvstitch.core"): "chunking raises InputError",
    ("kvstitch.serve", "kvstitch.corpus"): "the server retrieves from indexed collections",
    ("kvstitch.serve", "kvstitch.route"): "serve --replicas routes with the simulator's chunk affinity",
    ("kvstitch.bench", "kvstitch.route"): "bench replicas replays the routing simulator's trace over real passages",
    ("kvstitch.eval", "kvstitch.serve"): "calibrate updates the server's TOML config (load_toml)",
    ("kvstitch.bench", "kvstitch.serve"): "the load test runs a real server",
    ("kvstitch.bench", "kvstitch.corpus"): "the precompute bench times the Ray path",
    ("kvstitch.eval", "kvstitch.corpus"): "SQuAD over retrieval ranks with a collection (eval --retrieve)",
}

# (importer prefix, imported prefix) inside one layer that must not import each other
FORBIDDEN = [
    ("kvstitch.eval.viz", "kvstitch.eval.runner"),  # pictures use eval.selection, not the runner's internals
]
ALLOWED_FORBIDDEN: dict[tuple[str, str], str] = {}

# Library modules that still define a typer command (move it into kvstitch/cli/)
ALLOWED_TYPER: dict[str, str] = {
}

# Calls into Engine's private members from other modules (none: callers use the public request path,
# Engine.prefill / GenerationRequest). (module, member) pairs.
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


def layer_of(name: str) -> list[tuple[int, str]]:
    """(layer index, folder) of every layer folder `name` lies under (exactly one for a placed module)."""
    return [(i, folder) for i, (_, folders) in enumerate(LAYERS) for folder in folders if _under(name, folder)]


def upward_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) where the imported module sits in a higher layer than the importer."""
    out = set()
    for a, targets in graph.items():
        for b in targets:
            la, lb = layer_of(a), layer_of(b)
            if la and lb and lb[0][0] > la[0][0]:
                out.add((a, b))
    return out


def sibling_dependencies(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer folder, imported folder) for imports between different folders of one layer."""
    out = set()
    for a, targets in graph.items():
        for b in targets:
            la, lb = layer_of(a), layer_of(b)
            if la and lb and la[0][0] == lb[0][0] and la[0][1] != lb[0][1]:
                out.add((la[0][1], lb[0][1]))
    return out


def forbidden_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in graph.items() for b in targets
            for lo, hi in FORBIDDEN if _under(a, lo) and _under(b, hi)}


def engine_private_members() -> set[str]:
    """Engine's private methods and the private attributes it sets on itself."""
    tree = ast.parse((PACKAGE / "engine" / "engine.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def private_engine_uses() -> set[tuple[str, str]]:
    """(module, member) for every `x._member` outside engine/engine.py with `_member` one of Engine's private
    members and `x` not `self`/`cls` (another class's own private member of the same name is not a use)."""
    private = engine_private_members()
    uses = set()
    for name, path in modules().items():
        if name == "kvstitch.engine.engine":
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
    for d in ("core", "engine", "select", "eval", "serve"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .engine.engine import Engine\n")  # the facade imports anything
    (pkg / "engine" / "engine.py").write_text("from ..core import rope\n_SECRET = 1\nclass Engine: ...\n")
    (pkg / "core" / "rope.py").write_text("def f():\n    from kvstitch.engine.engine import Engine\n")
    (pkg / "select" / "x.py").write_text("def f():\n    from ..engine.engine import _SECRET\n")
    (pkg / "eval" / "viz.py").write_text("from . import runner\nfrom kvstitch.serve import app\n")
    (pkg / "eval" / "runner.py").write_text("")
    (pkg / "serve" / "app.py").write_text("from kvstitch.engine.engine import Engine\n")
    known = {"kvstitch": pkg / "__init__.py"}
    for p in sorted(pkg.rglob("*.py")):
        if p.parent != pkg:
            name = ".".join(["kvstitch", *p.relative_to(pkg).with_suffix("").parts])
            known[name.removesuffix(".__init__")] = p
    graph = {n: imports_of(n, p, known) for n, p in known.items()}
    assert upward_edges(graph) == {("kvstitch.core.rope", "kvstitch.engine.engine"),  # foundations -> engine
                                   ("kvstitch.select.x", "kvstitch.engine.engine")}  # methods -> engine
    assert sibling_dependencies(graph) == {("kvstitch.eval", "kvstitch.serve")}
    assert forbidden_edges(graph) == {("kvstitch.eval.viz", "kvstitch.eval.runner")}
    assert private_imports(known) == {("kvstitch.select.x", "kvstitch.engine.engine", "_SECRET")}


# ---- the package ---------------------------------------------------------------------------------------
def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "kvstitch.engine.engine" in graph["kvstitch.engine"]  # really walked
    for a, b in ALLOWED_CYCLE_EDGES:
        graph[a].discard(b)
    found = cycles(graph)
    assert not found, f"import cycles: {found}"


def test_every_module_is_in_exactly_one_layer():
    folders = [f for _, fs in LAYERS for f in fs]
    assert len(folders) == len(set(folders)) and not any(_under(a, b) for a in folders for b in folders if a != b)
    placed = {name: layer_of(name) for name in modules() if name != FACADE}
    assert placed and "kvstitch.engine.engine" in placed  # really walked
    bad = {name: where for name, where in placed.items() if len(where) != 1}
    assert not bad, f"modules in no layer or in several (add the folder to LAYERS): {bad}"


def test_no_upward_imports():
    bad = upward_edges(import_graph()) - set(ALLOWED_UPWARD)
    assert not bad, f"upward imports (importer, imported): {sorted(bad)}"
    bad = forbidden_edges(import_graph()) - set(ALLOWED_FORBIDDEN)
    assert not bad, f"forbidden imports inside a layer (importer, imported): {sorted(bad)}"


def test_no_new_dependencies_between_sibling_folders():
    bad = sibling_dependencies(import_graph()) - set(SIBLING_DEPENDENCIES)
    assert not bad, f"folders of one layer importing each other (importer, imported): {sorted(bad)}"


def typer_importers() -> set[str]:
    out = set()
    for name, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any((isinstance(n, ast.Import) and any(a.name.split(".")[0] == "typer" for a in n.names))
               or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "typer") for n in ast.walk(tree)):
            out.add(name)
    return out


def is_cli_module(name: str) -> bool:
    """A command-line module: one under ``kvstitch/cli/`` (``kvstitch.cli.main``, ``kvstitch.cli.eval``)."""
    return _under(name, "kvstitch.cli")


def test_no_library_module_imports_typer():
    """Command-line code lives in kvstitch/cli/; library modules stay free of typer."""
    assert is_cli_module("kvstitch.cli.eval") and is_cli_module("kvstitch.cli.serve")
    assert not is_cli_module("kvstitch.serve.server") and not is_cli_module("kvstitch.eval.runner")
    bad = {m for m in typer_importers() if not is_cli_module(m)} - set(ALLOWED_TYPER)
    assert "kvstitch.cli.main" in typer_importers()  # the scan sees typer imports
    assert not bad, f"library modules importing typer (move the command into kvstitch/cli/): {sorted(bad)}"


def test_no_private_engine_calls_outside_engine():
    private = engine_private_members()
    assert {"_fingerprint", "_eos_ids"} <= private  # the scan sees Engine's private members
    bad = private_engine_uses() - set(ALLOWED_PRIVATE)
    assert not bad, f"Engine private members used outside engine/engine.py (module, member): {sorted(bad)}"


def test_no_private_names_imported_across_modules():
    bad = private_imports() - set(ALLOWED_PRIVATE_IMPORTS)
    assert not bad, f"private names imported from another module (importer, module, name): {sorted(bad)}"


def test_allow_lists_are_not_stale():
    """Each allow-list entry names work in progress; once that work lands, the entry must go."""
    graph = import_graph()
    edges = {(a, b) for a, targets in graph.items() for b in targets}
    stale = [e for e in [*ALLOWED_CYCLE_EDGES, *ALLOWED_FORBIDDEN, *ALLOWED_UPWARD] if e not in edges]
    stale += [e for e in SIBLING_DEPENDENCIES if e not in sibling_dependencies(graph)]
    stale += [e for e in ALLOWED_PRIVATE if e not in private_engine_uses()]
    stale += [m for m in ALLOWED_TYPER if m not in typer_importers()]
    stale += [e for e in ALLOWED_PRIVATE_IMPORTS if e not in private_imports()]
    assert not stale, f"allow-list entries that no longer occur (delete them): {stale}"


def test_importing_kvstitch_shortens_openmp_spin_unless_the_user_set_it():
    """`import kvstitch` (before torch) sets libgomp's GOMP_SPINCOUNT, keeping a value the user gave."""
    code = "import kvstitch, os; print(os.environ['GOMP_SPINCOUNT'])"
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    ours = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert ours.stdout.strip() == "30000"
    theirs = subprocess.run([sys.executable, "-c", code], env={**env, "GOMP_SPINCOUNT": "7"}, capture_output=True,
                            text=True, check=True)
    assert theirs.stdout.strip() == "7"
