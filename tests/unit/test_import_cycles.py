"""No import cycles in racer_batch/: between modules, and between folders (a folder's modules taken as one).

Every ``import`` and ``from ... import`` statement counts, wherever it sits (module level, inside a function,
under ``TYPE_CHECKING``): a lazy import hides a cycle from the interpreter, not from the reader. Read from the
source with ``ast``, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "racer_batch"


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _targets(node: ast.AST, package: str, mods: dict) -> set[str]:
    """The package modules an import statement names (``from X import Y``: ``X.Y`` where it is a module)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in mods}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    out = set()
    for alias in node.names:
        sub = f"{mod}.{alias.name}"
        if sub in mods:
            out.add(sub)
        elif mod in mods:
            out.add(mod)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    mods = _modules(root)
    graph = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            edges |= _targets(node, package, mods)
        graph[name] = edges - {name}
    return graph


def folder_graph(graph: dict[str, set[str]], top: str = "racer_batch",
                 packages: set[str] | None = None) -> dict[str, set[str]]:
    """The graph with every module below a sub-folder merged into that folder (``racer_batch.service.job``);
    the package's own top-level modules and ``__init__`` stay themselves. ``packages``: the folders (default:
    those of ``racer_batch/`` with an ``__init__.py``), so that a folder holding only its ``__init__``
    (``engine/kernels``: the Python of the native ops) is a folder of its own, not a module of its parent."""
    if packages is None:
        packages = {name for name, (_, is_pkg) in _modules(PACKAGE).items() if is_pkg}

    def node(mod: str) -> str:
        parent = mod.rsplit(".", 1)[0]
        if mod == top or parent == top:
            return mod
        return mod if mod in graph and (mod in packages or _is_package(mod, graph)) else parent

    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(node(a), set())
        for b in targets:
            if node(a) != node(b):
                out[node(a)].add(node(b))
                out.setdefault(node(b), set())
    return out


def _is_package(mod: str, graph: dict[str, set[str]]) -> bool:
    return any(other.startswith(mod + ".") for other in graph)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back():
    assert cycles(import_graph()) == []


def test_no_folder_imports_itself_back():
    assert cycles(folder_graph(import_graph())) == []


def test_the_checker_finds_a_planted_cycle(tmp_path):
    """A module cycle through a lazy import, and a folder cycle between two sub-folders, are both reported."""
    pkg = tmp_path / "racer_batch"
    for folder in ("", "a", "b"):
        (pkg / folder).mkdir(exist_ok=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "x.py").write_text("def f():\n    from . import y\n")
    (pkg / "y.py").write_text("from racer_batch import x\n")
    (pkg / "a" / "one.py").write_text("from ..b.two import thing\n")
    (pkg / "b" / "two.py").write_text("from racer_batch.a import three\n")
    (pkg / "a" / "three.py").write_text("thing = 1\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [["racer_batch.x", "racer_batch.y"]]
    assert ["racer_batch.a", "racer_batch.b"] in cycles(folder_graph(graph))
    # a sub-folder with only its __init__ is a folder of its own, not merged into its parent
    (pkg / "a" / "k").mkdir()
    (pkg / "a" / "k" / "__init__.py").write_text("from racer_batch.b import two\n")
    folders = folder_graph(import_graph(pkg), packages={"racer_batch.a", "racer_batch.b", "racer_batch.a.k"})
    assert folders["racer_batch.a.k"] == {"racer_batch.b"}
