"""The package's layering and size, read from its source.

- apollo_compile's modules import each other without a cycle, counting imports inside functions
  and under ``if TYPE_CHECKING:``: a cycle hidden in a function or behind a type annotation is a
  layering problem all the same.
- The runtime and the performance model sit below the passes: they import nothing from
  ``apollo_compile/passes/``.
- Modules stay small enough to read: at most MAX_MODULE_LINES lines, classes at most
  MAX_CLASS_LINES, module docstrings at most MAX_DOCSTRING_LINES.
- Code and tests speak in the present tense: no numbered work sessions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx

import apollo_compile

ROOT = Path(apollo_compile.__file__).parent
TESTS = Path(__file__).parent

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300
MAX_DOCSTRING_LINES = 30


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """Every apollo_compile module `path` imports, at any depth of its code, ``if TYPE_CHECKING:``
    blocks included."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


def import_graph(root: Path = ROOT) -> nx.DiGraph:
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for path in paths:
        for target in imports_of(path, modules, root):
            # a package's __init__ re-exporting its modules is how a package is built, not a cycle
            if not module_name(path, root).startswith(target + ".") or not target.count("."):
                graph.add_edge(module_name(path, root), target)
    return graph


def cycles_of(graph: nx.DiGraph) -> list[list[str]]:
    graph = graph.copy()
    graph.remove_nodes_from([n for n in list(graph) if "." not in n])  # the package root re-exports
    return list(nx.simple_cycles(graph))


def test_no_import_cycle_inside_apollo_compile():
    cycles = cycles_of(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_the_checker_finds_a_function_level_cycle(tmp_path):
    """The check itself: a cycle through an import inside a function is found."""
    pkg = tmp_path / "apollo_compile"
    pkg.mkdir()
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    modules = {"apollo_compile.a", "apollo_compile.b"}
    assert imports_of(pkg / "b.py", modules, pkg) == {"apollo_compile.a"}
    assert imports_of(pkg / "a.py", modules, pkg) == {"apollo_compile.b"}
    assert cycles_of(import_graph(pkg))


def test_the_checker_finds_a_type_checking_cycle(tmp_path):
    """The check itself: an import under ``if TYPE_CHECKING:`` is an edge like any other."""
    pkg = tmp_path / "apollo_compile"
    pkg.mkdir()
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    (pkg / "c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from apollo_compile.a import A\n")
    modules = {"apollo_compile.a", "apollo_compile.b", "apollo_compile.c"}
    assert imports_of(pkg / "b.py", modules, pkg) == {"apollo_compile.a"}
    assert imports_of(pkg / "c.py", modules, pkg) == {"apollo_compile.a"}
    assert [sorted(c) for c in cycles_of(import_graph(pkg))] == [["apollo_compile.a", "apollo_compile.b"]]


def _below_the_passes(name: str) -> bool:
    """The runtime (``apollo_compile.runtime`` and below) and the performance model with its
    calibration, wherever a package move puts them."""
    parts = name.split(".")[1:]
    return "runtime" in parts or any(p.startswith(("perf", "calibration")) for p in parts)


def test_the_runtime_and_the_performance_model_import_no_pass():
    graph = import_graph()
    lower = sorted(n for n in graph if _below_the_passes(n))
    assert any(".runtime" in n for n in lower) and any("perf" in n for n in lower), lower
    passes = {n for n in graph if ".passes" in n}
    assert passes, "no passes package found: update this test's idea of where the passes live"
    upward = sorted(f"{n} -> {t}" for n in lower for t in graph.successors(n) if t in passes)
    assert not upward, "imports from a lower floor up into passes/: " + "; ".join(upward)


def _docstring_lines(tree: ast.Module) -> int:
    doc = ast.get_docstring(tree, clean=False)
    return len(doc.splitlines()) if doc else 0


def test_modules_classes_and_docstrings_stay_small():
    too_big = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        where = path.relative_to(ROOT.parent)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_big.append(f"{where}: {len(text.splitlines())} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_big.append(f"{where}: class {node.name} {node.end_lineno - node.lineno + 1} lines "
                               f"(at most {MAX_CLASS_LINES})")
        if _docstring_lines(tree) > MAX_DOCSTRING_LINES:
            too_big.append(f"{where}: module docstring {_docstring_lines(tree)} lines (at most "
                           f"{MAX_DOCSTRING_LINES}; the essay belongs on a docs/design page)")
    assert not too_big, "\n".join(too_big)


# what `grep -rniE "sessions? [0-9]"` finds; the pattern's own text does not match it
NUMBERED_SESSION = re.compile(r"sessions? [0-9]", re.IGNORECASE)


def test_no_numbered_sessions_in_code_or_tests():
    """Comments and docstrings give the rule and its reason; when it was found lives in git and
    benchmarks/RESULTS.md."""
    found = []
    for top in (ROOT, TESTS):
        for path in sorted(top.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:  # binary: grep says "Binary file matches" only for bytes we never write
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if NUMBERED_SESSION.search(line):
                    found.append(f"{path.relative_to(top.parent)}:{number}: {line.strip()[:100]}")
    assert not found, f"{len(found)} line(s) cite a numbered session:\n" + "\n".join(found[:40])
