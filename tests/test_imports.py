"""apollo_compile's modules import each other without a cycle, function-level imports included: a
cycle hidden in a function is a layering problem all the same (issue 25)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import apollo_compile

ROOT = Path(apollo_compile.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every apollo_compile module `path` imports, at any depth of its code."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
                   for n in ast.walk(block)}  # `if TYPE_CHECKING:` imports never run
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> nx.DiGraph:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = nx.DiGraph()
    for path in paths:
        for target in imports_of(path, modules):
            # a package's __init__ re-exporting its modules is how a package is built, not a cycle
            if not module_name(path).startswith(target + ".") or not target.count("."):
                graph.add_edge(module_name(path), target)
    return graph


def test_no_import_cycle_inside_apollo_compile():
    graph = import_graph()
    graph.remove_nodes_from([n for n in list(graph) if n == "apollo_compile"])  # the package root re-exports
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_the_checker_finds_a_function_level_cycle(tmp_path):
    """The check itself: a cycle through an import inside a function is found."""
    pkg = tmp_path / "apollo_compile"
    pkg.mkdir()
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    modules = {"apollo_compile.a", "apollo_compile.b"}
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        assert imports_of(pkg / "b.py", modules) == {"apollo_compile.a"}
        assert imports_of(pkg / "a.py", modules) == {"apollo_compile.b"}
    finally:
        ROOT = saved
