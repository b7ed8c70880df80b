"""The layout holds: the README's layout block names every top-level folder and every module and package of fastbert/,
and imports point one way (model -> execution -> dispatch -> backends -> kernels): no circle among fastbert's modules
(fastbert/kernels/ included), no backend reaching the dispatcher, no kernel reaching the library."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"fastbert": ROOT / "fastbert"}
DISPATCHER = "fastbert.ops"


def layout_block() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Layout", 1)[1]
    return section.split("```", 2)[1]


def test_the_layout_block_names_every_module_package_and_folder() -> None:
    named = set(re.findall(r"[\w.]+/?", layout_block()))
    package = ROOT / "fastbert"
    modules = {p.name for p in package.glob("*.py")} - {"__init__.py"}
    packages = {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()}
    folders = {f"{p.name}/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    folders -= {"build/", "fastbert_kernels.egg-info/"}  # build outputs, not the layout
    missing = sorted((modules | packages | folders) - named)
    assert not missing, f"README.md's layout block does not name {missing}"


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the installed package by its dotted name: (file, whether it is a package's __init__)."""
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join([package, *(parts[:-1] if is_package else parts)])] = (path, is_package)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, for every import statement anywhere in the file (module level, inside a
    function, under TYPE_CHECKING). `from p import x` is an edge to the module p.x where there is one, else to p (a
    name from p's __init__); the parents a dotted import runs implicitly are not edges (every module would have one)."""
    known = modules()
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in known.items():
        here = name if is_package else name.rpartition(".")[0]
        edges = graph[name] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    package = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(package + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in known and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted: every circle lies
    inside one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(graph: dict[str, dict[str, int]], start: str) -> dict[str, list[str]]:
    """Every module `start` imports, directly or through others: module -> one import path to it."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in graph[v]:
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    return paths


def _described(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    edges = [f"{a} -> {b} (line {graph[a][b]})" for a in component for b in graph[a] if b in component]
    return f"{component}: " + "; ".join(edges)


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "fastbert.backends.spec" in graph["fastbert.ops"]  # module level, `from p.m import name`
    assert "fastbert.backends.gemm" in graph["fastbert.ops"]  # `from p import m`
    assert "fastbert.kernels.limits" in graph["fastbert.kernels"]  # relative, `from . import m`
    assert "fastbert.capabilities" in graph["fastbert.backends.timing_store"]  # inside a function
    assert "fastbert.version" in graph["fastbert"]  # `from p.m import name` in a package's __init__
    assert ["a", "b"] in cycles({"a": {"b": 1}, "b": {"a": 1}, "c": {"a": 1}})


def test_no_import_circle() -> None:
    graph = import_graph()
    found = [_described(graph, c) for c in cycles(graph)]
    assert not found, "import circles (each component, with the imports inside it):\n" + "\n".join(found)


def test_no_backend_reaches_the_dispatcher() -> None:
    """The dispatcher imports the backends; a backend that imports it, directly or through another module, is a
    circle waiting to happen. What both need (this thread's backend scope) lives in a leaf, fastbert.backends.scope."""
    graph = import_graph()
    backends = [m for m in graph if m.startswith("fastbert.backends.")]
    assert "fastbert.backends.timing_store" in backends
    found = {m: path for m in backends if (path := reachable(graph, m).get(DISPATCHER))}
    assert not found, "backends that import fastbert.ops: " + "; ".join(" -> ".join(p) for p in found.values())


def test_the_kernels_import_nothing_of_the_library() -> None:
    """fastbert/kernels/ know nothing of models: they import each other and nothing else of fastbert."""
    graph = import_graph()
    found = {m: sorted(t for t in graph[m] if not t.startswith("fastbert.kernels"))
             for m in graph if m.startswith("fastbert.kernels")}  # fmt: skip
    assert not {m: t for m, t in found.items() if t}, found
